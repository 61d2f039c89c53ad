"""tiledmlp: exact tiled MLPs and tiled losses for long-sequence training.

``tiledmlp.patch(model)`` tiles every MLP of a Hugging Face model in place (``loss=True`` also tiles the
logits+loss); ``tiled_call`` tiles any token-wise function; ``plan_shards`` says how tokens are cut into tiles;
``offload_activations(model)`` keeps what activation checkpointing saves in host memory.
"""

from .architectures import MLPSpec, fused_glu_from_attrs, glu_from_attrs, register_mlp
from .engine import tiled_call
from .adapters import LoRAFactors
from .glu import GLUWeights, glu_tiled_call
from .loss import tiled_causal_lm_loss
from .loss_patching import patch_loss, unpatch_loss
from .offload import ActivationOffloader, offload_activations
from .patching import PatchReport, TiledMLP, patch, unpatch
from .tiling import plan_shards

__all__ = [
    "tiled_call",
    "plan_shards",
    "TiledMLP",
    "patch",
    "unpatch",
    "PatchReport",
    "register_mlp",
    "MLPSpec",
    "glu_from_attrs",
    "fused_glu_from_attrs",
    "GLUWeights",
    "LoRAFactors",
    "glu_tiled_call",
    "tiled_causal_lm_loss",
    "patch_loss",
    "unpatch_loss",
    "offload_activations",
    "ActivationOffloader",
]
__version__ = "0.1.0"
