"""Single-process checks of the ZeRO-3 gradient landing, 0-token tiles and the tile-count agreement logic.

The 2-process tests (test_backends.py) prove these under real DeepSpeed; here each rule is pinned down in
float64 against an untiled reference, fast enough for every run.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp import distributed as tdist


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 20), nn.Linear(20, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _grads(mlp: nn.Module, x: torch.Tensor, out: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor | None]:
    out.backward(upstream)
    return [x.grad] + [p.grad for p in mlp.parameters()]


def _run(splits: list[int] | None, x_requires_grad: bool = True) -> tuple[torch.Tensor, list, list[bool]]:
    torch.manual_seed(0)
    mlp = _MLP().double()
    x = torch.randn(2, 8, 8, dtype=torch.float64, requires_grad=x_requires_grad)
    upstream = torch.randn(2, 8, 8, dtype=torch.float64)
    ready: list[bool] = []
    mlp.down.weight.register_post_accumulate_grad_hook(lambda p: ready.append(getattr(p, "ds_grad_is_ready", None)))
    params = list(mlp.parameters())
    out = mlp(x) if splits is None else tdist._zero3_tiled(mlp.forward, x, (), params, splits)
    return out, _grads(mlp, x, out, upstream), ready


@pytest.mark.parametrize("splits", [[5, 5, 6], [0, 0, 5, 5, 6], [16, 0]])
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_zero3_landing_exact_and_flags_only_last_tile_ready(splits: list[int], x_requires_grad: bool) -> None:
    want_out, want, _ = _run(None, x_requires_grad)
    out, got, ready = _run(splits, x_requires_grad)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=0)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    # DeepSpeed may reduce a grad only when its last part has landed: one True, and only at the end
    assert ready == [False] * (len(splits) - 1) + [True], ready


def test_zero3_landing_refuses_a_last_tile_that_misses_a_weight() -> None:
    w = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:  # uses w only for tiles of more than 4 tokens
        return t @ w if t.shape[0] > 4 else t * 2

    out = tdist._zero3_tiled(fn, x, (), [w], [5, 3])
    with pytest.raises(RuntimeError, match="last tile must reach every parameter"):
        out.sum().backward()
    assert w.ds_grad_is_ready is True  # the flag is restored even when the backward fails


def test_zero3_landing_token_args_and_tuple_outputs() -> None:
    """MoE-style: a float token arg (routing weights) needing grad, an int one, and a tuple output."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(10, 1, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 3, (10, 1))

    def fn(t: torch.Tensor, i: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = (t @ w) * g * (i + 1)
        return y, y.sum(-1, keepdim=True)

    up = torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 1, dtype=torch.float64)
    results = []
    for tiled in (False, True):
        for t in (x, gate, w):
            t.grad = None
        a, b = tdist._zero3_tiled(fn, x, (idx, gate), [w], [0, 4, 6]) if tiled else fn(x, idx, gate)
        torch.autograd.backward((a, b), up)
        results.append([a.detach(), b.detach(), x.grad, gate.grad, w.grad])
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_engine_handles_zero_token_tiles() -> None:
    """The padding tiles the agreement adds go through the generic engine unchanged."""
    torch.manual_seed(0)
    mlp = _MLP().double()
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(7, 8, dtype=torch.float64)
    mlp(x).backward(up)
    want = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    tiledmlp.tiled_call(mlp, x, params=mlp.parameters(), splits=[0, 0, 4, 3]).backward(up)
    for g, w in zip([x.grad] + [p.grad for p in mlp.parameters()], want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def test_agreement_one_collective_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """First forward: every module makes its first call, joins the first one's all-reduce; afterwards one
    all-reduce per forward, in forward order, checkpoint (reverse) order, and for two interleaved models."""
    agreement = tdist._TileAgreement()
    reduced: list[int] = []

    def fake_all_reduce(value: int, group: Any, device: torch.device) -> int:
        reduced.append(value)
        agreement.collectives += 1
        return value + 100  # "another rank had 100 more tokens"

    monkeypatch.setattr(agreement, "_all_reduce_max", fake_all_reduce)
    model_a, model_b = [nn.Linear(1, 1) for _ in range(4)], [nn.Linear(1, 1) for _ in range(3)]
    cpu = torch.device("cpu")

    def forward(modules: list[nn.Module], tokens: int) -> list[int]:
        return [agreement.max_tokens(m, tokens, None, cpu) for m in modules]

    assert forward(model_a, 10) == [110] * 4 and agreement.collectives == 1
    assert forward(model_a[::-1], 10) == [110] * 4 and agreement.collectives == 2  # checkpoint recompute
    assert forward(model_a, 20) == [120] * 4 and agreement.collectives == 3
    assert forward(model_b, 7) == [107] * 3 and agreement.collectives == 4  # a new model: its own forward
    assert forward(model_a, 30) == [130] * 4 and agreement.collectives == 5
    assert forward(model_b, 8) == [108] * 3 and agreement.collectives == 6
    assert reduced == [10, 10, 20, 7, 30, 8]


def test_zero3_detected_from_all_params_even_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen (e.g. LoRA base) ZeRO-3 MLP still takes the ZeRO-3 path: its per-tile gathers need agreement."""
    monkeypatch.setattr(tdist, "is_zero3_param", lambda p: hasattr(p, "ds_id"))
    torch.manual_seed(0)
    mlp = _MLP().double().requires_grad_(False)
    for k, p in enumerate(mlp.parameters()):
        p.ds_id = k  # what DeepSpeed marks a ZeRO-3 param with
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(8, 8, dtype=torch.float64)
    mlp(x).backward(up)
    want, x.grad = x.grad, None
    before = tdist.TILE_AGREEMENT.tiles_run
    tdist.run_tiled(mlp.forward, x, module=mlp, splits=[4, 4], plan=lambda n, t: [4, 4],
                    accumulate_dtype="auto").backward(up)
    assert tdist.TILE_AGREEMENT.tiles_run - before == 2, "did not take the ZeRO-3 path"
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-15)


def test_mixed_zero3_and_plain_params_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tdist, "is_zero3_param", lambda p: hasattr(p, "ds_id"))
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    a.ds_id = 0
    assert tdist.gradient_landing([b]) == "once" and tdist.gradient_landing([a]) == "zero3"
    with pytest.raises(RuntimeError, match="mixes ZeRO-3 partitioned and plain parameters"):
        tdist.gradient_landing([a, b])


def test_zero3_landing_refuses_unlisted_trainable_tensors() -> None:
    w, hidden = nn.Parameter(torch.randn(8, 8, dtype=torch.float64)), nn.Parameter(torch.randn(8, dtype=torch.float64))
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    out = tdist._zero3_tiled(lambda t: t @ w + hidden, x, (), [w], [3, 3])  # `hidden` not declared
    with pytest.raises(RuntimeError, match="not passed as params"):
        out.sum().backward()


def _fake_agreement(monkeypatch: pytest.MonkeyPatch, extra: int = 100) -> tuple[tdist._TileAgreement, list[int]]:
    """An agreement whose all-reduce answers "another rank had ``extra`` more tokens" and records what it sent."""
    agreement = tdist._TileAgreement()
    reduced: list[int] = []

    def fake_all_reduce(value: int, group: Any, device: torch.device) -> int:
        reduced.append(value)
        agreement.collectives += 1
        return value + extra

    monkeypatch.setattr(agreement, "_all_reduce_max", fake_all_reduce)
    return agreement, reduced


class _VisionMLP(nn.Linear):
    """A vision tower's MLP class, other than the text MLPs'."""


def test_agreement_per_token_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vision-language model: its vision tower's MLPs (another class) run first on 16 patches, then the text
    MLPs (of different widths: one stack all the same) on 600 tokens. Each stream gets its own all-reduce per
    forward, so the text MLPs are tiled for the text's tokens (before: every MLP reused the forward's first
    all-reduce, the vision tower's 16, and the text MLPs ran untiled under ZeRO-3). One class under another
    layer path (an encoder's and a decoder's MLPs) is kept apart by the names."""
    agreement, reduced = _fake_agreement(monkeypatch)
    vision, text = [_VisionMLP(2, 2) for _ in range(2)], [nn.Linear(4, width) for width in (4, 6, 8)]
    cpu = torch.device("cpu")

    def forward(text_tokens: int, order: int = 1) -> list[int]:
        calls = [(m, 16) for m in vision] + [(m, text_tokens) for m in text]
        return [agreement.max_tokens(m, n, None, cpu) for m, n in calls[::order]]

    assert forward(600) == [116, 116, 700, 700, 700] and agreement.collectives == 2
    assert forward(640) == [116, 116, 740, 740, 740] and agreement.collectives == 4
    assert forward(640, order=-1) == [740, 740, 740, 116, 116] and agreement.collectives == 6  # checkpoint recompute
    assert reduced == [16, 600, 16, 640, 640, 16]

    encoder, decoder = [nn.Linear(3, 3) for _ in range(2)], [nn.Linear(3, 3) for _ in range(2)]
    named = [(m, f"encoder.block.{i}.mlp", 50) for i, m in enumerate(encoder)]
    named += [(m, f"decoder.block.{i}.mlp", 9) for i, m in enumerate(decoder)]
    for _ in range(2):
        assert [agreement.max_tokens(m, n, None, cpu, name) for m, name, n in named] == [150, 150, 109, 109]
    assert agreement.collectives == 10


def test_agreement_warns_once_when_a_call_outgrows_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MLP that sees more tokens than the call its stream's count was agreed at gets tiles larger than planned:
    a warning (rank-local; the tile count stays the agreed one), once per module."""
    agreement, _ = _fake_agreement(monkeypatch, extra=0)
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    cpu = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match="layers.1.mlp got 30 tokens, more than the 10 its tile count"):
        assert [agreement.max_tokens(m, n, None, cpu, f"layers.{i}.mlp")
                for i, (m, n) in enumerate([(first, 10), (second, 30)])] == [10, 10]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert agreement.max_tokens(first, 10, None, cpu) == 10 and agreement.max_tokens(second, 30, None, cpu) == 10


def test_last_tile_count_is_the_agreed_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ZeRO-3 a rank runs the tile count the ranks agreed on, not its own plan, and reports that count;
    exact against the untiled MLP with the 0-token padding tiles it adds."""
    agreement, _ = _fake_agreement(monkeypatch, extra=8)  # the busiest rank: 8 tokens more than this one's 4
    monkeypatch.setattr(tdist, "TILE_AGREEMENT", agreement)
    monkeypatch.setattr(tdist, "is_zero3_param", lambda p: hasattr(p, "ds_id"))
    monkeypatch.setattr(tdist.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist.dist, "get_world_size", lambda group=None: 2)
    torch.manual_seed(0)
    mlp = _MLP().double()
    for k, p in enumerate(mlp.parameters()):
        p.ds_id = k
    x = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(1, 4, 8, dtype=torch.float64)
    want = [g.clone() for g in _grads(mlp, x, mlp(x), up)]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    plan = lambda n, t: tdist.even_splits(n, -(-n // 2))  # noqa: E731  (2-token tiles)
    out = tdist.run_tiled(mlp.forward, x, module=mlp, splits=plan(4, x), plan=plan, accumulate_dtype="auto")
    assert tdist.last_tile_count(mlp) == 6 and agreement.tiles_run == 6  # plan(12): 6 tiles, 2 of them empty
    for got, ref in zip(_grads(mlp, x, out, up), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-15)
