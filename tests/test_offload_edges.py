"""Edges of activation offloading (offload.py, split_layers.py) a review found: a forward left by Ctrl-C, a
kept tensor changed in place, SDPA called with keyword arguments or a 3-D per-head mask inside a split layer, a
non-bool flag.

Helpers and the ``_copy_on_cpu`` convention are those of tests/test_offload.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import tiledmlp
from models import TINY, build
from test_offload import _assert_identical, _ids, _offload, _step
from test_split_layers import head_groups  # noqa: F401 -- the fixture
from tiledmlp import split_layers
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.split_layers import SplitLayerCheckpoint


def _hooks_on() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def test_a_forward_left_by_ctrl_c_does_not_leave_the_hooks_on_for_good() -> None:
    """A notebook cell interrupted in the middle of a forward, then training resumed with the same offloader: the
    next forward must start afresh (split layers again, after the Trainer re-enabled checkpointing) and take its
    hooks off at its end, so that code outside the model's forward is not packed. The old code counted the
    interrupted forward as still running: hooks stayed on for every later tensor saved anywhere, split layers were
    never put back. Grads stay those of plain non-reentrant checkpointing."""
    model, reference = build("llama"), build("llama")
    enable_checkpointing(reference, {"use_reentrant": False})
    ids = _ids()
    expected = _step(reference, [ids])
    off = _offload(model, split_layers=True)
    try:
        handle = model.model.layers[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=ids, labels=ids)
        handle.remove()
        enable_checkpointing(model)  # what Trainer.train() does: the whole-layer functions are back
        got = _step(model, [ids])
        split = [m for m in model.modules() if isinstance(getattr(m, "_gradient_checkpointing_func", None),
                                                           SplitLayerCheckpoint)]
        assert not _hooks_on(), "saved-tensor hooks still on after the forward"
        assert len(split) == model.config.num_hidden_layers
        packed = off.stats.packed
        x = torch.randn(8, 8, requires_grad=True)
        x.exp().sum().backward()  # unrelated autograd code after the step
        assert off.stats.packed == packed
        _assert_identical(got, expected)
    finally:
        off.remove()  # takes the hooks off even where the forward left them on


def test_a_forward_nested_in_its_own_still_runs_under_the_hooks() -> None:
    """A model that calls itself (the inner call must neither close the hooks of the outer one nor open new ones):
    every save of both calls is packed, the hooks come off after the outer call, grads exact."""

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)

        def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
            y = self.lin(x).tanh()
            return y if inner else self(y, inner=True).sin() * y

    model, x = Twice(), torch.randn(4, 8, dtype=torch.float64)
    model(x).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with _offload(model) as off:
        out = model(x)
        assert not _hooks_on()
        out.sum().backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference))
    # x, each tanh's output (the inner linear's input and mul's operand: moved once), sin's output; the weight's
    # transposes, views of the parameter, stay
    assert off.stats.offloaded == 4, off.stats


def test_a_kept_tensor_changed_in_place_after_it_was_saved_is_refused_like_autograd() -> None:
    """Saved-tensor hooks switch autograd's version check off. Without offloading, changing a saved tensor in
    place makes the backward raise; the old offloader handed the changed tensor back (it keeps the newest group on
    the device as it is) and the backward silently computed a wrong gradient (here 2 cos(2x + 1) for 2 cos(2x))."""

    class SinOfDouble(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            z = y.sin()  # saves y
            y.add_(1)
            return z.sum()

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        SinOfDouble()(x).backward()
    model = SinOfDouble()
    with _offload(model):
        loss = model(x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert x.grad is None


def test_kept_tensors_unchanged_still_come_back_as_they_are() -> None:
    """The version check does not refuse a tensor changed in place before it was saved (its save sees the new
    version), nor one saved twice: grads bit-identical, one tensor back."""

    class Inplace(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            y.add_(1)
            return (y * y).sum()

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    Inplace()(x).backward()
    reference, x.grad = x.grad, None
    with _offload(Inplace()) as off:
        off.model(x).backward()
    assert torch.equal(x.grad, reference) and off.stats.offloaded == 1


@pytest.mark.parametrize("case", ["query-key-value by keyword", "value by keyword", "3-d per-head mask"])
def test_sdpa_calls_split_by_head_groups_whatever_their_spelling(case: str, head_groups: list[int]) -> None:
    """SDPA's arguments may come by keyword, and a 3-D mask [heads, q, k] is per head (broadcasting aligns it with
    the query's last three dimensions). The old code read q, k, v from the positional arguments only (IndexError,
    TypeError) and split a 3-D per-head mask as if shared (a shape error). Outputs and grads equal one call."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    args, kwargs = {
        "query-key-value by keyword": ((), dict(query=q, key=k, value=v, is_causal=True, enable_gqa=True)),
        "value by keyword": ((q, k), dict(value=v, is_causal=True, enable_gqa=True)),
        "3-d per-head mask": ((q, k, v), dict(attn_mask=torch.randn(4, 16, 16, dtype=torch.float64), enable_gqa=True)),
    }[case]
    want = F.scaled_dot_product_attention(*args, **kwargs)
    want_grads = torch.autograd.grad(want.pow(2).sum(), (q, k, v))
    done: list[bool] = []
    with split_layers.AttentionByHeadGroups(lambda: done.append(True)):
        got = F.scaled_dot_product_attention(*args, **kwargs)
    assert head_groups == [2] and torch.equal(got, want)
    got_grads = torch.autograd.grad(got.pow(2).sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads)) and done == [True]


