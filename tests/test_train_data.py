"""``tiledmlp train``'s data in and models out: local and Hub datasets, held-out evaluation with the tiled loss,
the saved final model, and the folders a new run refuses to overwrite (tiny random Llama, in-process)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from trainrun import TINY, assert_close_losses, losses, one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.train.args import parse_args
from tiledmlp.train.cli import main


def test_hub_dataset_ids_go_to_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--dataset org/name`` (not a local path) is read with ``datasets.load_dataset(id, name=--dataset_config,
    split=--dataset_split)``, ``--eval_dataset`` likewise with ``--eval_split``; offline, an id that is not cached is
    one error line naming the flag. (No network here: the Hub itself is stood in for by a local Dataset.)"""
    from datasets import Dataset

    import tiledmlp.train.data as data

    calls: list[tuple] = []

    def fake_load_dataset(path: str, name: str | None = None, split: str | None = None, **kw: object) -> Dataset:
        calls.append((path, name, split))
        return Dataset.from_dict({"text": [f"hub document {i}: " + "long text " * 30 for i in range(4)]})

    monkeypatch.setattr(data, "load_dataset", fake_load_dataset)
    out = train(tmp_path, monkeypatch, "--dataset", "some-org/long-docs", "--dataset_config", "en",
                "--dataset_split", "train[:10%]", "--eval_dataset", "some-org/docs-2.5", "--eval_split", "test",
                "--eval_config", "de")
    assert calls == [("some-org/long-docs", "en", "train[:10%]"), ("some-org/docs-2.5", "de", "test")]
    assert out["steps"] == 3 and len(out["evals"]) == 1
    for eval_id, config in (("some-org/long-docs", "en"), ("other-org/held-out", None)):  # --eval_config unset
        data_args = parse_args([*TINY, "--dataset", "some-org/long-docs", "--dataset_config", "en",
                                "--eval_dataset", eval_id, "--output_dir", str(tmp_path / "x")])[1]
        assert data_args.eval_dataset_config() == config
    monkeypatch.undo()
    import datasets
    import huggingface_hub

    # offline as HF_HUB_OFFLINE=1 at start-up makes it (both libraries read the variable once, at import; set
    # later, the lookup would retry the network for ~20 s first)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    capsys.readouterr()
    assert main([*TINY, "--dataset", "no-such-org/no-such-dataset", "--output_dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tiledmlp train: error: --dataset no-such-org/no-such-dataset: "
                                               "cannot read it")
    assert main([*TINY, "--dataset", "data/missing.jsonl", "--output_dir", str(tmp_path / "x")]) == 2
    assert "--dataset not found: data/missing.jsonl" in capsys.readouterr().err


def test_training_past_the_models_positions_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaForCausalLM

    from tiledmlp.train.models import byte_tokenizer, tiny_llama_config

    path = tmp_path / "short-context"
    config = tiny_llama_config()
    config.max_position_embeddings = 32
    LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    capsys.readouterr()
    out = train(tmp_path, monkeypatch, "--model", str(path), "--max_steps", "1")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "max_position_embeddings" in line]
    assert out["steps"] == 1 and len(warnings) == 1
    assert "--max_seq_length 64 is past the model's max_position_embeddings 32" in warnings[0]


