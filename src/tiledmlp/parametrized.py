"""Weights parametrized only during a call (PEFT's LoRA on MoE experts' 3-D parameters registers a parametrization
around its call of the experts and removes it before the backward): which are live at a tiled call, and each tile's
recompute reading them computed again from the same chain. Apart from ``patching.py``, which finds and wraps MLPs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["Parametrization", "live_parametrizations", "held_tensors", "with_parametrizations"]

# a parametrized module, the tensor's name, its ParametrizationList, and the steps that list held at the call
Parametrization = tuple[nn.Module, str, nn.Module, tuple[nn.Module, ...]]


def live_parametrizations(modules: list[nn.Module]) -> list[Parametrization]:
    """The parametrizations registered in ``modules`` (``patching._walk``) at this call, each with the chain it applies
    now: PEFT's LoRA on 3-D expert weights registers one around its call of the experts and removes it before the
    backward. (``parametrize.is_parametrized`` reads the same ``ModuleDict``, through a slower attribute lookup.)"""
    return [(m, name, chain, tuple(chain)) for m in modules
            if isinstance(chain_dict := m._modules.get("parametrizations"), nn.ModuleDict)
            for name, chain in chain_dict.items()]


def held_tensors(live: list[Parametrization]) -> list[torch.Tensor]:
    """Tensors requiring grad that the parametrizations hold as plain attributes (PEFT keeps the LoRA factors so,
    computed from adapters outside the module): params of the tiled call, so each tile's grad flows on to them."""
    return [t for *_, steps in live for step in steps for sub in step.modules() for t in vars(sub).values()
            if isinstance(t, torch.Tensor) and t.requires_grad]


def with_parametrizations(fn: Callable[..., Any], live: list[Parametrization], *tiles: torch.Tensor) -> Any:
    """``fn`` on one tile with the weights parametrized as in the forward: a recompute in the backward runs after
    PEFT removed its parametrization, so the weight it read is computed again from the same chain for this tile."""
    with contextlib.ExitStack() as stack, parametrize.cached():  # one value per tile, however often fn reads it
        for m, name, chain, steps in live:
            now = m.parametrizations[name] if parametrize.is_parametrized(m, name) else None
            if now is chain and tuple(chain) == steps:
                continue  # still registered as in the forward (the forward itself, or a lasting parametrization)
            if now is not None or tuple(chain) != steps:
                raise RuntimeError(f"tiledmlp: the parametrization of {type(m).__name__}.{name} changed between the "
                                   "forward and the backward of a tiled call; it cannot be recomputed")
            stack.enter_context(standing_in(m, name, chain()))
        return fn(*tiles)


@contextlib.contextmanager
def standing_in(module: nn.Module, name: str, value: torch.Tensor) -> Iterator[None]:
    """``module.<name>`` reads ``value`` while the context lasts (the parameter or buffer itself stays registered)."""
    store = module._parameters if name in module._parameters else module._buffers
    bare = store[name]
    store[name] = value
    try:
        yield
    finally:
        store[name] = bare
