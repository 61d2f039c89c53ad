"""What torch FSDP (``--fsdp full_shard`` / ``shard_grad_op``, versions 1 and 2) adds to a rank's step, beside the
shards :func:`tiledmlp.plan.model._static` divides over the ranks.

Measured on CPU (FSDP2 over gloo, two ranks, each decoder layer and the root wrapped as Trainer's auto wrap does,
the profiler's exact peaks; ``tests/distributed/test_plan_fsdp.py``): FSDP gathers a module's weights whole while it
computes, and makes its grads whole in the backward, then reduce-scatters them through a buffer of their size. The
root (embeddings, head, final norm) is gathered from the forward into the backward, and its grads are reduced last:
the head's grad is held whole under every layer's backward, and at the root's reduce its weights, its grads and
their buffer are whole together.
"""

from __future__ import annotations

from .setup import Setup
from .shapes import ModelShape

__all__ = ["grad_shards", "fsdp_gathered", "fsdp_moments", "fsdp_mode", "trainer_fsdp"]


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


def fsdp_mode(value: object) -> str:
    """The sharding :class:`Setup` plans for Trainer's ``--fsdp`` value (options joined by spaces, a list of them, or
    a bool): ``full_shard``, ``shard_grad_op`` or ``""`` (none, or ``no_shard``: DDP's memory). ``auto_wrap`` is
    what the plan assumes (each decoder layer wrapped); CPU offload and hybrid sharding are refused by name."""
    if isinstance(value, bool):
        return "full_shard" if value else ""
    words = " ".join(value) if isinstance(value, (list, tuple)) else str(value)
    options = set(words.replace(",", " ").lower().split()) - {"auto_wrap"}
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
    mode = next(iter(modes), "full_shard" if "true" in options else "")
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