def test_learned_positions_are_a_hard_limit(tmp_path: Path) -> None:
    """GPT-2's learned position table has no row past n_positions (an IndexError mid-step otherwise): a longer
    --max_seq_length is refused naming both numbers. A model whose loss the tiled loss cannot stand in for
    (BioGPT's: its head is not ``lm_head``) is refused with the flag that turns it off; GPT-2's (refused until
    2026-11-29) is tiled."""
    from transformers import BioGptConfig, BioGptForCausalLM, GPT2Config, GPT2LMHeadModel

    from tiledmlp.train.args import TilingArguments, UsageError
    from tiledmlp.train.runner import _apply_tiled_loss, _check_past_trained_positions

    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    _check_past_trained_positions(model, 32)
    with pytest.raises(UsageError, match="--max_seq_length 64 is past the model's 32 learned positions .*pass "
                                         "--max_seq_length 32 or less"):
        _check_past_trained_positions(model, 64)
    biogpt = BioGptForCausalLM(BioGptConfig(vocab_size=257, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=32))
    with pytest.raises(UsageError, match="BioGptForCausalLM.*does more with the logits.*; pass --use_tiled_loss "
                                         "false$"):
        _apply_tiled_loss(biogpt, TilingArguments(), 0.0, tile_eval=False)
    _apply_tiled_loss(model, TilingArguments(), 0.0, tile_eval=False)
    assert model.forward.__class__.__name__ == "_TiledLossForward"


def test_a_quoted_tilde_in_the_model_path_is_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaForCausalLM

    from tiledmlp.train.models import byte_tokenizer, load_model_and_tokenizer, tiny_llama_config

    LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    model, _ = load_model_and_tokenizer("~/m")
    assert type(model).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("flag", ["--dataset", "--eval_dataset"])
def test_data_without_text_is_one_error_line(flag: str, tmp_path: Path) -> None:
    """A file of no records is "empty"; records that all lack text (the tokenized table then has no column at
    all) are "no text"; both as the flag's error, not datasets' StopIteration or pyarrow's KeyError."""
    from tiledmlp.train.args import UsageError
    from tiledmlp.train.data import load_raw_text, pack
    from tiledmlp.train.models import byte_tokenizer

    for name, content in (("none.jsonl", ""), ("none.txt", ""), ("blank.jsonl", "\n\n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(UsageError, match=f"^{flag} {tmp_path / name} is empty$"):
            load_raw_text(str(tmp_path / name), "text", flag)
    (tmp_path / "d.jsonl").write_text('{"text": ""}\n' * 3)
    raw = load_raw_text(str(tmp_path / "d.jsonl"), "text", flag)
    with pytest.raises(UsageError, match=f"^{flag}: the 'text' field holds no text$"):
        pack(raw, byte_tokenizer(), "text", 64, 1, flag)


def test_dataset_file_and_text_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"body": f"document {i}: " + "tiles of tokens " * 20}) + "\n"
                            for i in range(8)))
    out = train(tmp_path, monkeypatch, "--dataset", str(data), "--text_field", "body", "--use_tiled_loss", "false")
    assert out["steps"] == 3 and all(v is not None for v in losses(out))


