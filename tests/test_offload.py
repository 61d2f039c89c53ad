"""Activation offloading (tiledmlp.offload_activations): what it packs, exactness, prefetch order, memory released.

On CPU there is no separate host memory, so offloading moves nothing; ``_copy_on_cpu=True`` makes every pack copy
into a separate host buffer and every unpack copy back (on torch.cpu's streams), so the same code path runs here.
``min_bytes=0`` moves every tensor the hooks see. Exactness is bit-for-bit (``torch.equal``), not a tolerance.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers as tf

import tiledmlp
from models import TINY, build
from tiledmlp import glu
from tiledmlp.hf_compat import enable_checkpointing, is_checkpointing

SHARDS = 3


def _ids(seq: int = 40, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 96, (batch, seq))


def _offload(model: torch.nn.Module, **kw) -> tiledmlp.ActivationOffloader:
    return tiledmlp.offload_activations(model, min_bytes=kw.pop("min_bytes", 0), _copy_on_cpu=True, **kw)


def _step(model: torch.nn.Module, batches: list[torch.Tensor], autocast: bool = False) -> tuple[list, dict]:
    """Forward+backward over micro-batches (grads accumulate); returns the losses and the grads."""
    model.zero_grad(set_to_none=True)
    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_identical(a: tuple[list, dict], b: tuple[list, dict]) -> None:
    (la, ga), (lb, gb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        assert torch.equal(ga[name], gb[name]), f"{name}: max diff {(ga[name] - gb[name]).abs().max():.3e}"


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "q_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


SETUPS = {
    "checkpointed": lambda m: m,
    "tiled-mlp": lambda m: (tiledmlp.patch(m, num_shards=SHARDS), m)[1],
    "tiled-mlp+loss": lambda m: (tiledmlp.patch(m, num_shards=SHARDS, loss=True), m)[1],
    "lora+tiled": lambda m: (tiledmlp.patch(m, num_shards=SHARDS), _lora(m))[1],
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_grads_bit_identical_float64(setup):
    """float64, 2 micro-batches accumulated: loss and every grad equal to the same checkpointed run without
    offloading; every checkpointed layer's input went through the copy path and came back prefetched."""
    batches = [_ids(), _ids(seq=24)]
    model = SETUPS[setup](build("llama"))
    enable_checkpointing(model)
    reference = _step(model, batches)
    with _offload(model) as off:
        got = _step(model, batches)
    _assert_identical(got, reference)
    assert off.stats.offloaded >= 2 * model.config.num_hidden_layers and off.stats.waited == 0, off.stats


@pytest.mark.parametrize("arch", ["gemma2", "qwen3-moe"])
def test_grads_bit_identical_other_architectures(arch):
    """Gemma-2 reruns its tiled MLP in the recompute; Qwen3-MoE adds router logits to the (tiled) loss."""
    batches = [_ids()]
    model = build(arch)
    tiledmlp.patch(model, num_shards=SHARDS, loss=True)
    enable_checkpointing(model)
    reference = _step(model, batches)
    with _offload(model) as off:
        _assert_identical(_step(model, batches), reference)
    assert off.stats.offloaded >= model.config.num_hidden_layers and off.stats.waited == 0, off.stats


def test_bf16_autocast_bit_identical_to_bf16_without_offloading():
    batches = [_ids(seq=64)]
    model = build("llama", torch.float32)
    tiledmlp.patch(model, num_shards=SHARDS, loss=True)
    enable_checkpointing(model)
    reference = _step(model, batches, autocast=True)
    with _offload(model) as off:
        got = _step(model, batches, autocast=True)
    _assert_identical(got, reference)
    assert off.stats.offloaded > 0


