"""Review of the tiled loss against transformers' untiled one: what a long-context fine-tuner can hand it."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel
from models import build

from tiledmlp.loss import tiled_causal_lm_loss
from tiledmlp.loss_patching import patch_loss

V, H = 51, 16  # an odd vocabulary: the 16-bit weight grad's two row blocks differ in size


def _leaves(dtype: torch.dtype, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to(dtype, copy=True).requires_grad_() for t in ts]


def _untiled(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor, items: torch.Tensor
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' ``fixed_cross_entropy`` with ``num_items_in_batch``, in float64: the loss and its grads."""
    h64, w64, b64 = _leaves(torch.float64, h, w, b)
    shifted = F.pad(y, (0, 1), value=-100)[..., 1:]
    summed = F.cross_entropy(F.linear(h64, w64, b64).reshape(-1, V), shifted.reshape(-1), reduction="sum")
    loss = summed / items.double()
    loss.sum().backward()
    return loss.detach(), [h64.grad, w64.grad, b64.grad]


def _tiled(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor, items: torch.Tensor,
           dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    hd, wd, bd = _leaves(dtype, h, w, b)
    loss = tiled_causal_lm_loss(hd, wd, y, lm_head_bias=bd, num_shards=3, num_items_in_batch=items)
    loss.sum().backward()
    return loss.detach(), [hd.grad, wd.grad, bd.grad]


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-dim", "[1]", "[1,1]"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=["f64", "bf16", "f16"])
def test_num_items_in_batch_of_any_one_element_shape(shape: tuple[int, ...], dtype: torch.dtype,
                                                     kernels: str) -> None:
    """``num_items_in_batch`` may be any one-element tensor (Trainer's DataParallel path hands each replica a
    ``[1, 1]`` one; a custom loop may keep a dim when it counts labels). transformers' ``loss / num_items`` takes its
    shape; so does the tiled loss. A ``[1, 1]`` count used to crash the backward (a ``[V]`` bias grad, or a 16-bit
    weight's grad, scaled in place by a ``[1, 1]`` tensor: "output with shape [51] doesn't match the broadcast shape
    [1, 51]"). Float64: equal to the untiled loss and grads; 16-bit: bit-equal to the 0-dim count's."""
    h = torch.randn(2, 9, H, dtype=torch.float64).bfloat16().double()
    w = (torch.randn(V, H, dtype=torch.float64) * 0.5).bfloat16().double()
    b = torch.randn(V, dtype=torch.float64).bfloat16().double()
    y = torch.randint(0, V, (2, 9))
    y[0, :4] = -100
    items = torch.full(shape, 13.0)
    loss, grads = _tiled(h, w, b, y, items, dtype)
    if dtype == torch.float64:
        ref_loss, ref_grads = _untiled(h, w, b, y, items)
    else:
        ref_loss, ref_grads = _tiled(h, w, b, y, torch.tensor(13.0), dtype)
        ref_loss = ref_loss.reshape(shape)
    assert loss.shape == ref_loss.shape == shape
    tol = 1e-12 if dtype == torch.float64 else 0.0
    assert_rel(loss, ref_loss, tol, "loss")
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_rel(got, want, tol, name)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_sequence_parallel_shift_labels_with_another_ignore_index_float64() -> None:
    """A sequence-parallel shard's ``shift_labels`` (its last position's target is the next shard's first token, so
    they are not ``labels`` shifted) with ``ignore_index=7`` passed through the model, beside the whole sequence's
    ``labels`` (which then only say "compute a loss"): the float64 cross-entropy of the untiled model's logits, loss
    and every parameter's grad."""
    model = build("llama", torch.float64)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 24), generator=g)
    shift = torch.randint(0, 96, (2, 24), generator=g)
    shift[0, :6] = 7  # a masked prompt, under this ignore_index
    logits = model(input_ids=ids).logits
    ref = F.cross_entropy(logits.reshape(-1, 96), shift.reshape(-1), ignore_index=7)
    ref.backward()
    ref_grads = _grads(model)
    patch_loss(model, num_shards=3)
    whole = torch.cat([shift, shift], dim=1)
    out = model(input_ids=ids, labels=whole, shift_labels=shift, ignore_index=7)
    out.loss.backward()
    grads = _grads(model)
    assert out.logits is None and model.forward.last_used_tiled and grads.keys() == ref_grads.keys()
    assert_rel(out.loss, ref.detach(), 1e-12, "loss")
    for name, want in ref_grads.items():
        assert_rel(grads[name], want, 1e-12, name)


