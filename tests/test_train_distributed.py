"""The CPU twins of the GPU example configs, launched as the GPU ones are: ``torchrun --nproc_per_node 2 -m
tiledmlp.cli train --config ...`` with FSDP2 and with DeepSpeed ZeRO-3 (gloo, tiny Llama, 2 steps).

Each run's per-step losses must equal a plain-DDP run of the same flags with tiling off: sharding, tiled MLP,
tiled loss and activation checkpointing together change no number beyond float32 noise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(tmp_path: Path, name: str, *flags: str) -> dict:
    """Launch 2 CPU processes of ``tiledmlp train``; return rank 0's JSON summary."""
    report = tmp_path / f"{name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "TILEDMLP_TRAIN_REPORT": str(report)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "tiledmlp.cli", "train", *flags,
           "--output_dir", str(tmp_path / name), "--disable_tqdm", "true"]
    # Own session, so a timeout ends torchrun's workers too (killing torchrun alone would orphan them).
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun {name} did not finish in 420 s")
    errors = [line for line in stderr.splitlines() if "Error" in line or "error:" in line]
    assert proc.returncode == 0, "\n".join(errors[-10:]) or stderr[-3000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Plain DDP, no tiling, same model/data/optimizer flags as the twins (the twins' own YAML, minus sharding)."""
    return torchrun(tmp_path_factory.mktemp("ddp"), "ddp", "--config", str(EXAMPLES / "cpu" / "tiny-fsdp2.yaml"),
                    "--fsdp", "", "--use_tiled_mlp", "false", "--use_tiled_loss", "false")


@pytest.mark.parametrize("twin", ["tiny-fsdp2.yaml", "tiny-zero3.yaml"])
def test_cpu_twin_trains_like_ddp_untiled(twin: str, reference: dict, tmp_path: Path) -> None:
    out = torchrun(tmp_path, twin.split(".")[0], "--config", str(EXAMPLES / "cpu" / twin))
    assert out["steps"] == 2 and out["tiled_loss"] is True
    assert set(out["tiles"]) == {"model.layers.0.mlp", "model.layers.1.mlp"} and min(out["tiles"].values()) >= 2
    steps = sorted(reference["losses"], key=int)
    assert steps == sorted(out["losses"], key=int) == ["1", "2"]
    for step in steps:
        assert abs(out["losses"][step] - reference["losses"][step]) <= 1e-5, (out["losses"], reference["losses"])
