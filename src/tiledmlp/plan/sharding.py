"""What a rank holds whatever the tokens (weights, grads, optimizer states and their step's temporaries), as
DeepSpeed ZeRO and torch FSDP (``--fsdp full_shard`` / ``shard_grad_op``, versions 1 and 2) shard them, and the
moments FSDP adds to a step.

FSDP, measured on CPU (FSDP2 over gloo, two ranks, each decoder layer and the root wrapped as Trainer's auto wrap
does, the profiler's exact peaks; ``tests/distributed/test_plan_fsdp.py``): it gathers a module's weights whole
while it computes, and makes its grads whole in the backward, then reduce-scatters them through a buffer of their
size. The root (embeddings, head, final norm) is gathered from the forward into the backward, and its grads are
reduced last: the head's grad is held whole under every layer's backward, and at the root's reduce its weights,
its grads and their buffer are whole together.
"""

from __future__ import annotations

import torch

from .setup import OPTIMIZER_STATE_BYTES, Setup
from .shapes import ModelShape

__all__ = ["CUDA_BLAS_WORKSPACE_BYTES", "ZERO3_LIVE_PARAMETERS", "static_terms", "optimizer_temporaries",
           "deepspeed_step_grads", "grad_shards", "zero_grad_buffer", "fsdp_gathered",
           "fsdp_moments", "fsdp_mixed_precision", "fsdp_mode", "trainer_fsdp"]

# DeepSpeed ZeRO-3's stage3_max_live_parameters and stage3_max_reuse_distance defaults (elements; transformers' "auto"
# sets neither): a parameter is kept gathered after its forward while it will be reused within this many elements,
# so on CPU (2 ranks, 20M parameters) the whole model stayed gathered from the forward into the backward, and with
# both set to 4M only the head (8M) at the loss
ZERO3_LIVE_PARAMETERS = 10**9

# cuBLAS + cuBLASLt workspaces the caching allocator holds from a step's first matmul on (H100, torch 2.11:
# 64 MiB on the default stream, benchmarks/gpu_probe.py); they count in max_memory_allocated like a tensor
CUDA_BLAS_WORKSPACE_BYTES = 64 * 2**20


def _states(optim: str) -> tuple[int, float | None]:
    if optim not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optim {optim!r} is not modelled; use one of {', '.join(sorted(OPTIMIZER_STATE_BYTES))}")
    return OPTIMIZER_STATE_BYTES[optim]


