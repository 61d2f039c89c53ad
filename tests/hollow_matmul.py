"""Memory tests on CPUs whose 16-bit matmuls have no hardware path: the matmuls' allocations without their arithmetic.

On an x86 CPU with neither AVX512 nor AMX (AVX2 only), a bf16 or float16 matmul runs ATen's reference kernel at
about 1 GFLOP/s (float32: about 90); the bf16 memory tests' matmuls were a third of the suite's CPU time there
(2026-11-28: 1588 s of wall time on 2 cores). Those tests assert bytes, not values, so under :func:`hollow_matmuls`
every 16-bit CPU matmul runs with its contraction dimension sliced to zero: ATen's ``addmm.out`` / ``baddbmm.out``
kernel (which its ``mm`` and ``bmm`` call with beta 0), operands of the same strides, the output allocated as ATen
allocates it, the kernel's early return (the output zeroed, or the bias copied and scaled) instead of the products.
There the reference kernel allocates nothing but its output (``precision.matmul_scratch`` is 0), and
``tests/test_hollow_matmul.py`` checks that the profiler sees the same sequence of allocations and frees with the
arithmetic and without it, for the code paths these tests take.
Elsewhere (AVX512 CPUs: oneDNN, with its float32 scratch buffers) it does nothing and the tests do the arithmetic.

Only for tests whose allocations cannot depend on values: zeros route every MoE token alike, so no routed model.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch

aten = torch.ops.aten

# The overloads taken over. addmm.out and baddbmm.out are not: they are the kernels every one of these calls, as
# ATen's own do (mm and bmm are those with beta 0), on an output allocated as ATen allocates it or the caller's.
_MATMULS = ("mm", "mm.out", "bmm", "bmm.out", "addmm", "addmm_", "baddbmm", "baddbmm_")
_16BIT = (torch.bfloat16, torch.float16)


def reference_kernel_only() -> bool:
    """True where this CPU's 16-bit matmuls run ATen's reference kernel: no AVX512 (so no oneDNN bf16), no AMX."""
    has = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731 -- private, so looked up
    return not any(has(n) for n in ("_is_avx512_supported", "_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def _kernel(name: str) -> Callable[..., torch.Tensor]:
    """A CPU kernel for ``aten::<name>``: ``addmm.out`` / ``baddbmm.out`` on the output ATen's kernel writes, with
    the contraction sliced to zero for 16-bit operands."""
    op = name.split(".")[0]
    fall = aten.baddbmm.out if "bmm" in op else aten.addmm.out
    lhs = 0 if op in ("mm", "bmm") else 1  # mm / bmm: (left, right); the others: (self, left, right)

    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        args = list(args)
        left, right = args[lhs], args[lhs + 1]
        if left.dtype in _16BIT:
            args[lhs], args[lhs + 1] = left.narrow(-1, 0, 0), right.narrow(-2, 0, 0)
        shape = (*left.shape[:-1], right.shape[-1])
        out = args[0] if op.endswith("_") else kwargs.pop("out", None)
        if out is None:
            out = torch.empty(shape, dtype=left.dtype, device=left.device)
        if lhs == 0:
            return fall(out, *args, beta=0, out=out)
        return fall(*args, **kwargs, out=out)

    return kernel


@contextlib.contextmanager
def hollow_matmuls(enabled: bool | None = None) -> Iterator[bool]:
    """16-bit CPU matmuls without their arithmetic inside the block (see the module docstring); ``enabled=None``:
    where :func:`reference_kernel_only`. Yields whether it is on.

    CPU kernels registered over ATen's for the block, not a ``TorchDispatchMode``: under a Python mode autograd
    sums two gradients of one tensor out of place (``isTensorSubclassLike``), which allocates more."""
    on = reference_kernel_only() if enabled is None else enabled
    if not on:
        yield False
        return
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            for name in _MATMULS:
                lib.impl(name, _kernel(name), "CPU")
        yield True
    finally:
        lib._destroy()
