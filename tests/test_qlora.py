"""QLoRA: PEFT LoRA over bitsandbytes 4-bit base weights. The tiled MLPs (the GLU engine, bitsandbytes' products;
``test_qlora_glu.py`` for the generic engine's cases) and the tiled loss against an untiled float64 model holding
the very weights the 4-bit ones stand for (bitsandbytes computes in 16 or 32 bits only, so the tiled and untiled
4-bit runs are both float32 and both are measured against that reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import tiledmlp
from conftest import rel_err

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

CONFIG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=160, max_position_embeddings=256)
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(r: int = 4) -> "peft.LoraConfig":
    # init_lora_weights=False: B random too, so every adapter factor gets a non-zero grad
    return peft.LoraConfig(r=r, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)


def quantized_pair(tmp_path, double_quant: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(QLoRA model, float64 twin): the twin's base weights are the 4-bit ones dequantized (float32 values, exact in
    float64), its LoRA factors the same values."""
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                                  bnb_4bit_use_double_quant=double_quant)
    model = tf.LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
    state = {name + ".weight": bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
             for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(state) == 7 * CONFIG["num_hidden_layers"]
    twin = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG))
    twin.load_state_dict({**{k: v for k, v in model.state_dict().items() if k in twin.state_dict()}, **state},
                         strict=True)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, _lora())
    twin = peft.get_peft_model(twin, _lora()).double()
    factors = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if p.requires_grad:
                p.copy_(factors[name])
    return model, twin


def _batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 48))
    labels = ids.clone()
    labels[0, :13] = -100  # a masked prompt
    mask = torch.ones_like(ids)
    mask[1, 37:] = 0  # a padded second sequence
    labels[1, 37:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], float64_loss: bool = False
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    if float64_loss:  # transformers' loss casts the logits to float32: the reference takes its own in float64
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
    else:
        loss = model(**batch).loss
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def test_qlora_tiled_mlp_and_loss_as_exact_as_untiled(tmp_path) -> None:
    """bs 2 (one prompt masked, one sequence padded), 3 tiles on the GLU engine (4-bit weights computing in float32,
    the input's dtype), tiled loss: loss and every adapter grad as close to the float64 model as the untiled 4-bit
    run is (within 1.5x its error + 1e-6), and within 1e-5 of it."""
    model, twin = quantized_pair(tmp_path)
    batch = _batch()
    ref_loss, ref = _step(twin, batch, float64_loss=True)
    loss, untiled = _step(model, batch)
    report = tiledmlp.patch(model, num_shards=3, loss=True)
    assert [path for _, _, path in report.patched] == ["glu"] * CONFIG["num_hidden_layers"]
    tiled_loss, tiled = _step(model, batch)
    forwards = [model.get_submodule(name).forward for name, _, _ in report.patched]
    assert [(f.last_num_tiles, f.last_path) for f in forwards] == [(3, "glu")] * CONFIG["num_hidden_layers"]
    assert sorted(ref) == sorted(untiled) == sorted(tiled) and len(ref) == 4 * len(TARGETS)
    assert float(rel_err(tiled_loss, ref_loss)) <= 1.5 * float(rel_err(loss, ref_loss)) + 1e-6
    for name in ref:
        err_untiled, err_tiled = float(rel_err(untiled[name], ref[name])), float(rel_err(tiled[name], ref[name]))
        assert err_tiled <= 1.5 * err_untiled + 1e-6, f"{name}: tiled {err_tiled:.2e} untiled {err_untiled:.2e}"
        assert float(rel_err(tiled[name], untiled[name])) <= 1e-5, name


def test_target_gb_reads_the_quantized_projections_widths(tmp_path) -> None:
    """``patch(target_gb=)`` sizes a tile by the MLP's intermediate width. A 4-bit weight's tensor is the packed
    bytes ([in * out / 2, 1]), so that width must come from the Linear itself: the same tiles as the unquantized
    model's on the same (generic) engine."""
    model, twin = quantized_pair(tmp_path)
    twin = twin.float()
    ids = _batch()["input_ids"]
    x = torch.empty(1, ids.numel(), CONFIG["hidden_size"])
    tiles = []
    for m in (model, twin):  # the plain model's MLPs would take the GLU engine: both planned for the generic one
        report = tiledmlp.patch(m, target_gb=2e-5)
        tiles.append([m.get_submodule(name).forward.plan(ids.numel(), x, "generic") for name, _, _ in report.patched])
    assert tiles[0] == tiles[1] and len(tiles[0][0]) > 1, tiles


def test_tiles_keep_bitsandbytes_cpu_inference_packing_off(tmp_path) -> None:
    """On a CPU with AVX512-BF16 or AMX, a Linear4bit in eval mode repacks its weight for an inference-only kernel
    at a call whose input needs no grad, as every tile's forward is (no graph): no input grad flows through it after
    that, and with in-features not a multiple of the block size (down_proj's 176 here) the repacking raised. The
    flag bitsandbytes sets on such CPUs is set here on the MLPs' 4-bit Linears, so this runs on any CPU: the tiled
    eval-mode step is the untiled one's, no weight repacked, the flags as they were."""
    model, _ = quantized_pair(tmp_path)
    model.eval()
    mlps = [m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit) and ".mlp." in name]
    assert len(mlps) == 3 * CONFIG["num_hidden_layers"]
    for m in mlps:
        m.support_avx512bf16_for_cpu = True
    batch = _batch()
    loss, untiled = _step(model, batch)
    tiledmlp.patch(model, num_shards=3, loss=False)
    tiled_loss, tiled = _step(model, batch)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in mlps)
    assert all(m.support_avx512bf16_for_cpu is True for m in mlps)
    assert float(rel_err(tiled_loss, loss)) <= 1e-6
    assert sorted(tiled) == sorted(untiled) and len(tiled) == 4 * len(TARGETS)
    for name in untiled:
        assert float(rel_err(tiled[name], untiled[name])) <= 1e-5, name
