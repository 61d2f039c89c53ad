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

The same holds for the matmuls of CPU flash attention (``scaled_dot_product_attention``'s CPU kernel: 16-bit
``q @ k.T`` and ``p @ v`` blocks through the same reference gemm, most of a bf16 step at 1024 tokens): there the
kernels are replaced whole by :func:`_attention` and :func:`_attention_backward`, which allocate what ATen's do, in its
order, and write zeros. What they allocate is fixed by the shapes, not the values: the output (``empty_like`` the
query) and a float32 ``[batch, seq, heads]`` logsumexp; per thread a float32 block buffer (scores, row max, row sum,
an output block) and a 16-bit copy of the scores; in backward the zeroed grads in ``[batch, seq, heads, dim]``
layout, ``grad_out``'s contiguous copy in that layout, per thread two score blocks in float32 and two 16-bit, and the
calling thread's row sums (the profiler sees the calling thread's allocations). Block sizes follow the query's length
as ATen's dispatch picks them. ``tests/test_hollow_matmul.py`` checks the sequences for sequences on either side of
the block sizes' thresholds, grouped-query attention, masks and both layouts of the gradient.

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


def _cpu_has(name: str) -> bool:
    """``torch.cpu``'s private feature check ``name`` (False where this torch lacks it)."""
    return bool(getattr(torch.cpu, name, lambda: False)())


def reference_kernel_only() -> bool:
    """True where this CPU's 16-bit matmuls run ATen's reference kernel: no AVX512 (so no oneDNN bf16), no AMX."""
    return not any(_cpu_has(n) for n in ("_is_avx512_supported", "_is_amx_tile_supported", "_is_avx512_bf16_supported"))


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


def _blocks(q_len: int, kv_len: int) -> tuple[int, int]:
    """(query rows, key rows) per block of ATen's CPU flash attention for these lengths (its kernel's template
    arguments: 256 query rows from 768 tokens, 64 from 192, else 32; 512 keys; neither more than the sequence)."""
    rows = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(rows, q_len), min(512, kv_len)


_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _attention(keyset: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
               is_causal: bool = False, *, attn_mask: torch.Tensor | None = None, scale: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash attention's forward: ATen's kernel for other dtypes; for 16-bit ones, its allocations in its
    order ([batch, heads, seq, dim] inputs), zeros for the output and logsumexp."""
    if query.dtype not in _16BIT:
        return _FLASH.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, query, key, value, dropout_p,
                                 is_causal, attn_mask=attn_mask, scale=scale)
    batch, heads, seq, dim = query.shape
    out = torch.empty_like(query)
    logsumexp = torch.empty(batch, seq, heads, dtype=torch.float32).transpose(1, 2)
    rows, keys = _blocks(seq, key.shape[2])
    threads = torch.get_num_threads()
    scores = torch.empty(threads, rows * keys + 2 * rows + rows * dim, dtype=torch.float32)
    scores_16 = torch.empty(threads, rows * keys, dtype=query.dtype)
    del scores_16, scores  # freed as the kernel's locals are: the 16-bit one first
    return out.zero_(), logsumexp.zero_()


def _attention_backward(keyset: Any, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float,
                        is_causal: bool, *, attn_mask: torch.Tensor | None = None, scale: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Its backward likewise: zero grads, allocated (and the temporaries freed) as ATen's kernel does."""
    if query.dtype not in _16BIT:
        return _FLASH_BACKWARD.redispatch(keyset & torch._C._after_autograd_keyset, grad_out, query, key, value, out,
                                          logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    grads = tuple(torch.zeros(t.transpose(1, 2).shape, dtype=t.dtype).transpose(1, 2) for t in (query, key, value))
    grad_out_rows = grad_out.transpose(1, 2).contiguous()
    rows, keys = _blocks(query.shape[2], key.shape[2])
    threads = torch.get_num_threads()
    scores = torch.empty(threads, 2 * rows * keys, dtype=torch.float32)
    scores_16 = torch.empty(threads, 2 * rows * keys, dtype=query.dtype)
    row_sums = torch.empty(rows, dtype=torch.float32)
    del row_sums, scores_16, scores, grad_out_rows
    return grads


@contextlib.contextmanager
def hollow_matmuls(enabled: bool | None = None) -> Iterator[bool]:
    """16-bit CPU matmuls and flash attention without their arithmetic inside the block (see the module
    docstring); ``enabled=None``:
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
            # above the kernels, to reach ATen's for float32: the forward where autograd has recorded its node,
            # the backward (which has no gradient of its own) in place of its autograd kernel
            lib.impl("_scaled_dot_product_flash_attention_for_cpu", _attention, "ADInplaceOrView", with_keyset=True)
            lib.impl("_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward, "AutogradCPU",
                     with_keyset=True)
        yield True
    finally:
        lib._destroy()


@contextlib.contextmanager
def hollow_matmuls_native_bf16_too() -> Iterator[bool]:
    """:func:`hollow_matmuls`, and on a CPU with AVX512-BF16 or AMX too, with oneDNN off for the block, so that its
    16-bit matmuls take ATen's reference kernel as on an AVX2 CPU. For tests that hold our code's own bytes to
    within 1%: oneDNN's buffers for native bf16 products, sized by its blocking, are more than that there (0.3-2.3
    MB a product at one thread over the tiled loss's shapes, 18 MB for a 16384 x 4096 x 256 one; profiler, a Xeon
    with AMX, torch 2.13, 2026-11-29) and not in the plan (docs/plan.md). On an AVX512 CPU without them oneDNN runs
    as it is: its float32 product buffer is planned (``precision.matmul_scratch``)."""
    if not (_cpu_has("_is_amx_tile_supported") or _cpu_has("_is_avx512_bf16_supported")):
        with hollow_matmuls(None) as on:
            yield on
        return
    with torch.backends.mkldnn.flags(enabled=False), hollow_matmuls(True):
        yield True
