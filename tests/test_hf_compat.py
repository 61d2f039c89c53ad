"""Both transformers 5 spellings of checkpointing work: 5.23's activation_* and 5.0-5.22's gradient_* names."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
import transformers as tf

from tiledmlp.hf_compat import checkpointing_flags, enable_checkpointing, is_checkpointing
from tiledmlp.train.args import _renamed_flag, checkpointing, parse_args

NEW_NAMES = hasattr(tf.PreTrainedModel, "activation_checkpointing_enable")


class _OldNamesOnly(torch.nn.Module):
    """A model as transformers 5.0-5.22 has it: only the gradient_* names."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[object] = []
        self.is_gradient_checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.calls.append(gradient_checkpointing_kwargs)
        self.is_gradient_checkpointing = True


def test_the_installed_model_api_without_deprecation_warnings() -> None:
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # 5.23 warns on the old names: they must not be used there
        assert not is_checkpointing(model)
        enable_checkpointing(model, {"use_reentrant": False})
        assert is_checkpointing(model)
    funcs = {m._gradient_checkpointing_func for m in model.modules() if getattr(m, "gradient_checkpointing", False)}
    assert len(funcs) == 1 and funcs.pop().keywords == {"use_reentrant": False}


def test_the_old_names_are_used_where_the_new_ones_are_missing() -> None:
    model = _OldNamesOnly()
    enable_checkpointing(model)
    enable_checkpointing(model, {"use_reentrant": True})
    assert model.calls == [None, {"use_reentrant": True}] and is_checkpointing(model)


def test_flag_renames() -> None:
    assert checkpointing_flags({"activation_checkpointing", "gradient_checkpointing"}) == {
        "gradient_checkpointing": "activation_checkpointing",
        "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}
    old = checkpointing_flags({"gradient_checkpointing", "gradient_checkpointing_kwargs"})
    assert old == {"activation_checkpointing": "gradient_checkpointing",
                   "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}
    assert _renamed_flag("--activation_checkpointing", old) == "--gradient_checkpointing"
    assert _renamed_flag('--activation_checkpointing_kwargs={"a": 1}', old) == '--gradient_checkpointing_kwargs={"a": 1}'
    assert _renamed_flag("true", old) == "true" and _renamed_flag("--activation_offloading", old) == \
        "--activation_offloading"


@pytest.mark.parametrize("spelling", ["activation", "gradient"])
def test_train_reads_either_spelling(spelling: str, tmp_path: Path) -> None:
    """Flags and config keys in either spelling turn checkpointing on with its kwargs, on this transformers."""
    flags = ["--model", "tiny-llama", "--output_dir", str(tmp_path), f"--{spelling}_checkpointing", "true",
             f"--{spelling}_checkpointing_kwargs", '{"use_reentrant": false}']
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 warns on the gradient_* spelling, and takes it
        *_, train_args = parse_args(flags)
    assert checkpointing(train_args) == (True, {"use_reentrant": False})
    config = tmp_path / "c.yaml"
    config.write_text(f"{spelling}_checkpointing: true\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        *_, train_args = parse_args(["--config", str(config), "--model", "tiny-llama", "--output_dir", str(tmp_path)])
    assert checkpointing(train_args)[0] is True
    *_, train_args = parse_args(["--model", "tiny-llama", "--output_dir", str(tmp_path)])
    assert checkpointing(train_args) == (False, {})


@pytest.mark.skipif(not NEW_NAMES, reason="transformers < 5.23 has no activation_checkpointing names to map")
def test_old_names_are_read_as_the_new_ones() -> None:
    """From 5.23 both fields exist and transformers ignores the old one where the new is set: the old spelling is
    mapped to the new, so one option, whichever way it is spelled (before 2026-11-27 a --config file's
    ``activation_checkpointing: true`` beat a command line's ``--gradient_checkpointing false``)."""
    assert checkpointing_flags({f.name for f in dataclasses.fields(tf.TrainingArguments)}) == {
        "gradient_checkpointing": "activation_checkpointing",
        "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}
