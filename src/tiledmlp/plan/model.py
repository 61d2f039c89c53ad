"""The whole-step memory model: predicted peak device bytes of one training step, term by term.

A step is modelled as a handful of moments, and the peak is the largest (see ``docs/plan.md`` for every formula
and where it was measured):

- ``loss forward``: everything the layers saved for the backward + the loss's forward working set;
- ``loss backward``: the same saved tensors + the loss's backward working set;
- ``final norm backward``: the same, the head's gradients created, the final norm's backward working set;
- ``layer backward``: the first layer's backward (recompute + working set under checkpointing) with every other
  layer's saved tensors (or checkpointed inputs) still alive;
- ``last layer backward``: the last one's, with every layer's gradients created; offloaded, also the
  ``next-to-last layer backward`` (the last layer's input on its way back);
- ``optimizer step``: all gradients + the optimizer's temporaries; eager attention, probed: ``attention forward``.

Each moment adds the static part: weights, optimizer states (and ZeRO's float32 master weights), sharded as the
ZeRO stage says. Activation terms are bytes per token (times the tokens a rank holds), read off the tensors
autograd saves in transformers 5.23's Llama/Qwen3/Qwen3-MoE layers and checked against CPU profiler peaks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from ..loss import plan_loss_tiles
from ..memory import routed_tiling_pays
from ..norms import plan_norm_tiles
from ..offload import SHARED_MEMORY_DEVICES
from ..precision import NARROW_CHUNK, SplitSum, matmul_scratch
from ..split_layers import head_groups
from ..tiling import plan_shards
from .checks import ELEMENT_SIZES, check_accumulate, check_device_type, check_dtype, check_positive_int
from .layers import (_Act, _attention_backward_bytes, _attention_saved_per_token, _kv_width,
                     _eager_forward, _eager_probe, _eager_scores, _keeps_layer_input, _layer_saved_per_token,
                     _mlp_input, _norm, _norm_work, _post_norm, _tiled_mlp_work, lora_dropout_bytes)
from .setup import Prediction, Setup
from .shapes import ModelShape
from .sharding import (deepspeed_step_grads, fsdp_mixed_precision, fsdp_moments, grad_shards, optimizer_temporaries,
                       static_terms, zero_grad_buffer)

__all__ = ["Tiles", "predict_step_peak", "predict_with_tiles", "step_tiles", "norm_tiles", "planned_peak_for_model",
           "predict_loss_peak"]

_FUSED_DEVICES = ("cuda", "xpu")  # where the compiled tile kernels run by default (pointwise.fused_enabled)
_SIZE = ELEMENT_SIZES


def _sums(setup: Setup, w: int) -> int:
    """Bytes per element of the weight-grad sums over tiles: the weights' own with ``"param"`` (LoRA's trainable
    adapters are float32: theirs are float32 either way), else >= float32."""
    return w if setup.accumulate == "param" and not setup.lora_r else max(4, w)


def _scratch(setup: Setup) -> int:
    """Bytes per output element this machine's matmuls hold besides it, in the step's matmul dtype."""
    return matmul_scratch(torch.bfloat16 if setup.autocast else setup.dtype, setup.device_type)


def _loss_tiles(m: ModelShape, setup: Setup, t: int) -> list[int]:
    """The tiled loss's tiles as it plans them (compiled on CUDA/XPU: pointwise.fused_enabled's default)."""
    return plan_loss_tiles(t, m.vocab, fused=setup.device_type in _FUSED_DEVICES) if setup.tiled_loss else []


def _loss(m: ModelShape, a: _Act, setup: Setup, t: int, tile: int) -> tuple[int, int]:
    """Forward and backward working sets of the loss head (logits never saved past the forward); ``tile``: tokens
    of the tiled loss's largest tile."""
    h, v, w, s, r = m.hidden, m.vocab, a.w, a.s, a.r
    if not setup.tiled_loss:  # logits, their float32 copy, log_softmax / its saved output and grads in and out
        return t * v * (s + (4 if s < 4 else 0) + 4), 12 * t * v
    fused = setup.device_type in _FUSED_DEVICES
    acc = _sums(setup, w)
    dw = 0 if a.lora else acc * v * h  # the frozen head of a LoRA model gets no dW
    kept = r * t * h + dw  # d hidden and d W computed in the forward, held to the backward
    # One tile: its rows of hidden, its logits (eager: float32 + their 16-bit copy; compiled: the logits alone,
    # overwritten by their gradient), then its dh product and that product's cast, or (where matmuls cannot write
    # float32 products of 16-bit operands: off CUDA) its rows upcast for the float32 dW product.
    per_logit = s if fused else 4 + (s if s < 4 else 0)
    upcast = acc if dw and acc != s and r != acc and setup.device_type != "cuda" else 0
    # where this CPU's 16-bit matmuls form their products in float32 buffers (precision.matmul_scratch): the
    # logits', dh's, and 16-bit sums' dW (its products in row blocks: precision.acc_mm)
    sc = _scratch(setup)
    dw_scratch = sc * min(NARROW_CHUNK, v * h) if dw and acc == s else 0
    fwd = kept + tile * h * r + max(tile * v * per_logit + tile * h * max(s + max(sc, r if r != s else 0), upcast),
                                    tile * v * (s + sc), tile * v * per_logit + dw_scratch)
    if a.autocast:  # nothing saves the final norm's float32 output, but it is the loss's input: alive
        fwd += (r - s) * t * h
    # Backward: dh scaled in place (16-bit eagerly: through float32 chunks), then dW handed over in place: scaled
    # when summed in the weight's dtype, else narrowed into the float32 sum's own memory (precision.SplitSum),
    # with a few small temporaries.
    dh_temp = 4 * min(NARROW_CHUNK, t * h) if r < 4 and not fused else 0
    dw_temp = SplitSum.temp_bytes((v, h), acc, w, setup.device_type) if not a.lora and acc != w else 0
    return fwd, kept + max(dh_temp, dw_temp)


