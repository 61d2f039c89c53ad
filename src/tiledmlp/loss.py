"""Tiled fused ``lm_head`` + causal-LM cross-entropy: the ``[tokens, vocab]`` logits never exist whole.

Why the gradients are computed in the forward (and only scaled in the backward):
the loss is a scalar, so its gradient with respect to hidden states, ``W`` and ``b`` is fully known in the
forward up to the scalar ``grad_output`` that the backward receives. Each tile computes its logits, its loss and
``d loss / d logits``, turns them into its rows of ``d hidden`` and its share of ``dW``/``db`` (summed across
tiles, in float32 for 16-bit weights), and drops the logits. The backward multiplies the stored gradients by
``grad_output`` -- which it must: DeepSpeed's ``TiledFusedLogitsLoss`` skipped that, so ``loss / 40`` left the
``lm_head`` gradient 40x too large.

- Compute: 3 matmuls per tile (logits, ``dh``, ``dW``) instead of 4 for recompute-in-backward (the logits
  matmul twice): a quarter fewer FLOPs in the loss head, no RNG/autocast replay to get right.
- Memory: ``dW`` (weight-sized; float32 for 16-bit weights) and ``dh`` (hidden-sized) live from this forward
  to its backward. In a training step those are adjacent (the loss ends the forward and starts the backward),
  and a recompute design holds the same two buffers during its backward, so the step's peak is the same. They
  are held by the loss's autograd node, whose backward scales them in place and hands them over (a float32 ``dW``
  of 16-bit weights is narrowed into the 16-bit gradient in its own memory, :class:`~tiledmlp.precision.SplitSum`,
  so no second weight-sized buffer appears; it is summed as two row blocks for that). The cost shows
  only when a loss is computed with grad enabled and never back-propagated: use ``torch.no_grad()`` for that
  (then nothing is stored and no gradient work is done).

Tiles are cut over the flattened ``B*S`` tokens that carry a label (``!= ignore_index`` after the shift):
masked tokens cost no compute, no tile is ever all-masked, and an all-masked batch has zero tiles (loss 0,
zero gradients). The mean divides by ``max(count, 1)``; ``torch.nn.functional.cross_entropy`` gives NaN there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .loss_support import check_args
from .pointwise import KernelUnavailable, cross_entropy_kernel, cross_entropy_tile_, fused_enabled, scale_
from .precision import SplitSum, acc_add, acc_mm, matmul_dtype, scale_in_chunks_, wide_mm_available
from .recompute import check_accumulate_dtype, functorch_active, resolve_accumulate_dtype
from .tiling import NumShards, even_splits, validate_num_shards

__all__ = ["tiled_causal_lm_loss", "plan_loss_tiles", "AUTO_TILE_LOGITS"]

# ``num_shards="auto"``: the fewest even tiles whose logits hold at most this many elements (128 MiB of float32
# logits per tile, e.g. 682 tokens for a 49152 vocab, 261 for 128256). A tile's working set is one such float32
# buffer (two with a softcap) plus, for 16-bit weights, its 16-bit copy. The compiled tile (``fused``) keeps only
# the logits themselves and overwrites them with their gradient, so it takes FUSED_TILE_FACTOR times as many
# tokens for about the same bytes (16-bit logits: 2 bytes per element instead of 6 to 8), and fewer, larger
# matmuls.
AUTO_TILE_LOGITS = 2**25
FUSED_TILE_FACTOR = 4


def plan_loss_tiles(num_tokens: int, vocab_size: int, num_shards: NumShards = "auto", fused: bool = False
                    ) -> list[int]:
    """Split sizes over ``num_tokens`` labelled tokens: an int gives that many tiles (fewer if fewer tokens);
    ``"auto"`` gives the fewest even tiles with at most :data:`AUTO_TILE_LOGITS` logits each (times
    :data:`FUSED_TILE_FACTOR` for the compiled tile)."""
    validate_num_shards(num_shards)
    if num_shards == "auto":
        per_tile = AUTO_TILE_LOGITS * (FUSED_TILE_FACTOR if fused else 1) // max(1, vocab_size)
        num_shards = max(1, math.ceil(num_tokens / max(1, per_tile)))
    return even_splits(num_tokens, int(num_shards))


@dataclass
class _LossPlan:
    labels: torch.Tensor  # [N] labels of the labelled tokens, in the order of ``rows``
    rows: torch.Tensor  # [N] their row in the flattened [B*S, H] hidden states
    splits: list[int]
    softcap: float | None
    scale: torch.Tensor | float  # d loss / d (summed token loss): 1/count, 1/num_items_in_batch or 1
    compute_dtype: torch.dtype  # float32, or float64 for float64 inputs
    fused: bool = False  # one compiled kernel per tile (pointwise.cross_entropy_tile_) instead of eager passes
    accumulate_dtype: object = "auto"  # of the dW/db sums: "auto" = float32 for 16-bit weights (see the docstring)
    logit_scale: float = 1.0  # the logits are multiplied by it before the softmax (Cohere, Granite, Falcon-H1)
    num_shards: NumShards = "auto"  # what ``splits`` was planned from (re-planned if the compiled tile is unavailable)
    smoothing: float = 0.0  # label smoothing: the target is (1 - s) onehot + s / vocab
    defer_scale: bool = False  # ``scale`` left to the backward (float16 logits, see :func:`_defers_scale`)

    scale_tensor: torch.Tensor | None = None  # ``scale * logit_scale`` as a 0-dim tensor, for the compiled tile

    def __post_init__(self) -> None:
        # A Python float would be baked into (and recompile) the compiled kernel; ``torch.full`` fills on the
        # device without the blocking host-to-device copy that ``torch.tensor(x, device=...)`` does (made once
        # per tile, that copy made the CPU wait for the GPU at every tile).
        if self.fused and self.scale_tensor is None:
            scale = 1.0 if self.defer_scale else self.scale
            scale = scale if self.logit_scale == 1.0 else scale * self.logit_scale  # d z / d logits too
            self.scale_tensor = scale if isinstance(scale, torch.Tensor) else torch.full(
                (), scale, dtype=self.compute_dtype, device=self.labels.device)


def _add_weight_grad(acc: torch.Tensor | SplitSum, dz: torch.Tensor, g: torch.Tensor, h: torch.Tensor,
                     first: bool) -> None:
    """``acc += dz.T @ h`` (``acc = ...`` for the ``first`` tile) without a weight-sized temporary.

    ``g`` is ``dz`` (float32) cast to the matmul dtype. Where the matmul can accumulate 16-bit products into a
    float32 ``acc`` itself (CUDA) it does; elsewhere (CPU) ``dz`` itself is multiplied in float32 into ``acc`` in
    place: no temporary, no 16-bit rounding at all, and CPU float32 GEMMs are no slower than bf16 ones. A
    :class:`SplitSum` takes one product per row block (the vocabulary's two halves).
    """
    blocks = acc.blocks() if isinstance(acc, SplitSum) else [(slice(None), acc)]
    wide = blocks[0][1].dtype == g.dtype or wide_mm_available(g.device.type, g.dtype)
    hc = h.to(g.dtype if wide else blocks[0][1].dtype)
    for rows, block in blocks:
        acc_mm(block, g[:, rows].t() if wide else dz[:, rows].t().to(block.dtype), hc, first=first)


Grads = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | SplitSum | None, torch.Tensor | None]


def _tile_pass(plan: _LossPlan, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               want: tuple[bool, bool, bool]) -> Grads:
    """Summed token loss and, per ``want`` = (dh, dW, db), the gradients of ``scale * sum`` (all under no-grad).

    Where this torch cannot build the compiled tile (it says so before touching anything, once per process), the
    pass starts again on the eager path, with the eager path's tiles; ``plan`` is updated to say so."""
    if plan.fused:
        try:
            return _tiles(plan, hidden, weight, bias, want)
        except KernelUnavailable:
            plan.fused = False
            plan.splits = plan_loss_tiles(len(plan.labels), weight.shape[0], plan.num_shards, fused=False)
    return _tiles(plan, hidden, weight, bias, want)


def _tiles(plan: _LossPlan, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           want: tuple[bool, bool, bool]) -> Grads:
    want_dh, want_dw, want_db = want
    total = torch.zeros((), dtype=plan.compute_dtype, device=hidden.device)
    dh = torch.zeros_like(hidden) if want_dh else None  # masked rows stay zero
    acc = plan.accumulate_dtype
    new = torch.empty if plan.splits else torch.zeros  # the first tile writes the sums (no fill); no tile: zeros
    dw: torch.Tensor | SplitSum | None = None
    if want_dw:  # a float32 sum for 16-bit weights becomes the gradient in its own memory (precision.SplitSum)
        dw_dtype = resolve_accumulate_dtype(acc, weight.dtype)
        dw = SplitSum(weight.shape, dw_dtype, weight.dtype, weight.device, zero=not plan.splits) \
            if SplitSum.fits(weight.shape, dw_dtype, weight.dtype) else \
            new(weight.shape, dtype=dw_dtype, device=weight.device)
    db = new(bias.shape, dtype=resolve_accumulate_dtype(acc, bias.dtype), device=bias.device) \
        if want_db and bias is not None else None
    start = 0
    for index, size in enumerate(plan.splits):
        rows, y = plan.rows[start : start + size], plan.labels[start : start + size]
        start += size
        h = hidden.index_select(0, rows)
        logits = F.linear(h, weight, bias)
        if plan.logit_scale != 1.0:  # in the logits' own dtype, as the model's forward scales them
            logits.mul_(plan.logit_scale)
        if plan.fused:  # one compiled pass: the tile's loss, and its logits overwritten by their gradient
            total += cross_entropy_tile_(logits, y, plan.scale_tensor, plan.softcap, plan.smoothing, any(want))
            z, g = None, logits
            del logits  # ``g`` is its only name now (see below)
        else:
            grad_dtype = logits.dtype  # what an untiled lm_head back-propagates in (autocast included)
            z = logits.to(plan.compute_dtype)  # the float upcast of transformers' ForCausalLMLoss
            del logits  # before the tile's float work: one [t, vocab] buffer at a time
            z = _eager_tile(plan, z, y, total, any(want))
            g = None if z is None else z.to(grad_dtype)
        if g is not None and any(want):
            _land_tile_grads(g if z is None else z, g, h, rows, weight, dh, dw, db, first=index == 0)
        # every name of this tile's buffers is dropped before the next tile allocates its own (a compiled tile's
        # logits left bound to ``logits`` once doubled the loss's working set)
        del h, z, g
    return total, dh, dw, db


def _land_tile_grads(dz: torch.Tensor, g: torch.Tensor, h: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                     dh: torch.Tensor | None, dw: torch.Tensor | SplitSum | None, db: torch.Tensor | None,
                     first: bool) -> None:
    """A tile's share of the gradients from ``dz`` (d loss / d logits, float) and ``g`` (the same in the matmul
    dtype; ``dz`` itself on the compiled path): its rows of ``dh``, and ``dW``/``db`` summed in."""
    if db is not None:
        acc_add(db, dz.sum(0, dtype=db.dtype), first)
    if dh is not None:
        dh.index_copy_(0, rows, torch.mm(g, weight).to(dh.dtype))
    if dw is not None:
        _add_weight_grad(dw, dz, g, h, first)


def _eager_tile(plan: _LossPlan, z: torch.Tensor, y: torch.Tensor, total: torch.Tensor, want: bool
                ) -> torch.Tensor | None:
    """Adds the tile's summed loss over float logits ``z`` to ``total``; with ``want``, returns
    ``scale * d loss / d z`` (computed in ``z``'s buffer)."""
    dcap = None
    if plan.softcap is not None:  # Gemma-2 style: softcap * tanh(z / softcap), d/dz = 1 - tanh^2
        z.div_(plan.softcap).tanh_()
        dcap = z.square().neg_().add_(1) if want else None
        z.mul_(plan.softcap)
    # log-sum-exp in place: z becomes exp(z - max), so a tile holds one [t, vocab] float buffer, not two
    target = z.gather(1, y[:, None]).squeeze(1)
    s = plan.smoothing
    if s:  # the smoothed target's share of the row: -(1 - s) z[y] - s mean(z)
        target = (1 - s) * target + s * z.mean(dim=1)
    zmax = z.amax(dim=1, keepdim=True)
    denom = z.sub_(zmax).exp_().sum(dim=1, keepdim=True)
    total += (zmax.squeeze(1) + denom.log().squeeze(1) - target).sum()
    if not want:
        return None
    z.div_(denom)  # softmax
    z[torch.arange(z.shape[0], device=z.device), y] -= 1 - s
    if s:
        z.sub_(s / z.shape[1])
    if dcap is not None:
        z.mul_(dcap)
    if not plan.defer_scale and not (isinstance(plan.scale, float) and plan.scale == 1.0):
        z.mul_(plan.scale)  # fold the mean's 1/N in before any rounding, as an untiled backward does
    if plan.logit_scale != 1.0:
        z.mul_(plan.logit_scale)  # d loss / d (logits before their scaling)
    return z


class _TiledLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _LossPlan, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        want = (ctx.needs_input_grad[1], ctx.needs_input_grad[2], bias is not None and ctx.needs_input_grad[3])
        total, dh, dw, db = _tile_pass(plan, hidden, weight, bias, want)
        # Held on ctx, not saved with save_for_backward: the backward scales them in place and hands them over
        # (no second weight-sized buffer), and saved-tensor hooks (offloading) have no reason to move tensors
        # the backward needs first. The backward drops them itself unless the graph is retained.
        ctx.grads = (dh, dw, db)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.fused = fused_enabled(hidden.device)  # the in-place scale kernel (which has an exact eager fallback)
        ctx.post_scale = plan.scale if plan.defer_scale else None
        return total * plan.scale

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError("tiledmlp: double backward (create_graph=True) through tiled_causal_lm_loss is not "
                               "supported; compute that loss with torch.nn.functional.cross_entropy instead")
        if ctx.grads is None:
            raise RuntimeError("tiledmlp: this tiled_causal_lm_loss was already back-propagated without "
                               "retain_graph=True; pass retain_graph=True to the first backward to run a second")
        dh, dw, db = ctx.grads
        last = not _graph_retained()
        if last:  # nothing will read them again: scale in place, and drop them as soon as the caller does
            ctx.grads = None
        w_dtype, b_dtype = ctx.dtypes
        g = grad_output.to(torch.float64 if w_dtype == torch.float64 else torch.float32)
        if ctx.post_scale is not None:  # the mean's divisor, with the loss scale, in float32
            g = g * ctx.post_scale
        return (
            None,
            None if dh is None else _scaled(dh, g, dh.dtype, last, ctx.fused),
            None if dw is None else _scaled(dw, g, w_dtype, last, ctx.fused),
            None if db is None else _scaled(db, g, b_dtype, last, ctx.fused),
        )


def _defers_scale(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, accumulate_dtype: object
                  ) -> bool:
    """Whether the mean's ``1 / N`` waits for the backward instead of being folded into ``d loss / d logits``.

    Float16 logits (weights or autocast): their gradient, about ``softmax / N``, falls into float16's subnormals
    (5e-7 at 2k tokens and a 1k vocabulary), which float16 training avoids by scaling the loss (GradScaler,
    DeepSpeed). Folded in the forward, ``1 / N`` rounded it before the loss scale could reach it (``d hidden``
    5x the untiled error); deferred, the float16 gradient is ``softmax - onehot`` and ``1 / N`` comes in float32
    with ``grad_output``. Not where a trained weight's sum is itself 16-bit: unscaled, N tokens could overflow it.
    """
    if matmul_dtype(hidden.dtype, weight.dtype, hidden.device.type) != torch.float16:
        return False
    return all(resolve_accumulate_dtype(accumulate_dtype, t.dtype).itemsize > 2
               for t in (weight, bias) if t is not None and t.requires_grad)


def _graph_retained() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); unknown counts as retained."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _scaled(total: torch.Tensor | SplitSum, g: torch.Tensor, dtype: torch.dtype, in_place: bool, fused: bool
            ) -> torch.Tensor:
    """``(total * g).to(dtype)``, computed in ``g``'s precision (``1/40`` is not a bf16 number) and rounded once.

    With ``in_place`` (nothing reads the sum again) in the sum's own memory: scaled where it has ``dtype``
    already (through the compiled kernel, or float32 chunks), narrowed into it where it is a :class:`SplitSum`.
    Else written into a new tensor, ``total`` left as it is (a retained graph's second backward reads it again)."""
    if isinstance(total, SplitSum):
        return total.narrow_(g) if in_place else total.scaled(g)
    if in_place and total.dtype == dtype:
        if total.dtype == g.dtype:
            return total.mul_(g)
        return scale_(total, g) if fused else scale_in_chunks_(total, g)
    if total.dtype == g.dtype:
        return torch.mul(total, g, out=torch.empty(total.shape, dtype=dtype, device=total.device))
    return (total.to(g.dtype) * g).to(dtype)


