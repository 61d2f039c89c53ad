"""Running ``tiledmlp train`` in-process on a tiny random Llama, for the test modules that train with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiledmlp.train.cli import main

TINY = ["--model", "tiny-llama", "--max_seq_length", "64", "--max_steps", "3", "--disable_tqdm", "true",
        "--save_strategy", "no", "--tiled_mlp_num_shards", "4"]


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """Tiny models run fastest on one thread, and the machine is shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str, name: str = "run") -> dict:
    """Run ``tiledmlp train`` in-process; return its JSON summary."""
    report = tmp_path / f"{name}.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report))
    rc = main([*TINY, "--output_dir", str(tmp_path / name), *flags])
    assert rc == 0
    return json.loads(report.read_text())


def losses(summary: dict) -> list[float]:
    return [summary["losses"][k] for k in sorted(summary["losses"], key=int)]


def assert_close_losses(a: dict, b: dict, tol: float = 1e-5) -> None:
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) > 0
    assert max(abs(x - y) for x, y in zip(la, lb)) <= tol, (la, lb)
