"""Edges of tile planning and of the measurement helpers: huge counts, an int target past float range, a misspelt
``path``, ``env`` naming a variable the child already sets, rounds that cannot be run."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.bench.timing import time_interleaved
from tiledmlp.memory import tile_activation_bytes
from tiledmlp.measure import measure_in_subprocess, profiler_peak_bytes

MiB = 2**20


def _llama_mlp() -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=20, num_attention_heads=2, num_key_value_heads=1))


def test_an_int_target_gb_past_float_range_is_one_tile() -> None:
    """``target_gb * 2**30`` of a Python int past 1.8e308 bytes raised OverflowError (int to float) in plan_shards
    and in patch; a float that large was already one tile."""
    assert tiledmlp.plan_shards(10, target_gb=10**300, hidden_size=4, intermediate_size=8) == [10]
    assert tiledmlp.plan_shards(10, target_gb=10**400, hidden_size=4, intermediate_size=8) == [10]
    torch.manual_seed(0)
    ref = _llama_mlp().double()
    model = nn.ModuleDict({"mlp": copy.deepcopy(ref)})
    report = tiledmlp.patch(model, target_gb=10**300, norms=False)
    assert [p[0] for p in report.patched] == ["mlp"]
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    g = torch.randn(2, 6, 8, dtype=torch.float64)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).backward(g)
    model["mlp"](xt).backward(g)
    assert model["mlp"].forward.last_num_tiles == 1
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-14, atol=1e-14)
    for (name, p), q in zip(ref.named_parameters(), model["mlp"].parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-14, atol=1e-14, msg=name)


def test_an_int_target_gb_still_splits_where_it_does_not_fit() -> None:
    per_token = tile_activation_bytes(1, 4, 8, dtype=torch.float32)
    assert tiledmlp.plan_shards(2**30 // per_token * 3, target_gb=1, hidden_size=4, intermediate_size=8) \
        == [2**30 // per_token] * 3


@pytest.mark.parametrize("kw", [dict(num_shards=3), dict(hidden_size=4), dict(num_shards="auto", hidden_size=64,
                                                                                 intermediate_size=128),
                                dict(target_gb=1.0, hidden_size=4, intermediate_size=8)])
def test_a_misspelt_path_is_refused_whatever_the_plan(kw: dict) -> None:
    """``path`` was only checked where "auto" asked the planner (several tiles and a known intermediate size); a
    typo was accepted silently everywhere else."""
    with pytest.raises(ValueError, match="path must be 'glu' or 'generic'"):
        tiledmlp.plan_shards(10, path="generc", **kw)


def test_auto_tiles_stay_within_hidden_size_past_2_53_tokens() -> None:
    """``math.ceil(tokens / hidden)`` in floats dropped a tile past 2**53 tokens: tiles one token over the rule."""
    tokens, hidden = 2**60 + 1, 2**40
    splits = tiledmlp.plan_shards(tokens, hidden_size=hidden)
    assert len(splits) == 2**20 + 1 and sum(splits) == tokens and max(splits) <= hidden


def test_target_tiles_stay_within_the_target_past_2_53_tokens() -> None:
    per_token = tile_activation_bytes(1, 4, 8, dtype=torch.float32)
    tokens, per_tile = 2**60 + 1, 2**40
    target = per_tile * per_token / 2**30  # exactly 2**40 tokens per tile (a power of two: exact in a float)
    splits = tiledmlp.plan_shards(tokens, target_gb=target, hidden_size=4, intermediate_size=8)
    assert len(splits) == 2**20 + 1 and sum(splits) == tokens and max(splits) <= per_tile


def one_mib_step() -> object:
    """Child target: a step that allocates 1 MiB and frees it."""

    def step() -> None:
        t = torch.ones(MiB // 4)
        del t

    return step


def test_measure_in_subprocess_env_may_set_kineto_log_level() -> None:
    """``env={"KINETO_LOG_LEVEL": ...}`` raised ``TypeError: dict() got multiple values for keyword argument``."""
    here = os.path.dirname(__file__)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    result = measure_in_subprocess("test_tiling_edges:one_mib_step", env={"PYTHONPATH": path, "KINETO_LOG_LEVEL": "5"},
                                   rss=False, timeout=120)
    assert result == {"profiler_peak_bytes": MiB}
    assert profiler_peak_bytes(one_mib_step(), device="cpu") == MiB  # the same figure in this process


@pytest.mark.parametrize("kw,name,exc", [(dict(warmup=-1), "warmup", ValueError),
                                         (dict(repeat=0), "repeat", ValueError),
                                         (dict(repeat=True), "repeat", TypeError)])
def test_time_interleaved_refuses_rounds_it_cannot_run(kw: dict, name: str, exc: type) -> None:
    """A negative warmup silently took timed rounds away (repeat=5, warmup=-2: 3 timings); repeat=0 returned
    empty lists that median_ms then failed on; repeat=True ran one round."""
    calls: list[str] = []
    with pytest.raises(exc, match=f"{name} must be an int"):
        time_interleaved({"a": lambda: calls.append("a")}, device="cpu", **{"repeat": 3, "warmup": 1, **kw})
    assert calls == []  # refused before any step ran


def test_time_interleaved_without_warmup_times_every_round() -> None:
    calls: list[str] = []
    times = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeat=2, warmup=0,
                             device="cpu")
    assert calls == list("abba") and {n: len(v) for n, v in times.items()} == {"a": 2, "b": 2}