def predict_loss_peak(tokens: int, hidden: int, vocab: int, *, dtype: torch.dtype = torch.bfloat16,
                      device_type: str = "cuda", accumulate: str = "auto") -> int:
    """Predicted peak bytes, above its inputs, of one ``tiled_causal_lm_loss`` forward + backward alone (every
    token labelled, hidden states and head trainable): the loss moments of :func:`predict_step_peak`.
    ``accumulate``: ``"auto"`` or ``"param"``, as the loss's ``accumulate_dtype``."""
    for name, value in (("tokens", tokens), ("hidden", hidden), ("vocab", vocab)):
        check_positive_int(name, value)
    check_dtype("dtype", dtype)
    check_device_type("device_type", device_type)
    check_accumulate("accumulate", accumulate)
    w = _SIZE[dtype]
    m = ModelShape("", 0, hidden, 0, 0, 0, 0, vocab, "sdpa", False, 0, 0, vocab * hidden, 0)
    setup = Setup(dtype=dtype, tiled_loss=True, device_type=device_type, accumulate=accumulate)
    tile = max(_loss_tiles(m, setup, tokens))
    return max(_loss(m, _Act(s=w, r=w, w=w, autocast=False, lora=0, act=w), setup, tokens, tile))


@dataclass(frozen=True)
class Tiles:
    """What a step's plan reads of its tile plans at one length: the RMSNorms' tiles and the rows of the largest,
    the MLP's tiles (None: untiled) and the tokens of its last, the tiled loss's tiles and the tokens of its
    largest, attention's head groups under split layers. :mod:`tiledmlp.plan.search` hands in lower bounds."""

    norm_tiles: int
    norm_rows: int
    mlp: list[int] | None
    mlp_last: int
    loss_tiles: int
    loss_rows: int
    head_groups: int


