"""Row-tiled RMSNorms: at long sequences a norm's float32 working set, not the MLP, sets a layer's peak.

A Hugging Face RMSNorm upcasts its input to float32 and autograd keeps that copy (4 bytes per element) plus
``x * rsqrt`` cast back for its weight's gradient; its backward then holds about five float32 ``[tokens, hidden]``
temporaries at once. Measured on an H100 (Llama-3.2-1B shape, 256k tokens, bf16): 10 GiB of norm-backward
temporaries and 6 GiB of norm-saved tensors at the step's peak, more than the tiled MLP and the attention.

Here a norm runs tile by tile over the flattened tokens with no graph (each tile through the module's own
forward, written into one output), saves only its input, and in the backward recomputes each tile and
differentiates it with autograd: per-row math is the module's own, so ``dx`` is what the untiled norm gives
(to the last bit where the kernels round each row alike wherever it lies; Gemma3n's and Gemma4's norms compute
``pow(mean, -0.5)`` in float32, whose vectorised CPU kernel rounds a tensor's last rows apart: their ``dx`` is
1e-9 off in a float64 model, float32 rounding).
The weight's gradient is formed against a float32 copy of the weight (for 16-bit weights) and summed over
tiles in float32, then rounded once, so tiling adds no rounding to it. Tiles are sized by the float32 bytes
of one tile (:data:`NORM_TILE_BYTES`): short sequences run the module untouched.

Only modules that look like RMSNorms are tiled: class name ending in ``RMSNorm``, a 1-D ``weight`` and no
other parameter or child, checked again at every call: a norm changed since patching (a parametrization on its
weight, another parameter) runs untiled. Under ZeRO-3 (partitioned params, per-tile gathers) a norm runs untiled,
and so does a 16-bit norm whose forward computes otherwise with a float32 weight
(:meth:`TiledNormForward.wide_weight_exact`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .distributed import gradient_landing
from .engine import refuse_double_backward
from .recompute import (ReplayState, check_unmodified, functorch_active, pack_inputs_first, resolve_accumulate_dtype,
                        save_inputs, saved_inputs, tensor_versions)
from .tiling import NumShards, even_splits, validate_num_shards

__all__ = ["NORM_TILE_BYTES", "plan_norm_tiles", "is_tileable_norm", "TiledNormForward", "patch_norms",
           "unpatch_norms", "restore_forwards", "patched_forward", "FORWARD_SLOTS", "class_forward"]

NORM_TILE_BYTES = 256 * 2**20  # float32 bytes of one tile's [rows, hidden]: 32k rows at hidden 2048


def plan_norm_tiles(num_rows: int, hidden: int, num_tiles: NumShards = "auto") -> list[int]:
    """Row counts per tile: ``"auto"`` keeps each tile's float32 copy within :data:`NORM_TILE_BYTES`."""
    if num_tiles == "auto":
        num_tiles = max(1, math.ceil(num_rows * hidden * 4 / NORM_TILE_BYTES))
    return even_splits(num_rows, int(num_tiles))


def is_tileable_norm(module: nn.Module) -> bool:
    """An RMSNorm-like leaf: its name, a 1-D ``weight`` it reads as an attribute, and nothing else trainable."""
    if not type(module).__name__.endswith("RMSNorm") or next(module.children(), None) is not None:
        return False
    weight = module._parameters.get("weight", module.__dict__.get("weight"))
    others = [n for n in module._parameters if n != "weight"]
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and not others


@contextlib.contextmanager
def _weight_as(module: nn.Module, value: torch.Tensor) -> Iterator[None]:
    """Let ``module.weight`` read ``value`` for a while (where the attribute lives: FSDP1 keeps plain tensors)."""
    store = module._parameters if "weight" in module._parameters else module.__dict__
    old = store["weight"]
    store["weight"] = value
    try:
        yield
    finally:
        store["weight"] = old


def _tiles_no_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = rows = None
    start = 0
    with torch.no_grad():
        for size in splits:
            y = fn(flat[start : start + size].unsqueeze(0))
            if out is None:  # returned itself, not a view: a caller may modify it in place
                out = torch.empty((*x.shape[:-1], y.shape[-1]), dtype=y.dtype, device=y.device)
                rows = out.view(-1, out.shape[-1])
            rows[start : start + size].copy_(y.reshape(size, -1))
            del y  # before the next tile's forward allocates its own
            start += size
    return out


