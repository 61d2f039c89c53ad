"""Edges of the core a third review found: a weight changed in place between the forward and the backward (autograd
refuses that backward; the tiled Functions recomputed from the changed weight and returned wrong gradients)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import tiledmlp
from conftest import assert_rel
from tiledmlp.glu import GLUWeights
from tiledmlp.tiling import even_splits

F64 = torch.float64
H, I = 8, 12
INPLACE = "modified by an inplace operation"


def _llama() -> LlamaMLP:
    return LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=2)).to(F64)


def _generic(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    return tiledmlp.tiled_call(mlp, x, params=mlp.parameters(), num_shards=3)


def _glu(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    spec = GLUWeights(mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None, mlp.act_fn)
    return tiledmlp.glu_tiled_call(spec, x, even_splits(x.numel() // H, 3))


def _patched(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    tiledmlp.patch(mlp, num_shards=3)
    return mlp(x)


CALLS = {"untiled": lambda mlp, x: mlp(x), "tiled_call": _generic, "glu_tiled_call": _glu, "patch": _patched}
CASES = [(name, weight, x_grad) for name in CALLS for weight in ("gate_proj", "up_proj", "down_proj")
         for x_grad in (True, False) if name != "untiled" or x_grad]  # untiled keeps old activations without x.grad


@pytest.mark.parametrize("name,weight,x_grad", CASES, ids=str)
def test_a_weight_changed_in_place_before_the_backward_is_refused_like_untiled(name: str, weight: str,
                                                                               x_grad: bool) -> None:
    """Tiled, the backward recomputed each tile from the weights as they were at backward time: a step (or any
    in-place edit) between forward and backward silently gave the gradients of other weights, where the untiled
    backward raises autograd's in-place error (without x.grad untiled would use activations saved from the old
    weights: the tiled recompute cannot, so it refuses there too)."""
    call = CALLS[name]
    mlp = _llama()
    x = torch.randn(1, 7, H, dtype=F64, requires_grad=x_grad)
    out = call(mlp, x)
    with torch.no_grad():
        getattr(mlp, weight).weight.mul_(1.5)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()


@pytest.mark.parametrize("call", [_generic, _glu, _patched], ids=["tiled_call", "glu_tiled_call", "patch"])
def test_weights_changed_and_restored_between_steps_still_give_exact_grads(
        call: Callable[[LlamaMLP, torch.Tensor], torch.Tensor]) -> None:
    """A change after the backward (an optimizer step) is fine, and a retained graph backwards twice, exactly."""
    mlp = _llama()
    reference = _llama()
    x = torch.randn(2, 5, H, dtype=F64, requires_grad=True)
    g = torch.randn(2, 5, H, dtype=F64)
    for step in range(2):
        reference.load_state_dict(mlp.state_dict())
        want = torch.autograd.grad(reference(x), [x, *reference.parameters()], g)
        out = call(mlp, x)
        for _ in range(2):
            got = torch.autograd.grad(out, [x, *mlp.parameters()], g, retain_graph=True)
            for k, (a, b) in enumerate(zip(got, want)):
                assert_rel(a, b, 1e-12, f"step {step}, grad {k}")
        with torch.no_grad():
            for p in mlp.parameters():
                p.sub_(0.1 * p.sign())


def test_a_frozen_weight_changed_in_place_is_refused_on_the_glu_path() -> None:
    """The GLU path recomputes gate/up from frozen weights too (LoRA's base): a change to one is refused."""
    mlp = _llama()
    mlp.gate_proj.weight.requires_grad_(False)
    x = torch.randn(1, 7, H, dtype=F64, requires_grad=True)
    out = _glu(mlp, x)
    with torch.no_grad():
        mlp.gate_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()


def test_an_up_bias_without_up_weight_is_refused_by_name() -> None:
    """A fused ``gate_up`` spec given an ``up_bias`` had been accepted: the forward ignored the bias and its grad was
    uninitialised memory (6.9e-310 everywhere, say). Its bias belongs in ``gate_bias``."""
    gate_up = torch.randn(2 * I, H, dtype=F64, requires_grad=True)
    down = torch.randn(H, I, dtype=F64, requires_grad=True)
    up_bias = torch.randn(I, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match=r"Phi3MLP.gate_up_proj: up_bias was given without up_weight.*gate_bias"):
        GLUWeights(gate_up, None, None, up_bias, down, None, torch.nn.functional.silu, "Phi3MLP.gate_up_proj")


def test_a_fused_gate_up_with_its_bias_in_gate_bias_is_exact() -> None:
    """The accepted form: the fused bias (gate's values, then the up's) in ``gate_bias``, against plain ops."""
    gate_up = torch.randn(2 * I, H, dtype=F64, requires_grad=True)
    bias = torch.randn(2 * I, dtype=F64, requires_grad=True)
    down = torch.randn(H, I, dtype=F64, requires_grad=True)
    x = torch.randn(2, 5, H, dtype=F64, requires_grad=True)
    g = torch.randn(2, 5, H, dtype=F64)
    spec = GLUWeights(gate_up, bias, None, None, down, None, torch.nn.functional.silu)
    gate, up = torch.nn.functional.linear(x, gate_up, bias).chunk(2, dim=-1)
    want = torch.autograd.grad(torch.nn.functional.silu(gate) * up @ down.t(), [x, gate_up, bias, down], g)
    got = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, [4, 1, 5]), [x, gate_up, bias, down], g)
    for k, (a, b) in enumerate(zip(got, want)):
        assert_rel(a, b, 1e-12, f"grad {k}")


def test_params_passed_positionally_get_a_hint_to_pass_them_by_keyword() -> None:
    """``tiled_call(mlp, x, mlp.parameters())``: the generator (or a Parameter) lands in ``token_args``; the error
    says to pass the weights as ``params=``, not only that a token argument has the wrong shape."""
    mlp = torch.nn.Linear(4, 4)
    x = torch.randn(2, 3, 4, requires_grad=True)
    for wrong in (mlp.parameters(), mlp.weight):
        with pytest.raises(ValueError, match=r"token_args\[0\].*params=\.\.\."):
            tiledmlp.tiled_call(mlp, x, wrong, num_shards=2)
