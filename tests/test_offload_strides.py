"""Activation offloading keeps each saved tensor's layout (offload_copies.Layout): a strided view comes back with its
own sizes, strides and address alignment, so the backward's kernels take the same paths and the grads stay
bit-identical (``torch.equal``, float64). Before, every tensor came back contiguous: Phi-3's ``gate_up_proj`` output
cut in halves by ``chunk`` (two views with a gap) gave grads up to 9e-19 off.

Helpers and the ``_copy_on_cpu`` convention are those of tests/test_offload.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import tiledmlp
from models import TINY
from test_offload import _assert_identical, _ids, _offload, _step
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.offload_copies import Packed

ALIGN = 64  # the CPU allocator's alignment: a restored tensor's address keeps its residue modulo this


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.data_ptr() % ALIGN


def _recording(off: tiledmlp.ActivationOffloader) -> tuple[dict, list, list, list]:
    """Record, through the offloader's hooks, each moved tensor's geometry before and after, the packed objects and
    the tensors that were seen but stayed (the hooks take the methods at forward time)."""
    before: dict[int, tuple] = {}
    pairs: list[tuple[tuple, tuple]] = []
    packs: list = []
    stayed: list[torch.Tensor] = []
    pack, unpack = off._pack, off._unpack

    def on_pack(t: torch.Tensor):
        packed = pack(t)
        if not isinstance(packed, Packed):  # kept on the device (with the version it was saved at)
            stayed.append(t)
        else:
            before.setdefault(id(packed), _geometry(t))
            packs.append(packed)
        return packed

    def on_unpack(packed):
        t = unpack(packed)
        if id(packed) in before:
            pairs.append((before[id(packed)], _geometry(t)))
        return t

    off._pack, off._unpack = on_pack, on_unpack
    return before, pairs, packs, stayed


def _phi3(checkpointed: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(tf.Phi3Config(**TINY, pad_token_id=0)).double()
    model.train()
    if checkpointed != "none":
        enable_checkpointing(model, {"use_reentrant": False})
    if checkpointed == "first layer":  # the second layer's saves (the gate_up halves among them) reach the hooks
        model.model.layers[1].gradient_checkpointing = False
    return model


def _gapped(geometry: tuple) -> bool:
    size, stride, _ = geometry
    return any(s > 1 for s in size) and 1 + sum((s - 1) * st for s, st in zip(size, stride)) > torch.Size(size).numel()


@pytest.mark.parametrize("checkpointed", ["every layer", "first layer", "none"])
def test_phi3_chunked_gate_up_grads_bit_identical(checkpointed: str) -> None:
    """Tiny Phi-3 (hidden 32, 2 layers, float64), 2 micro-batches: loss and every grad equal to the same run
    without offloading, and each moved tensor back with its own sizes, strides and alignment. With every layer
    checkpointed, the hooks see the layers' inputs; with a layer left
    unchecked (or checkpointing off) they see its ``gate_up_proj`` halves, views with a gap, as well. The old
    offloader gave grads up to 8.7e-19 off on ``gate_up_proj.weight`` there."""
    batches = [_ids(), _ids(seq=24)]
    model = _phi3(checkpointed)
    reference = _step(model, batches)
    with _offload(model, checkpointing=checkpointed != "none") as off:
        _, pairs, _, _ = _recording(off)
        got = _step(model, batches)
    _assert_identical(got, reference)
    assert pairs and all(a == b for a, b in pairs), [(a, b) for a, b in pairs if a != b]
    halves = [a for a, _ in pairs if _gapped(a) and a[0][-1] == TINY["intermediate_size"]]
    assert bool(halves) is (checkpointed != "every layer"), halves
    assert off.stats.waited == 0


def test_views_of_parameters_stay_on_the_device() -> None:
    """A Linear saves its weight transposed, a view of the parameter, which lives on anyway: it stays, as the
    parameter does. Before, each was copied to the host and back every step (the LM head's: ``vocab x hidden``, a
    second device copy of it in the backward), and under FSDP a copy in flight would read a weight being freed."""
    model = _phi3("none")
    params = {p.data_ptr() for p in model.parameters()}
    with _offload(model, checkpointing=False) as off:
        _, _, packs, stayed = _recording(off)
        _step(model, [_ids()])
    stayed_views = [t for t in stayed if t._base is not None and t._base.data_ptr() in params]
    assert len(stayed_views) >= 2 * 4 + 1, len(stayed_views)  # every layer's qkv, o, gate_up, down; the head
    assert packs and not any(p.host.shape in {tuple(q.shape[::-1]) for q in model.parameters()} for p in packs)


class _Views(torch.nn.Module):
    """Saves every kind of strided tensor: gapped halves (chunk), a transpose, a slice at an unaligned storage
    offset, a row expanded over the batch (stride 0) and overlapping windows (unfold); then a module call, so they
    form a group of their own that leaves the device (the newest group stays as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = x * 1.5  # (n, 12)
        gate, up = fused.chunk(2, dim=-1)  # gapped: stride (12, 1), the second at offset 6
        h = torch.nn.functional.silu(gate) * up
        product = torch.mm(h.t(), h)  # saves the transpose
        shifted = fused[1:].sin()  # contiguous at offset 12 elements (96 bytes: 32 past a 64-byte boundary)
        row = x[1].expand(x.shape[0], -1)  # stride (0, 1), offset 12
        windows = fused.flatten().unfold(0, 4, 1)  # overlapping: stride (1, 1)
        total = self.cut(product.sum() + shifted.sum() + (row * fused).pow(2).sum() + windows.cos().sum())
        return total.sin()


def test_strided_views_come_back_as_they_were_saved() -> None:
    """Each moved tensor comes back with its sizes, strides and address residue; the expanded row is stored as one
    row (host and device), the overlapping windows stay on the device as they are; grads bit-identical."""
    torch.manual_seed(0)
    x = torch.randn(40, 12, dtype=torch.float64, requires_grad=True)
    _Views()(x).backward()
    reference, x.grad = x.grad.clone(), None
    model = _Views()
    with _offload(model) as off:
        before, pairs, packs, stayed = _recording(off)
        off.trace = []
        model(x).backward()
    assert ("fetch", 0) in off.trace  # the views came back through the copies
    assert torch.equal(x.grad, reference), f"max diff {(x.grad - reference).abs().max():.3e}"
    assert all(a == b for a, b in pairs), [(a, b) for a, b in pairs if a != b]
    seen = {stride for _, stride, _ in before.values()}
    assert {(12, 1), (1, 6), (0, 1)} <= seen, seen  # the halves (and h), h.t(), the expanded row
    assert any(a[0] == (39, 12) and a[2] == 32 for a, _ in pairs), pairs
    expanded = [p for p in packs if before[id(p)][1] == (0, 1)]
    assert len(expanded) == 1 and expanded[0].host.numel() == 12  # one row kept, not 40
    assert [t.stride() for t in stayed] == [(1, 1)] and off.stats.waited == 0


def test_layouts_cost_what_the_tensor_holds() -> None:
    """What each layout stores on the host (its elements, one slice per expanded dimension) and allocates on the
    device (the span its strides reach: a gapped half spans the fused rows, as the original's storage did)."""
    from tiledmlp.offload_copies import Layout

    fused = torch.empty(40, 176, dtype=torch.float64)
    gate, up = fused.chunk(2, dim=-1)
    cases = {
        "contiguous": (fused, 40 * 176, 40 * 176, True),
        "transposed": (fused.t(), 40 * 176, 40 * 176, True),
        "second half": (up, 40 * 88, 39 * 176 + 88, False),
        "expanded": (fused[0].expand(8, 40, 176), 176, 176, True),
    }
    for name, (tensor, stored, span, dense) in cases.items():
        layout = Layout(tensor)
        got = (layout.numel(), layout.span(), layout.dense(), layout.non_overlapping())
        assert got == (stored, span, dense, True), name
    assert Layout(up).offset == 88 % (512 // 8) and not Layout(fused.flatten().unfold(0, 4, 1)).non_overlapping()


def test_sparse_and_overlapping_tensors_stay_on_the_device() -> None:
    """Layouts are about strided tensors: a sparse one stays (its strides read (0, 0)), as does one whose elements
    overlap; an expanded one moves."""
    off = _offload(_Views())
    try:
        x = torch.randn(6, 8, dtype=torch.float64)
        assert off._moves(x.to_sparse()) is None and off._moves(x.flatten().unfold(0, 4, 1)) is None
        assert off._moves(x[0].expand(6, 8)) is not None
    finally:
        off.remove()
