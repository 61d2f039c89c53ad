"""Predicting the peak memory of one MLP forward+backward, tiled or not (:mod:`tiledmlp.measure` measures it).

Peak bytes above a baseline that already holds ``x`` and the weights, for a gated MLP
``down(act(gate(x)) * up(x))`` whose output and upstream gradient are alive during the backward. With ``T`` tokens,
hidden ``H``, intermediate ``I``, element size ``s`` and accumulator size ``a`` (4 for 16-bit weights, else ``s``;
the ``accumulate_dtype`` one when given),
fitted against CPU profiler peaks of LlamaMLP/GemmaMLP (fp32 and bf16, 256..16384 tokens, 1..16 tiles), where it
is exact to the byte once the 10,112 bytes of the two CPU RNG states saved for replay are added to the generic engine's runs
(``tests/test_memory.py`` re-checks it within 2%; not yet checked against a CUDA allocator):

untiled      s * (6 T*I + 2 T*H + H*I)      at the mul's backward: gate, act, up (saved), d(product),
                                            d(act), d(up); output and its grad; down's weight grad
GLU tiled    3 T*H*s + 3 H*I*a              output, its grad, the input-grad buffer; weight-grad accumulators
  eager      + s*5 t*I                      one tile's gate, up, act, d(product) (then d(act)) and d(up);
                                            the product is freed before d(product) is made, up before d(gate)
             (16-bit weights on CPU: at least (4s + a) t*I + a t*H, the phase where the tile's gate/up grads
             and the [t, H] input are upcast for a float32 weight-grad product; it sets the peak when H > I)
  compiled   + s*3 t*I                      gate and up (overwritten by their grads) and one [t, I] buffer:
                                            ``kernels="compiled"``, the CUDA default (pointwise.py); CUDA's
                                            matmuls accumulate float32 grads themselves, so nothing is upcast
             (16-bit weights: or, at the end, the three sums and the first one's cast, H*I*s)
    stacks   3 T*H*s + I*max(3 T*s + H*s,   compiled, where :func:`glu_stacks_fit`: per-token stacks instead of
                         T*s + 3 H*s)       the sums; at the end, three stacks and one grad ... one stack and
                                            three grads (CUDA; exact on CPU in float32, where CPU's bf16 matmuls
                                            add ~2 MiB of their own)

On an x86 CPU with AVX512 but neither AVX512-BF16 nor AMX a bf16 matmul also holds a float32 copy of its output
while it runs (:func:`tiledmlp.precision.matmul_scratch`, 4 bytes per output element): counted at the untiled
backward's d(product) product (``s (5 T*I + 2 T*H + H*I) + 4 T*I``) and, with 16-bit sums, in the eager tile.

Under autocast (``weight_dtype``: 32-bit weights and input ``w``, matmuls in 16-bit ``s``), fitted the same way
(LlamaMLP, H/I = 128/512 .. 512/1536, bf16 autocast, 1..4 tiles; the tiled terms over-predict by at most 3.3%,
the untiled one is exact where H <= I and a lower bound where H > I, so ``"auto"`` stays on the safe side):
untiled ``+ 3 H*I*s + (w - s) T*H`` (the weights' 16-bit casts autocast keeps, the input grad in ``w``), GLU tiled
``+ 5 H*I*s + (w - s) T*H`` (casts made per tile and the ones the backward reuses) and, in the upcast phase, the
tile's 16-bit input ``s t*H``; generic engine ``+ 2 H*I*s + (w - s) T*H + w t*H``.

where ``t`` is the largest tile. The last tile's gate/up, kept from the forward, are back-propagated first and
freed before any other tile is recomputed, so they add nothing to the peak of one MLP (in a model without
activation checkpointing they are alive from each layer's forward to its backward: 2 t_last*I per layer; under
checkpointing or offload nothing is kept). The generic engine has its own fitted model (:func:`generic_tile_work`;
an ungated MLP's tile, with ``activation=``: :func:`ungated_tile_bytes`, used by ``tiledmlp plan``);
DeepSpeed's TiledMLP is not modelled. Tile planning (``plan_shards``) uses the eager model everywhere: it
over-predicts the compiled path, so ``"auto"`` never costs memory on either; ``target_gb`` sizes tiles by the path's
own per-token model (:func:`tile_activation_bytes`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .precision import NARROW_CHUNK, copy_rows, matmul_scratch
from .recompute import resolve_accumulate_dtype

__all__ = [
    "tile_activation_bytes",
    "predict_mlp_peak_bytes",
    "generic_tile_work",
    "ungated_tile_bytes",
    "routed_tiling_pays",
    "routed_module_tiling_pays",
]

# Element counts (multiples of I per token) fitted against profiler peaks; see the module docstring.
_TILE_WORK = 5  # gate, up, act, d(product) (then d(act) over it), d(up); up freed before d(gate)
_TILE_WORK_COMPILED = 3  # gate and up (overwritten by their grads), and one of product / d(product)
_KEPT = 2  # the last tile's gate and up, kept from the forward
_UNTILED_TI, _UNTILED_TH, _UNTILED_HI = 6, 2, 1
# two CPU generator states (forward's saved one + the replay's fork), in bytes: the generic engine's (the GLU path
# replays no generator, LoRA dropout's per-tile states aside)
_TILED_CONSTANT = 2 * 5056


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tile_activation_bytes(num_tokens: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype,
                          path: str = "glu", top_k: int | None = None,
                          activation: tuple[int, int] | None = None, weight_dtype: torch.dtype | None = None,
                          lora: tuple[bool, int] | None = None, device_type: str = "cpu",
                          kernels: str = "eager") -> int:
    """Bytes that grow with one tile of ``num_tokens`` on ``path``: what ``target_gb`` sizes tiles by.

    GLU path: its backward's widest moment (16-bit off CUDA: the float32 upcast for the weight-grad products;
    ``kernels="compiled"``, the CUDA default, holds gate, up and one product buffer, eager two more) plus the kept
    last tile, alive from each layer's forward to its backward.
    Generic engine: its tile's widest moment less the weight grads, which do not grow with the tile
    (:func:`generic_tile_work`); for routed experts reaching ``top_k`` experts a token, ``k (6 I + 3 H)`` elements
    a token (the routed copies of x, gate|up, act, product, expert outputs: ``tiledmlp plan``'s term); for an MLP
    with a probed ``activation`` (saved, held bytes an element), at least :func:`ungated_tile_bytes`'s. Under
    autocast (``weight_dtype`` wider than ``dtype``) the generic engine also holds the tile's input in the weights'
    dtype, and experts their routed copies of it (fitted on CPU profiler peaks, bf16 autocast over float32).
    ``lora`` (GLU path over PEFT adapters): (whether they are float32 over a 16-bit base, the input elements a token
    has where they drop it, for their masks); the float32 copies are made in row blocks (``precision.copy_rows`` on
    ``device_type``), so past one block they stop growing with the tile (``tiledmlp plan``'s term).
    """
    if path not in ("glu", "generic"):
        raise ValueError(f"path must be 'glu' or 'generic', got {path!r}")
    if kernels not in ("eager", "compiled"):
        raise ValueError(f"kernels must be 'eager' or 'compiled', got {kernels!r}")
    t, h, i, s = num_tokens, hidden_size, intermediate_size, _itemsize(dtype)
    if path == "glu":
        held = _TILE_WORK_COMPILED if kernels == "compiled" else _TILE_WORK
        if s >= 4 or device_type == "cuda":  # CUDA's matmul writes 16-bit products into float32 sums itself
            extra = 0
        elif lora is not None:  # PEFT's frozen base: no sums; a CPU's 16-bit matmuls may use float32 buffers
            extra = (4 * s + matmul_scratch(dtype, device_type)) * t * i
        else:  # 16-bit products into float32 sums: the operands are upcast first
            extra = (4 * s + 4) * t * i + 4 * t * h
        work = max(held * t * i * s, extra) + _KEPT * t * i * s
        if lora is not None:
            cast, masks = lora
            # compiled (H100): adapters of the base's dtype add nothing that grows with the tile but their masks
            # and, with dropout, copies of the dropped inputs
            copies = 11 * min(t, copy_rows(i, device_type)) if cast else \
                2 * t if kernels == "eager" or masks else 0
            work += copies * i + masks * t
        return work
    w = _itemsize(weight_dtype) if weight_dtype is not None else s
    cast = w * t * h if w > s else 0
    if top_k is not None:
        return s * t * top_k * (6 * i + 3 * h) + (top_k + 1) * cast
    work = s * generic_tile_work(t, h, i, s, weight_grads=False)
    if activation is not None:
        work = max(work, ungated_tile_bytes(t, h, i, s, activation, wide=s < 4, weight_grads=False))
    return work + cast


def predict_mlp_peak_bytes(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    splits: Sequence[int] | None,
    dtype: torch.dtype = torch.float32,
    path: str = "glu",
    kernels: str = "eager",
    accumulate_dtype: torch.dtype | None = None,
    weight_dtype: torch.dtype | None = None,
    activation: tuple[int, int] | None = None,
    device_type: str = "cpu",
) -> int:
    """Predicted peak bytes above baseline of one gated-MLP forward+backward; ``splits=None`` means untiled.

    ``path="generic"`` predicts the generic engine (whole MLP recomputed under autograd per tile, per-tile weight
    grads returned by ``autograd.grad``; see :func:`generic_tile_work`), for an ungated MLP ``down(act(up(x)))``
    where ``activation`` gives its activation's probed (saved, held at once) bytes per ``[T, I]`` element
    (:func:`ungated_tile_bytes`; the untiled and GLU predictions are a gated MLP's whatever it says).
    ``kernels="compiled"`` predicts the GLU path with the compiled pointwise kernels and matmul-fused float32
    accumulation (the CUDA default). ``accumulate_dtype``: the weight-grad sums' dtype when not the default
    (float32 for 16-bit weights), e.g. ``torch.bfloat16`` for sums in the weights' own precision.
    ``weight_dtype``: the weights' and the input's dtype where wider than ``dtype``, the dtype the matmuls run in
    (a float32 model under bf16 autocast: ``dtype=torch.bfloat16, weight_dtype=torch.float32``).
    ``device_type``: where it runs; on a CPU whose 16-bit matmuls form their products in float32 buffers
    (:func:`tiledmlp.precision.matmul_scratch`) those buffers are counted where they set a peak.
    """
    _check_prediction(num_tokens, hidden_size, intermediate_size, splits, dtype=dtype, weight_dtype=weight_dtype,
                      accumulate_dtype=accumulate_dtype)
    if path not in ("glu", "generic"):
        raise ValueError(f"path must be 'glu' or 'generic', got {path!r}")
    if kernels not in ("eager", "compiled"):
        raise ValueError(f"kernels must be 'eager' or 'compiled', got {kernels!r}")
    s = _itemsize(dtype)
    w = s if weight_dtype is None else max(s, _itemsize(weight_dtype))
    t, h, i = num_tokens, hidden_size, intermediate_size
    sc = matmul_scratch(dtype, device_type)
    if not splits or len(splits) <= 1:
        cast = 3 * h * i * s + (w - s) * t * h if w > s else 0
        middle = s * (_UNTILED_TI * t * i + _UNTILED_TH * t * h + _UNTILED_HI * h * i) + cast
        # or down's input-grad product, over the four saved [T, I] tensors, with its float32 buffer
        middle = max(middle, s * ((_UNTILED_TI - 1) * t * i + _UNTILED_TH * t * h + _UNTILED_HI * h * i)
                     + sc * t * i + cast)
        # the backward's end, the three weight grads all made: the peak where tokens are few for the width
        # (for I = 3H, below about H/2 tokens; profiler peaks on CPU within 6%: tests/test_memory.py)
        end = 3 * h * i * w + (h * i * s if w > s else 0) + 2 * t * i * s + t * h * w
        return max(middle, end)
    a = (4 if w < 4 else w) if accumulate_dtype is None else _itemsize(accumulate_dtype)
    tile = max(splits)
    if path == "generic":
        cast = 2 * h * i * s + (w - s) * t * h + w * tile * h if w > s else 0
        work = 3 * h * i * a + s * generic_tile_work(tile, h, i, s) if activation is None else \
            2 * h * i * a + ungated_tile_bytes(tile, h, i, s, activation, wide=a != s)
        return 3 * t * h * s + work + cast + _TILED_CONSTANT
    cast = 5 * h * i * s + (w - s) * t * h if w > s else 0
    if kernels == "compiled":
        if glu_stacks_fit(t, h, tile, s, a, w):  # weight grads from [T, I] stacks (glu._Stacks)
            return 3 * t * h * s + i * _stacks_end(t, h, s, w) + cast
        return 3 * t * h * s + i * _sums_peak(h, tile, s, a, w, _TILE_WORK_COMPILED) + cast
    work = s * _TILE_WORK * tile * i
    if a == s:  # 16-bit sums, where matmuls hold float32 buffers: down's weight-grad product (row blocks:
        # precision.acc_mm) over gate, up, act and their product; d(product)'s over gate, up and act
        work = max(work, 4 * s * tile * i + sc * min(NARROW_CHUNK, h * i), (4 * s + sc) * tile * i)
    else:  # 16-bit matmuls: the tile's grads and [t, H] input are upcast for float32 weight-grad products
        upcast = (4 * s + a) * tile * i + a * tile * h + (s * tile * h if w > s else 0)
        work = max(work, upcast, h * i * s)  # or the first sum's cast at the end
    return 3 * t * h * s + 3 * h * i * a + work + cast


def _check_prediction(num_tokens: object, hidden_size: object, intermediate_size: object, splits: object,
                      **dtypes: object) -> None:
    """A prediction from a wrong shape is a wrong number, not an error later: refuse it, naming the argument."""
    for name, value, least in (("num_tokens", num_tokens, 0), ("hidden_size", hidden_size, 1),
                               ("intermediate_size", intermediate_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    for name, value in dtypes.items():
        if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
            raise TypeError(f"{name} must be a floating torch.dtype (e.g. torch.bfloat16), got {value!r}")
    if splits is not None:
        sizes = list(splits) if isinstance(splits, (list, tuple)) else None
        if sizes is None or not _positive_ints(sizes) or sum(sizes) != num_tokens:
            raise ValueError(f"splits must be None (untiled) or positive ints summing to num_tokens={num_tokens}, "
                             f"got {splits!r}; tiledmlp.plan_shards gives them")


def _positive_ints(sizes: list) -> bool:
    """Whether every size is a positive int (no bool). The planner's searches check splits of up to ~10^5 tiles
    thousands of times: plain ints are checked by C loops, anything else one by one."""
    if set(map(type, sizes)) <= {int}:
        return min(sizes, default=1) > 0
    return all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)


def _stacks_end(tokens: int, hidden: int, s: int, w: int, joined: bool = False) -> int:
    """Per unit of ``I``: the stacks' (``s`` bytes) widest moment, at the end, where each weight grad (``w``) is
    formed and its stack freed in turn (down's, gate's, up's): three stacks and one grad ... one stack and three
    grads. A fused ``gate_up`` (its grad formed first) holds three stacks and its double-height grad at once."""
    t, h = tokens, hidden
    return max(3 * t * s + (2 if joined else 1) * h * w, t * s + 3 * h * w)


def _sums_peak(hidden: int, tile: int, s: int, a: int, w: int, tile_work: int) -> int:
    """Per unit of ``I``: the sums' (``a`` bytes) widest moment: the three sums with one tile's buffers, or, when
    wider than the weights (``w``), with the first sum's cast at the end (the others are cast one at a time)."""
    return 3 * hidden * a + max(tile_work * tile * s, hidden * w if a != w else 0)


def glu_stacks_fit(tokens: int, hidden: int, tile: int, itemsize: int, acc_itemsize: int, weight_itemsize: int,
                   joined: bool = False) -> bool:
    """Whether the compiled GLU path forms its weight grads from per-token stacks (``glu._Stacks``, in the tiles'
    ``itemsize``) rather than per-tile sums (``acc_itemsize``): only where its peak is no higher. In practice
    16-bit weights summed in float32 and ``T`` up to about twice ``H`` (a ``[T, I]`` stack is then no larger than
    a weight-sized float32 sum)."""
    s, a, w = itemsize, acc_itemsize, weight_itemsize
    return _stacks_end(tokens, hidden, s, w, joined) <= _sums_peak(hidden, tile, s, a, w, _TILE_WORK_COMPILED)


def generic_tile_work(tile: int, hidden: int, intermediate: int, itemsize: int, weight_grads: bool = True) -> int:
    """Elements one tile of the generic engine adds at its widest moment (gated MLP, ``tile`` tokens).

    The larger of two moments, fitted conservatively on CPU profiler peaks (LlamaMLP, fp32 and bf16, 64-1024-token
    tiles, H/I = 256/704, 128/512, 512/256; over-predicting by at most 4% (fp32) and 8% (bf16) of the whole MLP):
    mid-backward, the recomputed gate/up/act/product with their gradients and down's per-tile weight grad; and
    where ``autograd.grad`` returns, every per-tile weight grad at once (``weight_grads=False``: frozen weights).
    """
    t, h, i = tile, hidden, intermediate
    hi = h * i if weight_grads else 0
    if itemsize >= 4:
        return max(6 * t * i + t * h + hi, 2 * t * i + 3 * t * h + 3 * hi)
    return max(7 * t * i + 3 * t * h + hi, t * i + t * h + 3 * hi)


def ungated_tile_bytes(tile: int, hidden: int, intermediate: int, itemsize: int, activation: tuple[int, int],
                       wide: bool = False, weight_grads: bool = True) -> int:
    """Bytes one tile of the generic engine adds at its widest moment, ungated MLP ``down(act(up(x)))`` (GPT-2,
    GPT-NeoX, Bloom, MPT), from ``activation``: the (saved, held at once) bytes per ``[t, I]`` element that
    :func:`tiledmlp.plan.activation.probe_activation_peak` reads off the activation module (GELU 8/12 in float32, GPT-2's
    tanh GELU 20/28, Bloom's ``GeLUFunction`` 8/28). Exact to the byte, biases aside, on CPU profiler peaks of those
    four MLPs (h 64 / i 256, fp32 and bf16, 512- and 1024-token tiles). The moments: the activation's (what it
    holds, the tile's ``[t, H]`` output, down's per-tile weight grad) and up's backward (d up, d x, the output,
    both weight grads). ``wide`` (16-bit matmuls into float32 sums: no per-tile weight grads, but off CUDA the
    operands are upcast, ``precision.acc_mm``): down's backward holds what the activation saved, d act, float32
    copies of the activation's output and of the tile's grad; up's, d up and float32 copies of it and of x.
    ``weight_grads=False``: less the per-tile weight grads (frozen weights, or what a tile's size does not change)."""
    t, h, i, s = tile, hidden, intermediate, itemsize
    saved, held = activation
    hi = h * i if weight_grads else 0
    if not wide:
        return max(held * t * i + s * (t * h + hi), s * (t * i + 2 * t * h + 2 * hi))
    return max((saved + s + 4) * t * i + (s + 4) * t * h, held * t * i + s * t * h,
               (s + 4) * t * i + (2 * s + 4) * t * h)


def routed_tiling_pays(num_tokens: int, tile: int, hidden: int, intermediate: int, top_k: int, *, itemsize: int,
                       weight_itemsize: int, sum_itemsize: int, summed: int, largest: int) -> bool:
    """Whether routed experts cut into tiles of ``tile`` tokens hold less than untiled: ``auto``'s check for them.

    Untiled, transformers' experts keep ``4 I + 2 H`` elements a routed copy (``top_k`` a token: the gathered
    input, gate|up, act, product, the expert output) and make the weight grads once. Tiled, the generic engine
    holds a tile's copies, but sums the ``summed`` trainable elements in ``sum_itemsize`` bytes (float32 for 16-bit
    experts), holds the ``largest`` weight's tile grad (and a sixteen-bit one's float32 eighth as it adds it), and
    one ``[tokens, H]`` gradient more: the untiled router's, beside the experts'. The experts' weights grow with
    their count, their activations with the tokens only: at 16k tokens a bf16 block of 64 experts (H 512, I 768,
    top-2) peaked at 462 MiB in 32 tiles against 405 untiled, measured on CPU. The untiled copies are an estimate
    (within 3% of that block's, 17% over one with H 128 and I 192), so tiling must come out 10% below.
    """
    row = itemsize * top_k * (4 * intermediate + 2 * hidden)
    upcast = sum_itemsize * largest // 8 if sum_itemsize > weight_itemsize else 0
    tiled = sum_itemsize * summed + weight_itemsize * largest + upcast + row * tile + itemsize * num_tokens * hidden
    return tiled < 0.9 * (weight_itemsize * summed + row * num_tokens)


def routed_module_tiling_pays(module: torch.nn.Module, splits: Sequence[int], hidden: int, intermediate: int,
                              top_k: int, dtype: torch.dtype, accumulate_dtype: object) -> bool:
    """:func:`routed_tiling_pays` for an experts ``module`` computing in ``dtype``, from its trainable weights' full
    shapes (ZeRO-3's ``ds_numel``: the same on every rank) and the sums' dtype ``accumulate_dtype`` gives them."""
    trainable = [p for p in module.parameters() if p.requires_grad and p.is_floating_point()]
    if not trainable:
        return True
    sizes = [int(getattr(p, "ds_numel", p.numel())) for p in trainable]
    w = trainable[0].dtype
    return routed_tiling_pays(sum(splits), max(splits), hidden, intermediate, top_k, itemsize=dtype.itemsize,
                              weight_itemsize=w.itemsize, summed=sum(sizes), largest=max(sizes),
                              sum_itemsize=resolve_accumulate_dtype(accumulate_dtype, w).itemsize)
