"""The copies of activation offloading (:mod:`tiledmlp.offload`): a device's side stream, one saved tensor's
host copy with the device copy it holds while resident, the layout that copy comes back in, and the region of
views of one storage that come back in one device buffer.

A saved tensor comes back with its own sizes and strides, and its address at the same offset from an aligned one:
the backward's kernels pick their paths by strides and alignment (a BLAS call on a transposed or gapped operand is
another call), so anything else can change the grads' last bits (Phi-3's ``gate_up_proj`` output cut in halves by
``chunk``: two views with a gap, up to 9e-19 apart in float64 when they came back contiguous). The host keeps only the
tensor's elements (one slice of an expanded dimension); the device copy spans what the strides reach, gaps
included, as the original's storage did. Views of one storage saved in one group (those two halves) share one
device buffer laid out as that storage was: the pair costs the fused buffer again, not a span each.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .offload import _Pass

__all__ = ["Lane", "Layout", "Packed", "Region"]

# allocators align blocks to a divisor of this (CUDA's caching allocator 512 bytes, the CPU one 64): a tensor that
# comes back this many bytes' residue into a fresh block sits as aligned as it did
_ALIGN_BYTES = 512


class Layout:
    """A saved tensor's sizes and strides, its storage offset (``at``; ``offset``: modulo the alignment), and what
    of it is stored: each expanded (stride-0) dimension is stored as one slice, so an expanded tensor costs what it
    did, not its size."""

    __slots__ = ("size", "stride", "at", "offset", "stored")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.size, self.stride, self.at = tuple(tensor.shape), tensor.stride(), tensor.storage_offset()
        self.offset = self.at % max(1, _ALIGN_BYTES // tensor.element_size())
        self.stored = tuple(1 if stride == 0 else size for size, stride in zip(self.size, self.stride))

    def numel(self) -> int:
        """Elements stored (and copied each way)."""
        return math.prod(self.stored)

    def span(self) -> int:
        """Elements from the first to the last one the strides reach (what the device copy allocates)."""
        return 1 + sum((size - 1) * stride for size, stride in zip(self.stored, self.stride)) if self.numel() else 0

    def non_overlapping(self) -> bool:
        """No two stored elements share an address (a sufficient test: each stride, smallest first, goes past what
        the smaller ones reach). Copies cannot write an overlapping layout back, so such tensors stay on the device."""
        reach = 0
        for size, stride in sorted((d for d in zip(self.stored, self.stride) if d[0] > 1), key=lambda d: d[1]):
            if stride <= reach:
                return False
            reach += (size - 1) * stride
        return True

    def dense(self) -> bool:
        """Non-overlapping without gaps (any dimension order, e.g. a transpose): the host copy takes its strides, so
        both copies are plain memory copies."""
        return self.non_overlapping() and self.span() == self.numel()

    def stored_part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of ``tensor`` (in this layout) that is copied: one slice of each expanded dimension."""
        return tensor.as_strided(self.stored, self.stride)


