"""PEFT LoRA on MoE experts' 3-D parameters, tiled, under DDP, FSDP2 and DeepSpeed ZeRO-3 (``_lora_experts_job.py``:
two processes over gloo), and the ZeRO-3 landing of tensors from outside the module (single process, float64); LoRA
on dense MLPs (the GLU path) under DDP, FSDP1, FSDP2 and ZeRO-1/2.

PEFT registers a parametrization on the experts' weights around its call; each tile recomputed in the backward
rebuilds the weight from the LoRA factors the forward held, which are tensors computed outside the experts module.
Under ZeRO-3 such experts ran untiled until 2026-11-26 (the per-tile landing reached the module's own parameters
only); now the landing also sums the factors' per-tile grads and returns them once. FSDP1 is not checked: PEFT's
parametrization fails under FSDP1 (``use_orig_params=True``, each decoder layer a unit) untiled as well, in its
forward ("Output 0 of View is a view ... modified inplace"; torch 2.13, peft 0.21).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import pytest
import test_patch_lora_experts as single
import torch
from test_backends import FP32_TOL, shared_job
from torch import nn

import tiledmlp
from tiledmlp import distributed as tdist

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
ZERO3_CHECKS = ("zero3_uneven_target", "zero3_base_trainable")
ZERO12_DENSE = ("zero1_dense", "zero2_dense")


@pytest.fixture(scope="module")
def lora_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    checks = ("ddp", "fsdp2", "ddp_dense", "fsdp1_dense", "fsdp2_dense",
              *(ZERO3_CHECKS + ZERO12_DENSE if HAS_DEEPSPEED else ()))
    return shared_job(tmp_path_factory, "_lora_experts_job.py", {"DS_ACCELERATOR": "cpu"}, timeout=300,
                      args=checks)


def _exact(r: dict[str, Any], tiles: list[list[int]]) -> None:
    """Tiled as asked on both ranks (per micro-batch, both experts modules); losses and LoRA grads as untiled."""
    assert "error" not in r, r["error"]
    assert r["tiled_mlps"] == 2 and r["expert_lora_grads"] == 8, r  # 2 layers x 2 params x A, B
    assert r["tiles_per_rank"] == [[[n, n] for n in tiles[0]], [[n, n] for n in tiles[1]]], r["tiles_per_rank"]
    losses, untiled = sum(r["losses_per_rank"], []), sum(r["untiled_losses_per_rank"], [])
    assert losses == pytest.approx(untiled, rel=FP32_TOL), r
    assert r["grad_rel"] <= FP32_TOL, (r["grad_rel"], r["grad_worst"])


@pytest.mark.slow
@pytest.mark.parametrize("check", ["ddp", "fsdp2"])
def test_lora_experts_tiled_exactly_under_ddp_and_fsdp2(lora_results: dict[str, Any], check: str) -> None:
    """4 tiles per experts call on both ranks; the factors' grads flow on once, so DDP's and FSDP2's per-parameter
    hooks (allreduce, reduce-scatter) fire once, as untiled."""
    _exact(lora_results[check], [[4, 4], [4, 4]])


@pytest.mark.slow
@pytest.mark.parametrize("check", ["ddp_dense", "fsdp1_dense", "fsdp2_dense",
                                   *(pytest.param(c, marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="no deepspeed"))
                                     for c in ZERO12_DENSE)])
def test_dense_lora_mlps_on_the_glu_path_under_ddp_fsdp_and_zero12(lora_results: dict[str, Any], check: str) -> None:
    """A tiny Llama with LoRA on its MLPs' projections (and q_proj): the GLU path reads the adapters, returns their
    grads once per call, so DDP's allreduce, FSDP1's (``use_orig_params``, decoder-layer units) and FSDP2's
    reduce-scatter and ZeRO-1/2's reduction at the accumulation boundary see them as untiled; 4 tiles on both
    ranks."""
    r = lora_results[check]
    assert "error" not in r, r["error"]
    assert r["paths"] == ["glu"] and r["tiled_mlps"] == 2 and r["expert_lora_grads"] == 12, r  # 2 layers x 3 x A, B
    assert r["tiles_per_rank"] == [[[4, 4]] * 2] * 2, r["tiles_per_rank"]
    assert sum(r["losses_per_rank"], []) == pytest.approx(sum(r["untiled_losses_per_rank"], []), rel=FP32_TOL), r
    assert r["grad_rel"] <= FP32_TOL and r["expert_lora_grad_rel"] <= FP32_TOL, (r["grad_rel"], r["grad_worst"])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("check", ZERO3_CHECKS)
def test_lora_experts_tiled_exactly_under_zero3(lora_results: dict[str, Any], check: str) -> None:
    """40-token tiles: rank 0 plans 3 and 2 tiles for its micro-batches, rank 1 4 and 3; both run the agreed 4 and 3
    (rank 0 padding with 0-token tiles), each tile's factor grads summed and passed on once; zero3_base_trainable:
    the experts' own 3-D weights train too, landed per tile into DeepSpeed. Before 2026-11-26: 1 tile (untiled, with
    a warning)."""
    r = lora_results[check]
    _exact(r, [[4, 3], [4, 3]])
    assert r["zero3_tiles_run_per_rank"] == [2 * (4 + 3)] * 2, r
    assert r["expert_base_grads"] == (4 if check == "zero3_base_trainable" else 0), r


# test_patch_lora_experts.py's checks (float64, every grad as untiled to 1e-12, the experts tiled), run again with
# the ZeRO-3 landing forced; they supersede its test_zero3_keeps_the_untiled_fallback (before 2026-11-26: 1 tile and
# a warning)
SINGLE_PROCESS: dict[str, Callable[[], None]] = {
    "qwen3-moe": lambda: single.test_lora_on_expert_parameters_is_tiled_exactly("qwen3-moe", 2),
    "gpt-oss": lambda: single.test_lora_on_expert_parameters_is_tiled_exactly("gpt-oss", 1),
    "base-weights-trainable": lambda: (
        single.test_trainable_base_expert_weights_get_their_grads_through_the_parametrization("lora-then-patch")),
    "checkpointed": lambda: single.test_lora_experts_under_activation_checkpointing(True),
    "dropout": lambda: single.test_dropout_inside_lora_experts_replays_its_masks(2),
}


@pytest.mark.parametrize("case", SINGLE_PROCESS)
def test_lora_experts_tiled_through_the_zero3_landing(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Single process: LoRA'd experts tiled through the ZeRO-3 landing, the factors' grads returned once; the
    experts' own 3-D weights, when trainable, landed per tile; activation checkpointing; dropout masks replayed."""
    monkeypatch.setattr(tdist, "gradient_landing", lambda params: "zero3")
    before = tdist.TILE_AGREEMENT.tiles_run
    SINGLE_PROCESS[case]()
    assert tdist.TILE_AGREEMENT.tiles_run > before, "did not take the ZeRO-3 landing"


