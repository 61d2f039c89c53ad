"""precision.SplitSum: a float32 sum that becomes its 16-bit gradient in its own memory, and the tiled loss using it.

Rounding once is unchanged (bit-identical to ``(sum * g).to(dtype)``); what changes is memory: the narrow gradient
is written over the sum, so no second weight-sized buffer exists when the backward hands it over."""

from __future__ import annotations

import pytest
import torch

from tiledmlp import precision
from tiledmlp.loss import tiled_causal_lm_loss
from tiledmlp.measure import profiler_peak_bytes
from tiledmlp.precision import SplitSum, scale_in_chunks_

PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float64, torch.float32)]


def _filled(shape: tuple[int, ...], dtype: torch.dtype, result: torch.dtype) -> tuple[SplitSum, torch.Tensor]:
    split = SplitSum(shape, dtype, result, torch.device("cpu"))
    whole = torch.randn(shape, dtype=torch.float64).to(dtype) * 1e-3
    for rows, block in split.blocks():
        block.copy_(whole[rows])
    return split, whole


@pytest.mark.parametrize("cuda_like", [False, True], ids=["capped", "doubling"])
@pytest.mark.parametrize("shape", [(1, 3), (2, 5), (7, 16), (64, 9), (65, 16), (300, 7)])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_narrowed_in_its_own_memory_bit_identical(pair, shape, cuda_like: bool, monkeypatch) -> None:
    """Many passes (a tiny head and chunk), odd and even rows: every element equals ``(sum * g).to(dtype)``,
    the result lies in the top block's memory, and ``scaled`` (the retained-graph path) gives the same."""
    dtype, result = pair
    monkeypatch.setattr(precision, "_HEAD", 4)
    monkeypatch.setattr(precision, "NARROW_CHUNK", 11)
    if cuda_like:  # the uncapped pass plan that CUDA gets, run here
        monkeypatch.setattr(precision, "pass_cap", lambda device_type: None)
    split, whole = _filled(shape, dtype, result)
    g = torch.tensor(1 / 40, dtype=torch.float32 if dtype != torch.float64 else torch.float64)
    expected = torch.mul(whole, g).to(result)
    kept = split.scaled(g)
    assert torch.equal(kept, expected) and all(torch.equal(b, whole[r]) for r, b in split.blocks())
    top = split.top
    narrowed = split.narrow_(g)
    assert narrowed.dtype == result and narrowed.shape == torch.Size(shape) and narrowed.is_contiguous()
    assert torch.equal(narrowed, expected)
    assert narrowed.untyped_storage().data_ptr() == top.untyped_storage().data_ptr()
    assert narrowed.untyped_storage().nbytes() == top.numel() * dtype.itemsize  # the top block, nothing more
    with pytest.raises(RuntimeError, match="already narrowed"):
        split.blocks()


def test_fits_only_a_twice_as_wide_sum() -> None:
    assert SplitSum.fits((5, 3), torch.float32, torch.bfloat16)
    assert not SplitSum.fits((5, 3), torch.float32, torch.float32)  # same width: scaled in place instead
    assert not SplitSum.fits((5, 3), torch.float64, torch.bfloat16)
    assert not SplitSum.fits((0, 3), torch.float32, torch.bfloat16)


@pytest.mark.parametrize("shape", [(512, 4096), (511, 4096), (64, 64)])
def test_temp_bytes_is_the_measured_peak_of_narrowing(shape: tuple[int, int]) -> None:
    """What ``tiledmlp plan`` counts for the narrowing is what the CPU profiler sees it allocate."""
    split, _ = _filled(shape, torch.float32, torch.bfloat16)
    g = torch.tensor(0.5)
    measured = profiler_peak_bytes(lambda: split.narrow_(g), device="cpu")
    assert measured == SplitSum.temp_bytes(shape, 4, 2, "cpu")
    assert SplitSum.temp_bytes(shape, 4, 2, "cuda") <= 6 * precision._HEAD


def test_scale_in_chunks_rounds_once(monkeypatch) -> None:
    monkeypatch.setattr(precision, "NARROW_CHUNK", 7)
    x = torch.randn(5, 9).bfloat16()
    g = torch.tensor(1 / 3)
    expected = (x.float() * g).bfloat16()
    assert scale_in_chunks_(x, g) is x and torch.equal(x, expected)


def _loss_step(vocab: int, hidden: int, tokens: int, accumulate_dtype: object) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden) * hidden**-0.5).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    grads = []

    def step() -> None:
        tiled_causal_lm_loss(h, w, y, shift=False, num_shards=16, accumulate_dtype=accumulate_dtype).backward()
        grads.append(w.grad)
        h.grad = w.grad = None

    step()  # warm-up outside the profile
    return profiler_peak_bytes(step, device="cpu"), grads[-1]


@pytest.mark.hollow_matmuls
@pytest.mark.parametrize("vocab", [8192, 8191])
def test_loss_hands_over_its_float32_sum_as_the_bf16_grad(vocab: int) -> None:
    """bf16 head, default float32 sum: the step's peak holds the sum and one tile, not also a new bf16 gradient
    (before: sum + bf16 gradient + a float32 temporary of CPU's cast, 2.5x the sum); the gradient owns exactly the
    top half-sum's bytes. With bf16 sums the 16-bit sum is scaled in place (before: two float32 copies)."""
    hidden, tokens = 1024, 512
    weight_bf16 = vocab * hidden * 2
    peak, grad = _loss_step(vocab, hidden, tokens, "auto")
    assert grad.untyped_storage().nbytes() == (vocab + 1) // 2 * hidden * 4
    assert peak < 2.5 * weight_bf16, (peak, weight_bf16)  # measured 2.31 (before: 5.0)
    peak16, _ = _loss_step(vocab, hidden, tokens, torch.bfloat16)
    assert peak16 < 1.5 * weight_bf16, (peak16, weight_bf16)


def test_a_retained_graph_reads_the_sum_again_then_narrows_it() -> None:
    """``retain_graph=True``: the first backward writes a new gradient and keeps the float32 sum; the last one
    narrows it in place. Both give the same bits."""
    torch.manual_seed(0)
    h = torch.randn(64, 32).bfloat16().requires_grad_()
    w = (torch.randn(301, 32) * 0.2).bfloat16().requires_grad_()
    y = torch.randint(0, 301, (64,))
    loss = tiled_causal_lm_loss(h, w, y, shift=False, num_shards=3) / 40
    split = loss.grad_fn.next_functions[0][0].grads[1]  # DivBackward0 -> the tiled loss node's held dW
    assert isinstance(split, SplitSum)
    loss.backward(retain_graph=True)
    first = w.grad
    assert first.untyped_storage().data_ptr() != split.top.untyped_storage().data_ptr()
    w.grad = None
    top = split.top.untyped_storage().data_ptr()
    loss.backward()
    assert torch.equal(w.grad, first) and w.grad.untyped_storage().data_ptr() == top