def test_chat_messages_are_rendered_with_the_models_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A ``messages`` column (role/content records) is rendered by the tokenizer's chat template and packed; with
    no template, or a column that is neither text nor chat, it is one error line (never the records' repr)."""
    from transformers import LlamaForCausalLM

    from tiledmlp.train.data import load_raw_text, pack
    from tiledmlp.train.models import byte_tokenizer, tiny_llama_config

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                      {"role": "assistant", "content": "an answer " * 8}]}) + "\n"
                             for i in range(12)))
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    packed = pack(load_raw_text(str(chats), "messages"), tokenizer, "messages", 64)
    text = tokenizer.decode(packed[0]["input_ids"])
    assert text.startswith("<user>question 0<assistant>an answer an answer") and "role" not in text
    model_dir = tmp_path / "chat-model"
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = train(tmp_path, monkeypatch, "--model", str(model_dir), "--dataset", str(chats), "--text_field", "messages")
    assert out["steps"] == 3
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(4)))
    capsys.readouterr()
    for flags, message in ((["--dataset", str(chats), "--text_field", "messages"], "the model's tokenizer has no "
                            "chat template"),
                           (["--dataset", str(numbers)], "field 'text' holds Value('int64'), neither text nor chat")):
        assert main([*TINY, *flags, "--output_dir", str(tmp_path / "x")]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tiledmlp train:")]
        assert len(err) == 1 and message in err[0], err


def test_compressed_files_and_folders_of_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``data.jsonl.gz``, a folder of parquet shards and a ``save_to_disk`` DatasetDict (its train split) train on
    the same text as the plain file: the same losses. (A DatasetDict was read as one table whose columns were its
    split names.) Compressed parquet is refused by a message that says all but parquet may be compressed."""
    import gzip

    from datasets import Dataset, DatasetDict

    docs = [f"document {i}: " + "tiles of tokens " * 20 for i in range(8)]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "plain.jsonl").write_text(lines)
    with gzip.open(tmp_path / "packed.jsonl.gz", "wt") as f:
        f.write(lines)
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        Dataset.from_dict({"text": docs[4 * k:4 * k + 4]}).to_parquet(shards / f"part-{k}.parquet")
    saved = tmp_path / "saved"  # save_to_disk of a DatasetDict: its "train" split
    DatasetDict({"test": Dataset.from_dict({"text": ["held out"] * 2}), "train": Dataset.from_dict({"text": docs})}
                ).save_to_disk(saved)
    runs = [train(tmp_path, monkeypatch, "--dataset", str(path), "--use_tiled_loss", "false", name=f"run-{k}")
            for k, path in enumerate((tmp_path / "plain.jsonl", tmp_path / "packed.jsonl.gz", shards, saved))]
    assert losses(runs[0]) == losses(runs[1]) == losses(runs[2]) == losses(runs[3])
    from tiledmlp.train.args import UsageError
    from tiledmlp.train.data import load_raw_text

    (tmp_path / "table.parquet.gz").write_bytes(b"")  # parquet compresses inside: refused, and the error says so
    with pytest.raises(UsageError, match=r"\.parquet or \.csv, all but \.parquet also \.gz/\.bz2/\.xz/\.zst"):
        load_raw_text(str(tmp_path / "table.parquet.gz"), "text")


def test_packing_keeps_every_token_and_a_text_file_is_a_document(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The packed blocks are the documents joined with eos, every token but the last short tail, however many
    documents there are (each 1000-document map batch used to drop its own tail: 18% of 5000 short documents). A
    .txt file, compressed or in a folder, is one document with its newlines (it was a document per line, an eos
    after each). Records with no text are skipped and counted."""
    import bz2

    from datasets import Dataset

    from tiledmlp.train.data import load_raw_text, pack
    from tiledmlp.train.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    docs = [f"document {i} " + "x" * (i % 37) for i in range(5000)]
    packed = pack(Dataset.from_dict({"text": docs}), tokenizer, "text", 512)
    eos = tokenizer.eos_token_id
    joined = [t for ids in tokenizer(docs, add_special_tokens=False)["input_ids"] for t in [*ids, eos]]
    rows = packed["input_ids"]
    assert len(rows) == len(joined) // 512 and [t for row in rows for t in row] == joined[:len(rows) * 512]
    assert packed["labels"] == rows

    book = "Chapter 1\nIt was a dark night.\n\nThe end.\n"
    (tmp_path / "book.txt").write_text(book)
    (tmp_path / "book.txt.bz2").write_bytes(bz2.compress(book.encode()))
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    for name in ("a.txt", "b.txt"):
        (shelf / name).write_text(book)
    for path, count in ((tmp_path / "book.txt", 1), (tmp_path / "book.txt.bz2", 1), (shelf, 2)):
        assert load_raw_text(str(path), "text")["text"] == [book] * count
    once = [t for row in pack(load_raw_text(str(tmp_path / "book.txt"), "text"), tokenizer, "text", 8, 0)["input_ids"]
            for t in row]
    assert once == tokenizer(book, add_special_tokens=False)["input_ids"][:len(once)] and len(once) == 40

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"text": "plain " * 10}) + "\n" + json.dumps({"messages": [{"role": "user",
                     "content": "hi"}]}) + "\n" + json.dumps({"text": ""}) + "\n")
    capsys.readouterr()
    pack(load_raw_text(str(mixed), "text"), tokenizer, "text", 8)
    assert "--dataset: 2 of 3 records have no text in 'text' and are skipped" in capsys.readouterr().err


