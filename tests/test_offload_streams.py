"""Activation offloading's copy schedule: groups leave in save order and come back one group ahead (trace), and
the stream protocol (recorded stand-in streams whose copies never finish by themselves).

Helpers and the ``_copy_on_cpu`` convention are those of tests/test_offload.py.
"""

from __future__ import annotations

import contextlib

import torch

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from test_offload import SHARDS, _assert_identical, _ids, _llama, _offload, _step


def test_prefetch_runs_one_group_ahead():
    """Trace of one step on a 6-layer model: groups leave in save order; in the backward each group is back on the
    device before it is used (prefetched while the next-later one was in use), never more than one group ahead,
    and the newest group (the loss's) never moves."""
    model = _llama(6)
    tiledmlp.patch_loss(model, num_shards=SHARDS)
    off = _offload(model)
    off.trace = []
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    forward = [g for kind, g in off.trace if kind == "offload"]
    assert forward == sorted(forward) and len(set(forward)) >= 6 + 2
    last = forward[-1]
    backward = off.trace[len(forward):]
    fetched: set[int] = set()
    used: list[int] = []
    for i, (kind, g) in enumerate(backward):
        if kind == "fetch":
            assert backward[i + 1] == ("use", g + 1), f"fetch of {g} not issued while {g + 1} is used: {backward}"
            fetched.add(g)
        else:
            assert g == last or g in fetched, f"group {g} used before its copy back started"
            if not used or used[-1] != g:
                used.append(g)
            assert fetched - set(used) <= {g - 1}, f"more than one group ahead at {g}: {fetched - set(used)}"
    assert used == list(range(last, -1, -1)) and last not in fetched
    assert off.stats.waited == 0 and off.stats.prefetched == off.stats.offloaded


class _FakeStreams:
    """A recording stand-in for a device module's streams and events (torch.cpu's are no-ops). Events complete
    only when synchronized, as if the copies were slow: the offloader must then bound what it keeps in flight."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = self.Stream(self, "compute")
        self.now = self.compute

    class Event:
        def __init__(self, owner: "_FakeStreams", stream: str) -> None:
            self.owner, self.stream, self.done = owner, stream, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True
            self.owner.log.append(("synchronize", self))

    class Stream:
        def __init__(self, owner: "_FakeStreams", name: str = "side") -> None:
            self.owner, self.name = owner, name

        def wait_stream(self, other) -> None:
            self.owner.log.append(("wait_stream", self.name, other.name))

        def record_event(self):
            event = _FakeStreams.Event(self.owner, self.name)
            self.owner.log.append(("record", self.name, self.owner.now.name, event))
            return event

        def wait_event(self, event) -> None:
            self.owner.log.append(("wait_event", self.name, event))

    def module(self):
        fake = self

        class Module:
            @staticmethod
            def Stream(*_):  # noqa: N802 - the device-module API
                return fake.Stream(fake)

            @staticmethod
            def current_stream(*_):
                return fake.now

            @staticmethod
            @contextlib.contextmanager
            def stream(s):
                before, fake.now = fake.now, s
                fake.log.append(("enter", s.name))
                yield
                fake.now = before
                fake.log.append(("exit", s.name))

        return Module


def test_stream_protocol_with_recorded_streams(monkeypatch):
    """Copies run on the side stream after it waited for the compute stream; the compute stream waits for each
    copy back before its tensor is used; with copies that never finish by themselves the forward keeps at most
    two groups' device tensors waiting for their copies (it waits for the oldest), the backward uses those as they
    are, and the grads stay exact."""
    model = _llama(6)
    enable_checkpointing(model)
    ids = _ids()
    reference = _step(model, [ids])
    fake = _FakeStreams()
    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module", lambda t=None: fake.module() if str(t) == "cpu" else real(t))
    model.zero_grad(set_to_none=True)
    with _offload(model) as off:
        in_flight: list[int] = []
        pack = off._pack
        off._pack = lambda t: (in_flight.append(len(off._in_flight)), pack(t))[1]  # taken at forward time
        loss = model(input_ids=ids, labels=ids).loss
        forward_end = len(fake.log)
        resident = sum(r().device is not None for group in off._pass.groups for r in group)
        loss.backward()
    _assert_identical(([loss.detach()], {n: p.grad for n, p in model.named_parameters()}), reference)
    records = [i for i, e in enumerate(fake.log) if e[0] == "record"]
    for i in records:  # each copy: the side stream waits for compute, becomes current, marks the copy's end
        assert fake.log[i - 2:i] == [("wait_stream", "side", "compute"), ("enter", "side")], fake.log[i - 2:i + 2]
        assert fake.log[i][1:3] == ("side", "side") and fake.log[i + 1] == ("exit", "side")
    to_host = [fake.log[i][3] for i in records if i < forward_end]
    to_device = [fake.log[i][3] for i in records if i > forward_end]
    # the last group and those whose copies never ended (at most two) are used as they are, the rest fetched
    assert len(to_host) == off.stats.offloaded and len(to_device) == off.stats.prefetched - resident
    assert resident > len(off._pass.groups[-1]) and off.stats.waited == 0
    compute_waits = [id(e[2]) for e in fake.log if e[0] == "wait_event" and e[1] == "compute"]
    assert all(compute_waits.count(id(ev)) == 1 for ev in to_device), "each copy back is waited for once"
    assert max(in_flight) <= 2 and sum(e[0] == "synchronize" for e in fake.log[:forward_end]) >= 6 - 2
