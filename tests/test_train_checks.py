"""``tiledmlp train``'s checks of things Trainer finds late or never: checkpoints that cannot really be resumed
(weights only, without their random state, another model, other LoRA settings), an ``--output_dir`` it cannot
write, float16 weights under Adam and a loss that stopped being a number, and split names on one data file."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from trainrun import TINY, one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.train.args import UsageError, parse_args
from tiledmlp.train.cli import compare_summaries, loss_diff_line, main


def _checkpoint(folder: Path, *files: str) -> Path:
    """A checkpoint folder with ``trainer_state.json`` and ``files`` (names; a trailing slash makes a folder)."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    for name in files:
        if name.endswith("/"):
            (folder / name).mkdir()
        else:
            (folder / name).write_text("")
    return folder


# --- 1. --save_only_model checkpoints --------------------------------------------------------------------------

def test_a_checkpoint_without_optimizer_or_scheduler_state_is_not_resumed(tmp_path: Path) -> None:
    """Trainer resumes a --save_only_model checkpoint with a fresh optimizer, schedule and random state, silently.
    Each backend's optimizer state counts: optimizer.pt, FSDP's optimizer.bin / optimizer_0 / per-rank files, and
    DeepSpeed's global_stepN folder (which also holds its scheduler)."""
    for files in (["optimizer.pt", "scheduler.pt"], ["optimizer.bin", "scheduler.pt"], ["optimizer_0/", "scheduler.pt"],
                  ["optimizer_0_rank0.bin", "optimizer_0_rank1.bin", "scheduler.pt"], ["global_step4/"]):
        folder = _checkpoint(tmp_path / "ok" / "-".join(files).replace("/", ""), *files, "rng_state.pth")
        assert parse_args(["--resume_from_checkpoint", str(folder)])[3].resume_from_checkpoint == str(folder)
    weights_only = _checkpoint(tmp_path / "out" / "checkpoint-2", "model.safetensors", "config.json")
    for value in (str(weights_only), "last"):
        with pytest.raises(UsageError, match=r"checkpoint-2 holds no optimizer state .*a --save_only_model true "
                                             r"checkpoint.*resume one saved without --save_only_model"):
            parse_args(["--resume_from_checkpoint", value, "--output_dir", str(tmp_path / "out")])
    no_scheduler = _checkpoint(tmp_path / "checkpoint-3", "optimizer.pt")
    with pytest.raises(UsageError, match=r"holds no learning-rate scheduler state \(scheduler.pt\)"):
        parse_args(["--resume_from_checkpoint", str(no_scheduler)])


def test_a_save_only_model_run_is_refused_when_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What Trainer really writes under --save_only_model true: refused, naming the flag (exit 2, before loading)."""
    flags = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--save_only_model", "true",
             "--save_final_model", "false"]
    train(tmp_path, monkeypatch, *flags, name="run")
    assert not (tmp_path / "run" / "checkpoint-2" / "optimizer.pt").exists()
    with pytest.raises(UsageError, match="--save_only_model"):
        parse_args([*TINY, *flags, "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "last"])


def test_a_checkpoint_without_its_random_state_is_not_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer resumes without the random state file it reads (rng_state.pth in one process, rng_state_<rank>.pth
    in each of several) with a fresh random state, and only logs it: dropout and random sampling then differ from
    the uninterrupted run. Refused before anything loads, each process asking only for the file it would read."""
    flags = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--save_final_model", "false"]
    train(tmp_path, monkeypatch, *flags, name="run")
    folder = tmp_path / "run" / "checkpoint-2"
    resume = [*TINY, *flags, "--max_steps", "3", "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint",
              "last"]  # one step left (a checkpoint at --max_steps has nothing to resume: test_user_journey.py)
    model_args, _, _, train_args = parse_args(resume)  # what Trainer wrote: whole
    (folder / "rng_state.pth").unlink()
    with pytest.raises(UsageError, match=rf"{re.escape(str(folder))} holds no random state \(rng_state.pth\): Trainer "
                                         r"would resume with a fresh one, and dropout and random sampling would differ "
                                         rf".*; copy it back .*, or start a new run from its weights with --model "
                                         rf"{re.escape(str(folder))}$"):
        parse_args(resume)
    for rank in (0, 1):  # what a run of two processes writes
        (folder / f"rng_state_{rank}.pth").write_bytes(b"")
    with pytest.raises(UsageError, match=r"holds no random state \(rng_state.pth\): .*; it holds rng_state_0.pth, "
                                         r"rng_state_1.pth instead, saved by a run of another number of processes"):
        parse_args(resume)
    from tiledmlp.train.resume_checks import validate_resume

    assert train_args.resume_from_checkpoint == str(folder)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under a launcher (parse_args would join its process group)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        validate_resume(train_args, model_args)
    (folder / "rng_state_0.pth").unlink()
    validate_resume(train_args, model_args)  # rank 1 reads only rng_state_1.pth
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match=r"holds no random state for process 0 of 2 \(rng_state_0.pth\): .*; copy it "
                                         r"back from where the checkpoint was saved"):
        validate_resume(train_args, model_args)
    (folder / "rng_state.pth").write_bytes(b"")  # a one-process run's
    with pytest.raises(UsageError, match=r"for process 0 of 2 \(rng_state_0.pth\): .*it holds rng_state.pth instead, "
                                         r"saved by a run of another number of processes"):
        validate_resume(train_args, model_args)