def test_split_layers_with_an_attention_function_calling_sdpa_by_keyword(head_groups: list[int]) -> None:
    """A registered attention function that spells SDPA's arguments out (query=..., key=..., value=...): the old
    split layer crashed with an IndexError in its first forward; now grads are bit-identical to whole layers."""

    def keyword_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = F.scaled_dot_product_attention(query=query, key=key, value=value, is_causal=True, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    tf.AttentionInterface.register("tiledmlp_review_keyword_sdpa", keyword_sdpa)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, attn_implementation="tiledmlp_review_keyword_sdpa")).double()
    enable_checkpointing(model)
    batches = [_ids(seq=24)]
    with _offload(model):
        reference = _step(model, batches)
    with _offload(model, split_layers=True) as off:
        got = _step(model, batches)
    _assert_identical(got, reference)
    assert head_groups == [2] * (2 * model.config.num_hidden_layers) and off.stats.waited == 0


@pytest.mark.parametrize("value", ["false", None, 0])
def test_checkpointing_must_be_a_bool(value: object) -> None:
    """``checkpointing="false"`` (a string from a config file) used to turn checkpointing on silently."""
    model = build("llama")
    with pytest.raises(TypeError, match="checkpointing must be a bool"):
        tiledmlp.offload_activations(model, checkpointing=value)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_a_refused_second_call_leaves_the_first_offloader_working() -> None:
    """``offload_activations(model, split_layers=True)`` on a model whose layers cannot be split is refused; the
    offloader already installed on the model must still be there and work afterwards (before: the refused call had
    already removed it, so the model trained on without offloading, silently)."""
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=64))
    first = tiledmlp.offload_activations(model, min_bytes=0, checkpointing=True, _copy_on_cpu=True)
    with pytest.raises(ValueError, match="split_layers"):
        tiledmlp.offload_activations(model, min_bytes=0, split_layers=True)
    before = first.stats.packed
    ids = torch.randint(0, 64, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert first.stats.packed > before and not _hooks_on()
    first.remove()



def test_a_tensor_changed_in_place_before_its_device_copy_is_released_is_refused() -> None:
    """The same refusal once a tensor's device copy was released (only the host copy is left). The old offloader
    checked kept tensors only: a change made after the save, before the release, went through unnoticed (on a GPU
    it races the copy to host: a torn copy, a silently wrong gradient). Here the change comes after the save,
    in the same group; the next group's first save releases the device copy; the tensor itself is gone by backward."""

    class Stage(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class ChangesFirst(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = torch.nn.ModuleList(Stage() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first = self.stages[0](x)
            out = first.sin()  # saves ``first``
            first.mul_(3)
            for stage in self.stages[1:]:  # each a new group: the first one leaves the device
                out = stage(out).cos()
            return out.sum()

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ChangesFirst()(x).backward()
    model = ChangesFirst()
    with _offload(model) as off:
        loss = model(x)
        first = off._pass.groups[0][0]()
        assert first is not None and first.device is None  # the host copy only
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert x.grad is None


def test_a_living_host_copied_tensor_changed_in_place_later_is_refused() -> None:
    """A tensor that outlives the forward (kept by the model) and is changed after its device copy was released:
    refused at unpack, as autograd refuses it."""

    class KeepsFirst(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.first = x * 2
            out = self.first.sin()
            for _ in range(3):
                out = torch.nn.Identity()(out).cos()  # a module call: a new group each time
            return out.sum()

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    model = KeepsFirst()
    loss = model(x)
    model.first.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with _offload(model) as off:
        loss = model(x)
        assert off._pass.groups[0][0]().device is None
        model.first.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        model(x).backward()  # unchanged: accepted, exact
    got, x.grad = x.grad, None
    model(x).backward()
    assert torch.equal(got, x.grad)


def test_a_weight_changed_in_place_before_the_backward_is_refused_like_autograd() -> None:
    """Parameters and their views (a Linear's saved ``weight.t()``) stay on the device. Changed in place between the
    forward and the backward (an optimizer step taken too early), plain autograd refuses the backward; the
    offloader used to hand the changed weight back, and the grads were those of the new weight, silently."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    loss = model(x).sum()
    with torch.no_grad():
        model[2].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with _offload(model, checkpointing=False):
        loss = model(x).sum()
        with torch.no_grad():
            model[2].weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        model(x).sum().backward()  # unchanged: accepted
    assert x.grad is not None and torch.equal(x.grad, torch.autograd.grad(model(x).sum(), x)[0])
