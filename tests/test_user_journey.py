"""What a new user runs from the README and docs, scaled to the tiny models: each test here failed before its fix."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import launch
import pytest
import torch
from trainrun import TINY, one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.train.args import UsageError, parse_args
from tiledmlp.train.cli import main


def test_resuming_a_finished_run_is_refused_not_trained_past_max_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Rerunning a finished command with ``--resume_from_checkpoint last`` resumed its last checkpoint, already at
    ``--max_steps``, and Trainer (which checks max_steps only after a step) trained one step more ("step 3/2")
    and overwrote the final model. It is one error line now; a larger ``--max_steps`` goes on."""
    flags = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--save_final_model", "false"]
    train(tmp_path, monkeypatch, *flags, name="run")
    out = tmp_path / "run"
    rc = main([*TINY, *flags, "--output_dir", str(out), "--resume_from_checkpoint", "last"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--resume_from_checkpoint {out / 'checkpoint-2'} is at step 2, and --max_steps is 2: nothing left " \
           "to train" in err
    assert not (out / "checkpoint-3").exists()
    more = [*TINY, "--max_steps", "3", "--output_dir", str(out), "--resume_from_checkpoint", "last"]
    assert parse_args(more)[3].resume_from_checkpoint == str(out / "checkpoint-2")


def test_plan_title_counts_a_tiny_models_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    """``tiledmlp plan --model <tiny local model>`` titled its table "(0M params": whole millions only."""
    from tiledmlp.plan.cli import main as plan_main

    assert plan_main(["--model", "tiny-llama", "--seq", "1024"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tiny-llama (0.12M params" in out and "(0M params" not in out


def test_resuming_a_run_at_its_last_epoch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The epoch form of the above: a checkpoint at the end of ``--num_train_epochs`` trained nothing and reported
    "final loss n/a, peak 0 MiB, 0 tok/s" with exit 0; more epochs go on."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "document {i} {"word " * 20}"}}\n' for i in range(3)))
    flags = ["--max_steps", "-1", "--num_train_epochs", "1", "--dataset", str(docs), "--save_strategy", "epoch",
             "--save_final_model", "false"]
    train(tmp_path, monkeypatch, *flags, name="run")
    out = tmp_path / "run"
    [last] = sorted(out.glob("checkpoint-*"))
    rc = main([*TINY, *flags, "--output_dir", str(out), "--resume_from_checkpoint", "last"])
    assert rc == 2
    assert f"--resume_from_checkpoint {last} is at epoch 1, and --num_train_epochs is 1: nothing left to train" \
        in capsys.readouterr().err
    more = [*TINY, *flags, "--num_train_epochs", "2", "--output_dir", str(out), "--resume_from_checkpoint", "last"]
    assert parse_args(more)[3].resume_from_checkpoint == str(last)


def _plain_process_env() -> dict[str, str]:
    """This environment without a launcher's variables: a command started plainly, offline, one thread."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _plain_process(tmp_path: Path, *target: str, script: str = "") -> subprocess.CompletedProcess:
    """``python target...`` (``script``: that source as the program, then ``target``'s arguments) started plainly."""
    if script:
        program = tmp_path / "program.py"
        program.write_text(script)
        target = (str(program), *target)
    return launch.run(launch.plain(*target), env=_plain_process_env(), timeout=300)


def test_deepspeed_config_runs_as_one_plain_process(tmp_path: Path) -> None:
    """``tiledmlp train --deepspeed ds.json`` started without a launcher (one GPU, or CPU) stopped in
    ``deepspeed.initialize`` with a traceback ending in ``No module named 'mpi4py'``: DeepSpeed looks for MPI where
    no launcher set RANK/WORLD_SIZE. It runs as one process now (a subprocess: DeepSpeed's state stays there)."""
    repo = Path(__file__).resolve().parents[1]
    done = _plain_process(tmp_path, "-m", "tiledmlp.cli", "train", *TINY, "--max_steps", "1", "--save_final_model",
                          "false", "--deepspeed", str(repo / "examples" / "ds_zero3.json"), "--output_dir",
                          str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mpi4py" not in done.stderr and "step    1/1  loss" in done.stdout


_ENGINE_SETTINGS = """
import sys
import deepspeed.runtime.engine as engine
real = engine.DeepSpeedEngine.__init__
def init(self, *args, **kwargs):
    real(self, *args, **kwargs)
    print(f"engine clipping {self.gradient_clipping()} accumulation {self.gradient_accumulation_steps()} "
          f"micro {self.train_micro_batch_size_per_gpu()} batch {self.train_batch_size()}", file=sys.stderr)
engine.DeepSpeedEngine.__init__ = init
from tiledmlp.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_deepspeed_config_without_batch_or_clipping_settings_takes_the_flags(tmp_path: Path) -> None:
    """A DeepSpeed config with only its ZeRO stage: the run stopped on DeepSpeed's batch-size assertion (a
    traceback), and with batch sizes given but no ``gradient_clipping`` DeepSpeed clipped at its own 1.0 whatever
    ``--max_grad_norm`` said (the Trainer leaves clipping to DeepSpeed; transformers fills only "auto" values).
    What the config leaves out is taken from the flags now, as "auto" would be (DeepSpeed works out the batch)."""
    bare = tmp_path / "bare.json"
    bare.write_text('{"zero_optimization": {"stage": 2}}')
    done = _plain_process(tmp_path, *TINY, "--max_steps", "1", "--save_final_model", "false", "--max_grad_norm", "0.3",
                          "--gradient_accumulation_steps", "2", "--deepspeed", str(bare), "--output_dir",
                          str(tmp_path / "run"), script=_ENGINE_SETTINGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine clipping 0.3 accumulation 2 micro 1 batch 2" in done.stderr, done.stderr[-3000:]
    assert "the DeepSpeed config leaves out train_micro_batch_size_per_gpu, gradient_accumulation_steps, " \
           "gradient_clipping: taken from --per_device_train_batch_size, --gradient_accumulation_steps, " \
           "--max_grad_norm" in done.stderr
    assert "step    1/1  loss" in done.stdout


_OUT_OF_MEMORY_ONCE = _ENGINE_SETTINGS.replace("from tiledmlp.train.cli import main", """
import torch
import transformers as tf
real_step = tf.Trainer.training_step
def step(self, model, inputs, *args, **kwargs):
    print(f"step on a batch of {len(inputs['input_ids'])}", file=sys.stderr)
    if not getattr(tf.Trainer, "failed", False):
        tf.Trainer.failed = True
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return real_step(self, model, inputs, *args, **kwargs)
tf.Trainer.training_step = step
from tiledmlp.train.cli import main""")


def test_auto_find_batch_size_retries_a_zero2_run_at_half_the_batch(tmp_path: Path) -> None:
    """``--auto_find_batch_size`` under DeepSpeed ZeRO-2: an out-of-memory error in the first step (injected) makes
    transformers build the engine again and the tiled run trains its steps at half the batch. (The engine's own
    micro-batch setting stays the first one: transformers fills the config's values once, then only "auto" ones.)"""
    config = tmp_path / "zero2.json"
    config.write_text('{"zero_optimization": {"stage": 2}}')
    done = _plain_process(tmp_path, *TINY, "--save_final_model", "false", "--deepspeed", str(config),
                          "--auto_find_batch_size", "true", "--per_device_train_batch_size", "2", "--output_dir",
                          str(tmp_path / "run"), script=_OUT_OF_MEMORY_ONCE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(re.findall("engine clipping", done.stderr)) == 2, done.stderr[-3000:]
    assert re.findall(r"step on a batch of (\d+)", done.stderr) == ["2", "1", "1", "1"], done.stderr[-3000:]
    assert "step    3/3  loss" in done.stdout and "4 tile(s) in each of 2 MLPs" in done.stdout


def test_auto_find_batch_size_under_zero3_is_one_line_before_anything_loads(tmp_path: Path) -> None:
    """transformers refuses the pair when the Trainer is made: a ValueError traceback after the model had loaded."""
    with pytest.raises(UsageError, match=re.escape(
            "--auto_find_batch_size: transformers does not retry a DeepSpeed ZeRO-3 run (examples/ds_zero3.json) at a "
            "smaller batch; use a ZeRO-1/2 config or FSDP")):
        parse_args([*TINY, "--deepspeed", "examples/ds_zero3.json", "--auto_find_batch_size", "true",
                    "--output_dir", str(tmp_path / "run")])


def test_a_multi_line_flag_error_from_transformers_is_reported_whole(tmp_path: Path) -> None:
    """``--load_best_model_at_end`` alone: transformers lists the two strategies on lines of their own, and the
    error said only "... except when --save_strategy="best", but found"."""
    with pytest.raises(UsageError) as caught:
        parse_args([*TINY, "--save_strategy", "steps", "--load_best_model_at_end", "true",
                    "--output_dir", str(tmp_path / "run")])
    assert str(caught.value).endswith('--save_strategy="best", but found: Evaluation strategy: IntervalStrategy.NO; '
                                      "Save strategy: SaveStrategy.STEPS"), str(caught.value)


def test_flags_the_trainer_refuses_together_are_one_line(tmp_path: Path) -> None:
    """transformers checks some pairs of flags only when the Trainer is made (``--fsdp`` with ``--deepspeed``,
    ``--save_only_model`` with ``--load_best_model_at_end`` under either): a ValueError traceback, exit code 1."""
    bare = tmp_path / "bare.json"
    bare.write_text('{"zero_optimization": {"stage": 2}}')
    done = _plain_process(tmp_path, "-m", "tiledmlp.cli", "train", *TINY, "--fsdp", "full_shard", "--deepspeed",
                          str(bare), "--output_dir", str(tmp_path / "run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "tiledmlp train: error: transformers' Trainer refuses these flags: Using --fsdp xxx together with " \
           "--deepspeed is not possible, deactivate one of those flags." in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_deepspeed_configs_own_settings_are_left_as_they_are(tmp_path: Path) -> None:
    from tiledmlp.train.checks import deepspeed_settings_from_flags

    own = tmp_path / "own.json"
    own.write_text('{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5, "train_batch_size": "auto", '
                   '"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": "auto"}')
    train_args = parse_args([*TINY, "--max_grad_norm", "0.5", "--deepspeed", str(own),
                             "--output_dir", str(tmp_path / "run")])[3]
    assert deepspeed_settings_from_flags(train_args) == []
    assert train_args.deepspeed_plugin.hf_ds_config.config["gradient_clipping"] == 0.5
    assert deepspeed_settings_from_flags(parse_args([*TINY, "--output_dir", str(tmp_path / "plain")])[3]) == []


def test_a_deepspeed_config_that_contradicts_a_flag_is_one_line_before_anything_loads(tmp_path: Path) -> None:
    """transformers compares them when training starts: a ValueError traceback after the model had loaded (and
    each contradiction listed twice)."""
    own = tmp_path / "own.json"
    own.write_text('{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5, "bf16": {"enabled": true}}')
    with pytest.raises(UsageError, match=re.escape(
            f"--deepspeed {own} disagrees with the flags (gradient_clipping=0.5 vs flag max_grad_norm=1.0; "
            "bf16.enabled=True vs flag bf16|bf16_full_eval=False): set those values to \"auto\" in the config, or "
            "pass the flags that match them")):
        parse_args([*TINY, "--deepspeed", str(own), "--output_dir", str(tmp_path / "run")])


def test_a_deepspeed_optimizer_or_scheduler_does_not_replace_a_flag_silently(tmp_path: Path) -> None:
    """With its own "optimizer" or "scheduler" DeepSpeed used those, and ``--optim sgd`` or ``--lr_scheduler_type
    constant`` trained with AdamW and WarmupLR without a word (read off the engine). Either the flag or the section."""
    own = tmp_path / "own.json"
    own.write_text('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, '
                   '"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}')
    run = ["--deepspeed", str(own), "--output_dir", str(tmp_path / "run")]
    for flag, value, section, kind in (("--optim", "sgd", "optimizer", "AdamW"),
                                       ("--lr_scheduler_type", "constant", "scheduler", "WarmupLR")):
        with pytest.raises(UsageError, match=re.escape(
                f"{flag} {value}, but the DeepSpeed config names its own {section} ({kind}), which DeepSpeed would "
                f'use instead: drop "{section}" from the config, or drop {flag}')):
            parse_args([*TINY, *run, flag, value])
    assert parse_args([*TINY, *run])[3].hf_deepspeed_config.config["optimizer"]["type"] == "AdamW"


def test_an_adapter_folder_as_model_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--model`` given a ``--lora_r`` run's output (adapter only): transformers loaded it onto its base with the
    adapter frozen and training died at the first backward with a RuntimeError traceback ("does not require
    grad"); ``tiledmlp plan`` said only that there was no model_type. Both name the base now."""
    from tiledmlp.plan.cli import main as plan_main
    from tiledmlp.train.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    base = tmp_path / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    train(tmp_path, monkeypatch, "--model", str(base), "--max_steps", "1", "--lora_r", "4", name="adapter")
    adapter = tmp_path / "adapter"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    capsys.readouterr()
    expected = f"--model {adapter} holds a LoRA adapter (adapter_config.json), not a model: pass its base, " \
               f"--model {base}"
    assert main([*TINY, "--model", str(adapter), "--output_dir", str(tmp_path / "again")]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
    assert plan_main(["--model", str(adapter)]) == 2
    assert expected in capsys.readouterr().err


def test_split_layers_refusal_names_the_cli_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``tiledmlp train --activation_offloading_split_layers true`` on layers that cannot split (GPT-2) ended with
    the Python API's hint, "pass split_layers=False", which is no flag of the command."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tiledmlp.train.models import byte_tokenizer

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=257, n_positions=128, bos_token_id=256,
                               eos_token_id=256)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    rc = main([*TINY, "--model", str(folder), "--use_tiled_loss", "false", "--activation_offloading", "true",
               "--activation_offloading_split_layers", "true", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "is exactly two residual halves" in err
    assert err.rstrip().endswith("drop --activation_offloading_split_layers")


@pytest.mark.parametrize("flags, error", [
    (["--max_steps", "0"], "--max_steps 0 would still train one step"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "--num_train_epochs 0 trains nothing"),
    (["--max_steps", "-5"], "--max_steps must be a positive number of steps, or -1 .* got -5"),
])
def test_a_run_of_no_steps_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                      error: str) -> None:
    """``--max_steps 0`` trained one step ("step 1/0") and saved it as the final model; ``--num_train_epochs 0``
    trained none and saved the untouched model as the final one, exit 0 both; ``--max_steps -5`` (any negative
    but -1) trained whole epochs."""
    assert main([*TINY, *flags, "--output_dir", str(tmp_path / "run")]) == 2
    assert re.search(f"tiledmlp train: error: {error}", capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("off", [["--activation_checkpointing", "false"], ["--gradient-checkpointing=false"]])
def test_offloading_with_checkpointing_turned_off_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             off: list[str]) -> None:
    """``--activation_offloading true`` turns checkpointing on (what it moves is what checkpointing keeps): an
    explicit ``--activation_checkpointing false`` beside it was overridden silently. Left out, it still is."""
    flags = [*TINY, "--activation_offloading", "true", "--output_dir", str(tmp_path / "run")]
    assert main([*flags, *off]) == 2
    assert "tiledmlp train: error: --activation_offloading moves what activation checkpointing keeps" \
        in capsys.readouterr().err
    assert parse_args(flags)[2].activation_offloading


def test_a_step_too_small_for_rss_gets_no_plan_ratio() -> None:
    """A tiny CPU run printed "plan/measured 0.12x" (3 MiB planned, 22 MiB of RSS growth: the allocator's and the
    libraries', not the step's), which read as a broken plan. Under 256 MiB an RSS peak gets no ratio; an
    allocator's peak (exact at any size) and a large RSS peak do."""
    from tiledmlp.plan import Setup
    from tiledmlp.train.fit import planned_vs_measured
    from tiledmlp.train.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("tiny-llama")
    setup = Setup(dtype=torch.float32, tiled_mlp=True, tiled_loss=True, device_type="cpu")
    lines = {(kind, peak): planned_vs_measured(model, setup, 64, 1, {"peak_bytes": peak, "peak_kind": kind}, 0)
             for kind in ("rss-hwm", "cuda-max-allocated") for peak in (20 * 2**20, 2**30)}
    assert lines["rss-hwm", 20 * 2**20].endswith("plan/measured n/a (a step under 256 MiB is below what RSS "
                                                  "resolves)")
    for key in (("rss-hwm", 2**30), ("cuda-max-allocated", 20 * 2**20), ("cuda-max-allocated", 2**30)):
        assert re.search(r"plan/measured \d+\.\d\dx$", lines[key]), lines[key]