# --- 2. --output_dir ------------------------------------------------------------------------------------------

def test_an_output_dir_that_cannot_be_written_is_refused_before_training(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Trainer writes into --output_dir first at a save, possibly the final one: all training lost. The nearest
    existing folder must be writable and searchable. As root permissions do not apply, so os.access is made to
    answer as for a user there (denying only that folder); otherwise the folder is really read-only."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False if Path(path) == locked and
                            mode & os.W_OK else real(path, mode, *a, **k))
    assert not os.access(locked, os.W_OK | os.X_OK)
    try:
        for out in (locked, locked / "a" / "b"):
            with pytest.raises(UsageError, match=f"--output_dir {out}: cannot write in {locked} .*permission"):
                parse_args(["--output_dir", str(out)])
            assert main([*TINY, "--output_dir", str(out)]) == 2
            assert f"cannot write in {locked}" in capsys.readouterr().err
        parse_args(["--output_dir", str(tmp_path / "fine" / "deeper")])  # a writable ancestor: fine
        (tmp_path / "afile").write_text("")
        with pytest.raises(UsageError, match=f"--output_dir {tmp_path}/afile/out: {tmp_path}/afile is a file"):
            parse_args(["--output_dir", str(tmp_path / "afile" / "out")])
        with pytest.raises(UsageError, match="--output_dir is empty"):
            parse_args(["--output_dir", ""])
    finally:
        locked.chmod(0o755)


# --- 3. float16 weights and losses that are not finite ---------------------------------------------------------

def test_float16_weights_are_refused_under_adam() -> None:
    """Adam's eps rounds to 0 in float16: weights with tiny grads become 0/0 = NaN at the first step."""
    with pytest.raises(UsageError, match=r"--dtype float16 with --optim adamw_torch: Adam's eps \(1e-08\) rounds to "
                                         r"0 .*--dtype bfloat16.*--fp16 true"):
        parse_args(["--dtype", "float16"])
    parse_args(["--dtype", "float16", "--optim", "sgd"])  # no eps, no second moment
    parse_args(["--dtype", "float16", "--lora_r", "4"])  # PEFT keeps the trained adapters in float32
    parse_args(["--dtype", "bfloat16"])


