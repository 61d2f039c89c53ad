"""Edge cases of tiled_causal_lm_loss: float16 gradients under loss scaling, and arguments refused up front."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from tiledmlp.loss import tiled_causal_lm_loss

LOSS_SCALE = 2.0**16  # GradScaler's and DeepSpeed's initial float16 loss scale


def _grads(h0: torch.Tensor, w0: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, autocast: bool,
           tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """d(loss * LOSS_SCALE) / d(hidden, weight), unscaled, in float64 (the untiled loss is transformers')."""
    h, w = h0.to(dtype, copy=True).requires_grad_(), w0.to(dtype, copy=True).requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        if tiled:
            loss = tiled_causal_lm_loss(h, w, y, num_shards=4)
        else:
            logits = F.linear(h, w).float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, w.shape[0]), y[:, 1:].reshape(-1))
    (loss * LOSS_SCALE).backward()
    return h.grad.double() / LOSS_SCALE, w.grad.double() / LOSS_SCALE


@pytest.mark.parametrize("autocast", [False, True], ids=["fp16-weights", "autocast-fp16"])
def test_float16_gradients_under_loss_scaling_are_no_worse_than_untiled(autocast: bool) -> None:
    """float16 training scales the loss (GradScaler, DeepSpeed) so that ``d loss / d logits`` (about
    ``softmax / tokens``, 5e-7 here) is not rounded to float16's subnormals. The tiled loss used to fold the mean's
    ``1 / tokens`` into its float16 logits gradient before the scale reached it, so ``d hidden`` lost that
    precision: 5.3x the untiled error (1.3e-3 vs 2.5e-4). The divisor now comes in the backward with the scale."""
    torch.manual_seed(0)
    tokens, vocab, width = 2048, 1024, 64
    h0 = torch.randn(1, tokens, width).half().double()
    w0 = (torch.randn(vocab, width) * 0.05).half().double()
    y = torch.randint(0, vocab, (1, tokens))
    ref = _grads(h0, w0, y, torch.float64, False, tiled=False)
    dtype = torch.float32 if autocast else torch.float16
    untiled = _grads(h0, w0, y, dtype, autocast, tiled=False)
    tiled = _grads(h0, w0, y, dtype, autocast, tiled=True)
    for name, t, u, r in zip(("hidden", "weight"), tiled, untiled, ref):
        assert rel_err(t, r) <= 1.5 * rel_err(u, r), f"{name}: tiled {rel_err(t, r):.2e} untiled {rel_err(u, r):.2e}"


def _args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(2, 5, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True), torch.randint(0, 7, (2, 5))


def test_an_infinite_softcap_is_refused_not_turned_into_nan() -> None:
    """``inf * tanh(z / inf)`` is ``inf * 0``: the loss was NaN with no word of why."""
    with pytest.raises(ValueError, match="logit_softcap must be a finite positive number"):
        tiled_causal_lm_loss(*_args(), logit_softcap=math.inf)


@pytest.mark.parametrize("items", ["8", True], ids=["str", "bool"])
def test_num_items_that_is_not_a_number_is_refused(items: object) -> None:
    """``float("8")`` and ``float(True)`` used to pass: a string or a flag in the divisor's place is a caller's
    mistake (True divided the summed loss by 1)."""
    with pytest.raises(TypeError, match="num_items_in_batch must be a number or a one-element tensor"):
        tiled_causal_lm_loss(*_args(), num_items_in_batch=items)


def test_uint8_labels_are_token_ids_and_shift_must_be_a_bool() -> None:
    """uint8 token ids (a vocabulary under 256) are labels like any integer ids: the same loss and grads as int64
    ones (before: torch's "value cannot be converted to type uint8_t" from padding them with ignore_index); a
    ``shift`` that is not a bool ("no") is refused rather than read as True."""
    h = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(200, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 200, (2, 7))
    want = tiled_causal_lm_loss(h, w, y, num_shards=3)
    got = tiled_causal_lm_loss(h, w, y.to(torch.uint8), num_shards=3)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="shift must be True"):
        tiled_causal_lm_loss(h, w, y, shift="no")
