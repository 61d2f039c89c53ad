"""What the whole-step memory model needs to know about a model, read from its config alone.

Parameter counts come from instantiating the model on the ``meta`` device (shapes, no storage), so a folder
holding only ``config.json`` of an 8B model plans in about a second and reads no weights. Matmul layers are
``nn.Linear`` and transformers' ``Conv1D`` (GPT-2 and its kin, weight stored ``[in, out]``).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from .activation import autocast_output_sizes, probe_activation, probe_activation_peak
from .probe import EagerForward, NormLayout, decoder_of, probe_eager_scores, probe_norms

__all__ = ["ModelShape"]

_ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")  # config keys, by family


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only causal LM; ``moe_*`` are zero for dense models."""

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    attn_impl: str
    qk_norm: bool
    num_params: int  # all parameters (tied weights once)
    largest_param: int  # elements of the largest parameter (optimizer temporaries are per parameter on CPU)
    lm_head_params: int
    lora_params_per_rank: int  # LoRA adapter elements per unit of rank over every Linear of the decoder layers
    matmul_params: int = 0  # elements of every Linear weight, lm_head included (what autocast casts)
    quantizable_params: int = 0  # and of all but the head's (what --load_in_4bit quantizes); the largest of them
    largest_linear: int = 0
    attn_linear_in: tuple[int, ...] = ()  # in_features of one layer's attention Linears (q, k, v, o)
    mlp_linear_in: tuple[int, ...] = ()  # and of its MLP Linears (gate, up, down)
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate: int = 0
    splittable_layers: bool = True  # split_layers.splittable: some decoder layer checkpoints in two halves
    norms: NormLayout = NormLayout()  # where the layer's norms sit and what they save (probe.probe_norms)
    loss_refusal: str = ""  # why patch_loss refuses this model (loss_support.loss_targets: BioGPT), "" if taken
    mlp_refusal: str = ""  # why patch() finds no MLP to tile (BioGPT's, OPT's fc1/fc2 in the layer), "" if it does
    fused_qkv: bool = False  # one matmul makes q, k and v (Phi-3's qkv_proj, GPT-NeoX's query_key_value, GPT-2's)
    rope: str = "full"  # "" (none: GPT-2), "full", or "partial": HF's rotated|passed halves joined per head
    mlp_gated: bool = True  # act(gate) * up (Llama, Phi-3's fused gate_up); False: act(up) (GPT-2, GPT-NeoX)
    mlp_fast_path: bool = True  # patch() tiles the MLP with the GLU engine (architectures.spec_for), else generic
    activation: tuple[tuple[int, int], ...] = ()  # (element size, bytes per element the MLP's activation saves)
    activation_peak: tuple[tuple[int, int], ...] = ()  # (size, bytes per element it holds at once: activation.py)
    # (device type, element size of the activation's output under its bf16 autocast): 4 where that autocast runs it
    # in float32 (CUDA's, XPU's and MPS's ``pow``: GPT-2's tanh GELU, squared ReLU)
    activation_autocast: tuple[tuple[str, int], ...] = ()
    mlp_token_args: int = 0  # token-wise inputs after the hidden states (Bloom's and MPT's residual)
    position_params: int = 0  # learned position embeddings (GPT-2's wpe): their grads come after the layers'
    # eager attention's forward and the layers' other inputs (probe.probe_eager_scores), per element size; empty:
    # not probed (sdpa, or no meta-device forward: the eager terms then are Llama's)
    eager_forward: tuple[EagerForward, ...] = ()
    # (window, layers): the layers attending through a sliding window; under sdpa, from ``window`` tokens on, each
    # gets a [batch, 1, seq, seq] mask (transformers' masking_utils: no is_causal skip), which torch's sdpa turns
    # into a float mask in q's dtype and saves for its backward
    sliding: tuple[int, int] = (0, 0)
    # a vision (or audio) tower beside the text decoder: its weights are counted, not its activations per image
    multimodal: bool = False

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def activation_size(self, size: int, autocast_device: str | None = None) -> int:
        """The element size the MLP's activation runs in for ``size``-byte inputs: under autocast on
        ``autocast_device`` (over wider weights), its output's there where that is wider (probed), as ``patch()``
        sizes a tile by at the call."""
        return max(size, dict(self.activation_autocast).get(autocast_device, size)) if autocast_device else size

    def activation_bytes(self, size: int) -> int:
        """Bytes per element of its input the MLP's activation keeps for the backward at ``size`` bytes an element,
        its output included (probed; SiLU/GELU: input and output)."""
        return dict(self.activation).get(size, 2 * size)

    def ungated_activation(self, size: int) -> tuple[int, int] | None:
        """(saved, held at once) bytes per element of an ungated MLP's activation at ``size`` bytes an element, as
        probed; None for a gated MLP or where either probe found nothing (its tile is then planned as gated)."""
        saved, peak = dict(self.activation), dict(self.activation_peak)
        return None if self.mlp_gated or size not in saved or size not in peak else (saved[size], peak[size])

    def sliding_mask_bytes(self, seq: int, batch: int, size: int) -> int:
        """Bytes of one sliding layer's float mask under sdpa at ``seq`` tokens (``size``: q's element size); 0 where
        there is none (no window, shorter than it, or another attention kernel)."""
        window, layers = self.sliding
        return batch * seq * seq * size if layers and self.attn_impl == "sdpa" and seq >= window else 0

    def sliding_note(self, seq: int, batch: int, size: int, checkpointing: bool) -> str:
        """What those masks cost at ``seq`` and the kernels that build none; "" where there are none."""
        each = self.sliding_mask_bytes(seq, batch, size)
        if not each:
            return ""
        window, layers = self.sliding
        held = "one at a time, recomputed" if checkpointing else "all held to their backward"
        return (f"{layers} sliding-window layers (window {window:,}) keep a seq x seq mask each under sdpa from "
                f"{window:,} tokens on: {each / 2**30:,.2f} GiB per layer at {seq:,} ({held}); "
                "on a GPU --attn_implementation flash_attention_2 or flex_attention builds none")

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> "ModelShape":
        """Read sizes from a transformers config; parameters from a meta-device instance of the model."""
        from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

        from ..split_layers import splittable

        asked = getattr(config, "_attn_implementation", None) or ""
        flash = asked if asked.startswith("flash_attention") else ""
        if flash:  # planned where its package is missing: built with sdpa (same parameters), planned as asked
            config = copy.deepcopy(config)
            config._attn_implementation = "sdpa"
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:  # a vision-language model (Qwen2.5-VL, Llava) is planned for its text decoder's tokens
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[
                type(config)]
        except KeyError as exc:
            raise ValueError(f"{type(config).__name__} is not a causal-LM or image-text-to-text config transformers "
                             "knows") from exc
        heads = getattr(text, "num_attention_heads", None)
        if not heads:  # state-space models (Mamba) and the like: the memory model is an attention decoder's
            raise ValueError(f"{name or type(config).__name__} ({getattr(text, 'model_type', '?')}) is not "
                             "supported: no attention heads in this config")
        for key in _ATTENTION_DROPOUT:
            if getattr(text, key, 0):  # CPU sdpa then materialises [heads, seq, seq] scores: GPT-2 at 2048 tokens
                # peaked at 5x the plan
                raise ValueError(f"{name or type(config).__name__}: attention dropout ({key} {getattr(text, key)}) "
                                 f"is not modelled; set {key} to 0 in its config.json to plan the run without it")
        # the class itself, not AutoModel.from_config: that enters deepspeed.zero.Init when a ZeRO-3 run is active,
        # whose collectives would hang a plan made on one rank
        with torch.device("meta"):
            model = model_class(config)
        seen, total, largest = set(), 0, 0
        for p in model.parameters():  # tied parameters are the same object
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            largest = max(largest, p.numel())
        head = model.get_output_embeddings()
        lm_head = head.weight.numel() if head is not None and head.weight is not model.get_input_embeddings().weight \
            else 0
        linears = [(n, m, dims) for n, m in model.named_modules() if (dims := _in_out(m))]
        lora = sum(i + o for _, m, (i, o) in linears if m is not head)
        first = _first_layer(model, linears, head)  # the text decoder's layer 0 stands for all
        in_mlp = _mlp_names(model)
        intermediate = _intermediate(text) or next(
            (i for n, i, o in first if in_mlp(n) and o == text.hidden_size and i != o), 0)
        in_mlp = _loose_mlp(in_mlp, first, text.hidden_size, intermediate)
        if not intermediate:
            raise ValueError(f"{name or type(config).__name__} ({getattr(text, 'model_type', '?')}) is not "
                             "supported: no MLP width (intermediate_size, ffn_dim, n_inner) in its config, and no MLP "
                             "module in its first decoder layer")
        attn_in = tuple(i for n, i, _ in first if "attn" in n or "attention" in n)
        mlp_in = tuple(i for n, i, _ in first if in_mlp(n) and ".gate." not in f"{n}.")
        heads_kv = getattr(text, "num_key_value_heads", None) or heads
        qk_norm = any(n.endswith("q_norm") for n, _ in model.named_modules())
        norms = probe_norms(model, text.hidden_size)
        if qk_norm and not norms.qk_rows:  # not traced (the meta forward failed): per-head q/k norms, as Qwen3's
            norms = replace(norms, qk_rows=heads + heads_kv)
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0
        q_width = heads * (getattr(text, "head_dim", None) or text.hidden_size // heads)
        kinds = _layer_kinds(model, first, in_mlp, intermediate, q_width + 2 * heads_kv * (q_width // heads), text)
        impl = flash or getattr(config, "_attn_implementation", None) or "sdpa"  # as the build resolved it
        if impl == "eager":
            kinds["eager_forward"] = probe_eager_scores(model, heads)
        return cls(
            name=name or getattr(text, "model_type", "model"),
            num_layers=text.num_hidden_layers,
            hidden=text.hidden_size,
            intermediate=intermediate,
            heads=heads,
            kv_heads=heads_kv,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab=text.vocab_size,
            attn_impl=impl,
            qk_norm=qk_norm or norms.qk_rows > 0,
            num_params=total,
            largest_param=largest,
            lm_head_params=lm_head,
            lora_params_per_rank=lora,
            matmul_params=sum(m.weight.numel() for _, m, _ in linears) + sum(p.numel() for p in model.parameters()
                                                                             if p.dim() >= 3),
            quantizable_params=sum(m.weight.numel() for _, m, _ in linears if m is not head),
            largest_linear=max((m.weight.numel() for _, m, _ in linears if m is not head), default=0),
            attn_linear_in=attn_in,
            mlp_linear_in=mlp_in,
            moe_experts=int(experts),
            moe_top_k=int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
            moe_intermediate=int(getattr(text, "moe_intermediate_size", 0) or getattr(text, "intermediate_size", 0))
            if experts else 0,
            splittable_layers=any(splittable(m) for m in model.modules()),
            norms=norms,
            loss_refusal=_loss_refusal(model),
            mlp_refusal=_mlp_refusal(model),
            sliding=_sliding(text, model),
            multimodal=text is not config,
            position_params=sum(m.weight.numel() for n, m in decoder_of(model).named_modules()
                                if isinstance(m, torch.nn.Embedding) and (n.endswith("wpe") or "position" in n)
                                and m is not model.get_input_embeddings()),
            **kinds,
        )


def _sliding(text: Any, model: torch.nn.Module) -> tuple[int, int]:
    """(window, layers using it) as the model's forward picks its masks: by ``layer_types`` ("sliding_attention")
    where the config lists them (Gemma 2/3, GPT-OSS, Cohere 2, Qwen2's ``use_sliding_window``), else every layer
    where a window is set and the model's module builds sliding masks (Mistral, Mixtral, Phi-3, Starcoder2)."""
    window = getattr(text, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return (0, 0)
    types = getattr(text, "layer_types", None)
    if types:
        return (window, sum(t == "sliding_attention" for t in types))
    if getattr(text, "use_sliding_window", True) is False:
        return (0, 0)
    try:
        source = inspect.getsource(inspect.getmodule(type(model)))
    except (OSError, TypeError):
        return (0, 0)
    return (window, text.num_hidden_layers) if "create_sliding_window_causal_mask" in source else (0, 0)


def _loss_refusal(model: torch.nn.Module) -> str:
    """Why ``patch_loss`` refuses ``model`` (its own check, on the meta-device instance), or ""."""
    from ..loss_support import loss_targets

    try:
        loss_targets(model)
    except ValueError as exc:
        return str(exc)
    return ""


def _mlp_refusal(model: torch.nn.Module) -> str:
    """Why ``patch()`` finds no MLP to tile in ``model`` (its own search: a module ``spec_for`` takes), or ""."""
    from ..architectures import spec_for

    if any(spec_for(m)[0] is not None for m in model.modules()):
        return ""
    return (f"tiledmlp.patch finds no MLP module to tile in {type(model).__name__} (none of its modules is one it "
            "knows; tiledmlp.register_mlp registers a module class that holds an MLP)")


def _first_layer(model: torch.nn.Module, linears: list, head: Any) -> list[tuple[str, int, int]]:
    """(name, in, out) of the matmuls of the text decoder's layer 0: under ``get_decoder()`` (a vision-language
    model's vision tower has a layer 0 too), the first index in the name 0 (not expert 0 of a later layer)."""
    decoder = decoder_of(model)
    prefix = next((n for n, m in model.named_modules() if m is decoder), "")
    prefix = f"{prefix}." if prefix else ""
    return [(n, i, o) for n, m, (i, o) in linears if m is not head and n.startswith(prefix)
            and next((part for part in n[len(prefix):].split(".") if part.isdigit()), None) == "0"]


def _mlp_names(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether a matmul's name is inside an MLP: ``mlp`` in its path, or a module of a ``...MLP`` class above it
    (MPT's ``ffn``), as ``patch()`` finds MLPs."""
    owners = tuple(f"{n}." for n, m in model.named_modules() if n and type(m).__name__.endswith("MLP"))
    return lambda name: "mlp" in name or name.startswith(owners)


def _loose_mlp(in_mlp: Callable[[str], bool], first: list[tuple[str, int, int]], hidden: int,
               intermediate: int) -> Callable[[str], bool]:
    """``in_mlp``, or where no matmul of layer 0 is in an MLP module (BioGPT's, OPT's ``fc1`` / ``fc2`` in the
    decoder layer), also the matmuls outside attention between the hidden and the MLP's width."""
    if any(in_mlp(n) for n, _, _ in first) or not intermediate:
        return in_mlp
    loose = {n for n, i, o in first if {i, o} == {hidden, intermediate} and "attn" not in n and "attention" not in n}
    return lambda name: in_mlp(name) or name in loose


def _layer_kinds(model: torch.nn.Module, first: list[tuple[str, int, int]], in_mlp: Callable[[str], bool],
                 intermediate: int, qkv_width: int, text: Any) -> dict[str, Any]:
    """What decoder layer 0's modules say about the tensors autograd keeps: a fused q/k/v matmul, the RoPE form, a
    gated MLP, the engine ``patch()`` tiles it with, what its activation saves and the dtype it runs in under each
    device type's autocast (:mod:`.activation`)."""
    from ..architectures import spec_for

    rope = getattr(text, "rope_parameters", None) or {}
    kinds: dict[str, Any] = {
        "fused_qkv": any(o == qkv_width for n, _, o in first if "attn" in n or "attention" in n),
        "rope": "partial" if "partial_rotary_factor" in rope else "full" if rope else ""}
    mlp = [(n, i, o) for n, i, o in first if in_mlp(n) and ".gate." not in f"{n}."]
    if mlp:
        module = model.get_submodule(mlp[0][0].rsplit(".", 1)[0])
        spec, _ = spec_for(module)
        reading = sum(o for _, i, o in mlp if i == text.hidden_size)  # gate and up, or up alone
        kinds.update(mlp_gated=reading != intermediate, mlp_fast_path=spec is None or spec.glu is not None,
                     activation=probe_activation(module), activation_peak=probe_activation_peak(module),
                     activation_autocast=autocast_output_sizes(module),
                     mlp_token_args=spec.num_token_args if spec is not None else 0)
    return kinds


def _in_out(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a matmul layer: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's, ``[in, out]``
    weight); None for anything else."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    return None


def _intermediate(text: Any) -> int:
    """The MLP width: ``intermediate_size`` (OPT's and XGLM's ``ffn_dim``), or GPT-2-style ``n_inner``, whose None
    means 4 x hidden."""
    for key in ("intermediate_size", "ffn_dim"):
        if getattr(text, key, None):
            return int(getattr(text, key))
    if hasattr(text, "n_inner"):
        return int(text.n_inner or 4 * text.hidden_size)
    return 0
