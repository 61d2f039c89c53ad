"""``tiledmlp bench --model M``: bench the MLP of a model (its config only, no weights) instead of set widths.

The bench builds its MLPs itself (the memory children rebuild them by name): a model's MLP is benched as the bench
MLP that computes what it computes, at its widths, read off a meta-device instance of the model (the first module
``patch()`` would tile). Llama-style SwiGLU (separate gate, up and down projections, SiLU) is ``swiglu``, with one
fused ``gate_up`` projection (Phi-3) ``swiglu-fused``, Gemma's tanh-GELU GLU ``geglu``, GPT-2's MLP ``gpt2``. A MoE
model's routed experts (benched in place of any dense MLPs before them) are ``moe`` when their block is a router
and SwiGLU experts without biases (Qwen3-MoE, Mixtral, OLMoE), at their widths, expert count and top-k. Any other
(shared experts, other activations, biases) is refused with the widths to pass to ``--mlp``/``--hidden``/
``--intermediate`` instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..architectures import fused_glu_from_attrs, glu_from_attrs, spec_for
from ..plan.probe import decoder_of

__all__ = ["mlp_of_model"]

_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu"}


def _first_tiled(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first module patch() tiles in the text decoder (a vision-language model's vision tower comes first,
    with fewer tokens); in a MoE model its first routed experts (most of its layers: DeepSeek's and Qwen3-MoE's
    ``mlp_only_layers`` keep some dense MLPs)."""
    decoder = {id(m) for m in decoder_of(model).modules()}
    tiled = [(n, m) for n, m in model.named_modules() if spec_for(m)[0] is not None and id(m) in decoder]
    return next((t for t in tiled if spec_for(t[1])[0].routed), tiled[0] if tiled else None)


def mlp_of_model(name: str) -> tuple[dict[str, Any], str]:
    """Bench settings (``mlp``, ``hidden``, ``intermediate``; ``experts`` and ``top_k`` for ``moe``; ``dtype`` where
    the config names one) for model ``name``'s MLP, and a note saying what was read; ``ValueError`` naming the model
    where none fits."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

    from ..train.args import UsageError
    from ..train.models import load_config, named_dtype

    try:
        config = load_config(name)
    except UsageError as exc:  # train's, which the bench does not catch
        raise ValueError(str(exc)) from exc
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None) or \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    if model_class is None:
        raise ValueError(f"--model {name}: {type(config).__name__} is not a causal-LM or image-text-to-text config "
                         "transformers knows")
    with torch.device("meta"):  # the class itself: no weights, no ZeRO-3 init
        model = model_class(config)
    found = _first_tiled(model)
    if found is None:
        raise ValueError(f"--model {name}: tiledmlp.patch finds no MLP to tile in {model_class.__name__}")
    path, mlp = found
    parent = model.get_submodule(path.rpartition(".")[0])
    kind = _routed_kind(mlp, parent, config) if spec_for(mlp)[0].routed else _kind(mlp)
    if kind is None:
        weights = [p for p in mlp.parameters() if p.dim() >= 2]
        widths = sorted({d for p in weights for d in p.shape[-2:]})
        raise ValueError(f"--model {name}: its MLP ({type(mlp).__name__} at {path}) has no bench MLP that computes "
                         "the same (swiglu: LlamaMLP, swiglu-fused: Phi3MLP, geglu: GemmaMLP, gpt2: GPT2MLP, moe: "
                         "Qwen3-MoE's router and experts); bench "
                         f"one of those at its widths ({', '.join(map(str, widths))}) with --mlp, --hidden and "
                         "--intermediate")
    hidden, intermediate = _widths(kind, mlp)
    settings: dict[str, Any] = {"mlp": kind, "hidden": hidden, "intermediate": intermediate}
    if kind == "moe":
        settings.update(experts=int(mlp.down_proj.shape[0]), top_k=int(config.num_experts_per_tok))
    dtype = named_dtype(config)
    if dtype is not None:
        settings["dtype"] = dtype
    note = (f"--model {name}: {type(mlp).__name__} ({path}) benched as --mlp {kind} --hidden {hidden} "
            f"--intermediate {intermediate}"
            + (f" --experts {settings['experts']} --top_k {settings['top_k']} (with {type(parent).__name__}'s "
               "router; the bench routes as Qwen3-MoE)" if kind == "moe" else "")
            + (f", --dtype {dtype} (its config's)" if dtype else ""))
    return settings, note


def _routed_kind(experts: nn.Module, block: nn.Module, config: Any) -> str | None:
    """``moe`` for routed SwiGLU experts in 3-D weights without biases (``gate_up_proj`` ``[E, 2I, H]``,
    ``down_proj`` ``[E, H, I]``) whose block holds them and one router only (no shared experts), else None."""
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters()}
    if set(shapes) != {"gate_up_proj", "down_proj"} or len(shapes["down_proj"]) != 3:
        return None
    num, hidden, inter = shapes["down_proj"]
    children = [type(c).__name__ for c in block.children()]
    act = getattr(config, "hidden_act", None)
    routed = len(children) == 2 and any(c.endswith("Router") for c in children)  # the experts and a router
    fits = shapes["gate_up_proj"] == (num, 2 * inter, hidden) and routed and act in ("silu", "swish")
    return "moe" if fits and isinstance(getattr(config, "num_experts_per_tok", None), int) else None


def _kind(mlp: nn.Module) -> str | None:
    """The bench MLP computing what ``mlp`` computes, or None."""
    spec = spec_for(mlp)[0]
    glu = None if spec is None else spec.glu
    for reader, names, suffix in ((glu_from_attrs("gate_proj", "up_proj", "down_proj", "act_fn"),
                                   ("gate_proj", "up_proj", "down_proj"), ""),
                                  (fused_glu_from_attrs("gate_up_proj", "down_proj", "activation_fn"),
                                   ("gate_up_proj", "down_proj"), "-fused")):
        if glu == reader:
            config = getattr(mlp, "config", None)
            act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            kind = _GATED.get(act) if isinstance(act, str) else None
            biases = any(getattr(mlp, n).bias is not None for n in names)
            # a fused GeGLU has no bench MLP
            return None if biases or kind is None or (suffix and kind != "swiglu") else kind + suffix
    if type(mlp).__name__ == "GPT2MLP":
        return "gpt2"
    return None


def _widths(kind: str, mlp: nn.Module) -> tuple[int, int]:
    if kind == "gpt2":  # Conv1D weights are [in, out]: c_fc's is [hidden, intermediate]
        return int(mlp.c_fc.weight.shape[0]), int(mlp.c_fc.weight.shape[1])
    down = mlp.down_proj if kind == "moe" else mlp.down_proj.weight  # experts: [E, H, I]
    return int(down.shape[-2]), int(down.shape[-1])