def step_tiles(m: ModelShape, setup: Setup, seq: int, batch: int = 1) -> Tiles:
    """The tile plans of one step over ``batch`` sequences of ``seq`` tokens, as ``patch()`` and the tiled loss
    make them (one MLP tile = untiled)."""
    sp, s = setup.sequence_parallel_size, 2 if setup.autocast else _SIZE[setup.dtype]
    t, h = batch * seq // sp, m.hidden
    norm_rows = norm_tiles(m, setup, t)
    act = m.ungated_activation(_activation_size(m, setup))
    splits = plan_shards(t, num_shards=setup.mlp_num_shards, hidden_size=h,
                         intermediate_size=(m.moe_intermediate if m.moe_experts else m.intermediate) or None,
                         dtype=torch.float32 if s == 4 else torch.bfloat16,
                         target_gb=setup.mlp_target_gb, path="generic" if _generic(m, setup) else "glu",
                         weight_dtype=torch.float32 if setup.autocast else None, device_type=setup.device_type,
                         top_k=m.moe_top_k or None, activation=act, lora=(_SIZE[setup.dtype] < 4,
                         sum(m.mlp_linear_in) if setup.lora_dropout else 0) if setup.lora_r else None,
                         kernels="compiled" if setup.device_type in _FUSED_DEVICES else "eager") \
        if setup.tiled_mlp else None
    if splits and len(splits) > 1 and m.moe_experts and setup.mlp_num_shards == "auto" and \
            setup.mlp_target_gb is None and not _experts_pay(m, setup, splits, s):
        splits = [t]  # as patch(): auto does not tile experts whose weight-grad sums outweigh the tiles
    mlp = splits if splits and len(splits) > 1 else None
    loss = _loss_tiles(m, setup, t)
    groups = head_groups(m.heads // sp if m.heads % sp == 0 else m.heads, max(m.kv_heads // sp, 1), seq) \
        if setup.offload and setup.split_layers and m.attn_impl == "sdpa" else 1
    return Tiles(len(norm_rows), max(norm_rows), mlp, mlp[-1] if mlp else 0, len(loss), max(loss or [0]), groups)


def _experts_pay(m: ModelShape, setup: Setup, splits: list[int], itemsize: int) -> bool:
    """``memory.routed_tiling_pays`` for the model's experts (gate|up and down: ``3 E H I`` elements, trained
    unless LoRA trains adapters instead)."""
    w = _SIZE[setup.dtype]
    per_expert = m.hidden * m.moe_intermediate
    summed = 0 if setup.lora_r else 3 * m.moe_experts * per_expert
    acc = w if setup.accumulate == "param" or w >= 4 else 4
    return routed_tiling_pays(sum(splits), max(splits), m.hidden, m.moe_intermediate, m.moe_top_k,
                              itemsize=itemsize, weight_itemsize=w, sum_itemsize=acc, summed=summed,
                              largest=2 * summed // 3)


def norm_tiles(m: ModelShape, setup: Setup, tokens: int) -> list[int]:
    """Rows per tile of ``patch()``'s row-tiled RMSNorms (untiled under ZeRO-3, whose partitioned weights they
    leave alone, and LayerNorms, which it never tiles)."""
    tiled = setup.tiled_mlp and setup.tiled_norms and setup.zero_stage < 3 and m.norms.row_tiled
    return plan_norm_tiles(tokens, m.hidden) if tiled else [tokens]


def _activation_size(m: ModelShape, setup: Setup) -> int:
    """The element size the MLP's activation runs in: the matmuls' outputs', or under autocast its output's on the
    device (float32 for GPT-2's tanh GELU on CUDA), as ``patch()`` checks at the call."""
    s = 2 if setup.autocast else _SIZE[setup.dtype]
    return m.activation_size(s, setup.device_type if setup.autocast else None)


def _generic(m: ModelShape, setup: Setup) -> bool:
    """Whether ``patch()`` tiles the MLP with the generic engine: experts and MLPs the GLU engine does not read
    (GPT-2's, GPT-NeoX's), or over 4-bit weights under autocast (``quantized.reads_exactly``). LoRA-wrapped ones
    take the GLU path, dropout and all (adapters.py), 4-bit ones elsewhere too (quantized.py), FSDP2's included."""
    return bool(m.moe_experts or not m.mlp_fast_path or (setup.load_in_4bit and setup.autocast))


def predict_step_peak(m: ModelShape, setup: Setup, seq: int, *, batch: int = 1) -> Prediction:
    """Predicted peak bytes on one device of one steady-state training step over ``batch`` sequences of ``seq``."""
    check_positive_int("seq", seq)
    check_positive_int("batch", batch)
    if not isinstance(setup, Setup):
        raise TypeError(f"setup must be a tiledmlp.plan.Setup, got {type(setup).__name__}")
    if seq % setup.sequence_parallel_size:
        raise ValueError(f"seq {seq} is not divisible by sequence_parallel_size {setup.sequence_parallel_size}")
    return predict_with_tiles(m, setup, seq, batch, step_tiles(m, setup, seq, batch))


def predict_with_tiles(m: ModelShape, setup: Setup, seq: int, batch: int, tiles: Tiles) -> Prediction:
    """:func:`predict_step_peak` with the tile plans given: it rises with ``seq`` and with each tile's size."""
    if setup.fsdp and setup.autocast:  # accelerate's FSDP mixed precision: a bf16 step over float32 shards
        moments = _moments(m, _bf16_step(setup), seq, batch, tiles, mixed=True)
        fsdp_mixed_precision(moments, static_terms(m, replace(setup, autocast=False), 4)[0], bool(setup.lora_r))
    else:
        moments = _moments(m, setup, seq, batch, tiles)
    name, terms = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    return Prediction(sum(terms.values()), name, terms)


def _bf16_step(setup: Setup) -> Setup:
    """``setup``'s step as FSDP's bf16 mixed precision makes it: a bf16 model's (its float32 shards are added by
    :func:`fsdp_mixed_precision`). Over a 4-bit base no Setup a user could ask for (PEFT's preparation leaves its
    other weights float32, ``checks.check_setup``), so this copy is not checked again."""
    step = copy.copy(setup)  # a frozen dataclass's copy: no __post_init__
    object.__setattr__(step, "dtype", torch.bfloat16)
    object.__setattr__(step, "autocast", False)
    return step


def _moments(m: ModelShape, setup: Setup, seq: int, batch: int, tiles: Tiles, mixed: bool = False
             ) -> dict[str, dict[str, int]]:
    """Every moment of the step that may be its peak, each as its named terms (bytes); ``mixed``: the bf16 step of
    FSDP's mixed precision (:func:`_bf16_step`), its LoRA adapters gathered in bf16 too."""
    sp, ws = setup.sequence_parallel_size, setup.world_size
    t = batch * seq // sp  # tokens on this rank outside attention (Ulysses)
    w = _SIZE[setup.dtype]
    h = m.hidden
    drop = lora_dropout_bytes(setup.device_type) if setup.lora_r and setup.lora_dropout else 0
    a = _Act(s=2 if setup.autocast else w, r=4 if setup.autocast else w, w=w, autocast=setup.autocast,
             lora=setup.lora_r, act=_activation_size(m, setup), norm_tiled=tiles.norm_tiles > 1, drop=drop,
             lora_w=2 if mixed else 4, sp=sp)
    s, s_res = a.s, a.r
    static, grads_all, trainable = static_terms(m, setup, w)
    # learned position embeddings' grads (GPT-2's wpe) are made after every layer's backward: not in those moments
    # (none under ZeRO-3, whose grads' partitions are static: max keeps GPT-2's there at 0)
    layer_grads = max(0, grads_all - (0 if setup.lora_r else m.position_params * w) // grad_shards(setup))
    v, L = m.vocab, m.num_layers
    generic, splits = _generic(m, setup), tiles.mlp
    tiled_mlp = splits is not None
    saved = _layer_saved_per_token(m, a, tiled_mlp) * t
    heads = m.heads // sp if m.heads % sp == 0 else -(-m.heads // sp)
    eager = _eager_probe(m, a)  # probed: the mask and ALiBi bias as the layers get them, and their forward
    units = batch * heads * seq * seq if m.attn_impl == "eager" else 0  # one layer's [heads, seq, seq] elements
    if eager and eager.saved is not None:  # as probed (XGLM's clamp saves its masked scores too)
        scores = int(units * eager.saved)
    else:
        scores = batch * _eager_scores(seq, s, heads) if units else 0
    saved += scores
    # sdpa's float mask of a sliding-window layer (the layer planned for stands for one of them: the worst case)
    sliding, mask = m.sliding[1], m.sliding_mask_bytes(seq, batch, s)
    saved += mask
    if tiled_mlp and not setup.checkpointing and not generic:
        saved += 2 * tiles.mlp_last * m.intermediate * s  # the last tile's gate/up kept from the forward
    # CPU and MPS memory is the host's: offloading moves nothing there, and split layers keep two inputs a layer
    moved = setup.offload and setup.device_type not in SHARED_MEMORY_DEVICES
    split = setup.offload and setup.split_layers
    if setup.checkpointing:
        layers = {"checkpointed_inputs": 0 if moved else (2 if split else 1) * L * s_res * h * t}
        if scores:  # eager's [batch, 1, seq, seq] causal mask is an input of every checkpointed layer: kept
            layers["checkpointed_mask"] = eager.inputs(batch, seq) if eager else batch * seq * seq * s_res
        elif mask:  # the sliding layers' boolean mask, likewise
            layers["checkpointed_mask"] = batch * seq * seq
    else:  # every layer's saved tensors, the float mask in the sliding layers only
        layers = {"saved_activations": L * saved - (L - sliding) * mask}
    other_layers = {k: n - (0 if setup.checkpointing else saved) for k, n in layers.items()}
    if moved:  # the layer being recomputed has its input back on the device (the next one's on its way:
        # in the layer's backward terms below)
        other_layers["restored_input"] = s_res * h * t
    # Shared by every layer: ids, labels, positions (int64), RoPE cos/sin; the final norm's saved tensors.
    inputs = t * (8 * 4 + 2 * m.head_dim * s)
    shared = inputs + _norm(m, 1, a, consumed=not a.lora) * t
    loss_fwd, loss_bwd = _loss(m, a, setup, t, tiles.loss_rows)

    # One layer's backward, at its two widest points. Autograd frees a layer's saved tensors node by node (and
    # non-reentrant checkpointing drops each recomputed tensor once unpacked), so at the attention backward the
    # MLP's and the second norm's saved tensors are gone. Both points hold the gradient flowing down the
    # residual stream. Under checkpointing the layer's input is both checkpointed and saved by its first norm
    # when the residual stream is float32: counted once.
    flow = s_res * h * t
    dup = s_res * h * t if setup.checkpointing and _keeps_layer_input(m, a) else 0
    if tiled_mlp and not m.moe_experts:
        mlp_work = _tiled_mlp_work(m, a, t, splits, generic, _sums(setup, w), setup.dtype, setup.device_type)
    elif tiled_mlp:  # experts: the generic engine per tile over the routed copies (k per token); per-tile expert
        # weight grads (fitted: 2 per expert weight's size, CPU profiler, Qwen3-MoE fp32/bf16)
        k, i, tile = m.moe_top_k, m.moe_intermediate, max(splits)
        mlp_work = 2 * s * t * h + s * tile * k * (6 * i + 3 * h) + 2 * s * m.moe_experts * h * i
    elif m.moe_experts:
        mlp_work = 2 * s * t * m.moe_top_k * m.moe_intermediate + s * t * m.moe_top_k * h
    else:
        # gated: d(product), d(act), d(up) less the product freed by down's backward; ungated: d(act), d(up) less
        # the activation's output freed by down's backward, or as probed, what it holds beyond what it saved
        held = m.ungated_activation(a.act)
        mlp_work = (max(s, held[1] - held[0]) if held else (2 if m.mlp_gated else 1) * s) * t * m.intermediate
        # or down's input-grad product where this CPU's matmuls hold it in float32 too (precision.matmul_scratch)
        mlp_work = max(mlp_work, (s + _scratch(setup)) * t * m.intermediate)
        if a.lora_cast:  # down's adapter: the float32 grad of its input copy, cast back and added to the base's
            mlp_work += (4 + s) * t * m.intermediate
    if scores:  # eager softmax backward: its saved output, the float32 gradient in and the one out (the 16-bit
        # probabilities' cast is freed by then)
        # (as probed where the meta device runs the layer's backward: XGLM's clamp holds two boolean masks more)
        per = eager.backward if eager and eager.backward is not None else 8 - (s if s < 4 else 0)
        work = int(per * units) + 3 * s * t * m.q_width
    else:
        work = _attention_backward_bytes(m, t, s, setup.device_type, sp)
    attention_saved = _attention_saved_per_token(m, a) * t
    if setup.offload and setup.split_layers and m.attn_impl == "sdpa":
        # attention per KV-head group (sdpa only: split_layers.AttentionByHeadGroups): one group's kernel workspace
        # at a time, the groups' grads joined at the end. Under Ulysses a rank holds heads / sp query heads and
        # kv / sp key/value heads, or one where they are replicated (kv < sp)
        groups = tiles.head_groups
        grads = s * t * (m.q_width + 2 * _kv_width(m, sp))
        work = max(grads + (work - grads) // groups, 2 * grads)
    # a post-norm's backward runs before its block's: its saved tensors are gone by the MLP's and attention's
    post_norm = _post_norm(m, a) * t
    # Ulysses' exchanges copy q, k, v and the output between layouts, but no two layouts outlive a copy (measured:
    # the kernel's backward holds what it holds without SP; its dq, dk, dv are exchanged after it has freed what
    # it saved), and o_proj's copy of the output (saved) is gone by then
    attn_point = attention_saved - post_norm + scores + work - (s * t * m.q_width if sp > 1 else 0)
    # The second norm's backward, the MLP's saved tensors (its input: the norm's output) gone: float32
    # temporaries over the norm's rows (untiled: all tokens; tiled: one tile, plus the whole input-grad buffer and
    # the incoming gradient, which the tiles read to the last).
    # Without pre-norms (OLMo2) that point is the post-attention norm's backward, over a matmul's output; with
    # post-norms the post-MLP norm's backward comes first, beside everything the layer saved.
    norm_work = _norm_work(s_res, a, h, t, tiles.norm_rows)  # the final norm's too
    second_work = norm_work if m.norms.pre else _norm_work(s, a, h, t, tiles.norm_rows)
    norm_point = (_layer_saved_per_token(m, a, True) - _mlp_input(m, a) - _post_norm(m, a)) * t + scores + second_work
    # Offloaded, the next checkpointed input is prefetched while a layer's backward runs: whole layers, the previous
    # layer's input, under every point of all but the last layer; split, the attention half's input under the MLP
    # half (every layer; attention is not recomputed yet there), and the previous layer's MLP-half input from the
    # end of attention's backward (all but the last layer): beside the first norm's tensors and dq, dk, dv.
    mlp_point = saved - post_norm + mlp_work
    post_point = saved + _norm_work(s, a, h, t, tiles.norm_rows, post=True) if m.norms.post else 0
    if split:
        restored = s_res * h * t if moved else 0  # kept on the device anyway
        mlp_point += restored - attention_saved - scores
        norm_point += restored - attention_saved - scores
        post_point += (restored - attention_saved - scores) if post_point else 0
    ahead = s_res * h * t if moved and L > 1 else 0
    # d(out) aliases the flowing gradient; the post-MLP norm's backward is a layer's first: none of the layer's
    # weight grads exist yet (every moment below adds one layer's)
    layer = max(mlp_point, attn_point, norm_point, post_point - layer_grads // max(1, L)) - dup + flow
    if split:
        after_attention = _norm(m, 3, a, present=m.norms.pre) * t + s * t * (m.q_width + 2 * _kv_width(m, sp)) + ahead
        layer_ahead = max(layer, after_attention - dup + flow)
    else:
        layer_ahead = layer + ahead

    head_grad = 0 if a.lora else (m.lm_head_params or v * h) * w // grad_shards(setup)
    # from the loss backward on, the last rank under ZeRO-1/2 holds its partition's grad buffer, the head's grad in it
    buffer = zero_grad_buffer(grads_all, setup)
    held_grads = {"zero_grad_buffer": buffer} if buffer > head_grad else {"head_grads": head_grad}
    moments: dict[str, dict[str, int]] = {
        "loss forward": {**static, **layers, "shared_saved": shared, "loss": loss_fwd},
        "loss backward": {**static, **layers, "shared_saved": shared, "loss": loss_bwd},
        "final norm backward": {**static, **layers, "shared_saved": shared, **held_grads, "norm_backward": norm_work},
        # the first layer's backward: every other layer's checkpoint, one layer's grads; the last one's: its own
        # checkpoint, every layer's grads (the peak there once checkpoints are offloaded or small)
        "layer backward": {**static, **other_layers, "shared_saved": inputs, **held_grads,
                           "layer_backward": layer_ahead + layer_grads // max(1, L)},
        "last layer backward": {**static, **{k: n // L for k, n in layers.items() if k == "checkpointed_inputs"},
                                **{k: n for k, n in layers.items() if k == "checkpointed_mask"},
                                **{k: n for k, n in other_layers.items() if k == "restored_input"},
                                "shared_saved": inputs, "head_grads": head_grad, "layer_backward": layer + layer_grads},
        # offloaded: the next-to-last layer's, every grad but one layer's and the last layer's input on its way
        **({"next-to-last layer backward": {
            **static, "restored_input": other_layers["restored_input"], "shared_saved": inputs,
            "head_grads": head_grad, "layer_backward": layer_ahead + layer_grads - layer_grads // L}} if ahead else {}),
        # ZeRO-3 has released every gathered parameter by its optimizer step
        "optimizer step": {**{k: n for k, n in static.items() if k != "zero3_live_parameters"},
                           "grads": deepspeed_step_grads(trainable, setup) if setup.zero_stage else grads_all,
                           "optimizer_temporaries": optimizer_temporaries(m, setup, trainable, w)},
    }
    if scores and eager:  # the last layer's eager attention forward, every other layer's saved or kept
        moments["attention forward"] = {**static, **{k: n for k, n in other_layers.items() if k != "restored_input"},
                                        "shared_saved": inputs, **_eager_forward(
                                            m, a, t, batch * heads * seq * seq, eager.inputs(batch, seq),
                                            setup.checkpointing)}
    if setup.autocast and not setup.lora_r:  # 16-bit copies of the matmul weights, cached for the forward
        cast = 2 * m.matmul_params
        moments["loss forward"]["autocast_weight_copies"] = cast
        if "attention forward" in moments:
            moments["attention forward"]["autocast_weight_copies"] = cast
        if not setup.checkpointing:  # saved by each Linear until its backward
            moments["loss backward"]["autocast_weight_copies"] = cast
            moments["layer backward"]["autocast_weight_copies"] = cast
            moments["last layer backward"]["autocast_weight_copies"] = cast
            moments["final norm backward"]["autocast_weight_copies"] = cast
    if setup.fsdp and ws > 1:
        fsdp_moments(moments, m, setup, w, layer_grads // max(1, L))
    return moments


def planned_peak_for_model(model: torch.nn.Module, setup: Setup, seq: int, *, batch: int = 1) -> Prediction:
    """The plan for an already-built (possibly PEFT-wrapped) model: its config's shape, ``setup``'s recipe."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config to plan from")
    return predict_step_peak(ModelShape.from_config(config), setup, seq, batch=batch)