class _TiledNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, norm: "TiledNormForward", splits: Sequence[int], x: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
        ctx.norm, ctx.splits = norm, list(splits)
        ctx.weight = weight  # by reference, as the engine keeps params: the very tensor the module reads
        ctx.versions = tensor_versions([weight])  # so an in-place change before the backward is refused
        ctx.replay = ReplayState(x.device)
        out = _tiles_no_grad(norm.original_forward(), x, splits)
        save_inputs(ctx, [x])
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        refuse_double_backward()
        check_unmodified([ctx.weight], ctx.versions)
        (x,) = saved_inputs(ctx)
        need_x, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        module, fn = ctx.norm.module, ctx.norm.original_forward()
        weight = ctx.weight
        # a float32 leaf for a 16-bit weight: its per-tile grads are float32 sums, rounded once at the end
        leaf = weight.detach().to(resolve_accumulate_dtype("auto", weight.dtype)).requires_grad_(need_w)
        flat, grad_flat = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        dx = torch.empty_like(flat) if need_x else None
        dw = None
        start = 0
        with ctx.replay.replay(), _weight_as(module, leaf):
            for size in ctx.splits:
                x_t = flat[start : start + size].unsqueeze(0).detach().requires_grad_(need_x)
                with torch.enable_grad():
                    y = fn(x_t)
                wrt = ([x_t] if need_x else []) + ([leaf] if need_w else [])
                got = torch.autograd.grad(y, wrt, grad_flat[start : start + size].view(y.shape).to(y.dtype),
                                          allow_unused=True)
                if need_x:
                    dx[start : start + size].copy_(got[0].reshape(size, -1)) if got[0] is not None \
                        else dx[start : start + size].zero_()
                if need_w and got[-1] is not None:
                    dw = got[-1] if dw is None else dw.add_(got[-1])
                del y, got  # this tile's output and input grad, before the next tile's forward allocates
                start += size
        if need_w and dw is None:
            dw = torch.zeros_like(leaf)
        return (None, None, None if dx is None else dx.view(x.shape),
                None if dw is None else dw.to(weight.dtype))