def test_two_forwards_one_backward_and_retained_graph():
    """Unusual orders still give the same grads: two graphs alive at once, and a second backward over a retained
    graph (its tensors come back a second time, then without a prefetch)."""
    a, b = _ids(), _ids(seq=24)
    model = build("llama")
    enable_checkpointing(model)

    def run() -> dict:
        model.zero_grad(set_to_none=True)
        (model(input_ids=a, labels=a).loss + model(input_ids=b, labels=b).loss).backward()
        loss = model(input_ids=a, labels=a).loss
        loss.backward(retain_graph=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = run()
    with _offload(model) as off:
        got = run()
    assert all(torch.equal(got[n], reference[n]) for n in reference)
    assert off.stats.waited > 0  # the second backward over the retained graph fetched on demand


def _llama(layers: int) -> torch.nn.Module:
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "num_hidden_layers": layers})).double()
    tiledmlp.patch(model, num_shards=SHARDS)
    return model


def _packed_tensors(layers: int) -> tuple[list[torch.Tensor], list[int]]:
    """Every tensor the offloader's hooks packed in one step of a ``layers``-deep tiled, checkpointed Llama, and
    the ids of the decoder layers' inputs."""
    model = _llama(layers)
    enable_checkpointing(model)
    inputs: list[int] = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda _m, args: inputs.append(id(args[0])))
    packed: list[torch.Tensor] = []
    with _offload(model) as off:
        pack = off._pack
        off._pack = lambda t: (packed.append(t), pack(t))[1]  # the hooks take the method at forward time
        ids = _ids()
        loss = model(input_ids=ids, labels=ids).loss
        forward_inputs = list(inputs)  # some transformers versions call the layer (and its hooks) again to recompute
        loss.backward()
    return packed, forward_inputs


def _saves_without_checkpointing(layers: int) -> int:
    count = [0]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (count.__setitem__(0, count[0] + 1), t)[1], lambda t: t):
        ids = _ids()
        _llama(layers)(input_ids=ids, labels=ids).loss.backward()
    return count[0]


def test_outer_hooks_see_exactly_the_checkpointed_layers_inputs():
    """Checkpointing's own hooks sit inside each layer, so the offloader packs each layer's input and nothing
    from inside the layers: two more layers add exactly two distinct packed tensors, the layers' inputs. (Tensors
    all layers share, such as the rotary tables, are packed once per layer by some torch versions: counted once.
    The same hooks without checkpointing see every tensor each layer saves.)"""
    counts = []
    for layers in (2, 4):
        packed, inputs = _packed_tensors(layers)
        assert len(inputs) == layers and set(inputs) <= {id(t) for t in packed}
        assert not any(t.dim() == 4 or t.dim() and t.shape[-1] == TINY["intermediate_size"] for t in packed), \
            [tuple(t.shape) for t in packed]
        counts.append(len({t.untyped_storage().data_ptr() for t in packed}))  # distinct tensors
    assert counts[1] - counts[0] == 2, counts
    per_layer_without = (_saves_without_checkpointing(4) - _saves_without_checkpointing(2)) / 2
    assert per_layer_without >= 10, per_layer_without


def test_checkpointed_inputs_leave_the_device():
    """After the forward nothing keeps a decoder layer's input alive but the offloader's host copy (with
    checkpointing alone, every layer's input stays alive until the backward)."""

    def alive_after_forward(offload: bool) -> int:
        model = build("llama")
        enable_checkpointing(model)
        refs: list[weakref.ref] = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda _m, args: refs.append(weakref.ref(args[0])))
        off = _offload(model) if offload else None
        ids = _ids()
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        alive = sum(r() is not None for r in refs)
        loss.backward()
        if off is not None:
            assert off.stats.offloaded_bytes >= sum(ids.numel() * TINY["hidden_size"] * 8 for _ in refs)
        return alive

    assert alive_after_forward(False) == TINY["num_hidden_layers"]
    assert alive_after_forward(True) == 0


