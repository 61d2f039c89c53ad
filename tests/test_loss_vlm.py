"""patch_loss on multimodal ``*ForConditionalGeneration`` models (the text decoder's lm_head + ForCausalLMLoss):
the same loss and grads as a float64 cross-entropy of the unpatched model's own logits, with and without images,
and refusals, with the reason, where the forward does something else with its logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from conftest import assert_rel
from trainrun import assert_close_losses, one_thread, train  # noqa: F401 (autouse fixture)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

import tiledmlp
from tiledmlp.loss_patching import patch_loss

VOCAB, IMAGE, START, END = 96, 95, 93, 92
TEXT = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2, vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2,
              out_hidden_size=32, embed_dim=32, image_size=28, patch_size=14)
TOKEN_IDS = {"image_token_id": IMAGE, "image_token_index": IMAGE, "video_token_id": 94, "video_token_index": 94,
             "boi_token_index": START, "eoi_token_index": END, "vision_start_token_id": START,
             "vision_end_token_id": END}


def _set(config: object, fields: dict) -> None:
    for key, value in fields.items():
        try:
            getattr(config, key)
        except Exception:  # AttributeError, or Gemma 4's per-layer head_dim, which refuses a global read
            continue
        setattr(config, key, value)


def tiny(model_type: str, **text: int) -> torch.nn.Module:
    """A seeded float64 model of ``model_type`` (its image-text-to-text class), text decoder (``TEXT``, updated by
    ``text``) and vision tower shrunk to a few thousand parameters each, special tokens at the top of the 96-token
    vocabulary."""
    config = tf.AutoConfig.for_model(model_type, experts_implementation="eager")  # grouped_mm: no float64 kernel
    _set(config.text_config, {**TEXT, **text})
    if getattr(config.text_config, "layer_types", None):  # Gemma 3's per-layer list, checked when loaded
        config.text_config.layer_types = config.text_config.layer_types[:TEXT["num_hidden_layers"]]
    if model_type in ("qwen2_vl", "qwen2_5_vl"):  # their multimodal RoPE sections, over the 8-wide heads' 4 pairs
        config.text_config.rope_parameters = {**config.text_config.rope_parameters, "mrope_section": [2, 1, 1]}
    if getattr(config, "vision_config", None) is not None:
        _set(config.vision_config, VISION)
    _set(config, {**TOKEN_IDS, "mm_tokens_per_image": 4})  # Gemma 3: its 2x2 patches pooled to 4 tokens
    torch.manual_seed(0)
    model = getattr(tf, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])(config).double().train()
    with torch.no_grad():
        for p in model.parameters():  # HF inits some weights to constants: randomise for sharper comparisons
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _exact(model: torch.nn.Module, labels: torch.Tensor, patch: object = patch_loss, **inputs: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    """Patched (by ``patch``, 3 tiles) against F.cross_entropy in float64 on the unpatched model's logits; the
    patched model's grads."""
    logits = model(**inputs).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    ref.backward()
    ref_grads = _grads(model)
    patch(model, num_shards=3)
    out = model(**inputs, labels=labels)
    patched = next(f for m in model.modules() if hasattr(f := vars(m).get("forward"), "last_used_tiled"))
    assert out.logits is None and patched.last_used_tiled
    out.loss.backward()
    assert_rel(out.loss, ref.detach(), 1e-12, "loss")
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, grad in grads.items():
        ref = ref_grads[name]
        if float(ref.abs().max()) < 1e-12 * scale:  # zero but for rounding (a key bias: softmax ignores a shift)
            assert float((grad - ref).abs().max()) <= 1e-12 * scale, name
        else:
            assert_rel(grad, ref, 1e-12, name)
    return grads


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "llava_onevision",
                                        "gemma3", "gemma4", "mistral3", "smolvlm", "mllama", "lfm2_vl"])
def test_vlm_text_batch_matches_float64_cross_entropy(model_type: str) -> None:
    """Two sequences, one with a masked prompt: the tiled loss stands in for the VLM's own."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100
    _exact(tiny(model_type), labels, input_ids=ids)


def test_qwen2_5_vl_with_an_image_mlps_and_loss_tiled_exact() -> None:
    """An image's tokens in the sequence (masked from the loss, as a chat template does), the vision tower's and
    the decoder's MLPs tiled too (``tiledmlp.patch(loss=True)``)."""
    model = tiny("qwen2_5_vl")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 90, (1, 40), generator=g)
    ids[0, 5], ids[0, 6:10], ids[0, 10] = START, IMAGE, END  # 4x4 patches merged 2x2: 4 image tokens
    labels = ids.clone()
    labels[0, :11] = -100
    pixels = torch.randn(16, 3 * 14 * 14 * 2, generator=g, dtype=torch.float64)  # 4x4 patches, 2 frames each
    grid = torch.tensor([[1, 4, 4]])

    grads = _exact(model, labels, _patch_all, input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
    assert any(name.startswith("model.visual.") and grad.abs().max() > 0 for name, grad in grads.items())


def _patch_all(model: torch.nn.Module, num_shards: int) -> None:
    """``tiledmlp.patch(loss=True)``: the vision tower's MLPs tiled as well as the decoder's, and the loss."""
    names = [name for name, _, _ in tiledmlp.patch(model, num_shards=num_shards, loss=True).patched]
    assert any("language_model" in n for n in names) and any("visual" in n or "vision" in n for n in names), names


@pytest.mark.parametrize("model_type", ["llava", "gemma3"])
def test_llava_and_gemma3_with_images_exact(model_type: str) -> None:
    """Two sequences with an image each (28x28 pixels in 14x14 patches: 4 image tokens), CLIP's and SigLIP's MLPs
    tiled over the 4 patches (generic engine), Gemma 3's image tokens attending to each other (token_type_ids)."""
    model = tiny(model_type)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 90, (2, 30), generator=g)
    ids[:, 4:8] = IMAGE
    labels = torch.where(ids == IMAGE, -100, ids)
    inputs = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 28, 28, generator=g, dtype=torch.float64)}
    if model_type == "gemma3":
        inputs["token_type_ids"] = (ids == IMAGE).long()
    grads = _exact(model, labels, _patch_all, **inputs)
    assert any(name.startswith("model.vision_tower.") and grad.abs().max() > 0 for name, grad in grads.items())


