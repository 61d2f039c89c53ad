"""``tiledmlp train`` stopped by SIGTERM or SIGUSR1 (what schedulers send before they kill a job): it finishes the
running step, saves a checkpoint on every rank after the same step, exits with code 143, and resuming
gives the losses of a run that was never stopped."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import launch
import pytest
import torch
import transformers as tf
from trainrun import TINY, one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.train.cli import main

JOB = Path(__file__).resolve().parent / "distributed" / "_signal_job.py"


REAL_STEP = tf.Trainer.training_step


def sigterm_during_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The process sends itself SIGTERM once, while optimizer step ``step`` runs (as a scheduler would)."""
    sent: list[int] = []

    def step_that_gets_sigterm(self: tf.Trainer, *args: object, **kwargs: object) -> object:
        if self.state.global_step == step - 1 and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return REAL_STEP(self, *args, **kwargs)

    monkeypatch.setattr(tf.Trainer, "training_step", step_that_gets_sigterm)


def test_a_signal_stops_after_the_step_with_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    flags = [*TINY, "--max_steps", "5", "--output_dir", str(out)]  # --save_strategy no: the signal saves anyway
    sigterm_during_step(monkeypatch, 2)
    assert main(flags) == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives only while training
    err = capsys.readouterr().err
    assert f"stopped by a signal after step 2 of 5: {out / 'checkpoint-2'} saved; add --resume_from_checkpoint last" \
        in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "model.safetensors").exists()  # not a finished run's final model
    assert main(flags) == 2  # the same command again, not resuming, would overwrite the checkpoint: refused
    assert f"--output_dir {out} already holds checkpoints of an earlier run (checkpoint-2)" in capsys.readouterr().err

    monkeypatch.setattr(tf.Trainer, "training_step", REAL_STEP)
    report = tmp_path / "resumed.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report))
    assert main([*flags, "--resume_from_checkpoint", "last"]) == 0
    resumed = json.loads(report.read_text())
    whole = train(tmp_path, monkeypatch, "--max_steps", "5", name="whole")
    assert list(resumed["losses"]) == ["3", "4", "5"] and resumed["stopped_by_signal"] is False
    assert max(abs(resumed["losses"][s] - whole["losses"][s]) for s in ("3", "4", "5")) <= 1e-5
    assert (out / "model.safetensors").exists()


def test_the_stop_checkpoint_is_whole_under_save_only_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop checkpoint is there to be resumed, so it keeps the optimizer, scheduler and random state even
    under --save_only_model true (weights alone resumed with a fresh AdamW: other losses); the flag still holds for
    the run's other checkpoints."""
    out = tmp_path / "run"
    flags = [*TINY, "--max_steps", "5", "--learning_rate", "1e-2", "--save_only_model", "true", "--output_dir",
             str(out)]
    sigterm_during_step(monkeypatch, 2)
    assert main(flags) == 143
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= {p.name for p in (out / "checkpoint-2").iterdir()}
    monkeypatch.setattr(tf.Trainer, "training_step", REAL_STEP)
    report = tmp_path / "resumed.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report))
    assert main([*flags, "--resume_from_checkpoint", "last", "--save_strategy", "steps", "--save_steps", "4"]) == 0
    resumed = json.loads(report.read_text())
    assert not (out / "checkpoint-4" / "optimizer.pt").exists()  # the run's own checkpoints: weights only, as asked
    whole = train(tmp_path, monkeypatch, "--max_steps", "5", "--learning_rate", "1e-2", name="whole")
    assert list(resumed["losses"]) == ["3", "4", "5"]
    assert max(abs(resumed["losses"][s] - whole["losses"][s]) for s in ("3", "4", "5")) <= 1e-5


