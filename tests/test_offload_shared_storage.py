"""Activation offloading brings saved views of one storage back in one device buffer laid out as that storage was:
Phi-3's fused ``gate_up_proj`` output cut in halves by ``chunk`` costs the fused buffer again, not a span per half
(each half spans nearly the whole fused buffer: the old offloader fetched about twice its bytes). Grads stay
bit-identical (``torch.equal``, float64) to the same run without offloading.

Helpers and the ``_copy_on_cpu`` convention are those of tests/test_offload.py.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import tiledmlp
from models import TINY
from test_offload import _assert_identical, _ids, _offload, _step
from test_offload_strides import _gapped, _geometry, _phi3

INTERMEDIATE = TINY["intermediate_size"]
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


class _Watch:
    """Through the offloader's hooks: each moved tensor as it was saved, and the tensor its unpack returned. All
    are kept alive (the packed objects too), so no address or id is reused while the steps run."""

    def __init__(self, off: tiledmlp.ActivationOffloader) -> None:
        self.saved: dict[int, tuple[Any, torch.Tensor]] = {}
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        pack, unpack = off._pack, off._unpack  # the hooks take the methods at forward time

        def on_pack(t: torch.Tensor) -> Any:
            packed = pack(t)
            if packed is not t:
                self.saved.setdefault(id(packed), (packed, t))
            return packed

        def on_unpack(packed: Any) -> torch.Tensor:
            t = unpack(packed)
            if id(packed) in self.saved:
                self.pairs.append((self.saved[id(packed)][1], t))
            return t

        off._pack, off._unpack = on_pack, on_unpack

    def fetched(self, select: Callable[[torch.Tensor], bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (saved, unpacked) pairs of the selected tensors that came back as copies."""
        return [(a, b) for a, b in self.pairs if select(a) and not _same_storage(a, b)]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _storage_bytes(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """How many distinct storages the tensors live in, and their bytes."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return len(storages), sum(storages.values())


def _figures(pairs: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Storages and bytes of the saved tensors' storages, and of the fetched copies' (printed: run with ``-s``)."""
    before, after = _storage_bytes([a for a, _ in pairs]), _storage_bytes([b for _, b in pairs])
    print(f"\n{what}: {len(pairs)} views saved in {before[0]} storage(s) of {before[1]} bytes; "
          f"fetched into {after[0]} allocation(s) of {after[1]} bytes")
    return before, after


def _half(t: torch.Tensor) -> bool:
    return t.dim() > 0 and t.shape[-1] == INTERMEDIATE and _gapped(_geometry(t))


@pytest.mark.parametrize("checkpointed", ["first layer", "none"])
def test_phi3_gate_up_halves_come_back_in_one_allocation(checkpointed: str) -> None:
    """Tiny Phi-3 (float64, 2 micro-batches): with a layer unchecked the hooks see its ``gate_up_proj`` halves;
    each pair comes back as two views of one allocation of the fused output's bytes (112640 for 2 x 40 tokens),
    each with its own sizes, strides and alignment; loss and grads equal to the run without offloading. The old
    offloader fetched each half into its own span (111936 and 112128 bytes: 1.99x the fused output)."""
    batches = [_ids(), _ids(seq=24)]
    model = _phi3(checkpointed)
    reference = _step(model, batches)
    with _offload(model, checkpointing=checkpointed != "none") as off:
        watch = _Watch(off)
        got = _step(model, batches)
    _assert_identical(got, reference)
    halves = watch.fetched(_half)
    layers = 1 if checkpointed == "first layer" else TINY["num_hidden_layers"]
    assert len(halves) == 2 * layers * len(batches), len(halves)
    assert all(_geometry(a) == _geometry(b) for a, b in halves)
    before, after = _figures(halves, f"Phi-3 gate/up halves ({checkpointed} checkpointed)")
    assert after == before, (before, after)
    fused: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for a, b in halves:
        fused.setdefault(a.untyped_storage().data_ptr(), []).append((a, b))
    for (a, b), (c, d) in fused.values():  # each half sits where it sat in the fused output, beside its partner
        assert _same_storage(b, d)
        assert d.storage_offset() - b.storage_offset() == c.storage_offset() - a.storage_offset()
    assert off.stats.waited == 0


class _Chunked(torch.nn.Module):
    """Saves both halves of a chunk (SiLU its input, the product its other operand), then module calls end their
    group and three more, so they leave the device even where copies run behind (the forward releases all but
    two groups still copying); ``apart=True`` puts a module call between the two saves (two groups)."""

    def __init__(self, apart: bool = False) -> None:
        super().__init__()
        self.act, self.cut, self.apart = torch.nn.SiLU(), torch.nn.Identity(), apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x * 1.5).chunk(2, dim=-1)
        first = self.act(gate)
        if self.apart:
            first = self.cut(first).sin()
        out = self.cut(first * up).cos()
        for _ in range(3):
            out = self.cut(out).sin()
        return out.sum()


