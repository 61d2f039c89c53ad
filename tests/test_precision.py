"""Case 9: 16-bit params accumulate per-tile weight grads in float32 and cast once."""

from __future__ import annotations

import pytest
import torch

import tiledmlp
from conftest import rel_err
from test_engine import H, Swiglu
from tiledmlp.recompute import GradSum


def _grads(mlp, x, grad_out, tiled, num_shards=8, **kw):
    params = list(mlp.parameters())
    fn = (lambda t: tiledmlp.tiled_call(mlp, t, params=params, num_shards=num_shards, **kw)) if tiled else mlp
    return torch.autograd.grad(fn(x), [x, *params], grad_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_case9_low_precision_error_no_worse_than_untiled(dtype):
    ref_mlp = Swiglu(dtype=torch.float64)
    mlp = Swiglu(dtype=dtype)
    mlp.load_state_dict({k: v.to(dtype) for k, v in ref_mlp.state_dict().items()})
    ref_mlp.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})  # same rounded weights
    x64 = torch.randn(2, 256, H, dtype=torch.float64)
    g64 = torch.randn(2, 256, H, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    ref = _grads(ref_mlp, x.detach().double().requires_grad_(), g64.to(dtype).double(), tiled=False)
    untiled = _grads(mlp, x, g64.to(dtype), tiled=False)
    tiled = _grads(mlp, x, g64.to(dtype), tiled=True)
    for k, (t, u, r) in enumerate(zip(tiled, untiled, ref)):
        assert t.dtype == dtype
        e_tiled, e_untiled = rel_err(t, r), rel_err(u, r)
        assert e_tiled <= 1.5 * e_untiled + 1e-6, f"grad {k}: tiled {e_tiled:.2e} vs untiled {e_untiled:.2e}"


def test_case9_accumulator_dtype_spy(monkeypatch):
    seen = []
    original = GradSum.__init__

    def spy(self, params, accumulate_dtype):
        original(self, params, accumulate_dtype)
        seen.extend(self.dtypes)

    monkeypatch.setattr(GradSum, "__init__", spy)
    mlp = Swiglu(dtype=torch.bfloat16)
    x = torch.randn(1, 64, H, dtype=torch.bfloat16, requires_grad=True)
    _grads(mlp, x, torch.randn_like(x), tiled=True)
    assert seen and all(d == torch.float32 for d in seen)
    seen.clear()
    _grads(mlp, x, torch.randn_like(x), tiled=True, accumulate_dtype=torch.bfloat16)
    assert seen and all(d == torch.bfloat16 for d in seen)