def test_a_loss_that_is_not_finite_stops_the_run_unsaved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Trainer's logging_nan_inf_filter would log the NaN loss as a finite average (0.0000) and the run would save
    NaN weights and exit 0. Here the filter is off, the step line says so, and training stops at that step: no
    checkpoint there, no final model, exit 1."""
    assert parse_args([])[3].logging_nan_inf_filter is False
    out = tmp_path / "run"
    report = tmp_path / "run.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report))
    # a learning rate of 1e9 throws the weights past float32's range at step 1: step 2's loss is NaN
    rc = main([*TINY, "--max_steps", "4", "--learning_rate", "1e9", "--save_strategy", "steps", "--save_steps", "1",
               "--output_dir", str(out)])
    captured = capsys.readouterr()
    assert rc == 1
    assert "loss nan" in captured.out and "NOT FINITE: stopping" in captured.out
    assert "tiledmlp train: error: the training loss is nan at step 2: stopped there" in captured.err
    summary = json.loads(report.read_text())
    assert summary["non_finite_loss_step"] == 2 and summary["steps"] == 2
    assert math.isfinite(summary["losses"]["1"]) and math.isnan(summary["losses"]["2"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (out / "model.safetensors").exists()


def test_compare_does_not_read_a_nan_as_agreement() -> None:
    """max() over [0.0, nan] is 0.0: the NaN step must make the largest difference NaN and be named."""
    a = {"losses": {"1": 2.0, "2": float("nan")}, "peak_bytes": 400,
         "evals": [{"loss": 1.0}, {"loss": float("nan")}]}
    b = {"losses": {"1": 2.0, "2": float("nan")}, "peak_bytes": 100, "evals": [{"loss": 1.0}, {"loss": 3.0}]}
    out = compare_summaries(a, b)
    assert math.isnan(out["max_abs_loss_diff"]) and out["non_finite_steps"] == ["2"]
    assert math.isnan(out["max_abs_eval_loss_diff"])
    assert out["loss_diffs"]["1"] == 0.0


# --- 4. split names on one data file --------------------------------------------------------------------------

def test_one_data_file_takes_train_and_its_slices_only(tmp_path: Path) -> None:
    from tiledmlp.train.data import load_raw_text

    docs = [f"document {i}" for i in range(10)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert load_raw_text(str(data), "text")["text"] == docs
    assert load_raw_text(str(data), "text", "--eval_dataset", split="validation")["text"] == docs  # its default
    assert load_raw_text(str(data), "text", "--eval_dataset", split="train[90%:]")["text"] == docs[9:]
    assert load_raw_text(str(data), "text", split="train[:30%]")["text"] == docs[:3]
    assert load_raw_text(str(data), "text", split="train[2:4]")["text"] == docs[2:4]
    for flag, split_flag, split in (("--dataset", "--dataset_split", "test"),
                                    ("--eval_dataset", "--eval_split", "validation[:5%]")):
        with pytest.raises(UsageError, match=rf"{flag} {data} is one file, read as the split train, so {split_flag} "
                                             rf"{split.replace('[', '.').replace(']', '.')} names nothing"):
            load_raw_text(str(data), "text", flag, split=split)


# --- 5. resuming with another model or other LoRA settings -----------------------------------------------------

def test_resume_refuses_another_model_or_other_lora_settings(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer compares none of these: a different alpha or dropout trains on silently differently, other target
    modules or another model fail after loading, with a traceback."""
    save = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--save_final_model", "false",
            "--use_tiled_loss", "false"]
    lora = ["--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj,v_proj,down_proj"]
    train(tmp_path, monkeypatch, *save, *lora, name="lora")
    train(tmp_path, monkeypatch, *save, name="full")

    def resume(name: str, *flags: str) -> None:
        parse_args([*TINY, "--output_dir", str(tmp_path / name), "--resume_from_checkpoint", "last", *flags])

    resume("lora", *lora)
    resume("lora", *lora, "--lora_target_modules", "down_proj,v_proj,q_proj")  # the same modules
    resume("full")
    for flags, error in ((["--lora_alpha", "16"], r"trained with lora_alpha 8 \(adapter_config.json\), not 16; "
                                                  r"pass --lora_alpha 8"),
                         (["--lora_dropout", "0.1"], r"lora_dropout 0.0 .*, not 0.1; pass --lora_dropout 0.0"),
                         (["--lora_target_modules", "q_proj,v_proj"], r"holds LoRA adapters on down_proj,q_proj,v_proj "
                          r".*pass --lora_target_modules down_proj,q_proj,v_proj"),
                         (["--lora_target_modules", "all-linear"], r"--lora_target_modules down_proj,q_proj,v_proj"),
                         (["--model", "tiny-qwen3-moe"], r"a LoRA adapter of another model \(model.layers.0.mlp.down_"
                                                         r"proj: no such module in --model tiny-qwen3-moe\)")):
        with pytest.raises(UsageError, match=error):
            resume("lora", *lora, *flags)
    with pytest.raises(UsageError, match=r"holds a llama \(hidden size 64, 2 layers\) model \(config.json\), but "
                                         r"--model tiny-qwen3-moe is a qwen3_moe .*; pass the --model it was trained"):
        resume("full", "--model", "tiny-qwen3-moe")