def test_tiled_mlp_still_skipped_by_the_recompute(monkeypatch):
    """Offloading wraps only what checkpointing keeps: the tiled MLP's inputs-first packing still ends each
    layer's recompute before the MLP (gate/up run per tile in the forward and in the tiled backward only)."""
    calls = [0]
    original = glu.GLUWeights.gate_up
    monkeypatch.setattr(glu.GLUWeights, "gate_up", lambda self, x, *masks: (calls.__setitem__(0, calls[0] + 1),
                                                                               original(self, x, *masks))[1])
    model = build("llama")
    tiledmlp.patch(model, num_shards=SHARDS)
    with _offload(model):
        ids = _ids()
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] == 2 * SHARDS * model.config.num_hidden_layers


def test_cpu_is_a_no_op_and_small_tensors_stay():
    model = build("llama")
    enable_checkpointing(model)
    ids = _ids()
    reference = _step(model, [ids])
    with tiledmlp.offload_activations(model) as off:  # CPU: nothing to move to
        _assert_identical(_step(model, [ids]), reference)
    assert off.stats.packed > 0 and off.stats.offloaded == 0
    with _offload(model, min_bytes=10**9) as off:  # everything below the threshold stays
        _step(model, [ids])
    assert off.stats.packed > 0 and off.stats.offloaded == 0


def test_turns_checkpointing_on_and_hooks_come_off():
    """A ``with`` block per step: the first turns non-reentrant checkpointing on (it stays on), each takes its
    hooks off at the end, and later forwards run without them."""
    model = build("llama")
    embedding_hooks = []
    for _ in range(2):
        with _offload(model) as off:
            assert is_checkpointing(model)
            model(input_ids=_ids(), labels=_ids()).loss.backward()
            assert off.stats.offloaded > 0
        embedding_hooks.append(len(model.get_input_embeddings()._forward_hooks))
    assert is_checkpointing(model) and embedding_hooks[0] == embedding_hooks[1], embedding_hooks
    packed = off.stats.packed
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    assert off.stats.packed == packed and not model._forward_pre_hooks and not model._forward_hooks