@pytest.mark.parametrize("model_type", ["gemma4", "paligemma"])
def test_vlm_soft_capped_logits_exact(model_type: str) -> None:
    """Gemma 4 (as Gemma 3n) soft-caps by its text config's cap in a walrus guard, PaliGemma by a local read from
    it: the tiled loss applies the cap (0.5 here, so that it bends the logits), and the config holds it again
    after the call."""
    model = tiny(model_type)
    text = model.config.get_text_config()
    ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(4))
    text.final_logit_softcapping = None
    raw = model(input_ids=ids).logits
    text.final_logit_softcapping = 0.5
    assert (model(input_ids=ids).logits - raw).abs().max() > 0.1
    _exact(model, ids.clone(), input_ids=ids)
    assert text.final_logit_softcapping == 0.5


def test_vlm_computing_its_loss_over_an_inner_causal_lms_logits_is_refused() -> None:
    """Llama-4's ``*ForCausalLM`` would take the patch, but the VLM around it computes the loss over its logits
    itself, so it would never run tiled: refused before anything is patched (before, patched and silently
    untiled)."""
    model = tiny("llama4")
    match = "Llama4ForConditionalGeneration.*computes the loss from the logits of the causal LM it holds"
    with pytest.raises(ValueError, match=match):
        patch_loss(model)
    with pytest.raises(ValueError, match=match):
        tiledmlp.patch(model, loss=True)
    assert "forward" not in vars(model) and not any(type(m).__name__ == "TiledMLP" for m in model.modules())


def test_an_encoder_decoder_is_refused_with_its_reason() -> None:
    config = tf.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration.*takes no labels, logits_to_keep"):
        patch_loss(tf.T5ForConditionalGeneration(config))


def test_a_config_vocab_other_than_the_heads_is_refused_at_the_call() -> None:
    """ForCausalLMLoss views the logits as [-1, config vocab_size]: with a head of another size the untiled loss
    is an error (or garbage), so the tiled one must not quietly compute another."""
    model = tiny("llava")
    patch_loss(model)
    model.config.text_config.vocab_size = VOCAB - 1
    ids = torch.randint(3, 90, (1, 16))
    with pytest.raises(ValueError, match="vocabulary of 95 .* lm_head has 96 rows"):
        model(input_ids=ids, labels=ids)


def test_train_takes_a_gemma3_checkpoint_with_the_tiled_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's checkpoints from 4B up (and Gemma 3n's, Gemma 4's) load through AutoModelForCausalLM as a
    ``*ForConditionalGeneration``: ``tiledmlp train`` with its default tiled loss stopped there with "no
    *ForCausalLM" before 2026-11-28. Now: the loss tiled, the text MLPs too, the losses the untiled run's."""
    from tiledmlp.train.models import byte_tokenizer

    path = tmp_path / "gemma3"
    tiny("gemma3", vocab_size=300).float().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    tiled = train(tmp_path, monkeypatch, "--model", str(path), "--use_tiled_loss", "true", name="tiled")
    plain = train(tmp_path, monkeypatch, "--model", str(path), "--use_tiled_loss", "false", "--use_tiled_mlp",
                  "false", name="plain")
    assert tiled["tiled_loss"] is True and plain["tiled_loss"] is False
    assert {k: v for k, v in tiled["tiles"].items() if "language_model" in k} == {
        "model.language_model.layers.0.mlp": 4, "model.language_model.layers.1.mlp": 4}
    assert_close_losses(tiled, plain)


def test_lora_on_a_vlm_with_the_tiled_loss_exact() -> None:
    """PEFT's LoRA on the decoder's and the vision tower's projections (the usual VLM fine-tune): the tiled loss
    found through the PeftModel, the adapters' grads float64-exact, the base weights frozen."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("qwen2_5_vl"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "qkv"],
                                                          init_lora_weights=False))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 90, (2, 24), generator=g)
    labels = ids.clone()
    labels[1, :7] = -100
    grads = _exact(model, labels, input_ids=ids)
    assert grads and all("lora_" in name for name in grads)