class _SpecialTokens:
    """A tokenizer that adds a bos (1) and, with ``eos_too``, an eos (2) of its own to each text, like Llama's and
    some others'."""

    eos_token_id, chat_template = 2, None

    def __init__(self, eos_too: bool) -> None:
        self.eos_too = eos_too

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        ids = [[10 + ord(c) % 50 for c in text] for text in texts]
        return {"input_ids": [[1, *x] + ([2] if self.eos_too else []) if add_special_tokens else x for x in ids]}


@pytest.mark.parametrize("eos_too", [False, True])
def test_plain_text_takes_the_tokenizers_bos_and_one_eos(eos_too: bool) -> None:
    """Each document starts with the bos a tokenizer adds (as run_clm trains; Gemma and Llama expect it) and ends
    with one eos, whether or not the tokenizer adds one too."""
    from datasets import Dataset

    from tiledmlp.train.data import pack

    packed = pack(Dataset.from_dict({"text": ["abc", "de"]}), _SpecialTokens(eos_too), "text", 3, 0)
    assert [t for row in packed["input_ids"] for t in row] == [1, 57, 58, 59, 2, 1, 10, 11, 2]


def test_local_splits(tmp_path: Path) -> None:
    """A local folder or ``save_to_disk`` dataset is read at the asked split; with only one split, the flag's
    default (train, or validation for --eval_dataset) takes it; any other name or a slice is refused."""
    from datasets import Dataset, DatasetDict

    from tiledmlp.train.args import UsageError
    from tiledmlp.train.data import load_raw_text

    docs = [f"document {i}" for i in range(4)]
    shards = tmp_path / "shards"
    shards.mkdir()
    Dataset.from_dict({"text": docs}).to_json(shards / "part-0.jsonl")
    saved = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_dict({"text": docs})}).save_to_disk(saved)
    for path in (shards, saved):
        assert load_raw_text(str(path), "text")["text"] == docs
        assert load_raw_text(str(path), "text", "--eval_dataset", split="validation")["text"] == docs
        with pytest.raises(UsageError, match=r"has no split 'test' \(splits: train; .*pass --eval_split NAME"):
            load_raw_text(str(path), "text", "--eval_dataset", split="test")
        with pytest.raises(UsageError, match=r"has no split 'train\[:5%\]'.*pass --dataset_split NAME"):
            load_raw_text(str(path), "text", split="train[:5%]")


