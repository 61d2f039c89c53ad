"""What a tile's recompute in the backward must find as the forward left it. Weights parametrized only during a call
(PEFT's LoRA on MoE experts' 3-D parameters registers a parametrization around its call of the experts and removes
it before the backward): which are live at a tiled call, and each tile's recompute reading them computed again from
the same chain. Hooks, train/eval and which weights train: checked unchanged. Apart from ``patching.py``, which
finds and wraps MLPs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["Parametrization", "live_parametrizations", "held_tensors", "with_parametrizations", "call_state",
           "in_call_state", "refuse_stateful_weights", "inference_packing", "without_inference_packing"]

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


def call_state(modules: list[nn.Module]) -> tuple:
    """What the tiled MLP's modules (``patching._walk``) run with, beyond their weights: train/eval, their hooks (by
    handle), a forward set on the instance, and which parameters require grad (PEFT's ``disable_adapter`` turns its
    factors' off). The recompute of a tile in the backward runs the modules as they are then: a hook registered
    around the forward only (a steering or tracing context) had been left out of it, and the gradients were of
    another function, without an error. Global module hooks are not compared: frameworks register them around a
    forward for bookkeeping (activation offloading marks the layers it meets so)."""
    hooks = tuple((m.training, tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._backward_hooks),
                   tuple(m._backward_pre_hooks), m.__dict__.get("forward") if i else None)  # the root's is ours
                  for i, m in enumerate(modules))
    # by parameter, not by module: a call-time parametrization moves a weight between modules and back
    trains = {id(p): p.requires_grad for m in modules for p in m._parameters.values() if p is not None}
    return hooks, trains


def in_call_state(fn: Callable[..., Any], modules: list[nn.Module], state: tuple, name: str,
                  *tiles: torch.Tensor) -> Any:
    """``fn`` on one tile, refused where the modules are not as :func:`call_state` found them at the call."""
    *now, trains = call_state(modules)
    if now != list(state[:-1]) or any(trains[k] != v for k, v in state[-1].items() if k in trains):
        raise RuntimeError(f"tiledmlp: {name} changed between the forward and the backward of its tiled call (a hook "
                           "added or removed, train/eval switched, an adapter enabled or disabled): the backward "
                           "recomputes each tile with the module as it is now, so its gradients would be another "
                           "function's; run the backward inside the same context as the forward")
    return fn(*tiles)


def inference_packing(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules that may repack their weight for an inference-only CPU kernel at a call: bitsandbytes' Linear4bit
    on a CPU with AVX512-BF16 or AMX (its own flag, ``support_avx512bf16_for_cpu``)."""
    return [m for m in modules if getattr(m, "support_avx512bf16_for_cpu", False)]  # 1 from its native check


def without_inference_packing(fn: Callable[..., Any], packing: list[nn.Module], *tiles: torch.Tensor) -> Any:
    """``fn`` on one tile with bitsandbytes' CPU inference path off in ``packing`` (:func:`inference_packing`).

    In eval mode, given an input that needs no grad, such a Linear4bit repacks its weight in place for an
    inference-only kernel, and no input grad flows through it from then on (bitsandbytes 0.50: the input's grad
    stayed None). A tile's forward runs without a graph, so every tiled 4-bit MLP of a model trained in eval mode
    took that path on such CPUs: the grads of everything below it lost, or, where a weight's in-features are not a
    multiple of its block size, a reshape error (``shape '[64, 2]' is invalid for input of size 176``)."""
    flags = [m.support_avx512bf16_for_cpu for m in packing]
    for m in packing:
        m.support_avx512bf16_for_cpu = False
    try:
        return fn(*tiles)
    finally:
        for m, flag in zip(packing, flags):
            m.support_avx512bf16_for_cpu = flag


def refuse_stateful_weights(modules: list[nn.Module], name: str) -> None:
    """Spectral norm in training steps its power iteration (vectors updated in place) at each read of the weight:
    tiled, the weight is read once a tile and again in each tile's recompute, so the loss, the grads and the vectors
    were another run's, without an error (4 tiles, float64: grads 6e-3 off, the vector 0.2)."""
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    for m in modules:
        chains = m._modules.get("parametrizations")
        found = [n for n, chain in (chains.items() if isinstance(chains, nn.ModuleDict) else ())
                 if any(isinstance(step, _SpectralNorm) and step.training for step in chain)]
        found += [hook.name for hook in m._forward_pre_hooks.values() if isinstance(hook, SpectralNorm) and m.training]
        if found:
            raise ValueError(f"tiledmlp: {name}'s {type(m).__name__}.{found[0]} is spectral-normed, whose power "
                             "iteration steps at each read of the weight in training, once a tile and again in the "
                             "backward's recompute; remove spectral_norm, or tiledmlp.unpatch(model) to train it")