def test_zero3_landing_returns_the_grads_of_extra_tensors_once() -> None:
    """A computed extra tensor (``a @ b``, as PEFT's factors) gets its tiles' grads summed and passed on once: the
    adapters behind it accumulate once, its ``.grad`` stays untouched; a leaf extra is landed per tile. Listed
    twice, an extra tensor still gets its grad once. 0-token tiles included."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    a, b = nn.Parameter(torch.randn(8, 2, dtype=torch.float64)), nn.Parameter(torch.randn(2, 8, dtype=torch.float64))
    scale = torch.randn(8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 7, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 7, 8, dtype=torch.float64)
    accumulated: list[str] = []
    a.register_post_accumulate_grad_hook(lambda _: accumulated.append("a"))

    def run(tiled: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        for t in (w, a, b, scale, x):
            t.grad = None
        delta = a @ b

        def fn(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(t @ (w + delta)) * scale

        out = tdist._zero3_tiled(fn, x, (), [w], [3, 0, 4, 7], extra=[delta, scale, delta]) if tiled else fn(x)
        out.backward(upstream)
        return [x.grad, w.grad, a.grad, b.grad, scale.grad], delta

    want, _ = run(False)
    got, delta = run(True)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-15)
    assert accumulated == ["a", "a"], accumulated  # once untiled, once tiled
    assert not delta.retains_grad
