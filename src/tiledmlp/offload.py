"""Activation offloading: what activation checkpointing keeps between forward and backward lives in host memory.

With non-reentrant checkpointing, the only activations a checkpointed layer keeps are its inputs (everything
inside the layer is recomputed). :func:`offload_activations` installs ``torch.autograd.graph.saved_tensors_hooks``
around the model's forward. Checkpointing pushes its own hooks inside each checkpointed region, so the outer hooks
see exactly what checkpointing keeps (each layer's inputs) plus what is saved outside checkpointed regions (the
final norm, the loss). Each such tensor of at least ``min_bytes`` is copied into a pinned host buffer on a side
stream, so the copy overlaps the next layer's compute, and its device memory is released. In the backward, when a
layer's inputs are unpacked, the previous layer's inputs start their copy back on the side stream: the copy
overlaps this layer's recompute and backward, so the compute stream never waits for it.

Tensors are grouped by module call: saves between two module calls (of any module) form one group; a checkpointed
layer's inputs are saved in one go. A group leaves the device when the next one starts, once its copies to host
have run (the forward waits for the oldest when more than two groups are still copying); the newest group stays,
so what the backward needs first never moves. Copies are exact and each tensor comes back in its own layout
(sizes, strides, alignment: :class:`~tiledmlp.offload_copies.Layout`), so gradients are bit-for-bit those of the
same run without offloading; a tensor whose elements overlap stays on the device. Views of one storage saved in
one group come back in one buffer laid out as that storage was (:class:`~tiledmlp.offload_copies.Region`), so they
cost what it did. With ``split_layers=True`` (:mod:`tiledmlp.split_layers`) each decoder layer is two checkpoints,
so two inputs per layer move. On a device without separate host memory (CPU, Apple MPS) nothing moves; the hooks
still run. Autograd does not check saved tensors for in-place changes under saved-tensor hooks, so the offloader
does, moved or kept, and raises autograd's error where it would have.
"""

from __future__ import annotations

import collections
import functools
import sys
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .hf_compat import enable_checkpointing
from .offload_copies import Lane, Layout, Packed, Region
from .split_layers import SplitLayerCheckpoint, splittable

__all__ = ["offload_activations", "ActivationOffloader", "OffloadStats", "DEFAULT_MIN_BYTES"]

DEFAULT_MIN_BYTES = 1 << 20
SHARED_MEMORY_DEVICES = ("cpu", "mps")  # device types whose memory is the host's
# the offloader installed on each model: a second offload_activations(model) replaces it instead of nesting
_INSTALLED: weakref.WeakKeyDictionary[nn.Module, ActivationOffloader] = weakref.WeakKeyDictionary()


@dataclass
class OffloadStats:
    """Counts since the offloader was made (all forwards and backwards)."""

    packed: int = 0  # tensors the hooks saw
    offloaded: int = 0  # tensors copied to host memory
    offloaded_bytes: int = 0
    prefetched: int = 0  # tensors back on the device before the backward asked for them
    waited: int = 0  # tensors whose copy back started only when the backward asked (the compute stream waits)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Kept:
    """A saved tensor that stays on the device (a parameter or a view of one, a small or CPU tensor), with the version
    it was saved at: autograd skips its in-place check under saved-tensor hooks, so a layer input a user's hook
    rescales in place, or a weight an optimizer steps before the backward, would be used as changed, silently."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version

    def take(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                               f"operation: a saved {list(self.tensor.shape)} tensor is at version "
                               f"{self.tensor._version}, saved at {self.version}")
        return self.tensor


class _Pass:
    """One forward: its groups of packed tensors in save order, and which tensor each came from (weak references
    only; the graph owns the packed tensors)."""

    __slots__ = ("groups", "sources", "late", "regions", "__weakref__")

    def __init__(self) -> None:
        self.groups: list[list[weakref.ReferenceType[Packed]]] = []
        self.regions: dict[tuple[int, torch.device, torch.dtype], Region] = {}  # the newest group's, by storage
        self.late: set[int] = set()  # groups whose predecessor is fetched after attention's backward (split layers)
        self.sources: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int, weakref.ReferenceType[Packed]]] = {}

    def already_packed(self, tensor: torch.Tensor) -> Packed | None:
        """The packed copy of ``tensor`` if it was saved before, unchanged (an RMSNorm saves its input twice)."""
        source, version, ref = self.sources.get(id(tensor), (None, -1, None))
        if source is None or source() is not tensor or tensor._version != version:
            return None
        return ref()

    def new_group(self) -> None:
        """Start a group; views of one storage share a region only within one (a group is fetched as a whole)."""
        self.groups.append([])
        self.regions = {}

    def region(self, tensor: torch.Tensor) -> Region:
        """The region of ``tensor``'s storage in the newest group; a new one where the address held by the last
        one was freed since (and so may name another storage now)."""
        key = (tensor.untyped_storage().data_ptr(), tensor.device, tensor.dtype)
        region = self.regions.get(key)
        if region is None or not region.holds_storage():
            region = self.regions[key] = Region()
        return region


def _checkpoint_funcs(model: nn.Module) -> list[Any]:
    """The checkpoint functions of the model's Hugging Face layers that have checkpointing turned on."""
    return [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) is True]