def test_a_compare_phase_stops_on_a_signal_saving_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A --compare phase is a measurement: stopped by a signal it saves no checkpoint (one had made the next
    comparison into the same folder refuse to start)."""
    out = tmp_path / "untiled"
    monkeypatch.setenv("TILEDMLP_COMPARE_PHASE", "untiled")
    sigterm_during_step(monkeypatch, 2)
    assert main([*TINY, "--max_steps", "5", "--output_dir", str(out)]) == 143
    assert "stopped by a signal after step 2 of 5: a --compare phase, nothing saved" in capsys.readouterr().err
    assert not list(out.glob("checkpoint-*"))


def test_a_signal_to_compare_reaches_its_phase(tmp_path: Path) -> None:
    """SIGTERM to ``tiledmlp train --compare`` stops its running phase too (it had been left running, orphaned):
    the phase stops after its step, both processes exit 143, nothing is saved."""
    import subprocess

    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "tiledmlp.cli", "train", *TINY, "--max_steps", "100000", "--output_dir", str(out),
           "--compare", "true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:  # the phase's first step line: it is training
            lines.append(line)
            if line.lstrip().startswith("step"):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    text = "".join(lines) + rest
    assert proc.returncode == 143, text[-2000:]
    assert "a --compare phase, nothing saved" in text and "was stopped by a signal" in text, text[-2000:]
    assert not list(out.rglob("checkpoint-*"))


def test_the_stop_names_the_checkpoint_this_run_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Redoing steps 3 and 4 of a finished run from its checkpoint-2: a signal during step 3 saves checkpoint-3,
    which the message names with how to resume it (``last`` would pick the earlier run's checkpoint-4)."""
    out = tmp_path / "run"
    flags = [*TINY, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--output_dir", str(out)]
    assert main(flags) == 0
    sigterm_during_step(monkeypatch, 3)
    assert main([*flags, "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 143
    assert f"stopped by a signal after step 3 of 4: {out / 'checkpoint-3'} saved; add --resume_from_checkpoint " \
           f"{out / 'checkpoint-3'} to go on" in capsys.readouterr().err
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3


def test_a_signal_during_the_last_step_lets_the_run_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """After the last step there is nothing left to resume: the run ends as a finished one (its final model, exit
    0, no checkpoint of a step that would resume as "step 4 of 3") and says the signal came as it finished."""
    out = tmp_path / "run"
    sigterm_during_step(monkeypatch, 3)
    report = tmp_path / "run.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report))
    assert main([*TINY, "--output_dir", str(out)]) == 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert "SIGTERM came during the last step (3 of 3): the run finished instead of stopping" \
        in capsys.readouterr().err
    summary = json.loads(report.read_text())
    assert summary["steps"] == 3 and summary["stopped_by_signal"] is False
    assert (out / "model.safetensors").is_file() and not list(out.glob("checkpoint-*"))


def test_a_retried_batch_size_gives_back_the_handlers_found_before(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--auto_find_batch_size`` begins training again, with half the batch, after an out-of-memory error: the
    handlers put back at the end are the ones training found, not its own (which would swallow SIGTERM after)."""
    failed: list[int] = []

    def step_out_of_memory_once(self: tf.Trainer, *args: object, **kwargs: object) -> object:
        if not failed:
            failed.append(self.args.per_device_train_batch_size)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return REAL_STEP(self, *args, **kwargs)

    def before(signum: int, frame: object) -> None:
        """A handler that was there before the run."""

    monkeypatch.setattr(tf.Trainer, "training_step", step_out_of_memory_once)
    previous = signal.signal(signal.SIGTERM, before)
    try:
        summary = train(tmp_path, monkeypatch, "--auto_find_batch_size", "true", "--per_device_train_batch_size", "2")
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert failed == [2] and summary["steps"] == 3


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    """FSDP2 over 2 gloo processes (its checkpoint's collectives run on every rank); only rank 1 gets SIGUSR1. Rank 0
    (which writes checkpoints) stops after the same step: checkpoint-2, FSDP's, and no later one; a rank that went
    on would have blocked in the next step's all-gather. (DDP before 2026-11-29, which --fsdp was on CPUs then.)"""
    out = tmp_path / "fsdp2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "SIGNAL_RANK": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(launch.free_port()), str(JOB), *TINY, "--max_steps", "6", "--output_dir", str(out),
           "--fsdp", "--fsdp_config", '{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}']
    proc = launch.run(cmd, env=env, timeout=300)
    assert proc.returncode != 0, "a stopped run is not a finished one"
    assert "exitcode  : 143" in proc.stderr, proc.stderr[-3000:]  # torchrun's report of the first rank to exit
    assert f"stopped by a signal after step 2 of 6: {out / 'checkpoint-2'} saved" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert (out / "checkpoint-2" / "pytorch_model_fsdp.bin").exists()