def test_shift_labels_of_the_wrong_shape_or_type_are_refused_by_that_name() -> None:
    """``shift_labels`` cut as ``labels[..., 1:]`` (one short) used to be refused as "labels must have shape (2, 24)"
    though the caller's ``labels`` had it; a list, as "labels must be a torch.Tensor". transformers' own forward
    fails there with a view error. Both now name ``shift_labels`` and the fix; ``inputs_embeds`` give the shape too."""
    model = build("llama", torch.float32)
    patch_loss(model)
    ids = torch.randint(0, 96, (2, 24))
    with pytest.raises(ValueError, match=r"shift_labels must have the input tokens' shape \(2, 24\), got "
                                         r"\(2, 23\): build them as labels\[\.\.\., 1:\] padded at the end with "
                                         r"ignore_index"):
        model(input_ids=ids, labels=ids, shift_labels=ids[:, 1:])
    with pytest.raises(TypeError, match="shift_labels must be a torch.Tensor of token ids, got list"):
        model(input_ids=ids, labels=ids, shift_labels=ids.tolist())
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match=r"shift_labels must have the input tokens' shape \(2, 24\), got \(2, 25\)"):
        model(inputs_embeds=embeds, labels=ids, shift_labels=F.pad(ids, (0, 1), value=-100))


def _peft_with_weight_tying() -> object:
    peft = pytest.importorskip("peft")
    if "ensure_weight_tying" not in inspect.signature(peft.LoraConfig).parameters:
        pytest.skip("this PEFT has no ensure_weight_tying")
    return peft


@pytest.mark.parametrize("adapter", ["ensure_weight_tying", "trainable_token_indices"])
def test_an_adapter_peft_puts_on_a_tied_head_is_refused_naming_the_fix(adapter: str) -> None:
    """Gemma-2 ties lm_head to embed_tokens. An adapter on embed_tokens with ``ensure_weight_tying`` (or trainable
    tokens) makes PEFT wrap lm_head too, and the refusal told the user to leave lm_head out of target_modules, where
    they never put it; it now names what did it and the setting that works (next test)."""
    peft = _peft_with_weight_tying()
    config = dict(ensure_weight_tying=dict(target_modules=["q_proj", "embed_tokens"], ensure_weight_tying=True),
                  trainable_token_indices=dict(target_modules=["q_proj"], trainable_token_indices=[1, 2, 3]))[adapter]
    model = peft.get_peft_model(build("gemma2", torch.float64), peft.LoraConfig(r=4, **config))
    with pytest.raises(ValueError, match=r"With tied embeddings PEFT puts one .* for an adapter on embed_tokens "
                                         r"\(ensure_weight_tying, trainable_token_indices\): train embed_tokens "
                                         r"through modules_to_save=\['embed_tokens'\] instead"):
        patch_loss(model)


def test_tied_head_with_embed_tokens_in_modules_to_save_float64() -> None:
    """The fix the refusal above names: ``modules_to_save=['embed_tokens']`` with ``ensure_weight_tying`` on a tied
    Gemma-2 (soft-capped) takes the tiled loss, float64-equal to the untiled logits' cross-entropy, every grad."""
    peft = _peft_with_weight_tying()
    model = peft.get_peft_model(build("gemma2", torch.float64), peft.LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True,
        init_lora_weights=False))
    ids = torch.randint(0, 96, (2, 24))
    logits = model(input_ids=ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1))
    ref.backward()
    ref_grads = _grads(model)
    assert patch_loss(model, num_shards=3) == 1
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = _grads(model)
    assert out.logits is None and grads.keys() == ref_grads.keys()
    assert_rel(out.loss, ref.detach(), 1e-12, "loss")
    for name, want in ref_grads.items():
        assert_rel(grads[name], want, 1e-12, name)
