"""QLoRA's MLPs on the two engines: the GLU engine for bitsandbytes' 4-bit Linears outside autocast, with their
casts to and from a compute dtype (``tiledmlp.quantized``), the generic engine under autocast, each as exact as the
untiled model; PEFT's 4-bit layer's own rounding of the adapter's term (a 16-bit base, float32 adapters); LoRA
dropout's masks drawn per tile over 4-bit MLPs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

import tiledmlp
from conftest import rel_err
from test_qlora import CONFIG, TARGETS, _batch, _step, quantized_pair
from tiledmlp.adapters import project
from tiledmlp.quantized import Dequantized

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def _mlp_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit) and ".mlp." in name]


def _compare(model: torch.nn.Module, batch: dict, path: str, twin: torch.nn.Module | None = None) -> None:
    """The untiled step, then the same patched with 3 tiles: every MLP took ``path``; loss and grads within 1e-5 of
    untiled, or with a float64 ``twin``, under bf16 autocast: as close to it as the untiled run (1.5x + 1e-6)."""
    autocast = twin is not None
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        loss, untiled = _step(model, batch)
    report = tiledmlp.patch(model, num_shards=3, loss=False)
    with context:
        tiled_loss, tiled = _step(model, batch)
    forwards = [model.get_submodule(name).forward for name, _, _ in report.patched]
    assert [(f.last_num_tiles, f.last_path) for f in forwards] == [(3, path)] * CONFIG["num_hidden_layers"]
    assert sorted(tiled) == sorted(untiled) and untiled
    if not autocast:
        assert float(rel_err(tiled_loss, loss)) <= 1e-6
        for name in untiled:
            assert float(rel_err(tiled[name], untiled[name])) <= 1e-5, name
        return
    ref_loss, ref = _step(twin, batch, float64_loss=True)
    assert float(rel_err(tiled_loss, ref_loss)) <= 1.5 * float(rel_err(loss, ref_loss)) + 1e-6
    for name in ref:
        err_untiled, err_tiled = float(rel_err(untiled[name], ref[name])), float(rel_err(tiled[name], ref[name]))
        assert err_tiled <= 1.5 * err_untiled + 1e-6, f"{name}: tiled {err_tiled:.2e} untiled {err_untiled:.2e}"


def test_4bit_weights_computing_in_bf16_over_a_float32_stream_take_the_glu_engine(tmp_path) -> None:
    """QLoRA as on a GPU: a bf16 ``compute_dtype`` under PEFT's float32 preparation. bitsandbytes casts the float32
    input to bf16 and the output back, and autograd the grads alike; the GLU engine makes the same casts: loss
    within 1e-6, grads within 1e-5 of untiled."""
    model, _ = quantized_pair(tmp_path)
    for m in _mlp_linears(model):
        m.compute_dtype = torch.bfloat16
    _compare(model, _batch(), "glu")


def test_4bit_weights_under_autocast_take_the_generic_engine(tmp_path) -> None:
    """Under autocast bitsandbytes' product does not follow autocast's rule for ``F.linear`` (its output is cast
    back to the input's dtype): the generic engine, as close to float64 as untiled (bf16 products: the tiles' and
    the whole sequence's matmuls round differently, 1.5e-3 apart here)."""
    model, twin = quantized_pair(tmp_path)
    _compare(model, _batch(), "generic", twin)


def test_frozen_4bit_mlp_without_adapters_takes_the_glu_engine(tmp_path) -> None:
    """LoRA on attention only: the MLPs are bare 4-bit Linears, frozen, whose tiles form the input grads alone (the
    attention adapters' grads flow through them)."""
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    model = tf.LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    _compare(model, _batch(), "glu")


def _bf16_pair(tmp_path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(QLoRA model in bf16 computing in bf16 with float32 adapters, float64 twin), in training mode (in eval mode
    bitsandbytes repacks a weight for its CPU inference kernel on some CPUs, at a call whose input needs no grad)."""
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    model = tf.LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu",
                                                dtype=torch.bfloat16)
    state = {name + ".weight": bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
             for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    twin = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG))
    twin.load_state_dict({**{k: v for k, v in model.state_dict().items() if k in twin.state_dict()}, **state},
                         strict=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, config).train()
    twin = peft.get_peft_model(twin, config).double().train()
    factors = dict(model.named_parameters())
    assert factors["base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"].dtype == torch.float32
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.requires_grad:
                p.copy_(factors[name])
    return model, twin


def test_the_4bit_layer_rounds_the_adapter_term_before_the_sum(tmp_path) -> None:
    """PEFT's 4-bit layer adds ``round(s B A x)`` to the bf16 base output (its ``lora.Linear`` rounds the float32
    sum once): ``project`` with the adapter read off it is that layer's output bit for bit, under autograd and in a
    tile, and with the other rounding it is not."""
    model, _ = _bf16_pair(tmp_path)
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    from tiledmlp.architectures import _projection

    weight, bias, lora = _projection(layer)
    assert isinstance(weight, Dequantized) and bias is None and lora.rounded
    torch.manual_seed(3)
    x = torch.randn(64, CONFIG["intermediate_size"], dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        assert torch.equal(project(x, weight, None, lora), expected)
        assert not torch.equal(project(x, weight, None, dataclasses.replace(lora, rounded=False)), expected)
    assert torch.equal(project(x.requires_grad_(), weight, None, lora).detach(), expected)


def test_bf16_qlora_on_the_glu_engine_as_close_as_untiled(tmp_path) -> None:
    """A bf16 model with bf16-computing 4-bit Linears and float32 adapters (no k-bit preparation: the residual
    stream bf16 too): the GLU engine; the forward bit for bit the untiled one, every grad as close to a float64
    twin as the untiled run is (bf16 products: 1.5x its error + 1e-6)."""
    model, twin = _bf16_pair(tmp_path)
    batch = _batch()
    _, ref = _step(twin, batch, float64_loss=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach()
    _, untiled = _step(model, batch)
    report = tiledmlp.patch(model, num_shards=3, loss=False)
    assert torch.equal(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, logits)
    _, tiled = _step(model, batch)
    assert [model.get_submodule(n).forward.last_path for n, _, _ in report.patched] == ["glu", "glu"]
    assert sorted(ref) == sorted(tiled) == sorted(untiled) and len(ref) == 4 * len(TARGETS)
    for name in ref:
        err_untiled, err_tiled = float(rel_err(untiled[name], ref[name])), float(rel_err(tiled[name], ref[name]))
        assert err_tiled <= 1.5 * err_untiled + 1e-6, f"{name}: tiled {err_tiled:.2e} untiled {err_untiled:.2e}"


def test_qlora_lora_dropout_takes_the_glu_path_exactly(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QLoRA with LoRA dropout in training mode: each tile draws its masks over the 4-bit MLP's adapters (the
    forward's 2 layers x 3 tiles, redrawn alike in the backward); the untiled 4-bit model fed those masks gives the
    same loss and adapter grads (float32: within 1e-5)."""
    from test_glu_lora_dropout import P, _joined, _Recorder, _replaced

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    names = ["gate_proj", "up_proj", "down_proj"]  # the MLPs' only: attention's dropout would draw its own masks
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=names, lora_dropout=P, init_lora_weights=False)
    models = []
    for _ in range(2):
        base = tf.LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
        torch.manual_seed(1)
        models.append(peft.get_peft_model(base, config).train())
    model, ref = models
    report = tiledmlp.patch(model, num_shards=3, loss=False)
    recorder = _Recorder(monkeypatch)
    batch = _batch()
    loss, got = _step(model, batch)
    assert [model.get_submodule(n).forward.last_path for n, _, _ in report.patched] == ["glu", "glu"]
    draws = recorder.take()
    assert len(draws) == 12 and all(m is not None for d in draws for m in d)  # forward's 6, then backward's 6
    for again in draws[9:12]:  # layer 0's backward (the kept last tile first) redraws its forward's masks
        assert any(all(torch.equal(a, b) for a, b in zip(drawn, again)) for drawn in draws[:3])
    _replaced(ref, names, [[_joined(draws[3 * n : 3 * n + 3], k) for k in range(3)] for n in range(2)])
    ref_loss, want = _step(ref, batch)
    assert float(rel_err(loss, ref_loss)) <= 1e-6
    assert sorted(got) == sorted(want) and len(want) == 4 * len(names)
    for name in want:
        assert float(rel_err(got[name], want[name])) <= 1e-5, name