class Lane:
    """One device's side stream and the two copies that run on it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = torch.get_device_module(device.type)
        self.pin = device.type != "cpu"
        self.side = self.module.Stream(device) if self.pin else self.module.Stream()

    def current(self) -> Any:
        return self.module.current_stream(self.device)

    def to_host(self, tensor: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, Any]:
        """The host copy and the event that marks its end (until then the device tensor must stay alive). A dense
        layout keeps its strides (empty_like does); a gapped one is gathered into a contiguous buffer (``copy_``
        gathers on the device first, in memory of the side stream's, freed there once the copy is queued)."""
        part = layout.stored_part(tensor)
        host = (torch.empty_like(part, device="cpu", pin_memory=self.pin) if layout.dense()
                else torch.empty(layout.stored, dtype=part.dtype, device="cpu", pin_memory=self.pin))
        return host, self._copy(part, host)

    def to_device(self, parts: list[tuple[torch.Tensor, Layout, int]], numel: int) -> list[tuple[torch.Tensor, Any]]:
        """Device copies of host tensors in one buffer of ``numel`` elements (the compute stream's memory, freed
        there), each at its offset in its layout, and the events marking their ends."""
        buffer = torch.empty(numel, dtype=parts[0][0].dtype, device=self.device)
        return [(buffer.as_strided(layout.size, layout.stride, at),
                 self._copy(host, buffer.as_strided(layout.stored, layout.stride, at))) for host, layout, at in parts]

    def _copy(self, source: torch.Tensor, target: torch.Tensor) -> Any:
        """Queue the copy on the side stream; the event marks its end."""
        # once the compute stream got here, the source is complete and the target's memory no longer in use there
        self.side.wait_stream(self.current())
        with self.module.stream(self.side):
            target.copy_(source, non_blocking=self.pin)
            return self.side.record_event()


class Region:
    """The saved tensors of one storage in one group (one tensor, or views such as Phi-3's ``gate_up_proj`` halves):
    fetched together into one device buffer laid out as that storage was, each view at its offset from the first
    (which keeps its alignment residue), so they cost on the device what the storage they cover did."""

    __slots__ = ("members",)

    def __init__(self) -> None:
        self.members: list[weakref.ReferenceType[Packed]] = []  # in save order: a later save wins where they overlap

    def _alive(self) -> list[Packed]:
        return [packed for packed in (ref() for ref in self.members) if packed is not None]

    def holds_storage(self) -> bool:
        """Whether a member still holds the storage: until then its address names no other one."""
        return any(packed.device is not None for packed in self._alive())

    def fetch(self) -> None:
        """Copy every member not on the device back into one new buffer (a member alone: its residue and span)."""
        members = [packed for packed in self._alive() if packed.device is None]
        first = min((packed.layout for packed in members), key=lambda layout: layout.at)
        shift = first.offset - first.at
        end = max(packed.layout.at + packed.layout.span() for packed in members)
        copies = members[0].lane.to_device([(p.host, p.layout, p.layout.at + shift) for p in members], end + shift)
        for packed, (tensor, event) in zip(members, copies):
            packed.device, packed.event = tensor, event


class Packed:
    """A saved tensor's host copy; ``device`` holds a device copy while one is resident (kept or fetched) and
    until each of the ``saves`` saved variables sharing it has been unpacked (one tensor comes back for all, in the
    saved tensor's ``layout``, in its ``region``'s buffer)."""

    __slots__ = ("lane", "layout", "region", "host", "copied", "device", "event", "owner", "group", "saves",
                 "unpacks", "source", "version", "changed", "__weakref__")

    def __init__(self, lane: Lane, tensor: torch.Tensor, layout: Layout, owner: _Pass, group: int, region: Region
                 ) -> None:
        self.lane, self.layout, self.region, self.device, self.event = lane, layout, region, tensor, None
        self.owner, self.group = owner, group
        self.host, self.copied = lane.to_host(tensor, layout)
        self.saves, self.unpacks = 1, 0
        region.members.append(weakref.ref(self))
        # autograd skips its version check under hooks: the saved tensor is watched to refuse what it would have
        # refused, checked when the device copy is released (a change by then may have raced the copy to host) and,
        # while the tensor lives (weakly referenced), when it is unpacked
        self.source, self.version, self.changed = weakref.ref(tensor), tensor._version, False

    def fetch(self) -> None:
        """Copy this tensor back, with the rest of its region that is not on the device."""
        self.region.fetch()

    def release(self) -> None:
        """Drop the device tensor once its copy to host has run."""
        if self.copied is not None:
            self.copied.synchronize()
        self.changed = self.changed or self.device._version != self.version
        self.device = self.copied = None

    def take(self) -> torch.Tensor:
        source = self.source()  # gone: nothing (no view either: a view keeps its base) can change it any more
        if self.changed or (source is not None and source._version != self.version):
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                               f"operation: a saved {list(self.layout.size)} tensor changed after version "
                               f"{self.version}")
        tensor = self.device
        self._order_after_copies()  # a fetched tensor is complete; a kept one's memory outlives its copy to host
        self.unpacks += 1
        if self.unpacks >= self.saves:
            self.device = None  # autograd holds the only reference now
        return tensor

    def _order_after_copies(self) -> None:
        """Make the compute stream wait for this tensor's pending copies (after that its memory may be reused)."""
        for event in (self.event, self.copied):
            if event is not None:
                self.lane.current().wait_event(event)
        self.event = self.copied = None

    def __del__(self) -> None:
        self._order_after_copies()  # fetched or kept but never used