def test_resume_refuses_other_data_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data position a checkpoint resumes at is counted in its own packed sequences: with another
    --max_seq_length (or dataset, split, column) it points at other samples, which Trainer never noticed."""
    from tiledmlp.train.data_record import DATA_RECORD

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"body": f"document {i} " * 40}) + "\n" for i in range(20)))
    data = ["--dataset", str(docs), "--text_field", "body"]
    train(tmp_path, monkeypatch, *data, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
          "--save_final_model", "false", name="run")
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / DATA_RECORD).read_text())
    assert saved["max_seq_length"] == 64 and saved["dataset"] == str(docs) and saved["text_field"] == "body"

    def resume(*flags: str) -> None:
        parse_args([*TINY, "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "last", *flags])

    monkeypatch.chdir(tmp_path)
    resume("--dataset", "docs.jsonl", "--text_field", "body")  # the same file, given relative
    with pytest.raises(UsageError, match=r"trained with --max_seq_length 64 .*not 32: its data position would "
                                         r"point at other samples; pass --max_seq_length 64"):
        resume(*data, "--max_seq_length", "32")
    with pytest.raises(UsageError, match=r"--text_field body .*not text"):
        resume("--dataset", str(docs))


# --- lesser: --fsdp_config file, ChatML's eos -------------------------------------------------------------------

def test_a_missing_fsdp_config_file_is_one_line(tmp_path: Path) -> None:
    """TrainingArguments opens the file itself: an OSError traceback before."""
    missing = tmp_path / "fsdp.json"
    with pytest.raises(UsageError, match=f"--fsdp_config {missing}: No such file or directory; pass an existing"):
        parse_args(["--fsdp", "full_shard", "--fsdp_config", str(missing)])


def test_a_deepspeed_or_fsdp_config_that_is_not_json_is_named(tmp_path: Path) -> None:
    """TrainingArguments reads these files itself: a trailing comma was "Expecting property name enclosed in double
    quotes: line 1 column 36 (char 35)", naming no file."""
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 2},}')
    for flag in ("--deepspeed", "--fsdp_config"):
        with pytest.raises(UsageError, match=f"^{flag} {re.escape(str(bad))} is not valid JSON: Expecting property "
                                             r"name .* \(char 35\); fix the file$"):
            parse_args([*TINY, "--output_dir", str(tmp_path / "run"), flag, str(bad),
                        *(["--fsdp", "full_shard"] if flag == "--fsdp_config" else [])])


def test_a_chatml_conversation_ends_with_one_eos() -> None:
    """ChatML renders each turn as ``...<|im_end|>\\n`` with ``<|im_end|>`` the eos: no second eos after the newline."""
    from datasets import Dataset

    from tiledmlp.train.data import pack
    from tiledmlp.train.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    eos = tokenizer.eos_token
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}" + eos + "\n{% endfor %}"
    chats = Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]] * 2})
    ids = [t for row in pack(chats, tokenizer, "messages", 4, 0)["input_ids"] for t in row]
    text = tokenizer.decode(ids)
    assert text.startswith(f"<|im_start|>hi{eos}\n<|im_start|>hi{eos}\n"), text
    assert text.count(eos) == 2, text


def test_the_loss_difference_line_stays_short() -> None:
    assert loss_diff_line({"1": 0.0, "2": 1e-6}) == "1:0.00e+00  2:1.00e-06"
    line = loss_diff_line({str(s): s * 1e-7 for s in range(1, 401)})
    assert line.split("  ") == ["1:1.00e-07", "2:2.00e-07", "3:3.00e-07", "4:4.00e-07", "...", "397:3.97e-05",
                                "398:3.98e-05", "399:3.99e-05", "400:4.00e-05"]


