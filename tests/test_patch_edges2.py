"""Edge cases of the patched norms: calls the unpatched module accepts must give the same result patched."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_rel
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tiledmlp.norms import TiledNormForward


def _run(norm: torch.nn.Module, x: torch.Tensor, name: str, tiles: int | None) -> tuple[torch.Tensor, ...]:
    norm = copy.deepcopy(norm)
    if tiles is not None:
        norm.forward = TiledNormForward(norm, tiles)
    x = x.clone().requires_grad_()
    y = norm(**{name: x})
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    y.backward(grad)
    if tiles is not None:
        assert norm.forward.last_num_tiles == tiles  # the keyword call is tiled, not passed through
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize(("cls", "name"), [(GemmaRMSNorm, "x"), (LlamaRMSNorm, "hidden_states")])
def test_norm_called_with_its_input_by_keyword_float64(cls: type, name: str) -> None:
    """``norm(x=t)`` works on Gemma's ``forward(self, x)``; patched it raised TypeError (the tiled forward's input
    was named ``hidden_states``). Now it is tiled, with the untiled output and grads."""
    gen = torch.Generator().manual_seed(0)
    norm = cls(16, eps=1e-3).double()
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
    x = torch.randn(2, 12, 16, dtype=torch.float64, generator=gen)
    ref = _run(norm, x, name, None)
    got = _run(norm, x, name, 3)
    for a, b, what in zip(ref, got, ("output", "input grad", "weight grad")):
        assert_rel(b, a, 1e-6, what)  # Gemma's forward computes in float32: its weight grad's tile sums round there


def test_norm_with_a_wrong_keyword_fails_as_unpatched() -> None:
    norm = GemmaRMSNorm(8)
    norm.forward = TiledNormForward(norm, 2)
    with pytest.raises(TypeError, match="hidden_states"):
        norm(hidden_states=torch.randn(2, 4, 8))