def test_a_new_run_never_overwrites_an_earlier_runs_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Without --resume_from_checkpoint a run into a folder with checkpoints, or with an earlier run's final model,
    is refused (exit 2, nothing touched); ``--resume_from_checkpoint last`` continues it. Checkpoints refuse even a
    run with ``--save_strategy no`` (a stop signal saves one anyway); a folder with only a final model takes a run
    that saves none (``--save_final_model false``)."""
    common = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1", "--use_tiled_loss", "false"]
    train(tmp_path, monkeypatch, *common, name="run")
    files = sorted((tmp_path / "run").glob("checkpoint-*/*.safetensors"))
    stamps = [f.stat().st_mtime_ns for f in files]
    assert [f.parent.name for f in files] == ["checkpoint-1", "checkpoint-2"]
    capsys.readouterr()
    assert main([*TINY, *common, "--output_dir", str(tmp_path / "run")]) == 2
    assert "--output_dir " + str(tmp_path / "run") + " already holds checkpoints of an earlier run (checkpoint-2)" \
        in capsys.readouterr().err
    assert [f.stat().st_mtime_ns for f in files] == stamps
    resumed = train(tmp_path, monkeypatch, *common, "--max_steps", "3", "--resume_from_checkpoint", "last",
                    name="run")
    assert sorted(resumed["losses"], key=int) == ["3"] and [f.stat().st_mtime_ns for f in files] == stamps
    final = tmp_path / "run" / "model.safetensors"  # the resumed run's final model
    stamp = final.stat().st_mtime_ns
    assert main([*TINY, "--save_final_model", "false", "--output_dir", str(tmp_path / "run")]) == 2
    assert "already holds checkpoints of an earlier run (checkpoint-3)" in capsys.readouterr().err
    assert [f.stat().st_mtime_ns for f in files] == stamps
    for checkpoint in (tmp_path / "run").glob("checkpoint-*"):
        checkpoint.rename(tmp_path / checkpoint.name)  # the final model alone
    assert main([*TINY, "--max_steps", "1", "--output_dir", str(tmp_path / "run")]) == 2
    assert "already holds an earlier run's final model (config.json)" in capsys.readouterr().err
    train(tmp_path, monkeypatch, "--save_final_model", "false", "--max_steps", "1", name="run")  # writes nothing
    assert final.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("lora", [False, True])
def test_final_model_is_saved_and_loads_untiled(lora: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After training the model (or LoRA adapter) and tokenizer are in --output_dir: the same tensors as the
    last step's checkpoint, loadable by plain transformers/PEFT with nothing of tiledmlp in them."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    flags = ["--save_strategy", "steps", "--save_steps", "3"] + (["--lora_r", "4"] if lora else [])
    train(tmp_path, monkeypatch, *flags, name="run")
    out = tmp_path / "run"
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    final, last = load_file(out / weights), load_file(out / "checkpoint-3" / weights)
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if lora:  # onto a fresh base (tiny-llama is built in code, so the adapter names no base to download)
        from peft import PeftModel

        from tiledmlp.train.models import load_model_and_tokenizer

        model = PeftModel.from_pretrained(load_model_and_tokenizer("tiny-llama", "float32", None)[0], out)
    else:
        model = AutoModelForCausalLM.from_pretrained(out)
    ids = tokenizer("tiles of tokens", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    assert not any("tiledmlp" in type(m.forward).__module__ for m in model.modules()
                   if "forward" in m.__dict__)


def test_eval_dataset_is_scored_by_the_tiled_loss_like_untiled(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``--eval_dataset``: evaluated at ``--eval_steps`` and after the last step, by the tiled loss under no-grad
    (no logits), with the eval losses of the untiled run; without ``--eval_strategy``, once after training."""
    import torch

    import tiledmlp.loss_patching as lp

    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(json.dumps({"text": f"held-out document {i}: " + "a page of long text " * 12}) + "\n"
                                for i in range(6)))
    no_grad_calls: list[bool] = []
    real = lp.tiled_causal_lm_loss
    monkeypatch.setattr(lp, "tiled_causal_lm_loss",
                        lambda *a, **kw: no_grad_calls.append(not torch.is_grad_enabled()) or real(*a, **kw))
    evals = ["--eval_dataset", str(held_out), "--eval_strategy", "steps", "--eval_steps", "2"]
    tiled = train(tmp_path, monkeypatch, *evals, name="tiled")
    plain = train(tmp_path, monkeypatch, *evals, "--use_tiled_mlp", "false", "--use_tiled_loss", "false",
                  name="plain")
    assert [e["step"] for e in tiled["evals"]] == [e["step"] for e in plain["evals"]] == [2, 3]
    sequences = no_grad_calls.count(True) // 2
    assert sequences >= 2 and no_grad_calls.count(False) == 3  # every eval sequence scored tiled, both times
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(tiled["evals"], plain["evals"])) <= 1e-5
    assert all(e["peak_bytes"] > 0 and abs(e["perplexity"] - math.exp(e["loss"])) < 1e-9 for e in tiled["evals"])
    assert_close_losses(tiled, plain)
    once = train(tmp_path, monkeypatch, "--eval_dataset", str(held_out), name="once")
    assert [e["step"] for e in once["evals"]] == [3]
    assert abs(once["evals"][0]["loss"] - tiled["evals"][-1]["loss"]) <= 1e-5
