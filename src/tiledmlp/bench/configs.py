"""What one benchmark configuration is: an MLP, an input, and an implementation that runs fwd+bwd on them.

Builders live here (not in the CLI) because the memory child process imports :func:`make_step` by name.
Peers (DeepSpeed) are imported lazily inside their builder, never by the library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..memory import predict_mlp_peak_bytes, routed_tiling_pays
from ..pointwise import fused_enabled
from ..tiling import plan_shards

__all__ = ["IMPLS", "LOW_ACC", "MLPS", "Config", "build_mlp", "build_forward", "build_inputs", "make_step",
           "peer_available", "plan_for", "predicted_bytes", "step_for"]

MLPS = ("swiglu", "geglu", "gpt2", "swiglu-lora", "swiglu-lora-dropout", "swiglu-qlora", "swiglu-fused",
        "moe")
IMPLS = ("untiled", "tiledmlp", "tiledmlp-bf16acc", "tiledmlp-generic", "deepspeed", "liger")
# ours with bf16 weight-grad sums (the peers' precision) instead of float32: what exactness costs in time
LOW_ACC = "tiledmlp-bf16acc"
_GATED = {"swiglu", "geglu", "swiglu-lora", "swiglu-lora-dropout", "swiglu-qlora", "swiglu-fused"}
LORA_RANK = 16
LORA_DROPOUT = 0.05  # swiglu-lora-dropout's: a common fine-tuning value


@dataclass(frozen=True)
class Config:
    """One row of the table. ``shards`` is what was asked for (an int or ``"auto"``; ignored by ``untiled``)."""

    mlp: str
    hidden: int
    intermediate: int
    seq: int
    batch: int
    dtype: str
    impl: str
    shards: str
    device: str = "cpu"
    experts: int = 8  # --mlp moe: routed experts, each of width ``intermediate``
    top_k: int = 2  # --mlp moe: the experts each token is routed to

    @property
    def num_tokens(self) -> int:
        return self.seq * self.batch

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def kwargs(self) -> dict[str, object]:
        return dict(self.__dict__)


def plan_for(cfg: Config) -> list[int]:
    """The tile sizes of ``cfg`` (the library's own planner for ``"auto"``: the generic engine's memory model for
    ``tiledmlp-generic``, the GLU path's for the others, so peers get the fast path's tiles)."""
    if cfg.impl == "untiled":
        return [cfg.num_tokens]
    shards: int | str = cfg.shards if cfg.shards == "auto" else int(cfg.shards)
    inter = cfg.intermediate if cfg.mlp in _GATED or cfg.mlp == "moe" else None
    splits = plan_shards(cfg.num_tokens, num_shards=shards, hidden_size=cfg.hidden, intermediate_size=inter,
                         dtype=cfg.torch_dtype, path=_path(cfg), device_type=torch.device(cfg.device).type,
                         top_k=cfg.top_k if cfg.mlp == "moe" else None)
    if cfg.mlp == "moe" and shards == "auto" and len(splits) > 1:  # as patch() plans the experts' auto
        w, summed = cfg.torch_dtype.itemsize, 3 * cfg.experts * cfg.hidden * cfg.intermediate
        acc = w if cfg.impl == LOW_ACC or w >= 4 else 4
        if not routed_tiling_pays(cfg.num_tokens, max(splits), cfg.hidden, cfg.intermediate, cfg.top_k,
                                  itemsize=w, weight_itemsize=w, sum_itemsize=acc, summed=summed,
                                  largest=2 * summed // 3):
            return [cfg.num_tokens]
    return splits


def _path(cfg: Config) -> str:
    """The engine whose memory model plans ``auto`` (PEFT's LoRA layers take the GLU path, as in patch(); routed
    experts the generic engine, as in patch())."""
    return "generic" if cfg.impl == "tiledmlp-generic" or cfg.mlp == "moe" else "glu"


def predicted_bytes(cfg: Config) -> int | None:
    """The planner's prediction for gated MLPs (untiled, GLU fast path, generic engine); None where it has none
    (peers; GPT-2's MLP; LoRA adapters, which the one-MLP model leaves out)."""
    if cfg.mlp not in ("swiglu", "geglu") or cfg.impl not in ("untiled", "tiledmlp", LOW_ACC, "tiledmlp-generic"):
        return None
    splits = plan_for(cfg)
    glu = cfg.impl in ("tiledmlp", LOW_ACC)
    kernels = "compiled" if glu and fused_enabled(torch.device(cfg.device)) else "eager"
    return predict_mlp_peak_bytes(cfg.num_tokens, cfg.hidden, cfg.intermediate,
                                  splits=None if len(splits) <= 1 else splits, dtype=cfg.torch_dtype,
                                  path=_path(cfg), kernels=kernels,
                                  accumulate_dtype=torch.bfloat16 if cfg.impl == LOW_ACC else None,
                                  device_type=torch.device(cfg.device).type)


def build_mlp(kind: str, hidden: int, intermediate: int, dtype: torch.dtype, seed: int = 0, *, experts: int = 8,
              top_k: int = 2) -> nn.Module:
    """A Hugging Face MLP module of the given kind (LlamaMLP, GemmaMLP, GPT2MLP, Phi3MLP or Qwen3-MoE's sparse block;
    LlamaMLP with LoRA) with seeded weights. Its config has one attention head: the MLP has none, and the configs'
    default head counts (32 for Llama) refuse a hidden size they do not divide (``--hidden 16``)."""
    torch.manual_seed(seed)
    if kind.startswith("swiglu-lora"):
        dropout = LORA_DROPOUT if kind.endswith("-dropout") else 0.0
        return _with_lora(build_mlp("swiglu", hidden, intermediate, dtype, seed), hidden, dropout)
    if kind == "swiglu-qlora":
        return _with_lora(_quantized(build_mlp("swiglu", hidden, intermediate, dtype, seed)), hidden, 0.0)
    if kind == "swiglu":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        mlp: nn.Module = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu",
                                   num_attention_heads=1, num_key_value_heads=1))
    elif kind == "geglu":
        from transformers import GemmaConfig
        from transformers.models.gemma.modeling_gemma import GemmaMLP

        mlp = GemmaMLP(GemmaConfig(hidden_size=hidden, intermediate_size=intermediate,
                                   hidden_activation="gelu_pytorch_tanh", num_attention_heads=1,
                                   num_key_value_heads=1))
    elif kind == "swiglu-fused":  # one gate_up projection, chunked (Phi-3, Phi-4-mini)
        from transformers import Phi3Config
        from transformers.models.phi3.modeling_phi3 import Phi3MLP

        mlp = Phi3MLP(Phi3Config(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu",
                                 num_attention_heads=1, num_key_value_heads=1))
    elif kind == "moe":
        mlp = _moe_block(hidden, intermediate, experts, top_k, dtype)
    elif kind == "gpt2":
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        mlp = GPT2MLP(intermediate, GPT2Config(n_embd=hidden, n_head=1, resid_pdrop=0.0))
    else:
        raise ValueError(f"unknown --mlp {kind!r}; choose from {', '.join(MLPS)}")
    for p in mlp.parameters():
        nn.init.normal_(p, std=hidden**-0.5)
    return mlp.to(dtype)


