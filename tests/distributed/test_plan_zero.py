"""``tiledmlp plan --zero_stage``: the planned peak of a DeepSpeed ZeRO rank against its measured step (2 processes,
gloo; ``_plan_zero_job.py``).

Until 2026-11-29 the ZeRO terms were not measured, and these setups were planned at 0.70-0.95 of the rank (ZeRO-1's
optimizer step at 1.08): DeepSpeed steps a float32 copy of each rank's partition, of float32 weights too, with
float32 AdamW states whatever the weights' dtype and a float32 copy of the partition's grads at the step (the plan
had master weights for 16-bit weights only, states in the weights' dtype, the grads whole under ZeRO-1); ZeRO-3
holds its grads' partitions from the start and keeps parameters gathered from the forward into the backward up to
``stage3_max_live_parameters`` (the plan had two layers).
"""

from __future__ import annotations

from typing import Any

import pytest
from _common import assert_plan_matches
from _plan_zero_job import CHECKS
from test_backends import deepspeed_job

pytestmark = pytest.mark.slow

TOLERANCE = 0.05  # |plan / measured - 1|, as the FSDP checks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return deepspeed_job(tmp_path_factory, "_plan_zero_job.py", timeout=400)


@pytest.mark.parametrize("check", list(CHECKS))
def test_zero_plan_matches_the_measured_rank(results: dict[str, Any], check: str) -> None:
    assert_plan_matches(results[check], TOLERANCE)


def test_the_step_and_the_backward_are_told_apart(results: dict[str, Any]) -> None:
    """Over few tokens the optimizer step is the peak (float32 grads and AdamW's temporaries over the partition,
    ZeRO-3's gathered parameters released by then); over more, the loss's backward."""
    assert {results[c]["moment"] for c in CHECKS if c.startswith("step-")} == {"optimizer step"}
    assert results["weights-fp32-z3"]["moment"] == "loss backward"
