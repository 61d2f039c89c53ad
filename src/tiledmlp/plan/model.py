"""The whole-step memory model: predicted peak device bytes of one training step, term by term.

A step is modelled as four moments, and the peak is the largest (see ``docs/plan.md`` for every formula and
where it was measured):

- ``loss forward``: everything the layers saved for the backward + the loss's forward working set;
- ``loss backward``: the same saved tensors + the loss's backward working set;
- ``layer backward``: the last layer's backward (recompute + working set under checkpointing) with every other
  layer's saved tensors (or checkpointed inputs) still alive and the head's gradients created;
- ``optimizer step``: all gradients + the optimizer's temporaries.

Each moment adds the static part: weights, optimizer states (and ZeRO's float32 master weights), sharded as the
ZeRO stage says. Activation terms are bytes per token (times the tokens a rank holds), read off the tensors
autograd saves in transformers 5.23's Llama/Qwen3/Qwen3-MoE layers and checked against CPU profiler peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..loss import plan_loss_tiles
from ..memory import predict_mlp_peak_bytes
from ..tiling import plan_shards
from .shapes import ModelShape

__all__ = ["Setup", "Prediction", "predict_step_peak", "planned_peak_for_model", "OPTIMIZER_STATE_BYTES"]

# Bytes of optimizer state per trainable element, by the Trainer's --optim name; None = "as the parameter" times
# the number of states (torch keeps its AdamW states in the parameter's dtype).
OPTIMIZER_STATE_BYTES: dict[str, tuple[int, float | None]] = {
    "adamw_torch": (2, None), "adamw_torch_fused": (2, None), "adamw_torch_foreach": (2, None),
    "adamw_hf": (2, None), "adam": (2, None),
    "adamw_bnb_8bit": (2, 1.0), "adamw_8bit": (2, 1.0), "paged_adamw_8bit": (2, 1.0),
    "sgd": (0, None), "adafactor": (1, 0.0),
}
_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


@dataclass(frozen=True)
class Setup:
    """A recipe's knobs: flag names as ``tiledmlp train``'s."""

    dtype: torch.dtype = torch.float32  # weights (--dtype)
    autocast: bool = False  # --bf16 true with 32-bit weights: 16-bit matmuls, float32 residual stream
    optim: str = "adamw_torch"
    lora_r: int = 0
    checkpointing: bool = False
    offload: bool = False  # checkpointed layer inputs on the host
    tiled_mlp: bool = False
    tiled_loss: bool = False
    mlp_num_shards: int | str = "auto"  # --tiled_mlp_num_shards
    sequence_parallel_size: int = 1
    world_size: int = 1
    zero_stage: int = 0
    device_type: str = "cuda"  # "cpu": single-tensor AdamW; accelerators: foreach AdamW (all-parameter temporaries)


@dataclass
class Prediction:
    peak_bytes: int
    moment: str  # which of the four moments is the peak
    terms: dict[str, int] = field(default_factory=dict)  # the named terms at that moment, bytes


def _states(optim: str) -> tuple[int, float | None]:
    if optim not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optim {optim!r} is not modelled; use one of {', '.join(sorted(OPTIMIZER_STATE_BYTES))}")
    return OPTIMIZER_STATE_BYTES[optim]


def _norm(width: int, s_norm: int, s_out: int) -> int:
    """RMSNorm saves its float32 input, ``x * rsqrt`` (cast to the weight dtype), and its output (for the next
    Linear), plus one float32 rsqrt per row."""
    return 4 * width + s_norm * width + s_out * width + 4


def _attention_saved_per_token(m: ModelShape, s: int) -> int:
    """q, k after RoPE, v, the attention output; float32 logsumexp per head (sdpa / flash kernels)."""
    total = s * (2 * m.q_width + 2 * m.kv_width) + 4 * m.heads
    if m.qk_norm:  # per-head RMSNorm of q and k: input and x*rsqrt (its output feeds RoPE, which saves none)
        total += (4 + s) * (m.q_width + m.kv_width) + 4 * (m.heads + m.kv_heads)
    return total


def _layer_saved_per_token(m: ModelShape, s: int, s_res: int, tiled_mlp: bool) -> int:
    """Bytes per token one decoder layer saves for its backward (without checkpointing), MLP excluded when tiled."""
    total = 2 * _norm(m.hidden, s_res, s) + _attention_saved_per_token(m, s)
    if tiled_mlp:
        return total
    if m.moe_experts:  # routed copies of x, gate|up, act, product, expert outputs; router probs and indices
        k = m.moe_top_k
        return total + s * k * (2 * m.hidden + 4 * m.moe_intermediate) + 4 * m.moe_experts + 4 * k + 8 * (3 * k + 1)
    return total + 4 * s * m.intermediate  # gate, up, act(gate), act*up


def _attention_backward_bytes(m: ModelShape, t: int, s: int, device_type: str) -> int:
    """dq, dk, dv plus the kernel's own buffers. CPU (``_scaled_dot_product_flash_attention_for_cpu``, torch
    2.13), fitted on its profiler peaks: per q element 4 (float32) or 2 (16-bit) bytes more, and per thread two
    ``[q_split, kv_split]`` float32 blocks (about 1.7x that for 16-bit). CUDA flash: a float32 dq accumulator."""
    q, kv = m.q_width, m.kv_width
    out = s * t * (q + 2 * kv)
    if device_type != "cpu":
        return out + 4 * t * q
    q_split = min(t, 256 if t >= 768 else 64 if t >= 192 else 32)
    blocks = torch.get_num_threads() * q_split * min(t, 512)
    return out + (4 if s == 4 else 2) * t * q + int(blocks * (8 if s == 4 else 13.4))


def _eager_scores(m: ModelShape, seq: int, s: int, heads: int) -> int:
    """Per layer, eager attention saves the float32 softmax and (16-bit) its cast: heads x seq x seq."""
    return heads * seq * seq * (4 + (s if s < 4 else 0))


def predict_step_peak(m: ModelShape, setup: Setup, seq: int, *, batch: int = 1) -> Prediction:
    """Predicted peak bytes on one device of one steady-state training step over ``batch`` sequences of ``seq``."""
    sp, ws = setup.sequence_parallel_size, setup.world_size
    if seq % sp:
        raise ValueError(f"seq {seq} is not divisible by sequence_parallel_size {sp}")
    t = batch * seq // sp  # tokens on this rank outside attention (Ulysses)
    w = _SIZE[setup.dtype]
    s = 2 if setup.autocast else w  # matmul activations
    s_res = 4 if setup.autocast else w  # residual stream and norms
    n_states, state_size = _states(setup.optim)
    trainable = m.lora_params_per_rank * setup.lora_r if setup.lora_r else m.num_params
    lora_weights = trainable * w if setup.lora_r else 0
    z = setup.zero_stage
    weights = (m.num_params * w) // (ws if z >= 3 else 1) + lora_weights
    grads_all = trainable * w // (ws if z >= 2 else 1)
    states = int(trainable * n_states * (state_size if state_size is not None else w)) // (ws if z >= 1 else 1)
    master = trainable * 4 // ws if z >= 1 and w < 4 else 0  # DeepSpeed keeps float32 master weights
    static = {"weights": weights, "optimizer_states": states + master}

    h, v, L = m.hidden, m.vocab, m.num_layers
    # Tiles as patch() plans them (experts: the generic engine over the expert intermediate size); one tile
    # means the MLP runs untiled.
    splits = plan_shards(t, num_shards=setup.mlp_num_shards, hidden_size=h,
                         intermediate_size=(m.moe_intermediate if m.moe_experts else m.intermediate) or None,
                         dtype=torch.float32 if s == 4 else torch.bfloat16,
                         path="generic" if m.moe_experts else "glu") if setup.tiled_mlp else None
    tiled_mlp = bool(splits) and len(splits) > 1
    saved = _layer_saved_per_token(m, s, s_res, tiled_mlp) * t
    heads = m.heads // sp if m.heads % sp == 0 else -(-m.heads // sp)
    if m.attn_impl == "eager":
        saved += _eager_scores(m, batch * seq if sp > 1 else t, s, heads)
    if tiled_mlp and not setup.checkpointing and not m.moe_experts:
        saved += 2 * splits[-1] * m.intermediate * s  # the last tile's gate/up kept from the forward
    ckpt_input = s_res * h * t
    if setup.checkpointing:
        layers = {"checkpointed_inputs": (0 if setup.offload else L * ckpt_input)}
    else:
        layers = {"saved_activations": L * saved}
    other_layers = {k: v - (0 if setup.checkpointing else saved) for k, v in layers.items()}
    # Shared by every layer: ids, labels, positions (int64), RoPE cos/sin; the final norm's saved tensors.
    inputs = t * (8 * 4 + 2 * m.head_dim * s)
    shared = inputs + _norm(h, s_res, s) * t

    # Loss head.
    head_grad = (m.lm_head_params or v * h) * w
    if setup.tiled_loss:
        tile = max(plan_loss_tiles(t, v) or [0])
        a = 4 if w < 4 else w
        kept = s * t * h + a * v * h  # d hidden and d W computed in the forward, held to the backward
        loss_fwd = kept + tile * v * (4 + (s if s < 4 else 0)) + tile * h * (s + 4)
        loss_bwd = kept + t * h * (4 + 4 + s) + v * h * (4 + w)
    else:
        loss_fwd = t * v * (s + (4 if s < 4 else 0) + 4)  # logits, their float32 copy, log_softmax
        loss_bwd = 12 * t * v  # log_softmax's saved output, its incoming and outgoing gradients (float32)

    # One layer's backward, at its two widest points. Autograd frees a layer's saved tensors node by node (and
    # non-reentrant checkpointing drops each recomputed tensor once unpacked), so at the attention backward the
    # MLP's and the second norm's saved tensors are gone. Both points hold the gradient flowing down the
    # residual stream. Under checkpointing the layer's input is both checkpointed and saved by its first norm
    # when the residual stream is float32: counted once.
    flow = s_res * h * t
    dup = 4 * h * t if setup.checkpointing and s_res == 4 else 0
    if tiled_mlp and not m.moe_experts:
        i = m.intermediate
        mlp_peak = predict_mlp_peak_bytes(t, h, i, splits=splits, dtype=torch.float32 if s == 4 else torch.bfloat16)
        acc = 4 if s < 4 else s
        mlp_work = mlp_peak - 2 * s * t * h - (3 * h * i * acc if acc == w else 0)
    elif m.moe_experts and tiled_mlp:  # generic engine per tile over the routed copies (k per token)
        k, i, tile = m.moe_top_k, m.moe_intermediate, max(splits or [t])
        mlp_work = 2 * s * t * h + s * tile * k * (6 * i + 3 * h) + 4 * s * m.moe_experts * h * i
    elif m.moe_experts:
        mlp_work = 2 * s * t * m.moe_top_k * m.moe_intermediate + s * t * m.moe_top_k * h
    else:
        mlp_work = 2 * s * t * m.intermediate  # d(product), d(act), d(up) less the product freed by down's backward
    attn_saved = (_norm(h, s_res, s) + _attention_saved_per_token(m, s)) * t
    attn_work = _attention_backward_bytes(m, t, s, setup.device_type)
    layer_mlp_point = saved - dup + flow + mlp_work
    layer_attn_point = attn_saved - dup + flow + attn_work  # d(out) aliases the flowing gradient
    if m.attn_impl == "eager":
        layer_attn_point += _eager_scores(m, batch * seq if sp > 1 else t, s, heads)

    grads_layer = grads_all // max(1, L)
    if n_states == 0:
        opt_tmp = 0
    elif setup.device_type == "cpu" or setup.optim == "adamw_torch_fused":
        opt_tmp = 2 * m.largest_param * w if setup.device_type == "cpu" else 0
    else:
        opt_tmp = trainable * w // (ws if z >= 1 else 1)  # foreach: sqrt of every second moment at once

    moments: dict[str, dict[str, int]] = {
        "loss forward": {**static, **layers, "shared_saved": shared, "loss": loss_fwd},
        "loss backward": {**static, **layers, "shared_saved": shared, "loss": loss_bwd},
        "layer backward": {**static, **other_layers, "shared_saved": inputs, "head_grads": head_grad // (ws if z >= 2 else 1),
                           "layer_backward": max(layer_mlp_point, layer_attn_point) + grads_layer},
        "optimizer step": {**static, "grads": grads_all, "optimizer_temporaries": opt_tmp},
    }
    if setup.autocast:
        cast = (m.num_params - (m.lm_head_params or v * h)) * 2  # 16-bit copies autocast caches for the forward
        moments["loss forward"]["autocast_weight_copies"] = cast
        if not setup.checkpointing:
            moments["loss backward"]["autocast_weight_copies"] = cast
            moments["layer backward"]["autocast_weight_copies"] = cast
    name, terms = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    return Prediction(sum(terms.values()), name, terms)


def planned_peak_for_model(model: torch.nn.Module, setup: Setup, seq: int, *, batch: int = 1) -> Prediction:
    """The plan for an already-built (possibly PEFT-wrapped) model: its config's shape, ``setup``'s recipe."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config to plan from")
    return predict_step_peak(ModelShape.from_config(config), setup, seq, batch=batch)
