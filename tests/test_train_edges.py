"""Regression tests for bugs found reviewing ``tiledmlp train`` (args, runner, data, checks, resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiledmlp.train.args import UsageError
from tiledmlp.train.data import load_raw_text, pack
from tiledmlp.train.models import byte_tokenizer


def test_chat_messages_whose_records_differ_in_keys_are_chat(tmp_path: Path) -> None:
    """datasets 5 reads a messages column whose records differ in their keys (a ``name`` in one, ``tool_calls`` in
    another: any tool-use or multi-speaker chat data) as ``List(Json)``, not records; it was refused as "neither
    text nor chat messages". It is rendered with the template like any chat column; JSON lists that are not
    messages are still refused."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 4}]},
            {"messages": [{"role": "system", "content": "be brief", "name": "sys"},
                          {"role": "user", "content": "a question"}]}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}{% if 'name' in m %} {{ m['name'] }}{% endif %}>"
                               "{{ m['content'] }}{% endfor %}")
    raw = load_raw_text(str(chats), "messages")
    packed = pack(raw, tokenizer, "messages", 8, 0)
    text = tokenizer.decode([t for row in packed["input_ids"] for t in row])
    assert text.startswith("<user>hi<assistant>hello hello hello hello <|endoftext|><system sys>be brief<user>a ")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"items": [{"a": 1}]}) + "\n" + json.dumps({"items": [{"b": "x"}]}) + "\n")
    with pytest.raises(UsageError, match="neither text nor chat messages"):
        load_raw_text(str(other), "items")


def test_ignore_data_skip_resumes_onto_other_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--ignore_data_skip true`` is Trainer's way to resume a checkpoint (optimizer, schedule, step) onto data it
    does not skip into, e.g. a new dataset; the data-flag check refused it, telling the user to start over from the
    weights alone. Without the flag, other data is still refused."""
    from tiledmlp.train.args import parse_args
    from trainrun import TINY, train

    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} document {i} " * 30}) + "\n"
                                                       for i in range(10)))
    train(tmp_path, monkeypatch, "--dataset", str(tmp_path / "a.jsonl"), "--max_steps", "2", "--save_strategy",
          "steps", "--save_steps", "2", "--save_final_model", "false", name="run")
    resume = [*TINY, "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "last", "--dataset",
              str(tmp_path / "b.jsonl")]
    with pytest.raises(UsageError, match=r"--ignore_data_skip true to go on from the first batch of this data"):
        parse_args(resume)
    report = tmp_path / "resumed.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report))
    from tiledmlp.train.cli import main

    assert main([*resume, "--max_steps", "3", "--ignore_data_skip", "true", "--save_final_model", "false"]) == 0
    assert sorted(json.loads(report.read_text())["losses"]) == ["3"]  # went on from step 2: the state was resumed


def test_do_eval_and_do_predict_are_not_ignored(tmp_path: Path) -> None:
    """Trainer leaves ``--do_eval``/``--do_predict`` to the script; here they did nothing: ``--do_eval true``
    without held-out text evaluated nothing, ``--do_predict true`` predicted nothing, silently."""
    from tiledmlp.train.args import parse_args

    base = ["--model", "tiny-llama", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(UsageError, match=r"^--do_eval true needs --eval_dataset FILE"):
        parse_args([*base, "--do_eval", "true"])
    with pytest.raises(UsageError, match=r"^--do_predict true: tiledmlp train writes no predictions"):
        parse_args([*base, "--do_predict", "true"])
    (tmp_path / "ev.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    assert parse_args([*base, "--do_eval", "true", "--eval_dataset", str(tmp_path / "ev.jsonl")])[3].do_eval


def test_resume_from_checkpoint_false_in_a_config_is_a_new_run(tmp_path: Path) -> None:
    """A config template's ``resume_from_checkpoint: false`` (``true`` resumes the last checkpoint) was refused as
    a missing folder named ``false``."""
    from tiledmlp.train.args import parse_args

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: tiny-llama\nresume_from_checkpoint: false\noutput_dir: {tmp_path / 'out'}\n")
    assert parse_args(["--config", str(cfg)])[3].resume_from_checkpoint is None
    assert parse_args(["--config", str(cfg), "--resume_from_checkpoint", "False"])[3].resume_from_checkpoint is None


def test_resuming_another_folders_checkpoint_never_overwrites_this_ones(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume_from_checkpoint A/checkpoint-2 --output_dir B`` with B holding another run's checkpoints went
    ahead: it wrote B/checkpoint-4 over that run's and ``--save_total_limit 1`` deleted its checkpoint-2. It is
    refused like a new run there; resuming a checkpoint of B itself still goes on."""
    from tiledmlp.train.args import parse_args
    from trainrun import TINY, train

    saving = ["--save_strategy", "steps", "--save_steps", "2", "--save_final_model", "false"]
    train(tmp_path, monkeypatch, "--max_steps", "4", *saving, name="B")
    train(tmp_path, monkeypatch, "--max_steps", "2", *saving, "--learning_rate", "1e-3", name="A")
    before = {p.parent.name: p.read_bytes() for p in (tmp_path / "B").glob("checkpoint-*/model.safetensors")}
    resume = [*TINY, "--output_dir", str(tmp_path / "B"), "--max_steps", "4", *saving, "--save_total_limit", "1"]
    with pytest.raises(UsageError, match=rf"already holds checkpoints of an earlier run \(checkpoint-4\); .*resuming "
                                         rf"{tmp_path / 'A' / 'checkpoint-2'} there would overwrite them"):
        parse_args([*resume, "--resume_from_checkpoint", str(tmp_path / "A" / "checkpoint-2")])
    assert {p.parent.name: p.read_bytes() for p in (tmp_path / "B").glob("checkpoint-*/model.safetensors")} == before
    assert parse_args([*resume, "--resume_from_checkpoint", str(tmp_path / "B" / "checkpoint-2")])[3] \
        .resume_from_checkpoint == str(tmp_path / "B" / "checkpoint-2")


def test_an_adapter_of_a_relative_model_path_names_its_base_from_anywhere(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model m`` (a folder in the current one) with ``--lora_r``: the adapter recorded ``m`` as its base, so
    ``AutoPeftModelForCausalLM.from_pretrained(ADAPTER)`` from any other folder asked the Hub for a model ``m``.
    It records the folder's absolute path."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from tiledmlp.train.models import tiny_llama_config
    from trainrun import train

    LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    train(tmp_path, monkeypatch, "--model", "m", "--lora_r", "4", "--max_steps", "1", name="adapter")
    base = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(tmp_path / "m")
    monkeypatch.chdir(tmp_path / "adapter")
    assert type(AutoModelForCausalLM.from_pretrained(base)).__name__ == "LlamaForCausalLM"


def test_a_checkpoint_save_is_not_counted_in_the_next_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer saves after the step's ``on_step_end``: the save's time went into the next step's seconds and tok/s
    (SmolLM2-135M: 2.9 s and 22 tok/s for a 1 s step after each save, until 2026-11-27). A save made to take 1.5 s
    here shows in no step."""
    import time

    import transformers as tf
    from trainrun import train

    real = tf.Trainer._save_checkpoint

    def slow_save(self: tf.Trainer, *args: object, **kwargs: object) -> object:
        time.sleep(1.5)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tf.Trainer, "_save_checkpoint", slow_save)
    summary = train(tmp_path, monkeypatch, "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1",
                    "--save_final_model", "false")
    assert [r["step"] for r in summary["records"]] == [1, 2, 3]
    assert all(r["seconds"] < 1.5 for r in summary["records"]), summary["records"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-3"]
