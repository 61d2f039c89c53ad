"""CPUs differ in what a bf16 matmul allocates: with AVX512 but neither AVX512-BF16 nor AMX, oneDNN forms the product
in a float32 buffer (4 bytes per output element, beside the output); AVX2 and AVX512-BF16/AMX CPUs allocate
nothing. The memory models count that buffer where :func:`tiledmlp.precision.matmul_scratch` says it exists, so the
detection is checked on whatever CPU runs the suite, and 16-bit weight-grad sums are formed in row blocks there."""

from __future__ import annotations

import pytest
import torch

from tiledmlp import precision
from tiledmlp.measure import profiler_peak_bytes
from tiledmlp.precision import NARROW_CHUNK, acc_mm, matmul_scratch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_matmul_scratch_is_what_this_cpu_allocates(dtype: torch.dtype) -> None:
    """Per output element, at a shape whose output is 64 times each operand: buffers the size of an operand (the
    H100 machine's CPU packed or converted them, 0.2 and 1.3 bytes per output element at [256, 64] x [64, 512] in
    bf16 and fp16) are not what the models count, a buffer the size of the output is."""
    torch.manual_seed(0)
    a, b = torch.randn(2048, 16, dtype=dtype), torch.randn(16, 2048, dtype=dtype)
    out = torch.empty(2048, 2048, dtype=dtype)
    torch.mm(a, b, out=out)
    per_element = profiler_peak_bytes(lambda: torch.mm(a, b, out=out), device="cpu") / out.numel()
    assert abs(per_element - matmul_scratch(dtype, "cpu")) < 0.1, per_element
    assert matmul_scratch(dtype, "cuda") == 0


@pytest.mark.parametrize("first", [True, False], ids=["first", "accumulate"])
def test_sums_in_row_blocks_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, first: bool) -> None:
    """Blocks of 3 rows (a short last one) against one product, a transposed operand as the loss passes it."""
    torch.manual_seed(0)
    a, b = torch.randn(40, 101, dtype=torch.bfloat16).t(), torch.randn(40, 24, dtype=torch.bfloat16)
    start = torch.randn(101, 24, dtype=torch.bfloat16)
    whole, blocked = start.clone(), start.clone()
    acc_mm(whole, a, b, first)
    monkeypatch.setattr(precision, "matmul_scratch", lambda dtype, device_type: 4)
    monkeypatch.setattr(precision, "NARROW_CHUNK", 3 * 24)
    assert precision.scratch_rows(24, torch.bfloat16, "cpu") == 3
    acc_mm(blocked, a, b, first)
    assert torch.equal(blocked, whole)
    reference = a.double() @ b.double() + (0 if first else start.double())
    assert (whole.double() - reference).abs().max() <= 2**-7 * reference.abs().max()


def test_a_16_bit_sum_holds_at_most_one_block_of_float32() -> None:
    """A bf16 [8192, 1024] sum (a vocabulary-sized head's): a product in one piece would hold 32 MiB of float32
    where the CPU needs the buffer; in row blocks, 4 MiB (nothing where it needs none), besides what a CPU may hold
    the size of the operands (the H100 machine's CPU held 90 KB of packed operands here)."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 8192, dtype=torch.bfloat16).t(), torch.randn(64, 1024, dtype=torch.bfloat16)
    total = torch.zeros(8192, 1024, dtype=torch.bfloat16)
    acc_mm(total, a, b, first=False)
    peak = profiler_peak_bytes(lambda: acc_mm(total, a, b, first=False), device="cpu")
    operands = 4 * (a.numel() + b.numel())  # float32 copies of both, an upper bound on packing them
    assert peak <= matmul_scratch(torch.bfloat16, "cpu") * NARROW_CHUNK * 1.01 + operands, peak