def _grad(model: torch.nn.Module, x: torch.Tensor, backwards: int = 1) -> torch.Tensor:
    x.grad = None
    loss = model(x)
    for k in range(backwards):
        loss.backward(retain_graph=k < backwards - 1)
    return x.grad


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("backwards", [1, 2])
def test_both_halves_of_a_chunk_share_one_buffer(device: str, backwards: int) -> None:
    """The two halves of a (40, 24) float64 buffer come back in one allocation of its 7680 bytes (the old
    offloader: two, of 7584 and 7680), 12 elements apart, with their strides and alignment; grads exact. A second
    backward over the retained graph fetches them again, on demand, into one buffer again."""
    x = torch.randn(40, 24, dtype=torch.float64, device=device, requires_grad=True)
    reference = _grad(_Chunked(), x, backwards)
    model = _Chunked()
    copy_on_cpu = device == "cpu"
    with tiledmlp.offload_activations(model, min_bytes=0, _copy_on_cpu=copy_on_cpu) as off:
        watch = _Watch(off)
        got = _grad(model, x, backwards)
    assert torch.equal(got, reference), f"max diff {(got - reference).abs().max():.3e}"
    halves = watch.fetched(lambda t: t.shape == (40, 12) and t.stride() == (24, 1))
    assert len(halves) == 2 * backwards and all(_geometry(a) == _geometry(b) for a, b in halves)
    for k in range(backwards):
        (gate, gate_back), (up, up_back) = sorted(halves[2 * k:2 * k + 2], key=lambda p: p[0].storage_offset())
        before, after = _figures([(gate, gate_back), (up, up_back)], f"chunk halves on {device}, backward {k + 1}")
        assert after == before == (1, 40 * 24 * 8), (before, after)
        assert up_back.storage_offset() - gate_back.storage_offset() == 12
    assert (off.stats.waited == 0) is (backwards == 1)  # a second backward fetches on demand


def test_halves_saved_in_different_groups_come_back_as_before() -> None:
    """Views of one storage saved in two groups come back each in its own buffer, as any tensor alone in its
    storage does (its offset residue and its span); grads exact."""
    x = torch.randn(40, 24, dtype=torch.float64, requires_grad=True)
    reference = _grad(_Chunked(apart=True), x)
    model = _Chunked(apart=True)
    with _offload(model) as off:
        watch = _Watch(off)
        got = _grad(model, x)
    assert torch.equal(got, reference)
    halves = watch.fetched(lambda t: t.shape == (40, 12) and t.stride() == (24, 1))
    assert len(halves) == 2 and all(_geometry(a) == _geometry(b) for a, b in halves)
    span = 39 * 24 + 12
    assert sorted(b.untyped_storage().nbytes() for _, b in halves) == [span * 8, (12 + span) * 8]


class _Overlapping(torch.nn.Module):
    """Saves two overlapping column ranges of one buffer, and the same range twice (two view objects), in one
    group; ``change=True`` changes the buffer in place between the saves."""

    def __init__(self, change: bool = False) -> None:
        super().__init__()
        self.cut, self.change = torch.nn.Identity(), change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = x * 1.5
        first = fused[:, 2:10].sin()  # saves columns 2..9
        if self.change:
            fused.mul_(2)
        second = fused[:, 6:14].cos()  # 6..13: overlaps the first
        third = fused[:, 2:10].pow(3)  # the first's columns, another view object
        return self.cut(first.sum(-1) * second.sum(-1) + third.sum(-1)).tanh().sum()


def test_overlapping_and_identical_views_share_one_buffer() -> None:
    """Overlapping views and a view saved twice as two objects come back in one buffer covering the columns they
    reach (rows 0..39, columns 2..13: 39 x 16 + 12 elements plus the first's offset residue, 2); grads exact."""
    x = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    reference = _grad(_Overlapping(), x)
    model = _Overlapping()
    with _offload(model) as off:
        watch = _Watch(off)
        got = _grad(model, x)
    assert torch.equal(got, reference)
    views = watch.fetched(lambda t: t.shape == (40, 8))
    assert len(views) == 3 and all(_geometry(a) == _geometry(b) for a, b in views)
    assert sorted(b.storage_offset() for _, b in views) == [2, 2, 6]
    before, after = _figures(views, "overlapping views")
    assert after == (1, (2 + 39 * 16 + 12) * 8) and after[1] < before[1], (before, after)


def test_a_buffer_changed_between_the_saves_of_its_views_is_refused() -> None:
    """A view saved, its buffer changed in place, another view saved: autograd refuses the first; so does the
    offloader, though both views come back in one buffer."""
    x = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _Overlapping(change=True)(x).backward()
    model = _Overlapping(change=True)
    with _offload(model):
        loss = model(x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_an_address_no_member_holds_any_more_starts_a_new_region() -> None:
    """Within a group an address names one storage only while a saved member holds it: once each member let go
    of its device tensor (released, or unpacked by a backward run inside the forward), the storage may be freed
    and its address given to another, which must not come back laid over the first (nor its span widen it)."""
    from tiledmlp.offload import _Pass
    from tiledmlp.offload_copies import Lane, Layout, Packed

    owner, t = _Pass(), torch.randn(4, 8, dtype=torch.float64)
    owner.new_group()
    region = owner.region(t)
    packed = Packed(Lane(t.device), t, Layout(t), owner, 0, region)
    assert owner.region(t[1:]) is region and owner.region(t.float()) is not region  # a view joins; a copy does not
    packed.release()
    assert owner.region(t) is not region