def test_a_tokenizer_without_eos_is_refused_before_the_weights_load(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The check ran after the weights had loaded (minutes for a large model)."""
    import transformers
    from tokenizers import Tokenizer, models

    from tiledmlp.train.models import load_model_and_tokenizer

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1},
                                                                                           unk_token="<unk>")))
    tok.save_pretrained(tmp_path / "model")

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(UsageError, match="the tokenizer has no eos token"):
        load_model_and_tokenizer(str(tmp_path / "model"))


# --- what Trainer checks only after loading: the optimizer, the seed, integrations, sizes ----------------------

def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize("flags, message", [
    (["--learning_rate", "-1"], r"--optim adamw_torch \(AdamW\) refuses the settings: Invalid learning rate: -1.0; "
                                "check --learning_rate"),
    (["--adam_beta1", "2"], "refuses the settings: Invalid beta parameter at index 0: 2.0"),
    (["--adam_epsilon", "-1"], "refuses the settings: Invalid epsilon value: -1.0"),
    (["--optim", "sgd", "--learning_rate", "-1"], r"--optim sgd \(SGD\) refuses the settings: Invalid learning rate"),
    (["--seed", "-1"], r"--seed must be in \[0, 2\*\*32 - 1\], got -1"),
    (["--dataloader_num_workers", "-1"], "--dataloader_num_workers must be >= 0, got -1"),
    (["--max_seq_length", "4000000000"], "--max_seq_length 4000000000 is 4,000,000,000 tokens a step, past the "
                                         "2,147,483,648 that tiledmlp plans and packs"),
    (["--per_device_train_batch_size", "100000000"], "x --per_device_train_batch_size 100000000 is 6,400,000,000 "
                                                     "tokens a step.* or a smaller --per_device_train_batch_size"),
    (["--tiled_mlp_target_gb", "inf"], "--tiled_mlp_target_gb must be a finite number > 0, got inf"),
    (["--save_strategy", "steps", "--save_steps", "0"], "--save_steps must be > 0 under --save_strategy steps"),
    pytest.param(["--optim", "adamw_bnb_8bit"], "--optim adamw_bnb_8bit: You need to install `bitsandbytes`",
                 marks=pytest.mark.skipif(_has("bitsandbytes"), reason="bitsandbytes is installed")),
    pytest.param(["--report_to", "wandb"], "--report_to wandb: WandbCallback requires wandb to be installed.*; or "
                 "pass --report_to none", marks=pytest.mark.skipif(_has("wandb"), reason="wandb is installed")),
])
def test_what_trainer_finds_after_loading_is_one_line_before(tmp_path: Path, flags: list[str], message: str) -> None:
    """Before 2026-11-27 these ran the model load and the packing, created --output_dir, and then stopped with a
    traceback (from torch's optimizer, ``set_seed``, the DataLoader, an integration's callback), or ran the host out
    of memory packing (``--max_seq_length 4000000000``: a 16 GB allocation)."""
    with pytest.raises(UsageError, match=message):
        parse_args([*TINY, "--output_dir", str(tmp_path / "run"), *flags])
    assert not (tmp_path / "run").exists()


def test_a_deepspeed_stage_that_is_not_0_to_3_is_named(tmp_path: Path) -> None:
    """It had reached the plan's ``Setup`` after the model loaded: "Setup.zero_stage must be 0, 1, 2 or 3" in a
    traceback. A stage written as a string DeepSpeed reads ("3") is taken, as ``tiledmlp plan --config`` takes it."""
    ds = tmp_path / "ds.json"
    for stage, ok in ((7, False), (-1, False), ("three", False), ("3", True), (2, True)):
        ds.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}))
        argv = [*TINY, "--output_dir", str(tmp_path / "run"), "--deepspeed", str(ds)]
        if ok:
            parse_args(argv)
        else:
            with pytest.raises(UsageError, match=f"--deepspeed {re.escape(str(ds))}: zero_optimization.stage must be "
                                                 f"0, 1, 2 or 3, got {re.escape(repr(stage))}"):
                parse_args(argv)


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 0}, "config.json's num_attention_heads must be a positive integer, got 0"),
    ({"num_hidden_layers": 0}, "config.json's num_hidden_layers must be a positive integer, got 0"),
    ({"hidden_size": 65}, "cannot .*: Class validation error for validator 'validate_architecture': ValueError: The "
                          r"hidden size \(65\) is not a multiple of the number of attention heads \(4\)"),
    ({"hidden_size": "64"}, "cannot .*: Validation error for field 'hidden_size': TypeError: Field 'hidden_size' "
                            "expected int, got str"),
])
def test_a_hand_written_config_with_impossible_sizes_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  change: dict, message: str) -> None:
    """A folder holding a config.json (and a tokenizer, for train): 0 heads or layers stopped plan and train with a
    ZeroDivisionError, a size the config's own validators refuse with huggingface_hub's errors, which are no
    ValueError (tracebacks until 2026-11-27)."""
    from tiledmlp.plan.cli import main as plan
    from tiledmlp.train.models import byte_tokenizer, load_model_and_tokenizer, tiny_llama_config

    config = tiny_llama_config().to_dict() | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    byte_tokenizer().save_pretrained(tmp_path)
    assert plan(["--model", str(tmp_path), "--seq", "1024"]) == 2
    assert re.search(f"tiledmlp plan: error: --model {re.escape(str(tmp_path))}: {message}", capsys.readouterr().err)
    with pytest.raises(UsageError, match=message):
        load_model_and_tokenizer(str(tmp_path))