def _reentrant(func: Any) -> bool:
    if isinstance(func, SplitLayerCheckpoint):
        func = func.original
    keywords = func.keywords if isinstance(func, functools.partial) else {}
    base = func.func if isinstance(func, functools.partial) else func
    # torch's checkpoint reads a missing (or None) use_reentrant as True (with a warning)
    return base is torch_checkpoint and keywords.get("use_reentrant") is not False


class ActivationOffloader:
    """Hooks installed on one model by :func:`offload_activations`; ``remove()`` (or leaving the ``with`` block)
    takes them off (checkpointing it turned on stays on, so a ``with`` block per step turns it on once)."""

    def __init__(self, model: nn.Module, min_bytes: int, checkpointing: bool, split_layers: bool, copy_on_cpu: bool
                 ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload_activations(model): model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"offload_activations: min_bytes must be an int >= 0, got {min_bytes!r}")
        previous = _INSTALLED.get(model)
        if previous is not None:
            previous.remove()
        self.model = model
        self.min_bytes = min_bytes
        self.copy_on_cpu = copy_on_cpu
        self.stats = OffloadStats()
        self.trace: list[tuple[str, int]] | None = None  # set to [] to record ("offload"|"fetch"|"use", group)
        self.split_layers = split_layers
        try:
            if checkpointing and not _checkpoint_funcs(model) and getattr(model, "supports_gradient_checkpointing", 0):
                enable_checkpointing(model, {"use_reentrant": False})
            self._check_not_reentrant()
            if split_layers:
                self._split(required=True)
        except BaseException:  # a refused call leaves the offloader it would have replaced working
            if previous is not None:
                previous._install()
            raise
        self._lanes: dict[torch.device, Lane] = {}
        # the groups left behind whose device tensors are still held, oldest first (see _leave)
        self._in_flight: collections.deque[list[weakref.ReferenceType[Packed]]] = collections.deque()
        self._pass = _Pass()
        self._new_group = True
        self._after_attention: tuple[_Pass, int] | None = None  # the group to fetch once attention's backward is done
        self._hooks_ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._mark_handle: Any = None
        self._install()

    def _install(self) -> None:
        # first of the pre-hooks: when a later one raises, the always-called exit still balances this enter
        self._handles = [self.model.register_forward_pre_hook(self._enter, prepend=True),
                         self.model.register_forward_hook(self._exit, always_call=True)]
        _INSTALLED[self.model] = self
        if self.split_layers:
            self._split(required=False)

    # -- installation ---------------------------------------------------------------------------------------

    def _check_not_reentrant(self) -> None:
        if any(_reentrant(f) for f in _checkpoint_funcs(self.model)):
            raise ValueError("offload_activations needs non-reentrant activation checkpointing, but the model "
                             "checkpoints with use_reentrant=True: enable it with activation_checkpointing_kwargs="
                             "{'use_reentrant': False} (transformers' default)")

    def _split(self, required: bool) -> None:
        """Checkpoint each splittable checkpointed layer in two halves (split_layers.py); again at every forward,
        since enabling transformers' checkpointing (the Trainer does) puts the whole-layer function back."""
        layers = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False) is True
                  and splittable(m) and callable(getattr(m, "_gradient_checkpointing_func", None))]
        if not layers and required and not _checkpoint_funcs(self.model):
            raise ValueError(f"offload_activations(split_layers=True): no layer of {type(self.model).__name__} "
                             "has activation checkpointing on, and split layers are a way of checkpointing: pass "
                             "checkpointing=True (or enable non-reentrant checkpointing first), or split_layers=False")
        if not layers and required:
            raise ValueError("offload_activations(split_layers=True): no checkpointed decoder layer of "
                             f"{type(self.model).__name__} is exactly two residual halves, h = x + self_attn(x) and "
                             "h + mlp(h), optional norms around each call, nothing else; pass split_layers=False")
        for layer in layers:
            if not isinstance(layer._gradient_checkpointing_func, SplitLayerCheckpoint):
                layer._gradient_checkpointing_func = SplitLayerCheckpoint(layer._gradient_checkpointing_func, self)

    def remove(self) -> None:
        """Take the hooks off (tensors already packed still come back in their backward); split layers are
        checkpointed whole again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._hooks_ctx is not None:  # a forward left by a BaseException (Ctrl-C) never reached _exit
            self._close()
        if _INSTALLED.get(self.model) is self:
            del _INSTALLED[self.model]
        for m in self.model.modules():
            func = getattr(m, "_gradient_checkpointing_func", None)
            if isinstance(func, SplitLayerCheckpoint):
                m._gradient_checkpointing_func = func.original

    def __enter__(self) -> ActivationOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._hooks_ctx is not None:
            if self._nested():
                return
            self._close()  # the last forward was left by a BaseException (Ctrl-C): it never reached _exit
        self._check_not_reentrant()
        if self.split_layers:
            self._split(required=False)
        self._pass = _Pass()
        self._new_group = True
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        # a global hook, only while the forward runs: hooks on the submodules themselves would, e.g., send a
        # tiled MLP's hooked Linears down the generic path
        self._mark_handle = nn.modules.module.register_module_forward_pre_hook(self._mark)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._hooks_ctx is not None and not self._nested():  # None: the forward failed before _enter ran
            self._close()

    def _close(self) -> None:
        self._mark_handle.remove()
        self._hooks_ctx.__exit__(None, None, None)
        self._hooks_ctx = None

    def _nested(self) -> bool:
        """Whether this call of the model runs in another (counting calls would miss one left by a BaseException)."""
        calls, code, frame = 0, nn.Module._call_impl.__code__, sys._getframe(1)
        while frame is not None:
            calls, frame = calls + (frame.f_code is code and frame.f_locals.get("self") is self.model), frame.f_back
        return calls > 1

    def _mark(self, module: nn.Module, args: Any) -> None:
        self._new_group = True

    # -- the saved-tensor hooks ---------------------------------------------------------------------------

    def _moves(self, tensor: torch.Tensor) -> Layout | None:
        """The layout ``tensor`` is stored and comes back in, or None where it stays on the device."""
        if type(tensor) is not torch.Tensor or tensor.device.type == "meta" or tensor.layout is not torch.strided:
            return None  # parameters stay (they live on anyway), as do tensor subclasses and sparse tensors
        if isinstance(tensor._base, nn.Parameter):
            return None  # a view of one (a Linear saves ``weight.t()``) lives on with it: a copy would only add one
        if tensor.device.type in SHARED_MEMORY_DEVICES and not (self.copy_on_cpu and tensor.device.type == "cpu"):
            return None  # no separate host memory to move to
        layout = Layout(tensor)
        size = layout.numel() * tensor.element_size()  # an empty one (torch 2.11 checkpoints save one): nothing to move
        # an overlapping one (an unfold's windows) could not be written back as it is: it stays, as big as it was
        return layout if size > 0 and size >= self.min_bytes and layout.non_overlapping() else None

    def _record(self, kind: str, group: int) -> None:
        if self.trace is not None:
            self.trace.append((kind, group))

    def _pack(self, tensor: torch.Tensor) -> _Kept | Packed:
        self.stats.packed += 1
        layout = self._moves(tensor)
        if layout is None:
            return _Kept(tensor)
        known = self._pass.already_packed(tensor)
        if known is not None:
            known.saves += 1
            return known
        groups = self._pass.groups
        if self._new_group or not groups:
            if groups:
                self._leave(groups[-1])
            self._pass.new_group()
            self._new_group = False
        lane = self._lanes.get(tensor.device)
        if lane is None:
            lane = self._lanes[tensor.device] = Lane(tensor.device)
        packed = Packed(lane, tensor, layout, self._pass, len(groups) - 1, self._pass.region(tensor))
        groups[-1].append(weakref.ref(packed))
        self._pass.sources[id(tensor)] = (weakref.ref(tensor), tensor._version, weakref.ref(packed))
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += layout.numel() * tensor.element_size()
        self._record("offload", packed.group)
        return packed

    def _leave(self, group: list[weakref.ReferenceType[Packed]]) -> None:
        """The previous group leaves the device: each tensor is released once its copy to host has run (until then
        it stays usable as it is), and the forward waits for the oldest copies when more than two groups are
        still copying, so a compute stream far ahead of the copies cannot pile up device memory."""
        self._in_flight.append(group)
        self._release_copied(keep=2)

    def _release_copied(self, keep: int) -> None:
        """Release the device tensors of the oldest left groups whose copies have run; wait beyond ``keep``."""
        while self._in_flight and (len(self._in_flight) > keep or all(
                p is None or p.copied is None or p.copied.query() for p in (r() for r in self._in_flight[0]))):
            for ref in self._in_flight.popleft():
                packed = ref()
                if packed is None or packed.unpacks:  # gone, or already handed to autograd
                    continue
                packed.release()

    def _fetch_group(self, owner: _Pass, group: int) -> None:
        """Start the copy back of every tensor of ``group`` that is not on the device and still to be unpacked."""
        started = False
        for ref in owner.groups[group] if 0 <= group < len(owner.groups) else ():
            packed = ref()
            if packed is not None and packed.device is None and packed.unpacks < packed.saves:
                packed.fetch()
                started = True
        if started:
            self._record("fetch", group)

    def _unpack(self, packed: _Kept | Packed) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.take()
        if packed.device is None:  # not prefetched (or unpacked again, e.g. a second backward)
            self.stats.waited += 1
            packed.fetch()
            self._record("fetch", packed.group)
            self._fetch_group(packed.owner, packed.group)
        elif packed.unpacks == 0:
            self.stats.prefetched += 1
        if packed.group in packed.owner.late:  # an attention half: the group before waits for its backward
            self._after_attention = (packed.owner, packed.group - 1)
        else:
            self._fetch_group(packed.owner, packed.group - 1)  # one group ahead: overlaps this layer's backward
        self._record("use", packed.group)
        return packed.take()

    # -- split layers (split_layers.SplitLayerCheckpoint calls these) -----------------------------------------

    def fetch_previous_after_attention(self) -> None:
        """The newest group is an attention half's input: when it comes back, fetch the group before it only once
        attention's backward is done (:meth:`attention_backward_done`), so that copy is not on the device during
        attention's backward, a layer's widest point (it still overlaps the rest of that half's backward)."""
        if self._pass.groups:
            self._pass.late.add(len(self._pass.groups) - 1)

    def attention_backward_done(self) -> None:
        pending, self._after_attention = self._after_attention, None
        if pending is not None:
            self._record("attention backward done", pending[1])
            self._fetch_group(*pending)


def offload_activations(model: nn.Module, *, min_bytes: int = DEFAULT_MIN_BYTES, checkpointing: bool = True,
                        split_layers: bool = False, _copy_on_cpu: bool = False) -> ActivationOffloader:
    """Keep what activation checkpointing saves of ``model`` in pinned host memory between forward and backward.

    Apply once (``offloader = offload_activations(model)``, e.g. before building a ``Trainer``; ``offloader.remove()``
    takes the hooks off) or around a step
    (``with offload_activations(model): loss = model(**batch).loss; loss.backward()``).
    Every forward of ``model`` runs under the hooks; tensors smaller than ``min_bytes``, empty ones and parameters
    stay on the device. ``checkpointing=True`` turns on a Hugging Face model's non-reentrant activation
    checkpointing if it is off (and leaves it on); pass ``False`` when something else checkpoints (FSDP's
    checkpoint wrapper, your own ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` calls).
    Reentrant checkpointing is refused. Applying it again to the same model replaces the earlier offloader (its
    hooks come off first), so the last call's options hold.
    ``split_layers=True`` checkpoints each decoder layer as two halves, attention and MLP (twice the host memory
    and copies; the MLP's backward no longer holds attention's tensors, attention runs per KV-head group: see
    :mod:`tiledmlp.split_layers`). ``_copy_on_cpu`` (tests) makes CPU tensors take the whole copy path too.
    """
    for name, flag in (("checkpointing", checkpointing), ("split_layers", split_layers)):
        if not isinstance(flag, bool):
            raise TypeError(f"offload_activations: {name} must be a bool (True or False), got {flag!r}")
    return ActivationOffloader(model, min_bytes, checkpointing, split_layers, _copy_on_cpu)
