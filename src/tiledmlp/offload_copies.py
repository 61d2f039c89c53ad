"""The copies of activation offloading (:mod:`tiledmlp.offload`): a device's side stream, and one saved tensor's
host copy with the device copy it holds while resident."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .offload import _Pass

__all__ = ["Lane", "Packed"]


class Lane:
    """One device's side stream and the two copies that run on it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = torch.get_device_module(device.type)
        self.pin = device.type != "cpu"
        self.side = self.module.Stream(device) if self.pin else self.module.Stream()

    def current(self) -> Any:
        return self.module.current_stream(self.device)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The host copy and the event that marks its end (until then the device tensor must stay alive)."""
        return self._copy(tensor, torch.empty_like(tensor, device="cpu", pin_memory=self.pin))

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self._copy(host, torch.empty_like(host, device=self.device))  # the compute stream's memory, freed there

    def _copy(self, source: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Any]:
        # once the compute stream got here, the source is complete and the target's memory no longer in use there
        self.side.wait_stream(self.current())
        with self.module.stream(self.side):
            target.copy_(source, non_blocking=self.pin)
            return target, self.side.record_event()


class Packed:
    """A saved tensor's host copy; ``device`` holds a device copy while one is resident (kept or fetched) and
    until each of the ``saves`` saved variables sharing it has been unpacked (one tensor comes back for all)."""

    __slots__ = ("lane", "host", "copied", "device", "event", "owner", "group", "saves", "unpacks", "version",
                 "__weakref__")

    def __init__(self, lane: Lane, tensor: torch.Tensor, owner: _Pass, group: int) -> None:
        self.lane, self.device, self.event, self.owner, self.group = lane, tensor, None, owner, group
        self.host, self.copied = lane.to_host(tensor)
        self.saves, self.unpacks, self.version = 1, 0, tensor._version  # version: while device is the saved tensor

    def fetch(self) -> None:
        self.device, self.event = self.lane.to_device(self.host)
        self.version = None

    def take(self) -> torch.Tensor:
        tensor = self.device
        if self.version is not None and tensor._version != self.version:  # autograd skips this check under hooks
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                               f"operation: {list(tensor.shape)} at version {tensor._version}, expected {self.version}")
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