def static_terms(m: ModelShape, setup: Setup, w: int) -> tuple[dict[str, int], int, int]:
    """Weights and optimizer states (sharded by ZeRO or FSDP) and what is gathered beside them, plus all gradients'
    bytes and the trainable count; ``w`` the weights' element size."""
    ws, z, fsdp = setup.world_size, setup.zero_stage, bool(setup.fsdp)
    n_states, state_size = _states(setup.optim)
    lora = bool(setup.lora_r)
    trainable = m.lora_params_per_rank * setup.lora_r if lora else m.num_params
    tw = 4 if lora else w  # PEFT keeps adapters (and so their grads and AdamW states) in float32
    weights = (m.num_params * w) // (ws if z >= 3 or fsdp else 1) + (trainable * tw // (ws if fsdp else 1)
                                                                      if lora else 0)
    if setup.load_in_4bit:  # float32 w (checks.check_setup); FSDP2 shards the packed weights, not their scales
        q, shard = m.quantizable_params, ws if fsdp else 1
        packed = -(-q // 2)
        weights -= (q * w - packed) // shard - (quantized_bytes(q, setup.bnb_nested_quant) - packed)
    grads = trainable * tw // grad_shards(setup)
    # DeepSpeed's optimizer steps a float32 copy of the rank's partition (a copy of float32 weights too), its AdamW
    # states float32 with it, whatever the weights' dtype
    state_size = state_size if state_size is not None else 4 if z >= 1 else tw
    states = int(trainable * n_states * state_size) // (ws if z >= 1 or fsdp else 1)
    master = trainable * 4 // ws if z >= 1 else 0
    static = {"weights": weights, "optimizer_states": states + master}
    if z >= 3:  # ZeRO-3 holds its grads' partitions in one buffer from the start
        static["zero3_grad_partitions"], grads = grads, 0
    if setup.load_in_4bit:  # bitsandbytes dequantizes a Linear's whole weight for each of its matmuls, then frees it
        static["dequantized_weight"] = m.largest_linear * w
    if setup.device_type == "cuda":
        static["blas_workspace"] = CUDA_BLAS_WORKSPACE_BYTES
    if z >= 3:  # until 2026-11-29 two layers (the one computing and the one prefetched): 0.70-0.90 of the rank
        static["zero3_live_parameters"] = min(m.num_params, ZERO3_LIVE_PARAMETERS) * w
    if fsdp and ws > 1:
        static["fsdp_gathered"] = fsdp_gathered(m, setup) * w - (_gathered_quantized(m, setup) * (2 * w - 1) // 2
                                                                  if setup.load_in_4bit else 0)
    return static, grads, trainable


def quantized_bytes(elements: int, nested: bool) -> int:
    """bitsandbytes' 4-bit storage: two weights a byte, and per block of 64 its scale, a float32, or with nested
    quantization one byte plus a float32 per 256 blocks."""
    blocks = -(-elements // 64)
    return -(-elements // 2) + (blocks + 4 * -(-blocks // 256) if nested else 4 * blocks)


def optimizer_temporaries(m: ModelShape, setup: Setup, trainable: int, w: int) -> int:
    """CPU's single-tensor AdamW: two temporaries of the largest parameter (FSDP's: of its shard); CUDA's default
    foreach AdamW: the square root of every second moment at once; fused: none. Under DeepSpeed ZeRO the parameter
    is the rank's float32 partition, one flat tensor."""
    if _states(setup.optim)[0] == 0 or setup.optim == "adamw_torch_fused":
        return 0
    if setup.zero_stage >= 1:
        return (2 if setup.device_type == "cpu" else 1) * deepspeed_step_grads(trainable, setup)
    tw = 4 if setup.lora_r else w
    if setup.device_type == "cpu":
        return 2 * (m.largest_param if not setup.lora_r else trainable) * tw // (setup.world_size if setup.fsdp
                                                                                  else 1)
    return trainable * tw // (setup.world_size if setup.zero_stage >= 1 or setup.fsdp else 1)


def deepspeed_step_grads(trainable: int, setup: Setup) -> int:
    """The grads at DeepSpeed's optimizer step: a float32 copy of the rank's partition of them (ZeRO-1/2/3)."""
    return trainable * 4 // setup.world_size


def zero_grad_buffer(grads: int, setup: Setup) -> int:
    """The bytes of DeepSpeed ZeRO-1/2's buffer for the rank's partition of the grads (``grads``: theirs as the plan
    holds them, sharded under ZeRO-2), allocated whole when the rank reduces the first grad of its partition: the
    last rank's partition holds the head, whose grad comes first in the backward, so that rank holds it from there
    on (measured, 2 ranks, float32, at the first layer's backward: 6.5 MB above rank 0 under ZeRO-2, the buffer's
    size). Its ``stage_1_and_2`` optimizer only: bf16 weights under ZeRO-1 take DeepSpeed's bf16 optimizer."""
    if setup.zero_stage == 2:
        return grads
    if setup.zero_stage == 1 and setup.dtype != torch.bfloat16:
        return grads // setup.world_size
    return 0


def grad_shards(setup: Setup) -> int:
    """Ranks the weight grads are sharded over: ZeRO-2/3's, FSDP's (both strategies shard grads)."""
    return setup.world_size if setup.zero_stage >= 2 or setup.fsdp else 1


def _root_params(m: ModelShape) -> int:
    """Weight elements outside the decoder layers: embeddings (the head's too where untied), final norm."""
    return m.vocab * m.hidden + m.lm_head_params + m.position_params + 2 * m.hidden


def fsdp_gathered(m: ModelShape, setup: Setup) -> int:
    """Weight elements FSDP holds gathered whole beside the shards from the forward into the backward.
    ``shard_grad_op``: every layer, from its forward to its backward. ``full_shard``: the root's, and two decoder
    layers' (the one computing and the one prefetched)."""
    if setup.fsdp == "shard_grad_op":
        return m.num_params
    root = _root_params(m)
    return root + 2 * max(0, m.num_params - root) // max(1, m.num_layers)


def _gathered_quantized(m: ModelShape, setup: Setup) -> int:
    """The 4-bit weight elements among :func:`fsdp_gathered`'s, gathered as their packed half bytes."""
    q = m.quantizable_params
    return q if setup.fsdp == "shard_grad_op" else 2 * q // max(1, m.num_layers)


def fsdp_moments(moments: dict[str, dict[str, int]], m: ModelShape, setup: Setup, w: int, layer_grad: int) -> None:
    """Turn the plan's moments (``moments``, edited in place) into FSDP's, ``layer_grad`` being one decoder layer's
    sharded grad bytes: the head's grad whole through the backward, each layer's grads whole in its own backward,
    the root's reduce added, nothing gathered at the optimizer step (every module is resharded by then)."""
    ws = setup.world_size
    root_grads = 0 if setup.lora_r else _root_params(m) * w  # LoRA leaves embeddings and head frozen
    head = 0 if setup.lora_r else (m.lm_head_params or m.vocab * m.hidden) * w
    for name, terms in moments.items():
        if "head_grads" in terms:
            terms["head_grads"] = head
        if name.endswith("layer backward"):
            terms["fsdp_whole_layer_grads"] = layer_grad * (ws - 1)
    step = moments["optimizer step"]
    layers_grads = step["grads"] - root_grads // ws
    moments["root grads reduce (FSDP)"] = {**{k: n for k, n in step.items() if k not in ("grads", "fsdp_gathered")},
                                          "fsdp_gathered": _root_params(m) * w, "grads": layers_grads,
                                          "root_grads_and_reduce_buffer": 2 * root_grads}
    moments["root grads reduce (FSDP)"].pop("optimizer_temporaries", None)
    step.pop("fsdp_gathered", None)


def fsdp_mixed_precision(moments: dict[str, dict[str, int]], full: dict[str, int], lora: bool) -> None:
    """A bf16 step's ``moments`` (edited in place) as FSDP runs it under ``--bf16`` over float32 weights: accelerate
    sets a mixed-precision policy (bf16 gathers, compute, module outputs and reduce), so everything a step makes is
    the bf16 model's, while the shards and their optimizer states stay float32 (``full``: the float32 run's static
    terms) and so do the sharded grads and AdamW's temporaries (LoRA's adapters are float32 either way)."""
    for terms in moments.values():
        terms.update({key: full[key] for key in ("weights", "optimizer_states")})
        for key in ("grads", "optimizer_temporaries"):
            if key in terms and not lora:
                terms[key] *= 2


def fsdp_mode(value: object) -> str:
    """The sharding :class:`Setup` plans for Trainer's ``--fsdp`` value (options joined by spaces, a list of them, or
    a bool): ``full_shard``, ``shard_grad_op`` or ``""`` (none, or ``no_shard``: DDP's memory). ``auto_wrap`` is
    what the plan assumes (each decoder layer wrapped; alone, ``full_shard``, as Trainer runs it); CPU offload and
    hybrid sharding are refused by name."""
    if isinstance(value, bool):
        return "full_shard" if value else ""
    words = " ".join(value) if isinstance(value, (list, tuple)) else str(value)
    given = set(words.replace(",", " ").lower().split())
    options = given - {"auto_wrap"}
    if options & {"hybrid_shard", "hybrid_shard_zero2"}:
        raise ValueError(f"fsdp {words!r}: hybrid sharding is not modelled; plan it as full_shard (or shard_grad_op "
                         "for hybrid_shard_zero2) with --world_size set to the ranks of one node, which it shards over")
    if "offload" in options:
        raise ValueError(f"fsdp {words!r}: FSDP's CPU offload of weights and optimizer states is not modelled; drop "
                         "offload to plan the run without it (more than it holds on the device)")
    modes = options & {"full_shard", "shard_grad_op", "no_shard"}
    unknown = options - modes - {"true", "false"}
    if unknown or len(modes) > 1:
        raise ValueError(f"fsdp {words!r}: expected one of full_shard, shard_grad_op or no_shard (with auto_wrap), "
                         "as Trainer's --fsdp")
    # auto_wrap alone: Trainer shards it fully (FSDP's reshard_after_forward defaults to true)
    mode = next(iter(modes), "full_shard" if given & {"true", "auto_wrap"} else "")
    return "" if mode == "no_shard" else mode


def trainer_fsdp(fsdp: object, fsdp_config: object) -> str:
    """Trainer's FSDP setup as ``--fsdp`` words: ``fsdp`` (a bool, or the older strategy words) and ``fsdp_config``
    (a mapping; keys with or without ``fsdp_``), whose ``reshard_after_forward`` (FSDP2's bool, FSDP1's strategy
    name) and ``cpu_offload`` transformers reads the strategy from. :func:`fsdp_mode` reads the answer."""
    if not fsdp:
        return ""
    given = fsdp_config if isinstance(fsdp_config, dict) else {}
    config = {str(k).removeprefix("fsdp_"): v for k, v in given.items()}
    words = [] if isinstance(fsdp, bool) else (list(map(str, fsdp)) if isinstance(fsdp, (list, tuple))
                                               else str(fsdp).split())
    if not set(words) & {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"}:
        reshard = str(config.get("reshard_after_forward", True)).lower()
        words.append({"true": "full_shard", "false": "shard_grad_op"}.get(reshard, reshard))
    if str(config.get("cpu_offload", False)).lower() == "true" and "offload" not in words:
        words.append("offload")
    return " ".join(words)
