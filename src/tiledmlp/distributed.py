"""Backend detection and the adapters that make tiling exact under DDP, FSDP1/2 and DeepSpeed ZeRO.

DDP, FSDP2 (decoder layer or MLP as the unit), FSDP1 (``use_orig_params=True``, MLP inside a unit) and
ZeRO-1/2 need nothing special: the engine returns each weight grad once, so their per-parameter hooks fire
once. Two things need care:

- ZeRO-3 partitions parameters (0 elements outside their gather), so a Function cannot take them as inputs
  and return their grads: :class:`tiledmlp.zero3.Zero3Tiled` lands each tile's grads into ``param.grad``
  (:mod:`tiledmlp.zero3`), and returns once the grads of tensors from outside the module (LoRA factors).
- ZeRO-3 gathers a submodule's parameters at every call, i.e. once per tile: ranks with different token
  counts must run the same number of tiles or their all-gathers deadlock. :class:`_TileAgreement` agrees on
  the count with one all-reduce per model forward and token stream (not per layer call) and pads short ranks
  with 0-token tiles.
"""

from __future__ import annotations

import functools
import re
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .engine import TileLayout, run_tiles_no_grad, tiled_call
from .recompute import pack_inputs_first
from .tiling import even_splits
from .zero3 import Zero3Plan, Zero3Tiled

__all__ = ["check_tileable", "refuse_data_parallel", "run_tiled", "is_zero3_param", "gradient_landing", "agreed_splits",
           "last_tile_count", "TILE_AGREEMENT", "close_process_group"]


# ----------------------------------------------------------------------------------------------- detection
@functools.lru_cache(maxsize=None)
def _sharded_unit_types() -> tuple[type, ...]:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FSDPModule, FullyShardedDataParallel)