def test_offloading_again_replaces_the_earlier_offloader():
    """A second ``offload_activations(model)`` (a notebook cell run twice, new options) takes the first one's hooks
    and split layers off: one offloader packs, with the last call's options; grads bit-identical."""
    from tiledmlp.split_layers import SplitLayerCheckpoint

    model, reference = build("llama"), build("llama")
    first = _offload(model, split_layers=True)
    assert any(isinstance(getattr(m, "_gradient_checkpointing_func", None), SplitLayerCheckpoint)
               for m in model.modules())
    second = _offload(model)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    assert not any(isinstance(getattr(m, "_gradient_checkpointing_func", None), SplitLayerCheckpoint)
                   for m in model.modules())
    enable_checkpointing(reference, {"use_reentrant": False})
    ids = _ids()
    _assert_identical(_step(model, [ids]), _step(reference, [ids]))
    assert first.stats.packed == 0 and second.stats.offloaded > 0
    second.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_reentrant_checkpointing_and_bad_arguments_are_refused():
    model = build("llama")
    enable_checkpointing(model, {"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant"):
        tiledmlp.offload_activations(model)
    model = build("llama")
    off = tiledmlp.offload_activations(model)
    enable_checkpointing(model, {"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant"):
        model(input_ids=_ids(), labels=_ids())
    off.remove()
    model = build("llama")  # no use_reentrant given: torch's checkpoint runs reentrant then
    enable_checkpointing(model, {"preserve_rng_state": True})
    with pytest.raises(ValueError, match="use_reentrant"):
        tiledmlp.offload_activations(model, split_layers=True)
    with pytest.raises(ValueError, match="checkpointing=True"):  # splittable layers, but none checkpointed
        tiledmlp.offload_activations(build("llama"), checkpointing=False, split_layers=True)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        tiledmlp.offload_activations(lambda x: x)
    with pytest.raises(ValueError, match="min_bytes"):
        tiledmlp.offload_activations(build("llama"), min_bytes=-1)


# --- tiledmlp train --activation_offloading ------------------------------------------------------------------

def test_train_flag_same_losses_and_hooks_ran(tmp_path, monkeypatch):
    """On CPU the flag moves nothing, but the hooks run on the checkpointed layers' inputs; losses are identical
    to plain non-reentrant checkpointing."""
    from test_train import losses, train

    plain = train(tmp_path, monkeypatch, "--activation_checkpointing", "true", name="plain")
    offloaded = train(tmp_path, monkeypatch, "--activation_offloading", "true", name="offload")
    assert losses(offloaded) == losses(plain) and len(losses(plain)) == 3
    stats = offloaded["offload"]
    assert stats["packed"] >= 3 * 2 and stats["offloaded"] == 0, stats  # 3 steps x 2 layers at least
    assert plain["offload"] is None


@pytest.mark.parametrize("kwargs,message", [('{"use_reentrant": true}', "non-reentrant"),
                                            ('{"preserve_rng_state": true}', "left out"),
                                            ('{"offload": true}', "offload")])
def test_train_flag_refuses_reentrant_and_double_offload(kwargs, message):
    from tiledmlp.train.args import UsageError, parse_args

    with pytest.raises(UsageError, match=message):
        parse_args(["--model", "tiny-llama", "--activation_offloading", "true", "--activation_checkpointing", "true",
                    "--activation_checkpointing_kwargs", kwargs])


def test_a_tensor_saved_twice_moves_once_and_comes_back_as_one():
    """``e * e`` saves ``e`` twice (so does an RMSNorm its float32 input): one host copy, one tensor back."""

    class Square(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            e = t.exp()
            return e * e

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    Square()(x).sum().backward()
    reference, x.grad = x.grad, None
    model = Square()
    with _offload(model) as off:
        unpacked: list[torch.Tensor] = []
        unpack = off._unpack
        off._unpack = lambda p: (unpacked.append(unpack(p)), unpacked[-1])[1]  # taken at forward time
        model(x).sum().backward()
    assert off.stats.packed == 3 and off.stats.offloaded == 1, off.stats  # exp's result, mul's two operands
    assert len(unpacked) == 3 and unpacked[0] is unpacked[1] is unpacked[2]
    assert torch.equal(x.grad, reference)


def test_gpu_benchmark_script_runs_tiny(capsys):
    """benchmarks/offload_gpu.py at a tiny size on CPU (copies forced through the host path): both modes, one table."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offload_gpu.py"
    spec = importlib.util.spec_from_file_location("offload_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "checkpointing" in out and "+ offload" in out and ", 0 waits" in out, out
    assert bench.tokens("128k") == 131072 and bench.tokens("256") == 256


def test_empty_tensors_are_not_moved():
    """torch 2.11's non-reentrant checkpoint saves an empty tensor per region: nothing to copy, even at min_bytes=0."""
    off = _offload(_llama(1))
    try:
        assert off._moves(torch.ones(1, dtype=torch.float64)) and not off._moves(torch.empty(0))
    finally:
        off.remove()


def test_a_failed_forward_leaves_the_offloader_whole() -> None:
    """A pre-hook registered before the offloader raising once (an out-of-memory error in FSDP2's root unshard,
    retried) must not switch offloading off for good, and a forward left by Ctrl-C must not leave the offloader's
    saved-tensor hooks behind once it is removed."""
    model = build("llama")
    enable_checkpointing(model)
    fail = [True]

    def flaky(module, args):
        if fail:
            fail.pop()
            raise RuntimeError("out of memory (simulated)")

    model.register_forward_pre_hook(flaky)
    off = _offload(model)
    with pytest.raises(RuntimeError, match="simulated"):
        model(input_ids=_ids(), labels=_ids())
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    assert off.stats.offloaded > 0
    off.remove()

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), _offload(model):
        model(input_ids=_ids(), labels=_ids())
    handle.remove()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
