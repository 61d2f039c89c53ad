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
import transformers as tf
from trainrun import TINY, one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.train.cli import main

JOB = Path(__file__).resolve().parent / "distributed" / "_signal_job.py"


def test_a_signal_stops_after_the_step_with_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    real_step = tf.Trainer.training_step

    def step_that_gets_sigterm(self: tf.Trainer, *args: object, **kwargs: object) -> object:
        if self.state.global_step == 1:  # while step 2 runs
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, *args, **kwargs)

    out = tmp_path / "run"
    flags = [*TINY, "--max_steps", "5", "--output_dir", str(out)]  # --save_strategy no: the signal saves anyway
    monkeypatch.setattr(tf.Trainer, "training_step", step_that_gets_sigterm)
    assert main(flags) == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives only while training
    err = capsys.readouterr().err
    assert f"stopped by a signal after step 2 of 5: {out / 'checkpoint-2'} saved; add --resume_from_checkpoint last" \
        in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "model.safetensors").exists()  # not a finished run's final model

    monkeypatch.setattr(tf.Trainer, "training_step", real_step)
    report = tmp_path / "resumed.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report))
    assert main([*flags, "--resume_from_checkpoint", "last"]) == 0
    resumed = json.loads(report.read_text())
    whole = train(tmp_path, monkeypatch, "--max_steps", "5", name="whole")
    assert list(resumed["losses"]) == ["3", "4", "5"] and resumed["stopped_by_signal"] is False
    assert max(abs(resumed["losses"][s] - whole["losses"][s]) for s in ("3", "4", "5")) <= 1e-5
    assert (out / "model.safetensors").exists()


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    """DDP over 2 gloo processes; only rank 1 gets SIGUSR1. Rank 0 (which writes checkpoints) stops after the same
    step: checkpoint-2 and no later one; a rank that went on would have blocked in the next step's all-reduce."""
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "SIGNAL_RANK": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(launch.free_port()), str(JOB), *TINY, "--max_steps", "6", "--output_dir", str(out),
           "--ddp_backend", "gloo"]
    proc = launch.run(cmd, env=env, timeout=300)
    assert proc.returncode != 0, "a stopped run is not a finished one"
    assert "exitcode  : 143" in proc.stderr, proc.stderr[-3000:]  # torchrun's report of the first rank to exit
    assert f"stopped by a signal after step 2 of 6: {out / 'checkpoint-2'} saved" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