def is_zero3_param(p: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter (DeepSpeed's own ``is_zero_param`` test: it carries ``ds_id``)."""
    if "deepspeed" not in sys.modules:  # a ZeRO-3 param can only exist once deepspeed is imported
        return False
    from deepspeed.runtime.zero.utils import is_zero_param

    return bool(is_zero_param(p))


def gradient_landing(params: Sequence[torch.Tensor]) -> str:
    """``"zero3"`` when any param is ZeRO-3 partitioned (grads land per tile), else ``"once"`` (engine returns them)."""
    flags = {is_zero3_param(p) for p in params}
    if flags == {True, False}:
        raise RuntimeError(
            "tiledmlp: this MLP mixes ZeRO-3 partitioned and plain parameters; wrap the whole model with one "
            "deepspeed.initialize (stage 3) so every parameter of the MLP is partitioned the same way"
        )
    return "zero3" if flags == {True} else "once"


def check_tileable(module: nn.Module, name: str = "", modules: Sequence[nn.Module] | None = None) -> None:
    """Refuse an MLP containing its own FSDP units: their hooks would fire per tile inside backward. ``modules``:
    ``module`` and its submodules, where the caller has walked them already."""
    units = _sharded_unit_types()
    if not any(m is not module and isinstance(m, units) for m in (module.modules() if modules is None else modules)):
        return
    inner = [n for n, m in module.named_modules() if m is not module and isinstance(m, units)]
    if inner:
        raise ValueError(
            f"tiledmlp: {name or type(module).__name__} contains FSDP units ({', '.join(inner)}); wrap the decoder "
            "layer (or the MLP itself) with fully_shard / FullyShardedDataParallel instead of each Linear inside "
            "the MLP, or tiledmlp.unpatch(model) to train it untiled"
        )


_NO_PARAM = object()


def refuse_data_parallel(module: nn.Module, x: torch.Tensor, param: object = _NO_PARAM) -> None:
    """Refuse ``torch.nn.DataParallel``: its replicas share a patched forward, which computes with the original
    module. A replica runs on another GPU than the original's weights, so the mismatch shows at its first call.
    ``param``: the module's first parameter (or None), where the caller has it already."""
    p = next(module.parameters(), None) if param is _NO_PARAM else param
    if p is not None and p.device.type == x.device.type == "cuda" and p.device != x.device:
        raise RuntimeError(
            f"tiledmlp: a patched {type(module).__name__} got inputs on {x.device} but its weights are on {p.device}. "
            "torch.nn.DataParallel (which transformers' Trainer uses when it sees several GPUs in one process) is not "
            "supported: launch one process per GPU (torchrun --nproc_per_node N, accelerate launch) for DDP, or "
            "expose one GPU (CUDA_VISIBLE_DEVICES=0)"
        )


# ------------------------------------------------------------------------------------ tile-count agreement
@dataclass
class _Forward:
    creator: weakref.ref  # the module whose call made the all-reduce
    seq: int  # global call number at creation
    most: int  # max token count over ranks


def _stream_key(module: nn.Module, name: str) -> Hashable:
    """What tells a model's token streams apart, from rank-identical data only: the module's class and its name
    with layer numbers blanked. The MLPs of one decoder stack share a key (whatever their widths: layers of
    different intermediate sizes still see the same tokens), a vision tower's or an encoder's get their own."""
    return re.sub(r"(?<![^.])\d+(?![^.])", "#", name), type(module)


class _TileAgreement:
    """Agree on tile counts across ranks with one all-reduce per model forward and token stream, not per call.

    Every rank calls the patched MLPs in the same order (ZeRO-3 requires it), so the ``n``-th call of a module
    belongs to forward ``n`` on every rank. A module's first call joins the forward in progress of its *stream*
    (:func:`_stream_key`: same class and layer path), if any; the modules joined form a *group*,
    learned in the first forward. The first call of forward ``n`` in a group all-reduces the max token count; the
    group's other modules reuse it if it was made after their own previous call. A vision-language model thus
    makes two all-reduces per forward, one for the vision tower's MLPs and one for the text MLPs, each sized for
    its own tokens. All decisions depend only on call order, module structure and all-reduced values, never on a
    rank's own token count, so no rank can run a different number of tiles. A rank with fewer tokens cuts them
    into ``len(plan(max_tokens))`` tiles (none larger than the busiest rank's) and pads with 0-token tiles.
    """

    def __init__(self) -> None:
        self.calls: weakref.WeakKeyDictionary[nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()
        self.group: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
        self.streams: weakref.WeakKeyDictionary[nn.Module, Hashable] = weakref.WeakKeyDictionary()
        self.forwards: dict[tuple[int, int], _Forward] = {}  # (id(group leader), forward index) -> agreement
        self.latest: dict[Hashable, tuple[int, int]] = {}  # stream -> key of its latest agreement
        self.warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.seq = 0
        self.collectives = 0  # all-reduces made (diagnostics: one per forward and stream once groups are learned)
        self.tiles_run = 0  # tiled forwards' tiles under ZeRO-3, 0-token padding included (diagnostics)

    def _all_reduce_max(self, value: int, group: Any, device: torch.device) -> int:
        if dist.get_backend(group) == "gloo":
            device = torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        self.collectives += 1
        return int(t.item())

    def max_tokens(self, module: nn.Module, num_tokens: int, group: Any, device: torch.device, name: str = "") -> int:
        """The max token count over ranks for this forward of ``module``'s group (all-reduced at its first call)."""
        self.seq += 1
        index, previous = self.calls.get(module, (0, -1))
        self.calls[module] = (index + 1, self.seq)
        stream = self.streams.get(module)
        if stream is None:
            stream = self.streams[module] = _stream_key(module, name)
        leader = self.group.get(module)
        if leader is not None:
            key: tuple[int, int] | None = (id(leader), index)
        else:  # first call: join its stream's forward in progress, if any (a model's first forward)
            latest = self.latest.get(stream)
            key = latest if latest is not None and latest[1] == index else None
        known = self.forwards.get(key) if key is not None else None
        if known is not None and known.seq > previous and known.creator() is not None:
            self.group[module] = self.group.get(known.creator(), known.creator())
            most = known.most
        else:
            most = self._all_reduce_max(num_tokens, group, device)
            leader = self.group.setdefault(module, leader if leader is not None else module)
            key = (id(leader), index)
            self.forwards[key] = _Forward(weakref.ref(module), self.seq, most)
            self.latest[stream] = key
            stale = [k for k, f in self.forwards.items()
                     if (k[0] == key[0] and k[1] < index - 8) or f.creator() is None]
            for k in stale:
                del self.forwards[k]
        if num_tokens > most and module not in self.warned:  # a warning only: it decides nothing
            self.warned.add(module)
            warnings.warn(
                f"tiledmlp: under ZeRO-3, {name or type(module).__name__} got {num_tokens} tokens, more than the "
                f"{most} its tile count was agreed for (the first tiled call of its kind in this forward had that "
                "many on the busiest rank), so its tiles are larger than planned. Pass an int num_shards to "
                "tiledmlp.patch (the same tile count at any length) if this MLP's memory matters",
                RuntimeWarning, stacklevel=4)
        return most


TILE_AGREEMENT = _TileAgreement()
_TILES_RUN: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


Planner = Callable[[int, torch.Tensor], "list[int]"]


def agreed_splits(
    module: nn.Module, plan: Planner, x: torch.Tensor, splits: Sequence[int], group: Any = None, name: str = ""
) -> list[int]:
    """Splits of this rank's tokens into the tile count every rank of ``group`` uses (0-token tiles first).

    ``plan(num_tokens, x)`` must give every rank the same answer for the same token count (the patched
    module's planner reads full parameter shapes, never ZeRO-3's partitioned ones). ``name`` is the module's name
    in its model: it keeps streams of one MLP class apart (an encoder's and a decoder's MLPs).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(splits)
    num_tokens = sum(splits)
    most = TILE_AGREEMENT.max_tokens(module, num_tokens, group, x.device, name)
    count = len(plan(most, x))
    real = even_splits(num_tokens, count)
    return [0] * (count - len(real)) + real


def last_tile_count(module: nn.Module) -> int:
    """The number of tiles ``module``'s latest :func:`run_tiled` call ran: under ZeRO-3 the count the ranks agreed
    on, which this rank's own plan may not match (0 before any call)."""
    return _TILES_RUN.get(module, 0)


# ------------------------------------------------ ZeRO-3: the agreed tile count, then the landing (zero3.py)
def _zero3_group(params: Sequence[torch.Tensor]) -> Any:
    """The process group DeepSpeed partitions these params over (``ds_process_group``, set by DeepSpeed)."""
    groups = {id(getattr(p, "ds_process_group", None)) for p in params}
    if len(groups) > 1:
        raise RuntimeError("tiledmlp: the params of one MLP are partitioned over different ZeRO-3 process groups")
    return getattr(params[0], "ds_process_group", None) if params else None


def _zero3_tiled(fn: Callable[..., Any], x: torch.Tensor, token_args: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor], splits: Sequence[int], extra: Sequence[torch.Tensor] = (),
                 accumulate_dtype: object = "auto") -> Any:
    TILE_AGREEMENT.tiles_run += len(splits)
    if len(splits) <= 1:
        return fn(x, *token_args)
    inputs = (x, *token_args)
    extra = list({id(e): e for e in extra}.values())  # each once: its grad is returned once
    layout = TileLayout(tuple(x.shape[:-1]), tuple(splits))
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (*inputs, *params, *extra)):
        outs, _, is_tuple = run_tiles_no_grad(fn, layout, [layout.flat(t) for t in inputs])
    else:
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        plan = Zero3Plan(fn, layout, list(params), len(inputs), accumulate_dtype)
        outs = Zero3Tiled.apply(plan, anchor, *pack_inputs_first(inputs), *extra)
        is_tuple = plan.is_tuple
    return outs if is_tuple else outs[0]


# ------------------------------------------------------------------------------------------------- entry
def run_tiled(
    fn: Callable[..., Any],
    x: torch.Tensor,
    *token_args: torch.Tensor,
    module: nn.Module,
    splits: Sequence[int],
    plan: Planner,
    accumulate_dtype: object,
    name: str = "",
    extra: Sequence[torch.Tensor] = (),
) -> Any:
    """Run ``fn`` (``module``'s original forward, named ``name`` in its model) tiled, with the gradient landing
    the backend needs; :func:`last_tile_count` then says how many tiles ran. ``extra``: tensors from outside the
    module that ``fn`` reads and whose grads flow on, once per backward (a parametrization's LoRA factors).

    ZeRO-3 is detected from all the module's params, frozen ones included: even with nothing to train (LoRA
    elsewhere, inference) its per-tile gathers need the ranks' tile counts to agree, hence ``plan``.
    """
    scope = list(module.parameters()) or _flat_views(module)
    params = [p for p in scope if p.requires_grad]
    if gradient_landing(scope) == "zero3":
        splits = agreed_splits(module, plan, x, splits, _zero3_group(scope), name)
        _TILES_RUN[module] = len(splits)
        return _zero3_tiled(fn, x, token_args, params, splits, extra, accumulate_dtype)
    _TILES_RUN[module] = len(splits)
    return tiled_call(fn, x, *token_args, params=[*params, *extra], splits=splits, accumulate_dtype=accumulate_dtype)


def _flat_views(module: nn.Module) -> list[torch.Tensor]:
    """The weights of a module that holds no parameters of its own: under FSDP1 with ``use_orig_params=False`` its
    submodules' weights are views of the unit's flat parameter, set as plain attributes for the forward. Each is
    passed as a tiled param: its grad flows on into the flat parameter, once per backward."""
    return [t for m in module.modules() for t in vars(m).values() if isinstance(t, torch.Tensor) and t.requires_grad]


# ------------------------------------------------------------------------------------------------- exit
def close_process_group() -> None:
    """Let every collective finish, then destroy the default process group (neither Trainer nor accelerate does),
    before the interpreter shuts down: call it at the end of a distributed run. No-op without one.

    FSDP2's and ZeRO-3's prefetches can leave an all-gather in flight when training ends. A gloo worker thread that
    releases such a finished work during ``Py_FinalizeEx`` needs the GIL to drop its tensors, is made to exit by
    Python, and the process aborts ("terminate called without an active exception", SIGABRT; seen in about 1 of 10
    FSDP2 twin runs, core-dump backtrace: ``~AsyncAllgatherWork`` -> ``take_gil`` -> ``pthread_exit`` in
    ``ProcessGroupGloo::runLoop`` while the main thread was in ``Py_FinalizeEx``). gloo's barrier waits for all
    earlier work; the short sleep hands the GIL to the worker threads that still hold finished works.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        time.sleep(0.2)
        dist.destroy_process_group()