def _moe_block(hidden: int, intermediate: int, experts: int, top_k: int, dtype: torch.dtype) -> nn.Module:
    """Qwen3-MoE's sparse block (a softmax top-k router and ``experts`` SwiGLU experts in 3-D weights), its experts run
    as a model built from its config runs them: transformers' grouped matmul (its default), or its per-expert loop in
    float64, which the grouped matmul does not take."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                            num_experts_per_tok=top_k, hidden_act="silu", num_attention_heads=1,
                            num_key_value_heads=1)
    config._experts_implementation = "eager" if dtype == torch.float64 else "grouped_mm"
    return Qwen3MoeSparseMoeBlock(config)


def _with_experts_tiled(block: nn.Module, tiled: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The block's own forward (its router untiled) with ``tiled`` standing in for its experts, as patch() tiles a
    MoE model; the block is left as it was after each call."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        experts = block._modules["experts"]
        block._modules["experts"] = tiled
        try:
            return block(x)
        finally:
            block._modules["experts"] = experts

    return forward


def _tokens_in_rows(block: nn.Module, tiles: torch.Tensor) -> torch.Tensor:
    """A MoE block over a tile of any layout: the peers recompute tiles as rows of tokens (``[n, hidden]``) and cut a
    batch along its sequence, where the block reads a contiguous ``[batch, seq, hidden]``."""
    return block.forward(tiles.reshape(1, -1, tiles.shape[-1])).reshape(tiles.shape)


def _with_lora(mlp: nn.Module, hidden: int, dropout: float) -> nn.Module:
    """PEFT LoRA (rank 16, alpha 32, ``dropout``) on the three projections, base weights frozen, adapters in float32
    over 16-bit weights (as ``get_peft_model`` keeps them) and every adapter matrix nonzero (PEFT starts B at zero,
    which would leave A without a gradient): the common long-context fine-tuning setup, which patch() runs on its
    GLU path (the peers' backward draws other dropout masks than their forward: not exact with dropout)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=dropout,
                        target_modules=["gate_proj", "up_proj", "down_proj"])
    if getattr(mlp, "is_loaded_in_4bit", False):  # PEFT's 4-bit layers, float32 adapters over the 4-bit base
        mlp = inject_adapter_in_model(config, mlp)
        for name, p in mlp.named_parameters():
            if "lora_" in name:
                nn.init.normal_(p, std=hidden**-0.5)
        return mlp
    dtype = next(mlp.parameters()).dtype
    mlp = inject_adapter_in_model(config, mlp.float())
    for name, p in mlp.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            nn.init.normal_(p, std=hidden**-0.5)
    mlp = mlp.to(dtype)
    for name, p in mlp.named_parameters():
        if "lora_" in name and dtype.itemsize < 4:
            p.data = p.data.float()
    return mlp


