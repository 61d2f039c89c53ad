"""What a step's memory is planned for: a recipe's knobs (:class:`Setup`, ``tiledmlp train``'s flags) and the
plan's answer (:class:`Prediction`); :mod:`tiledmlp.plan.model` computes one from the other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .checks import check_setup

__all__ = ["Setup", "Prediction", "OPTIMIZER_STATE_BYTES"]

# Bytes of optimizer state per trainable element, by the Trainer's --optim name; None = "as the parameter" times
# the number of states (torch keeps its AdamW states in the parameter's dtype).
OPTIMIZER_STATE_BYTES: dict[str, tuple[int, float | None]] = {
    "adamw_torch": (2, None), "adamw_torch_fused": (2, None), "adamw_torch_foreach": (2, None),
    "adamw_hf": (2, None), "adam": (2, None),
    "adamw_bnb_8bit": (2, 1.0), "adamw_8bit": (2, 1.0), "paged_adamw_8bit": (2, 1.0),
    "sgd": (0, None), "adafactor": (1, 0.0),  # Adafactor's factored row/column statistics: negligible
}


@dataclass(frozen=True)
class Setup:
    """A recipe's knobs: flag names as ``tiledmlp train``'s."""

    dtype: torch.dtype = torch.float32  # weights (--dtype)
    autocast: bool = False  # --bf16 true with 32-bit weights: 16-bit matmuls, float32 residual stream
    optim: str = "adamw_torch"
    lora_r: int = 0
    lora_dropout: float = 0.0  # > 0: each adapter saves its mask (layers.lora_dropout_bytes); MLP tiles draw theirs
    checkpointing: bool = False
    offload: bool = False  # checkpointed layer inputs on the host
    split_layers: bool = False  # with offload: attention and MLP halves checkpointed apart (tiledmlp.split_layers)
    tiled_mlp: bool = False
    tiled_loss: bool = False
    tiled_norms: bool = True  # with tiled_mlp: patch()'s row-tiled RMSNorms (they tile past 256 MiB float32)
    mlp_num_shards: int | str = "auto"  # --tiled_mlp_num_shards
    mlp_target_gb: float | None = None  # --tiled_mlp_target_gb: tiles sized to it, whatever mlp_num_shards says
    accumulate: str = "auto"  # --tiled_accumulate_dtype: weight-grad sums in float32 or ("param") the weights' dtype
    sequence_parallel_size: int = 1
    world_size: int = 1
    zero_stage: int = 0
    # --fsdp (torch FSDP, versions 1 and 2): "full_shard" shards weights, grads and optimizer states, and gathers
    # each layer while it computes; "shard_grad_op" keeps the weights gathered from the forward to the backward
    fsdp: str = ""
    device_type: str = "cuda"  # "cpu": single-tensor AdamW; accelerators: foreach AdamW (all-parameter temporaries)
    # --load_in_4bit (QLoRA, with lora_r): the decoder's Linear weights in 4 bits plus their blocks' scales (one
    # float32 per 64, or with --use_bnb_nested_quant one byte), dequantized one at a time to compute; the rest of the
    # weights float32 (as PEFT prepares them: ``dtype`` float32, the residual stream too)
    load_in_4bit: bool = False
    bnb_nested_quant: bool = False

    def __post_init__(self) -> None:
        """Refuse a knob the plan would misread (a KeyError, a division by zero, or a silent number later)."""
        check_setup(self, OPTIMIZER_STATE_BYTES)


@dataclass
class Prediction:
    peak_bytes: int
    moment: str  # which of the moments is the peak
    terms: dict[str, int] = field(default_factory=dict)  # the named terms at that moment, bytes
