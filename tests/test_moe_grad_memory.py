"""Routed experts' weight grads on the generic engine: each stacked (3-D) weight's tile grad is summed when autograd
makes it, and a 16-bit one is upcast into its float32 sum a slice at a time, so a tile's backward does not hold
every tile grad and a float32 copy of each. Same sums, bit for bit."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tiledmlp import engine
from tiledmlp.bench.configs import Config, build_forward, build_inputs
from tiledmlp.measure import profiler_peak_bytes


def _run(cfg: Config) -> tuple[int, list[torch.Tensor]]:
    mlp, x = build_inputs(cfg)
    forward = build_forward(cfg, mlp)
    grad = torch.randn_like(x)
    grads: list[torch.Tensor] = []

    def step() -> None:
        forward(x).backward(grad)
        grads[:] = [x.grad, *(p.grad for p in mlp.parameters())]
        x.grad = None
        mlp.zero_grad(set_to_none=True)

    step()  # warm-up: the peak below is a steady step's
    return profiler_peak_bytes(step, device="cpu"), [g.clone() for g in grads]


@pytest.mark.parametrize("impl", ["tiledmlp", "tiledmlp-generic"])
def test_stacked_expert_grads_are_summed_as_autograd_makes_them(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 Qwen3-MoE block, 32 experts (H 128, I 192), 2048 tokens in 8 tiles, float32 sums: the peak drops by at
    least down's bf16 tile grad (1.5 MiB) and half of gate_up's float32 copy (3 MiB); measured: 6.7 MiB, of 20.9."""
    cfg = Config("moe", 128, 192, 2048, 1, "bfloat16", impl, "8", experts=32)
    peak, grads = _run(cfg)

    @contextlib.contextmanager
    def returned_together(_sums):  # before: every tile grad returned by autograd.grad, then added whole
        yield set()

    monkeypatch.setattr(engine, "_landed_as_produced", returned_together)
    before, grads_before = _run(cfg)
    experts = 32 * 128 * 192
    assert before - peak >= experts * 2 + experts * 2 * 4 // 2, (before, peak)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_before))


def _block(experts: int, dtype: torch.dtype) -> torch.nn.Module:
    from tiledmlp.bench.configs import build_mlp

    return build_mlp("moe", 128, 192, dtype, experts=experts)


@pytest.mark.parametrize("experts, dtype, tokens, accumulate, tiles", [
    (64, torch.bfloat16, 4096, "auto", 1),  # float32 sums of 64 experts' weights: more than the tiles save
    (64, torch.bfloat16, 4096, torch.bfloat16, 32),  # bf16 sums (accumulate_dtype): they pay
    (64, torch.bfloat16, 2048, torch.bfloat16, 1),  # ... but not at half the tokens
    (8, torch.float32, 4096, "auto", 32),  # few experts: their sums are small beside the tokens' copies
])
def test_auto_tiles_experts_only_where_that_holds_less(experts: int, dtype: torch.dtype, tokens: int,
                                                       accumulate: object, tiles: int) -> None:
    """``auto`` on routed experts weighs the weight-grad sums against what the tiles save (``tiledmlp plan``
    and ``tiledmlp bench`` plan the same), and the measured peaks agree with each choice: where it keeps one tile,
    the tiles the ALST rule would cut peak above untiled; where it tiles, below."""
    import tiledmlp

    block = _block(experts, dtype)
    tiled = tiledmlp.patch(block, num_shards="auto", accumulate_dtype=accumulate)
    assert tiled.patched
    x = torch.randn(1, tokens, 128, dtype=dtype, requires_grad=True)
    block(x).sum().backward()
    assert block.experts.forward.last_num_tiles == tiles

    def peak(num_shards: object) -> int:
        tiledmlp.unpatch(block)
        if num_shards != 1:
            tiledmlp.patch(block, num_shards=num_shards, accumulate_dtype=accumulate)

        def step() -> None:
            block(x).backward(torch.ones_like(x))
            x.grad = None
            block.zero_grad(set_to_none=True)

        step()
        return profiler_peak_bytes(step, device="cpu")

    rule = tokens // 128  # the ALST rule's count, which auto cut before
    untiled, cut = peak(1), peak(rule)
    assert (cut < untiled) == (tiles > 1), (untiled, cut)


def test_the_plan_and_the_bench_plan_the_experts_auto_as_patch() -> None:
    from tiledmlp.bench.configs import plan_for
    from tiledmlp.plan import ModelShape, Setup
    from tiledmlp.plan.model import step_tiles
    import transformers as tf

    config = tf.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=192, num_experts=64,
                               num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, vocab_size=100)
    shape = ModelShape.from_config(config)
    for accumulate, tiles in (("auto", None), ("param", 32)):
        setup = Setup(dtype=torch.bfloat16, tiled_mlp=True, accumulate=accumulate, device_type="cpu")
        got = step_tiles(shape, setup, 4096).mlp
        assert (len(got) if got else None) == tiles
    for impl, tiles in (("tiledmlp", 1), ("tiledmlp-bf16acc", 32)):
        assert len(plan_for(Config("moe", 128, 192, 4096, 1, "bfloat16", impl, "auto", experts=64))) == tiles