def _quantized(mlp: nn.Module) -> nn.Module:
    """QLoRA's base: the MLP's Linears as bitsandbytes NF4 ``Linear4bit`` computing in the weights' dtype (the input's,
    so that ``patch()`` runs its GLU path over them), quantized on the device the MLP was built on."""
    import bitsandbytes as bnb

    for name in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(mlp, name)
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=linear.weight.dtype,
                              quant_type="nf4")
        q.weight = bnb.nn.Params4bit(linear.weight.data.contiguous(), requires_grad=False, quant_type="nf4")
        setattr(mlp, name, q.to(linear.weight.device))  # quantized as it is placed
    mlp.is_loaded_in_4bit = True  # what PEFT reads to wrap them with its 4-bit LoRA layers
    return mlp


def peer_available(impl: str, device: torch.device | None = None, dtype: str = "bfloat16") -> str:
    """Empty string when ``impl`` can run here (on ``device``, weights in ``dtype``), else why it is skipped."""
    if impl == LOW_ACC and dtype != "bfloat16":
        return "its sums are bf16, for bf16 weights only (--dtype bfloat16)"
    if impl == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:  # deepspeed raises several kinds of errors when its setup is incomplete
            return f"deepspeed not importable ({type(exc).__name__})"
    if impl == "liger":
        if device is not None and device.type == "cpu":
            return "Liger's kernels are Triton, which needs a GPU"
        try:
            import triton  # noqa: F401
            from liger_kernel.ops.tiled_mlp import LigerTiledMLPFunction  # noqa: F401
        except Exception as exc:
            return f"liger-kernel/triton not importable ({type(exc).__name__})"
    return ""


def build_forward(cfg: Config, mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> mlp(x)`` computed the way ``cfg.impl`` does it."""
    splits = plan_for(cfg)
    if cfg.impl == "untiled":
        return mlp
    if cfg.impl in ("tiledmlp", LOW_ACC):
        from ..patching import TiledMLP

        accumulate = torch.bfloat16 if cfg.impl == LOW_ACC else "auto"
        if cfg.mlp == "moe":  # patch() tiles a MoE block's experts; the peers below tile the whole block
            return _with_experts_tiled(mlp, TiledMLP(mlp.experts, num_shards=len(splits), accumulate_dtype=accumulate))
        return TiledMLP(mlp, num_shards=len(splits), accumulate_dtype=accumulate)
    if cfg.impl == "tiledmlp-generic":
        from ..engine import tiled_call

        params = list(mlp.parameters())
        return lambda x: tiled_call(mlp.forward, x, params=params, splits=splits)
    fn = _tokens_in_rows if cfg.mlp == "moe" else lambda module, t: module.forward(t)
    if cfg.impl == "deepspeed":
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP as DSTiledMLP

        params = list(mlp.parameters())
        return lambda x: DSTiledMLP.apply(fn, mlp, x, len(splits), params)
    if cfg.impl == "liger":
        from liger_kernel.ops.tiled_mlp import LigerTiledMLPFunction

        params = list(mlp.parameters())
        return lambda x: LigerTiledMLPFunction.apply(fn, mlp, x, len(splits), params)
    raise ValueError(f"unknown impl {cfg.impl!r}; choose from {', '.join(IMPLS)}")


def make_step(**kwargs: object) -> Callable[[], None]:
    """One fwd+bwd of a configuration, leaving no grads behind (so every call starts from the same baseline).

    The upstream gradient is created inside the step, as the output is: the peak counts both.
    """
    cfg = Config(**kwargs)  # type: ignore[arg-type]
    mlp, x = build_inputs(cfg)
    return step_for(build_forward(cfg, mlp), mlp, x)


def build_inputs(cfg: Config) -> tuple[nn.Module, torch.Tensor]:
    """The seeded MLP and input of a configuration, made on its device: an accelerator never waits on a host
    build of the weights (seconds for the seeds' 151M-parameter MLP), and one pair serves a whole length."""
    device = torch.device(cfg.device)
    with device:
        mlp = build_mlp(cfg.mlp, cfg.hidden, cfg.intermediate, cfg.torch_dtype, experts=cfg.experts, top_k=cfg.top_k)
    torch.manual_seed(1)
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, dtype=cfg.torch_dtype, device=device).requires_grad_()
    return mlp, x


def step_for(forward: Callable[[torch.Tensor], torch.Tensor], mlp: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """The fwd+bwd closure shared by the memory child and the timing loop."""
    params = list(mlp.parameters())

    def step() -> None:
        out = forward(x)
        out.backward(torch.ones_like(out))
        del out
        x.grad = None
        for p in params:
            p.grad = None

    return step