@torch.compiler.disable
def tiled_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    lm_head_bias: torch.Tensor | None = None,
    num_shards: NumShards = "auto",
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | None = None,
    logit_softcap: float | None = None,
    shift: bool = True,
    accumulate_dtype: object = "auto",
    logit_scale: float | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``cross_entropy(hidden_states @ W.T + b, labels)`` with transformers' causal-LM semantics, tile by tile.

    - ``shift=True``: position ``s`` predicts ``labels[..., s + 1]`` and the last position of each row has no
      target (as ``ForCausalLMLoss``); ``shift=False`` takes ``labels`` as already shifted (``shift_labels``).
    - Logits are upcast to float32 before the softmax (float64 inputs stay float64), then soft-capped
      (``softcap * tanh(z / softcap)``) if ``logit_softcap`` is set. Note Gemma-2 caps before the upcast.
    - ``reduction="mean"`` divides the summed loss by ``num_items_in_batch`` when given (gradient accumulation,
      like transformers; 0 gives inf/NaN there too), else by the number of labelled tokens; with none, the loss
      is 0 and every gradient is 0 (``F.cross_entropy`` returns NaN). ``"sum"`` returns the sum.
    - ``num_shards``: an int (tiles over the labelled tokens) or ``"auto"`` (see :func:`plan_loss_tiles`).
    - ``accumulate_dtype``: what the lm_head weight (and bias) gradient is summed over tiles in. ``"auto"``:
      float32 for 16-bit weights, rounded once at the end. ``torch.bfloat16`` (the weight's dtype) sums in the
      weight's dtype, as Liger's fused linear cross-entropy does: half the accumulator memory and traffic, one
      16-bit rounding per tile (measured in ``docs/loss.md``); ``"param"`` does that for whatever the weight's dtype.
    - ``logit_scale``: the logits are multiplied by it (in their own dtype) before the upcast and any soft-cap, as
      Cohere (``logit_scale``), Granite (``1 / logits_scaling``) and Falcon-H1 (``lm_head_multiplier``) do.
    - ``label_smoothing``: as ``F.cross_entropy``'s and Trainer's ``label_smoothing_factor``: each labelled token's
      target is ``(1 - s)`` on its label plus ``s / vocab`` on every entry (after any soft-cap).
    - Returns a 0-dim float32 loss (float64 for float64 inputs), or one of a tensor ``num_items_in_batch``'s shape
      (as transformers' division gives). Under no-grad, or when nothing needs a gradient, no autograd Function is
      built and no gradient is computed. Double backward is refused.
    """
    check_args(hidden_states, lm_head_weight, labels, lm_head_bias, reduction, num_items_in_batch, logit_softcap,
                label_smoothing)
    if functorch_active():  # else torch's setup_context error (grad) or a broadcast error deep in a tile (vmap)
        raise RuntimeError("tiled_causal_lm_loss cannot run inside torch.func's transforms (grad, vmap, jvp): compute "
                           "that loss untiled (F.cross_entropy of the logits); a model patched with patch_loss runs "
                           "its own loss there by itself")
    if logit_scale is not None and (isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float))
                                    or not math.isfinite(logit_scale) or logit_scale == 0):
        raise ValueError(f"logit_scale must be a finite non-zero number or None, got {logit_scale!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int (the label that carries no loss, -100 in transformers), got "
                        f"{ignore_index!r}")
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be True (labels are the input ids) or False (already shifted), got {shift!r}")
    validate_num_shards(num_shards)
    check_accumulate_dtype(accumulate_dtype, [t for t in (lm_head_weight, lm_head_bias) if t is not None], "lm_head")
    device, width = hidden_states.device, hidden_states.shape[-1]
    labels = labels.to(device=device, dtype=torch.long)  # uint8 ids could not hold ignore_index's padding
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_labels = labels.reshape(-1)
    rows = (flat_labels != ignore_index).nonzero().squeeze(1)
    kept = flat_labels.index_select(0, rows).long()
    vocab = lm_head_weight.shape[0]
    if kept.numel() and bool(((kept < 0) | (kept >= vocab)).any()):
        bad = kept[(kept < 0) | (kept >= vocab)][0].item()
        raise ValueError(f"labels must be in [0, {vocab}) or equal ignore_index={ignore_index}; found {bad}")
    count = kept.numel()
    compute_dtype = torch.float64 if lm_head_weight.dtype == torch.float64 else torch.float32
    scale: torch.Tensor | float
    if isinstance(num_items_in_batch, torch.Tensor):  # no .item(): no device sync; 0-dim (see the end)
        scale = num_items_in_batch.reshape(()).to(device=device, dtype=compute_dtype).reciprocal()
    elif num_items_in_batch is not None:
        items = float(num_items_in_batch)
        if not items >= 0:
            raise ValueError(f"num_items_in_batch must be >= 0 (the labelled tokens the loss is divided by), got "
                             f"{num_items_in_batch!r}")
        scale = 1.0 / items if items else math.inf  # 0: inf/NaN, as transformers' division gives
    else:
        scale = 1.0 / max(count, 1) if reduction == "mean" else 1.0
    fused = fused_enabled(device) and cross_entropy_kernel()
    plan = _LossPlan(kept, rows, plan_loss_tiles(count, vocab, num_shards, fused), None if logit_softcap is None
                     else float(logit_softcap), scale, compute_dtype, fused, accumulate_dtype,
                     1.0 if logit_scale is None else float(logit_scale), num_shards, float(label_smoothing),
                     _defers_scale(hidden_states, lm_head_weight, lm_head_bias, accumulate_dtype))
    hidden2d = hidden_states.reshape(-1, width)
    tensors = [t for t in (hidden_states, lm_head_weight, lm_head_bias) if t is not None]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        total, _, _, _ = _tile_pass(plan, hidden2d, lm_head_weight, lm_head_bias, (False, False, False))
        loss = total * scale
    else:
        loss = _TiledLossFunction.apply(plan, hidden2d, lm_head_weight, lm_head_bias)
    # the count's shape outside, as transformers' ``loss / num_items_in_batch``; 0-dim inside, where a [1, 1] scale
    # cannot scale a [vocab] bias grad in place. Never a view: FSDP2 hooks its backward onto a module's output, and
    # an in-place change of a view (a MoE model's ``loss += aux``) drops that hook
    if isinstance(num_items_in_batch, torch.Tensor) and loss.shape != num_items_in_batch.shape:
        return loss.reshape(num_items_in_batch.shape).clone()
    return loss
