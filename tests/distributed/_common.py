"""Shared by the distributed jobs (run under torchrun): tiny models, the global batch, the untiled reference.

Every rank trains on its own micro-batches; the reference is one process, untiled, fed all ranks' micro-batches
with the loss scaled by ``1 / (world * micro-batches)`` — the same average DDP, FSDP and DeepSpeed compute.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import transformers as tf

from tiledmlp.distributed import close_process_group
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.patching import TiledForward

# rank 0 at 96 tokens, rank 1 at 160 (the tile-count agreement case); a second, shorter micro-batch each
LENGTHS = {0: (96, 72), 1: (160, 120)}
STEPS = 2
LR = 1e-3
# AdamW's eps, above torch's 1e-8 default: d(update)/d(grad) near a zero grad is lr / eps, 1e5 at 1e-8, so float32
# summation-order noise (1e-7 relative in the first step's grads) became 1e-5 in the second step's grads and params
# on some CPUs (untiled ZeRO-3 against torch: 6.7e-6, tiled 1.3e-5 on an AVX2 Zen 3, 2026-11-28), whatever the
# tiling. At 1e-6 every backend's second step sits near 1e-6 on that CPU, tiled or not, 10x under FP32_TOL.
EPS = 1e-6
VOCAB = 128


def llama() -> torch.nn.Module:
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    return _init(tf.LlamaForCausalLM(config))


def qwen3_moe() -> torch.nn.Module:
    config = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=172, moe_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                               output_router_logits=True, router_aux_loss_coef=0.01, experts_implementation="eager")
    return _init(tf.Qwen3MoeForCausalLM(config))


def llama_frozen_mlp() -> torch.nn.Module:
    """LoRA-like: the MLP weights are frozen, so a tiled MLP has nothing to land but still runs per-tile gathers."""
    model = llama()
    for name, p in model.named_parameters():
        p.requires_grad_(".mlp." not in name)
    return model


def llama_checkpointed() -> torch.nn.Module:
    """transformers' default (non-reentrant) activation checkpointing on every decoder layer."""
    model = llama()
    enable_checkpointing(model)
    return model


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"llama": llama, "qwen3-moe": qwen3_moe,
                                                    "llama-frozen-mlp": llama_frozen_mlp,
                                                    "llama-checkpointed": llama_checkpointed}


def _init(model: torch.nn.Module) -> torch.nn.Module:
    """Same weights on every rank and in the reference; constants (norms) randomised for sharper checks."""
    torch.manual_seed(0)
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    model.train()
    return model


def batch(step: int, rank: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, VOCAB, (1, LENGTHS[rank][micro]), generator=g)


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference(kind: str, world: int) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Untiled single-process fp32 run: per step, (accumulated grads before the step, params after it)."""
    model = MODELS[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    out = []
    micro = len(LENGTHS[0])
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for rank in range(world):
            for m in range(micro):
                (loss_of(model, batch(step, rank, m)) / (world * micro)).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        out.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    denom = b.norm()
    return float((a - b).norm() if denom == 0 else (a - b).norm() / denom)


def max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest per-tensor relative error, and the tensor it occurs in; every name must be present."""
    missing = sorted(set(want) ^ set(got))
    if missing:
        raise AssertionError(f"parameter names differ from the reference: {missing[:6]}")
    errs = {n: rel_err(got[n], want[n]) for n in want}
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def compare(steps: list[tuple[dict, dict]], ref: list[tuple[dict, dict]]) -> dict[str, Any]:
    g = [max_rel(s[0], r[0]) for s, r in zip(steps, ref)]
    p = [max_rel(s[1], r[1]) for s, r in zip(steps, ref)]
    return {"grad_rel": max(e for e, _ in g), "grad_worst": max(g)[1], "param_rel": max(e for e, _ in p),
            "param_worst": max(p)[1], "steps": len(steps)}


def clean(name: str) -> str:
    for prefix in ("module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def count_gate_calls(model: torch.nn.Module) -> list[int]:
    """Counts forward calls of every MLP projection named gate_proj (per tile under the generic path)."""
    counter = [0]

    def hook(*_: Any) -> None:
        counter[0] += 1

    for name, module in model.named_modules():
        if name.endswith("mlp.gate_proj"):
            module.register_forward_pre_hook(hook)
    return counter


def lm_head_output_dims(model: torch.nn.Module) -> list[int]:
    """Records the number of dims of every ``lm_head`` output: 0 when the tiled loss ran inside it (no logits)."""
    dims: list[int] = []
    head = next(m for n, m in model.named_modules() if n.endswith("lm_head"))
    head.register_forward_hook(lambda _m, _a, out: dims.append(out.dim()))
    return dims


def tiled_forwards(model: torch.nn.Module) -> list[TiledForward]:
    """The tiled forwards ``tiledmlp.patch`` set on ``model``'s MLPs (none when nothing was tiled)."""
    found = [m.__dict__.get("forward") for m in model.modules()]
    return [f for f in found if isinstance(f, TiledForward)]


def tiles_run(model: torch.nn.Module) -> list[int]:
    """The distinct tile counts ``model``'s tiled MLPs ran in their latest call: [] when nothing is tiled."""
    return sorted({f.last_num_tiles for f in tiled_forwards(model)})


def all_ranks(value: Any) -> list[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class Job:
    """Runs named checks in order on every rank; rank 0 writes one JSON file of figures (or error text)."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._refs: dict[str, Any] = {}

    def ref(self, kind: str) -> list[tuple[dict, dict]]:
        if kind not in self._refs:
            self._refs[kind] = reference(kind, self.world) if self.rank == 0 else None
        return self._refs[kind]

    def check(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # recorded for the test to report; the job goes on to the next check
            result = {"error": f"{type(exc).__name__}: {exc}"}
            import traceback

            traceback.print_exc()
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.results[name] = result
        if self.rank == 0:
            print(f"[{name}] {result}", flush=True)
        dist.barrier()

    def write(self) -> None:
        if self.rank == 0:
            with open(os.environ["TILEDMLP_RESULTS"], "w") as f:
                json.dump(self.results, f, indent=1)

    def run(self, checks: dict[str, Callable[[], dict[str, Any]]]) -> None:
        """Run the checks named on the command line (all by default), write the figures, end the process group."""
        for name in sys.argv[1:] or checks:
            self.check(name, checks[name])
        self.write()
        close_process_group()


def run_plan_checks(checks: dict[str, tuple], measure: Callable[..., dict[str, Any]]) -> None:
    """The plan jobs' main: ``measure(*spec, world, rank)`` for each named check, their 16-bit matmuls and
    attention hollow (``tests/hollow_matmul.py``: the same allocations without the arithmetic)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    from hollow_matmul import hollow_matmuls

    init()
    job = Job()
    with hollow_matmuls():
        job.run({name: (lambda spec=spec: measure(*spec, job.world, job.rank)) for name, spec in checks.items()})


def assert_plan_matches(result: dict[str, Any], tolerance: float) -> None:
    """A plan check's figures: no error, and the plan within ``tolerance`` of the measured rank."""
    assert "error" not in result, result["error"]
    assert abs(result["planned"] / result["measured"] - 1) <= tolerance, result


def init() -> None:
    torch.set_num_threads(1)
    sys.stdout.reconfigure(line_buffering=True)
    dist.init_process_group("gloo")


def count_reduce_scatters(counter: list[int]) -> None:
    """Wrap the reduce-scatter entry points FSDP2 may use; ``counter[0]`` counts outermost calls only."""
    depth = [0]

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[0] += depth[0] == 0
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name)))