class TiledNormForward:
    """The instance-level ``forward`` of a patched norm: untouched below one tile, else the tiled Function."""

    def __init__(self, module: nn.Module, num_tiles: NumShards = "auto") -> None:
        self.module = module
        self.num_tiles = num_tiles
        self.original: Callable[..., Any] | None = module.__dict__.get("forward")
        self.last_num_tiles = 0
        self._wide_weight_exact: dict[torch.dtype, bool] = {}
        self._input_name: str | None = None  # the forward's first parameter, read at the first keyword call

    def original_forward(self) -> Callable[..., Any]:
        return self.original if self.original is not None else class_forward(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.original_forward()
        hidden_states = self._sole_input(fn, args, kwargs)
        if torch.compiler.is_compiling() or hidden_states is None or hidden_states.dim() < 2:
            return fn(*args, **kwargs)  # a compiled model fuses its norms itself
        if functorch_active():  # torch.func's transforms take no tiled Function (recompute.functorch_active)
            return fn(*args, **kwargs)
        hidden = hidden_states.shape[-1]
        splits = plan_norm_tiles(hidden_states.numel() // max(1, hidden), hidden, self.num_tiles)
        self.last_num_tiles = len(splits)
        weight = self.module.weight
        # a norm changed since patching (a parametrization on its weight, another parameter) runs untiled: the
        # backward could not stand a float32 leaf in for a weight the module computes
        if len(splits) <= 1 or not is_tileable_norm(self.module) \
                or gradient_landing(list(self.module.parameters())) == "zero3" \
                or not self.wide_weight_exact(weight.dtype):
            return fn(hidden_states)
        if not torch.is_grad_enabled() or not (hidden_states.requires_grad or weight.requires_grad):
            return _tiles_no_grad(fn, hidden_states, splits)
        (x,) = pack_inputs_first([hidden_states])
        return _TiledNormFunction.apply(self, splits, x, weight)

    def _sole_input(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The one tensor the call passes, positionally or by the forward's own name for it (``norm(x=t)`` for
        Gemma's ``forward(self, x)``: accepted as unpatched), else None: any other argument runs untiled."""
        if len(args) + len(kwargs) != 1:
            return None
        if kwargs:
            if self._input_name is None:
                self._input_name = next(iter(inspect.signature(fn).parameters), "")
            value = kwargs.get(self._input_name)
        else:
            value = args[0]
        return value if isinstance(value, torch.Tensor) else None

    def wide_weight_exact(self, dtype: torch.dtype) -> bool:
        """Whether the forward gives the same output and input grad with a float32 copy of its ``dtype`` weight,
        which the backward recomputes with (so the tiles' weight grads sum in float32). A forward that rounds in
        the weight's dtype (``(1.0 + self.weight).float()``) or branches on it does not: that norm runs untiled,
        exact. Probed once per dtype on a small CPU input (any failure there counts as not exact)."""
        wide = resolve_accumulate_dtype("auto", dtype)
        if wide == dtype:
            return True
        if dtype not in self._wide_weight_exact:
            self._wide_weight_exact[dtype] = self._probe(dtype, wide)
        return self._wide_weight_exact[dtype]

    def _probe(self, dtype: torch.dtype, wide: torch.dtype) -> bool:
        gen = torch.Generator().manual_seed(0)
        hidden = self.module.weight.numel()
        weight = (torch.randn(hidden, generator=gen) / 2).to(dtype)
        x = torch.randn(1, 8, hidden, generator=gen).to(dtype)
        grad = torch.randn(1, 8, hidden, generator=gen).to(dtype)  # the real output's, as the backward gets
        results = []
        try:
            for value in (weight, weight.to(wide)):
                x_l = x.clone().requires_grad_()
                # the probe's own saved tensors stay its own: inside a checkpointed layer's first forward they would
                # count as the layer's, and its recomputation (probe cached) would save fewer (CheckpointError)
                with _weight_as(self.module, value), torch.enable_grad(), torch.autocast("cpu", enabled=False), \
                        torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                    y = self.original_forward()(x_l)
                    (dx,) = torch.autograd.grad(y, x_l, grad.to(y.dtype))
                results.append((y.to(dtype), dx))
        except Exception:  # noqa: BLE001 - a forward the probe cannot run is left untiled, which is exact
            return False
        return all(torch.equal(a, b) for a, b in zip(*results))


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def validate_norms(norms: object) -> None:
    """``norms`` for :func:`tiledmlp.patch`: True/"auto", False, or a positive tile count."""
    if norms is True or norms is False:
        return
    try:
        validate_num_shards(norms)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("num_shards", "norms") + " (or True/False)") from None


def patch_norms(model: nn.Module, num_tiles: NumShards = "auto") -> int:
    """Tile every RMSNorm of ``model`` (see the module docstring); returns how many were newly patched (the
    already tiled ones take ``num_tiles``)."""
    count = 0
    for module in model.modules():
        current = patched_forward(module, TiledNormForward)
        if current is not None:
            current.num_tiles = num_tiles
        elif is_tileable_norm(module):
            module.forward = TiledNormForward(module, num_tiles)
            count += 1
    return count


# Where a patched forward may sit: ``forward``, or the ``_old_forward`` that accelerate's hooks call once they are
# added after patching (``dispatch_model``, ``cpu_offload``)
FORWARD_SLOTS = ("forward", "_old_forward")


def class_forward(module: nn.Module) -> Callable[..., Any]:
    """``module``'s class ``forward``, bound to it, past the patched one on the instance. A partial, not
    ``forward.__get__(module)``: under ``torch.compile`` Dynamo resolves the latter to the instance's attribute,
    the patched forward itself, which would then call itself until the recursion limit."""
    return functools.partial(type(module).forward, module)


def patched_forward(module: nn.Module, kind: type) -> Any:
    """The ``kind`` instance patched into ``module`` (in either slot), or None."""
    return next((f for f in map(module.__dict__.get, FORWARD_SLOTS) if isinstance(f, kind)), None)


def restore_forwards(model: nn.Module, kind: type) -> int:
    """Put back the forward of every module whose patched forward is a ``kind`` (it keeps ``original``), in the
    slot it is found in."""
    count = 0
    for module in model.modules():
        for slot in FORWARD_SLOTS:
            tiled = module.__dict__.get(slot)
            if not isinstance(tiled, kind):
                continue
            if slot == "forward" and tiled.original is None:
                del module.forward
            else:  # accelerate's hook calls ``_old_forward``: it must stay callable
                setattr(module, slot, tiled.original or type(module).forward.__get__(module))
            count += 1
    return count


def unpatch_norms(model: nn.Module) -> int:
    """Restore the norms :func:`patch_norms` tiled; returns how many."""
    return restore_forwards(model, TiledNormForward)
