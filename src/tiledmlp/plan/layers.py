"""Per-token activation terms of one decoder layer: what it saves for its backward and what its backward adds.

Read off the tensors autograd saves in transformers 5.23's Llama/Qwen3/Qwen3-MoE layers; the norms' share is
probed per model (:mod:`tiledmlp.plan.probe`: OLMo2's and Gemma's norms keep float32 products, OLMo2 norms the
outputs of attention and MLP instead of their inputs). Used by :func:`tiledmlp.plan.model.predict_step_peak`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..memory import generic_tile_work, predict_mlp_peak_bytes
from ..precision import copy_rows
from .probe import EagerForward
from .shapes import ModelShape

# An RMSNorm's backward above what it saved, per element of its rows, by its input's element size: float32
# temporaries (16-bit: the CUDA allocator at 256k tokens of the 1B shape held five float32 copies; the CPU
# profiler fits: tests/test_plan.py). A float32 input is its own float32 copy: fewer.
NORM_BACKWARD_BYTES = {2: 20, 4: 12}
# A post-norm's (OLMo2, Gemma 2/3: over the MLP's output, first in a layer's backward), float32: one float32 row
# buffer more. Measured, CPU profiler, tiled MLP + checkpointing (its peak moment): the pow backward of the norm
# holds four [T, H] buffers (the mul path's input grad waiting for the pow path's), where a pre-norm's peak
# moment is fitted with three; OLMo2 / Gemma3 fp32 were planned 238-257 bytes per token (h 64) under, 1024-8192
# tokens (0.952-0.964).
POST_NORM_BACKWARD_BYTES = {2: 20, 4: 16}


@dataclass(frozen=True)
class _Act:
    """Element sizes of a step's activations: ``s`` matmul outputs, ``r`` residual stream and norms, ``w`` weights;
    ``autocast`` (each Linear saves its own 16-bit cast of its input); ``act`` the MLP activation's (``s``, or 4
    where the device's autocast runs it in float32: ``ModelShape.activation_size``); ``lora`` rank (frozen base
    weights; PEFT keeps adapters in float32, so with 16-bit weights each adapted Linear saves a float32 copy of its
    input); ``drop``: bytes PEFT's LoRA dropout adds per element of an adapter's input (:func:`lora_dropout_bytes`);
    ``lora_w`` the adapters' element size as they compute: PEFT's float32, or 2 under FSDP's bf16 mixed precision,
    which gathers them in bf16 like every other weight (their float32 input copies planned there were 14% over a
    QLoRA rank's measured step); ``sp`` the Ulysses ranks (:func:`_kv_width`, and o_proj's input is a copy of
    the attention output, not the kernel's output itself)."""

    s: int
    r: int
    w: int
    autocast: bool
    lora: int
    act: int
    norm_tiled: bool = False  # row-tiled RMSNorms (tiledmlp.norms): they save their input only
    drop: int = 0
    lora_w: int = 4
    sp: int = 1

    @property
    def lora_cast(self) -> bool:
        return bool(self.lora) and self.w < self.lora_w


def lora_dropout_bytes(device_type: str) -> int:
    """Bytes per element of an adapter's input that PEFT's ``nn.Dropout`` saves for its backward: the mask (CUDA
    and XPU: the fused kernel's bool mask; CPU: a noise tensor in the adapter's float32)."""
    return 1 if device_type in ("cuda", "xpu") else 4


def _dropout_saved(a: _Act, widths: Sequence[int], shared: bool, only_adapters: bool) -> int:
    """Bytes per token LoRA dropout adds to what adapted Linears reading inputs of ``widths`` save (``shared``: all
    read one tensor, as q/k/v or gate/up read the norm's output). Each saves its mask and has ``A`` save the dropped
    input; that replaces a 16-bit base's float32 copy (or autocast's 16-bit cast), but with float32 weights ``A``
    read the input itself, which is then no longer saved where the adapters alone kept it (``only_adapters``: a
    frozen base saves none; SDPA keeps its output, o_proj's input). Measured on a tiny Llama, CPU: exact per layer."""
    if not a.drop:
        return 0
    total = a.drop * sum(widths)
    if a.w == 4 and not a.autocast:
        total += 4 * sum(widths) - (4 * (widths[0] if shared else sum(widths)) if only_adapters else 0)
    return total


def _norm_saved(m: ModelShape, a: _Act, width: int, input_size: int, rows: int = 1) -> int:
    """Bytes per token one norm saves itself (its output aside): as probed for the model's norm class (Llama's
    RMSNorm: float32 input, rsqrt per row, ``x * rsqrt`` for a trainable weight); row-tiled, its input alone."""
    if a.norm_tiled:
        return input_size * width
    return m.norms.saved(width, rows, weight_size=a.w, input_size=input_size, trainable=not a.lora)


def _norm(m: ModelShape, consumers: int, a: _Act, *, consumed: bool = True, present: bool = True) -> int:
    """A norm over the residual stream (``present``: a pre-norm; OLMo2's Linears read the stream itself) and its
    output, which the Linears reading it save: one shared tensor, or one 16-bit cast per Linear under autocast
    (``consumers``), or none when only frozen/LoRA-cast Linears read it."""
    width = m.hidden
    total = _norm_saved(m, a, width, a.r) if present else 0
    if not consumed:
        return total
    if a.autocast:
        return total + consumers * 2 * width
    return total + (0 if a.lora_cast else a.s * width)


def _post_norm(m: ModelShape, a: _Act) -> int:
    """A norm over attention's or the MLP's output (OLMo2, Gemma 2/3), before the residual add: its input is a
    matmul's output; its own output is saved by nobody."""
    return _norm_saved(m, a, m.hidden, a.s) if m.norms.post else 0


def _keeps_layer_input(m: ModelShape, a: _Act) -> bool:
    """Whether the layer's first saved tensor is its input itself: a pre-norm that saves a float32 input as is
    (row-tiled norms as before: float32 streams only), or, without pre-norms, q/k/v reading an uncast stream.
    Under checkpointing that input is counted once."""
    if not m.norms.pre:
        return not a.autocast and not a.lora_cast
    if a.norm_tiled:
        return a.r == 4
    return m.norms.cost(a.w, a.r, not a.lora).keeps_input


def _attention_saved_per_token(m: ModelShape, a: _Act) -> int:
    """The first norm; q, k after RoPE, v, the attention output; float32 logsumexp per head (sdpa / flash; eager
    saves k and v repeated to every head and no logsumexp, its scores are counted apart); q/k norms and the
    post-attention norm; the LoRA adapters' float32 input copies and rank-wide outputs."""
    s = a.s
    first = _norm(m, 3, a, present=m.norms.pre)
    if m.attn_impl == "eager":
        kv = m.q_width if m.kv_heads < m.heads else m.kv_width  # its matmuls save copies, not a fused output
        total = first + s * (2 * m.q_width + 2 * kv)
    else:
        total = first + s * (2 * m.q_width + 2 * _kv_width(m, a.sp) + _fused_qkv_kept(m)) + 4 * m.heads
        # q joined per head, so is the kernel's output: copied for o_proj (Phi-3, GPT-NeoX); under Ulysses o_proj's
        # input is the output exchanged back to this rank's tokens, a copy too (measured: 2.1 MB a layer at 2048
        # tokens a rank, h 256, float32)
        if m.rope == "partial" or a.sp > 1:
            total += s * m.q_width
    if m.qk_norm:  # RMSNorm of q and k (per head: Qwen3; full width: OLMo2); RoPE saves none of its output
        total += _norm_saved(m, a, m.q_width + m.kv_width, s, rows=m.norms.qk_rows or m.heads + m.kv_heads)
    total += _post_norm(m, a)
    if a.lora:
        ins = m.attn_linear_in  # q, k, v (or one fused qkv) over the norm's output, then o_proj
        total += 4 * a.lora * len(ins) + (4 * sum(ins) if a.lora_cast else 0) \
            + _dropout_saved(a, ins[:-1], shared=True, only_adapters=True) \
            + _dropout_saved(a, ins[-1:], shared=False, only_adapters=False)
    return total


def _kv_width(m: ModelShape, sp: int) -> int:
    """Elements per token of this rank's k (or v) as attention computes on it. Under Ulysses each rank holds the
    whole sequence for ``kv / sp`` heads, the same bytes, except where there are fewer KV heads than ranks:
    DeepSpeed repeats them to ``sp`` first, and every rank holds one over the whole sequence (``sp / kv`` times
    the bytes; measured, MQA at SP 2: 1.05 MB a layer more than planned for 2048 tokens a rank)."""
    return m.kv_width if sp == 1 else sp * max(m.kv_heads // sp, 1) * m.head_dim


def _fused_qkv_kept(m: ModelShape) -> int:
    """Elements per token a fused q/k/v matmul's output keeps beyond v under sdpa/flash: v, a view of it, is saved,
    and with RoPE q and k are rotated copies, so all of it stays (Phi-3 planned 12% under without it); without RoPE
    (GPT-2) q and k are views too and nothing more is kept."""
    return m.q_width + m.kv_width if m.fused_qkv and m.rope else 0


def _mlp_input(m: ModelShape, a: _Act) -> int:
    """The MLP's input as its Linears save it (the second norm's output, or the stream itself)."""
    return _norm(m, 2, a) - _norm(m, 2, a, consumed=False)


def _layer_saved_per_token(m: ModelShape, a: _Act, tiled_mlp: bool) -> int:
    """Bytes per token one decoder layer saves for its backward (without checkpointing), MLP excluded when tiled."""
    total = _attention_saved_per_token(m, a) + _norm(m, 2, a, present=m.norms.pre) + _post_norm(m, a)
    if tiled_mlp:
        return total
    s = a.s
    if m.moe_experts:  # routed copies of x, gate|up, act, product, expert outputs; router probs and indices
        k = m.moe_top_k
        return total + s * k * (2 * m.hidden + 4 * m.moe_intermediate) + 4 * m.moe_experts + 4 * k + 8 * (3 * k + 1)
    # gated: what act(gate) keeps (its output: an operand of the product) and up; ungated (GPT-2, GPT-NeoX): what
    # act(up) keeps but its output, which down saves alone (in ``s``: under autocast its own cast of a float32
    # output). Then down's input (LoRA over 16-bit: a float32 copy, counted with the adapters)
    act = m.activation_bytes(a.act)
    total += m.intermediate * (act + s if m.mlp_gated else act - a.act) + (0 if a.lora_cast else s * m.intermediate)
    if a.lora:
        ins = m.mlp_linear_in  # gate and up (or one fused gate_up, or an ungated MLP's first Linear), then down
        total += 4 * a.lora * len(ins) + (4 * sum(ins) if a.lora_cast else 0) \
            + _dropout_saved(a, ins[:-1], shared=True, only_adapters=True) \
            + _dropout_saved(a, ins[-1:], shared=False, only_adapters=True)
    return total


def _norm_work(input_size: int, a: _Act, h: int, t: int, rows: int, post: bool = False) -> int:
    """A norm's backward above what it saved: float32 temporaries over its rows (untiled: all tokens; tiled: one
    tile, plus the whole input-grad buffer and the incoming gradient, which the tiles read to the last)."""
    per_element = (POST_NORM_BACKWARD_BYTES if post else NORM_BACKWARD_BYTES)[min(input_size, 4)]
    return per_element * h * rows + ((input_size + a.s) * h * t if a.norm_tiled else 0)


def _attention_backward_bytes(m: ModelShape, t: int, s: int, device_type: str, sp: int = 1) -> int:
    """dq, dk, dv plus the kernel's own buffers. CPU (``_scaled_dot_product_flash_attention_for_cpu``, torch
    2.13), fitted on its profiler peaks: per q element 4 (float32) or 2 (16-bit) bytes more, and per thread two
    ``[q_split, kv_split]`` float32 blocks (16-bit: see :func:`_cpu_flash_16bit_block_bytes`). CUDA flash: a
    float32 dq accumulator and, under GQA, dk/dv for every q head before they are summed (not yet checked against
    a CUDA allocator). Under Ulysses (``sp`` ranks) the kernel runs over ``sp * t`` tokens for heads / sp."""
    q, kv, n = m.q_width, _kv_width(m, sp), t * sp
    out = s * t * (q + 2 * kv)
    if device_type != "cpu":  # + per-q-head dk, dv before the GQA reduction (flash-attention 2's backward)
        return out + 4 * t * q + (2 * s * t * q if kv < q else 0)
    q_split = min(n, 256 if n >= 768 else 64 if n >= 192 else 32)
    blocks = torch.get_num_threads() * q_split * min(n, 512)
    return out + (4 if s == 4 else 2) * t * q + int(blocks * (8 if s == 4 else _cpu_flash_16bit_block_bytes()))


def _cpu_flash_16bit_block_bytes() -> float:
    """Bytes per ``[q_split, kv_split]`` element of CPU flash attention's 16-bit backward buffers: 12 (two float32
    blocks and two 16-bit ones; measured exactly on an AVX2 CPU), 13.4 where the kernel also packs its blocks for
    AVX512-BF16/AMX matmuls (fitted on such a CPU)."""
    cpu = torch.cpu
    packs = any(getattr(cpu, name, lambda: False)() for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return 13.4 if packs else 12.0


def _eager_scores(seq: int, s: int, heads: int) -> int:
    """Per layer, eager attention saves the float32 softmax and (16-bit) its cast: heads x seq x seq."""
    return heads * seq * seq * (4 + (s if s < 4 else 0))


def _eager_probe(m: ModelShape, a: _Act) -> EagerForward | None:
    """The probed eager forward at the activations' element size (float32's for other sizes), or None."""
    probed = {e.size: e for e in m.eager_forward}
    return probed.get(a.s, probed.get(4)) if m.attn_impl == "eager" else None


def _eager_forward(m: ModelShape, a: _Act, t: int, units: int, inputs: int, checkpointing: bool) -> dict[str, int]:
    """The last layer's eager attention forward, as probed (:func:`tiledmlp.plan.probe.probe_eager_scores`): its
    ``[heads, seq, seq]`` buffers held at once (``units`` elements: batch x heads x seq^2; Bloom: scores, masked
    scores and the float32 softmax, 12 bytes in float32 and bf16), the tensors it reads, the layers' other inputs
    (mask, ALiBi bias: ``inputs`` bytes; kept with the checkpoints under checkpointing) and, checkpointed, the
    probabilities the previous layer returned, alive until this layer returns (Bloom's, MPT's; without
    checkpointing they are saved already)."""
    e = _eager_probe(m, a)
    terms = {"attention_inputs": _attention_saved_per_token(m, a) * t, "eager_forward_scores": int(e.held * units)}
    if checkpointing:
        terms["previous_probabilities"] = int(e.kept * units) if m.num_layers > 1 else 0
    else:
        terms["layer_inputs"] = inputs
    return terms


def _tiled_mlp_work(m: ModelShape, a: _Act, t: int, splits: list[int], generic: bool, acc: int,
                    dtype: torch.dtype, device_type: str) -> int:
    """A tiled dense MLP's backward above the layer's saved tensors and the flowing gradient (which is its output's
    grad): ``memory.predict_mlp_peak_bytes`` of the GLU engine or the generic one, less its output and that grad,
    and less its weight-grad sums where they are the grads themselves (``acc``: their element size, as the weights'
    ``a.w``; counted with the grads). An ungated MLP (GPT-2, GPT-NeoX, Bloom, MPT) on the generic engine: two
    weights, its activation as probed, and the grad buffer of each token-wise input beside the hidden states (Bloom's
    and MPT's residual); before 2026-11-26 planned as a gated MLP's tile (GPT-NeoX tiled + ckpt up to 1.19)."""
    s, h, i = a.s, m.hidden, m.intermediate
    own = torch.float32 if s == 4 else torch.bfloat16
    if a.lora and not generic:  # the GLU path over PEFT's adapters: frozen base weights, no sums nor their upcasts;
        # over 16-bit bases the adapters' float32 copies (down's input, the terms added into d(product) and the
        # recomputed gate/up), made in row blocks of precision.copy_rows (profiler, one LoRA
        # LlamaMLP, H/I 0.36, 2-8 tiles: 10.2-10.3 bytes per [tile, I] element where a tile is one block, 0.24 at
        # 11 blocks); over float32 bases 0.1-0.3; with dropout the tile's bool masks, one per adapter input element,
        # and their inverse's block (fitted the same way: 1.75-1.86 bytes per [tile, I] element, H/I 0.37)
        tile = max(splits)
        rows = min(tile, copy_rows(i, device_type))
        peak = predict_mlp_peak_bytes(t, h, i, splits=splits, dtype=own, path="glu", accumulate_dtype=own,
                                      device_type=device_type)
        masks = sum(m.mlp_linear_in) if a.drop else 0
        return peak - 2 * s * t * h - 3 * h * i * s + (11 * rows if a.lora_cast else 2 * tile) * i + masks * tile
    act = m.ungated_activation(a.act) if generic and not a.lora else None
    peak = predict_mlp_peak_bytes(t, h, i, splits=splits, dtype=own, path="generic" if generic else "glu",
                                  accumulate_dtype=dtype if acc < 4 else None, activation=act,
                                  device_type=device_type)
    if a.lora:  # frozen base weights: no weight-grad accumulators nor per-tile weight grads
        tile = max(splits)
        return peak - 2 * s * t * h - 3 * h * i * acc \
            - s * (generic_tile_work(tile, h, i, s) - generic_tile_work(tile, h, i, s, weight_grads=False))
    if act is not None:
        return peak - 2 * s * t * h - (2 * h * i * acc if acc == a.w else 0) + m.mlp_token_args * s * t * h
    return peak - 2 * s * t * h - (3 * h * i * acc if acc == a.w else 0)
