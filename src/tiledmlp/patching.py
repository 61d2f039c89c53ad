"""Finding the MLPs of a model and tiling them in place.

A patched module keeps its class, parameters, state-dict keys and hooks: only an instance-level ``forward``
is set, which tiles the original forward (called as a plain function, so no module hooks fire per tile).
``module(x)`` still runs the module's own hooks once around the whole tiled call, which is what FSDP2's
unshard/reshard and DeepSpeed's fetch hooks expect. A weight parametrized only during the call (PEFT's LoRA on MoE
experts' parameters) is computed again from the same chain in each tile's recompute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from . import distributed
from .architectures import MLPSpec, flat_routing, spec_for, token_wise
from .glu import GLUWeights, glu_tiled_call
from .norms import class_forward, patch_norms, patched_forward, restore_forwards, unpatch_norms, validate_norms
from .parametrized import (call_state, held_tensors, in_call_state, inference_packing, live_parametrizations,
                           refuse_stateful_weights, with_parametrizations, without_inference_packing)
from .pointwise import fusable_activation, fused_enabled
from .memory import routed_module_tiling_pays
from .precision import matmul_dtype
from .quantized import reads_exactly
from .recompute import check_accumulate_dtype, functorch_active
from .tiling import NumShards, plan_shards, validate_num_shards

__all__ = ["patch", "unpatch", "TiledMLP", "PatchReport", "TiledForward"]


@dataclass(frozen=True)
class TileOptions:
    num_shards: NumShards = "auto"
    target_gb: float | None = None
    accumulate_dtype: object = "auto"

    def validate(self) -> None:
        validate_num_shards(self.num_shards)
        if self.target_gb is not None:
            plan_shards(1, target_gb=self.target_gb, hidden_size=1, intermediate_size=1)
        check_accumulate_dtype(self.accumulate_dtype)

    def check_weights(self, module: nn.Module, name: str) -> None:
        """Refuse an ``accumulate_dtype`` narrower than ``module``'s trainable weights, at patch time (each call
        checks again: weights may be cast or unfrozen after patching)."""
        check_accumulate_dtype(self.accumulate_dtype, module.parameters(), f"the weights of {name}")


class TiledForward:
    """The instance-level ``forward`` of a patched MLP: plans tiles, then takes the GLU or the generic path."""

    def __init__(self, module: nn.Module, spec: MLPSpec, options: TileOptions, name: str = "") -> None:
        self.module = module
        self.spec = spec
        self.name = name
        self.original: Callable[..., Any] | None = module.__dict__.get("forward")
        self.last_num_tiles = 0
        self.last_path = ""  # the engine the last tiled call took: "glu" or "generic" (path() says which it may)
        self.activation: dict[int, tuple[int, int]] = {}  # probed for target_gb: see set_options
        self._autocast_sizes: dict[tuple[str, torch.dtype], int] = {}  # see _activation
        self.set_options(options)

    def set_options(self, options: TileOptions) -> None:
        """Take ``options``; a ``target_gb`` sizes tiles by what a tile holds, which for an MLP the generic path may
        run depends on its activation: probed here, once, on the CPU (not inside a forward, under its hooks)."""
        self.options = options
        if options.target_gb is not None and not self.spec.routed and not self.activation:
            from .plan.activation import activation_bytes

            self.activation = activation_bytes(self.module)

    def _original(self) -> Callable[..., Any]:
        return self.original if self.original is not None else class_forward(self.module)

    def _glu(self) -> GLUWeights | None:
        """The weights for the GLU fast path, or None: the module's forward must then be called (generic path).

        A forward the instance had before patching (accelerate's hooks set one) is never bypassed.
        """
        if self.spec.glu is None or self.original is not None:
            return None
        return self.spec.glu(self.module)

    def path(self) -> str:
        return "glu" if self._glu() is not None else "generic"

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.spec.routed and flat_routing(hidden_states, args):  # DBRX's experts: [B, T, H], routing [B*T, k]
            out = self(hidden_states.reshape(-1, hidden_states.shape[-1]), *args, **kwargs)  # the tokens it routes
            return out.reshape(*hidden_states.shape[:-1], -1) if isinstance(out, torch.Tensor) else out
        fn = self._original()
        token_args, constants = args[: self.spec.num_token_args], args[self.spec.num_token_args :]
        if (len(token_args) != self.spec.num_token_args or not isinstance(hidden_states, torch.Tensor)
                or hidden_states.dim() < 2 or not all(token_wise(a, hidden_states) for a in token_args)
                or not all(map(_constant, (*constants, *kwargs.values()))) or functorch_active()):
            return fn(hidden_states, *args, **kwargs)
        return self._tiled(fn, hidden_states, token_args, constants, kwargs)

    @torch.compiler.disable
    def _tiled(self, fn: Callable[..., Any], hidden_states: torch.Tensor, token_args: tuple, constants: tuple,
               kwargs: dict[str, Any]) -> Any:
        """The tiled call and its checks. It runs eagerly under ``torch.compile`` as a whole: the tiled Functions
        do anyway, and Dynamo traced the checks' module walk to break the graph two more times per MLP."""
        module = self.module
        modules = _walk(module)  # one walk per call, shared by the checks below (the GPU waits on this host time)
        live = live_parametrizations(modules)
        if self.original is None:
            distributed.refuse_data_parallel(module, hidden_states, _first_param(modules))
        distributed.check_tileable(module, self.name, modules)
        glu = None if constants or kwargs or live else self._glu()  # the GLU formula reads no other argument
        if glu is not None and not reads_exactly(glu.dequantized().values(), hidden_states):
            glu = None  # 4-bit projections under autocast, or a weight repacked for the CPU inference kernel
        top_k = token_args[0].shape[-1] if self.spec.routed else None  # the same on every rank: the model's top-k
        splits = self._splits(hidden_states, "glu" if glu is not None else "generic", glu, top_k)
        if constants or kwargs:  # e.g. Zamba2's ``feed_forward(x, layer_idx)``: every tile gets the same ones
            fn = functools.partial(_with_constants, fn, constants, kwargs)
        self.last_path = "glu" if glu is not None else "generic"
        if glu is not None:
            self.last_num_tiles = len(splits)
            return glu_tiled_call(glu, hidden_states, splits, self.options.accumulate_dtype)
        self.options.check_weights(module, self.name or type(module).__name__)  # here, not in the backward
        if len(splits) > 1:  # one tile runs the module as is
            refuse_stateful_weights(modules, self.name or type(module).__name__)
        if live:
            fn = functools.partial(with_parametrizations, fn, live)
        fn = functools.partial(in_call_state, fn, modules, call_state(modules), self.name or type(module).__name__)
        if packing := inference_packing(modules):
            fn = functools.partial(without_inference_packing, fn, packing)
        plan = self.plan if top_k is None else functools.partial(self.plan, top_k=top_k)
        out = distributed.run_tiled(fn, hidden_states, *token_args, module=module, splits=splits, plan=plan,
                                    accumulate_dtype=self.options.accumulate_dtype, name=self.name,
                                    extra=held_tensors(live))
        # set only once run_tiled returns: under ZeRO-3 this rank's plan may differ from the count the ranks agreed
        # on, and a checkpoint's recompute may stop inside run_tiled (its early stop), which must not leave it here
        self.last_num_tiles = distributed.last_tile_count(module)
        return out

    def _splits(self, x: torch.Tensor, path: str, glu: GLUWeights | None, top_k: int | None) -> list[int]:
        return self.plan(x.numel() // x.shape[-1] if x.shape[-1] else 0, x, path, glu=glu, top_k=top_k)

    def plan(self, num_tokens: int, x: torch.Tensor, path: str | None = None, *, glu: GLUWeights | None = None,
             top_k: int | None = None) -> list[int]:
        """Tile sizes for ``num_tokens`` tokens like ``x`` on ``path`` (the one a call would take now, if not given:
        the weights are read once per call); the same on every rank for the same count. ``glu``: the weights the
        call read, which give the weight dtype and width without a walk over the module's parameters; ``top_k``:
        the experts each token reaches, for routed experts."""
        dtype, weight_dtype = x.dtype, None
        weight = glu.gate_weight if glu is not None else \
            next((p for p in self.module.parameters() if p.is_floating_point()), None)
        compute = None if weight is None else matmul_dtype(x.dtype, weight.dtype, x.device.type)
        if compute is not None and compute.itemsize < weight.dtype.itemsize:
            # autocast: the matmuls run in its dtype, and the wider weights add their casts
            dtype, weight_dtype = compute, weight.dtype
        path = path or self.path()
        activation = self._activation(dtype, weight_dtype, x.device) if path == "generic" else None
        inter = self._intermediate(x.shape[-1], glu)
        splits = plan_shards(num_tokens, num_shards=self.options.num_shards, hidden_size=x.shape[-1],
                             intermediate_size=inter, dtype=dtype, target_gb=self.options.target_gb, path=path,
                             weight_dtype=weight_dtype, device_type=x.device.type, top_k=top_k,
                             activation=activation, lora=self._lora_tile(path, glu),
                             kernels=self._kernels(path, glu, x.device))
        if top_k is not None and inter and len(splits) > 1 and self.options.target_gb is None \
                and self.options.num_shards == "auto" and not routed_module_tiling_pays(
                    self.module, splits, x.shape[-1], inter, top_k, dtype, self.options.accumulate_dtype):
            return [num_tokens]  # auto never costs memory: the experts' weight-grad sums would outweigh the tiles
        return splits

    def _lora_tile(self, path: str, glu: GLUWeights | None) -> tuple[bool, int] | None:
        """What the GLU path's PEFT adapters add to a tile, for ``target_gb`` only (read off the weights a call read,
        or read here)."""
        if self.options.target_gb is None or path != "glu":
            return None
        glu = glu if glu is not None else self._glu()
        return None if glu is None else glu.lora_tile()

    def _activation(self, dtype: torch.dtype, weight_dtype: torch.dtype | None,
                    device: torch.device) -> tuple[int, int] | None:
        """The probed activation's bytes for tiles in ``dtype``; under autocast, in the element size its output
        has there (checked once per device and dtype: CUDA's autocast runs GPT-2's tanh GELU in float32)."""
        size = dtype.itemsize
        if weight_dtype is not None and self.activation:
            key = (device.type, dtype)
            if key not in self._autocast_sizes:
                from .plan.activation import activation_output_size

                self._autocast_sizes[key] = activation_output_size(self.module, device, dtype) or size
            size = max(size, self._autocast_sizes[key])
        return self.activation.get(size)

    def _kernels(self, path: str, glu: GLUWeights | None, device: torch.device) -> str:
        """Whether a GLU-path call here runs the compiled tile kernels, which hold less a tile: for ``target_gb``."""
        if self.options.target_gb is None or path != "glu":
            return "eager"
        glu = glu if glu is not None else self._glu()
        fused = glu is not None and fused_enabled(device) and fusable_activation(glu.act) is not None
        return "compiled" if fused else "eager"

    def _intermediate(self, hidden: int, glu: GLUWeights | None = None) -> int | None:
        if self.spec.intermediate_size is not None:
            return self.spec.intermediate_size(self.module, hidden)
        if glu is not None:  # down's input width ([H, I])
            return int(glu.down_weight.shape[1])
        shapes = _weight_shapes(self.module)
        dims = [d for shape in shapes if len(shape) == 2 for d in shape if d != hidden]
        if not dims and any(len(shape) == 2 for shape in shapes):
            return hidden  # every matrix is hidden x hidden: the intermediate width is the hidden size
        return max(dims) if dims else None


def _weight_shapes(module: nn.Module) -> list[tuple[int, ...]]:
    """The logical shapes of ``module``'s weights: a Linear's ``(out, in)`` (a 4-bit bitsandbytes weight's tensor is
    its packed bytes, ``[out * in / 2, 1]``), any other parameter's own (ZeRO-3 keeps a partitioned one's in
    ``ds_shape``)."""
    shapes = []
    for m in module.modules():
        linear = isinstance(m, nn.Linear)
        if linear:
            shapes.append((m.out_features, m.in_features))
        shapes += [tuple(getattr(p, "ds_shape", p.shape)) for name, p in m.named_parameters(recurse=False)
                   if not (linear and name == "weight")]
    return shapes


def _constant(value: object) -> bool:
    """An argument every tile can take as it is (a layer index, a flag): immutable, no tensor. Anything else (a
    tensor that may be per token, a cache a call updates) runs the module untiled."""
    return value is None or isinstance(value, (bool, int, float, str))


def _with_constants(fn: Callable[..., Any], constants: tuple, kwargs: dict[str, Any], hidden_states: torch.Tensor,
                    *token_args: torch.Tensor) -> Any:
    return fn(hidden_states, *token_args, *constants, **kwargs)


def _walk(module: nn.Module) -> list[nn.Module]:
    """``module.modules()`` as a list (depth first, registration order, each module once), without its name strings:
    read at every call, on the host time a GPU may wait on."""
    out, seen, stack = [], set(), [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return out


def _first_param(modules: list[nn.Module]) -> torch.Tensor | None:
    """The first parameter ``module.parameters()`` would yield, from :func:`_walk`'s list."""
    return next((p for m in modules for p in m._parameters.values() if p is not None), None)


def _is_patched(module: nn.Module) -> bool:
    return patched_forward(module, TiledForward) is not None


@dataclass
class PatchReport:
    """What :func:`patch` did: each tiled module with its path, each MLP-like module skipped with the reason."""

    patched: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    loss_patched: int = 0
    norms_patched: int = 0

    def __len__(self) -> int:
        return len(self.patched)

    def __str__(self) -> str:
        rows = [("module", "class", "path / reason")] + self.patched + self.skipped
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"tiledmlp: {len(self.patched)} module(s) tiled, {len(self.skipped)} skipped"
                 + (f", {self.norms_patched} RMSNorm(s) row-tiled" if self.norms_patched else "")
                 + (f", tiled loss on {self.loss_patched} causal LM(s)" if self.loss_patched else "")]
        for k, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def patch(
    model: nn.Module,
    *,
    num_shards: NumShards = "auto",
    target_gb: float | None = None,
    accumulate_dtype: object = "auto",
    loss: bool = False,
    norms: NumShards | bool = True,
) -> PatchReport:
    """Tile every MLP of ``model`` in place, exactly; returns a :class:`PatchReport`.

    Works on bare ``PreTrainedModel``s, PEFT models and already-wrapped models. Patching again applies the new
    options to what is already tiled (MLP tiles, ``accumulate_dtype``, ``norms``; ``loss=True`` updates or adds
    the tiled loss, keeping what :func:`tiledmlp.patch_loss` set (its tiles, smoothing, ``tile_eval``);
    ``loss=False`` leaves it as it is), as :func:`unpatch` then :func:`patch` would for the MLPs. Raises
    ``ValueError`` listing the module classes seen when nothing can be tiled, so a typo'd model never trains
    untiled silently. ``loss=True`` also makes causal LMs compute
    their training loss with :func:`tiledmlp.tiled_causal_lm_loss` (see :func:`tiledmlp.patch_loss`), its head's
    weight grad summed in ``accumulate_dtype`` too. ``accumulate_dtype``: what weight grads are summed over tiles
    in, ``"auto"`` (float32 for 16-bit weights: one rounding, as untiled), ``"param"`` (each weight's own dtype:
    half the sums' memory, one rounding per tile) or a floating dtype for all, never one narrower than the weights
    (ValueError).
    ``target_gb``, when given, picks each call's tile count from the predicted activation memory per tile and
    overrides ``num_shards``.
    ``norms`` (default True = ``"auto"``) row-tiles the model's RMSNorms once a tile's float32 copy would pass
    256 MiB (:mod:`tiledmlp.norms`; shorter inputs run them untouched); False leaves them, an int fixes the tiles.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    options = TileOptions(num_shards, target_gb, accumulate_dtype)
    options.validate()
    if not isinstance(loss, bool):
        raise TypeError(f"loss must be True or False, got {type(loss).__name__}")
    validate_norms(norms)
    if loss:  # a model the tiled loss cannot stand in for is refused before anything is patched
        from .loss_patching import loss_targets

        loss_targets(model)
    report = PatchReport()
    inside: list[nn.Module] = []
    for name, module in model.named_modules():
        if any(_contains(outer, module) for outer in inside):
            continue
        cls = type(module).__name__
        if isinstance(module, TiledMLP):
            options.check_weights(module, name or cls)
            module._tiled.set_options(options)
            report.patched.append((name, cls, "TiledMLP (options updated)"))
            inside.append(module)
            continue
        tiled = patched_forward(module, TiledForward)
        if tiled is not None:
            options.check_weights(module, name or cls)
            tiled.set_options(options)
            report.patched.append((name, cls, f"{tiled.path()} (already patched; options updated)"))
            inside.append(module)
            continue
        spec, reason = spec_for(module)
        if spec is None:
            if reason:
                report.skipped.append((name, cls, reason))
            continue
        distributed.check_tileable(module, name)
        options.check_weights(module, name or cls)
        tiled = TiledForward(module, spec, options, name)
        path = tiled.path()  # reads a GLU's weights: a malformed one is refused before the module is touched
        module.forward = tiled
        inside.append(module)
        report.patched.append((name, cls, path))
    if not report.patched:
        seen = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            "tiledmlp.patch found no MLP to tile in this model. Module classes seen: " + ", ".join(seen)
            + ". Register yours with tiledmlp.register_mlp(...)"
            + ("; skipped: " + "; ".join(f"{n} {c} ({r})" for n, c, r in report.skipped) if report.skipped else "")
        )
    if norms is False:
        unpatch_norms(model)
    else:
        report.norms_patched = patch_norms(model, "auto" if norms is True else norms)
    if loss:
        from .loss_patching import loss_options, patch_loss

        # the loss plans its own tiles (over labelled tokens, bounded by vocab size): never the MLP's count; its
        # head's weight grad is summed like the MLPs' (accumulate_dtype); what patch_loss set stays
        report.loss_patched = patch_loss(model, **{**loss_options(model), "accumulate_dtype": accumulate_dtype})
    return report


def _contains(outer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in outer.modules())


def unpatch(model: nn.Module) -> int:
    """Restore every patched module of ``model`` (tiled MLPs, norms and losses); returns how many were restored."""
    from .loss_patching import unpatch_loss

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return unpatch_loss(model) + unpatch_norms(model) + restore_forwards(model, TiledForward)


class TiledMLP(nn.Module):
    """Wrap one MLP module so that its forward is tiled (the module itself is left untouched between calls).

    The call goes through ``mlp(...)``, so the MLP's own hooks (user hooks, FSDP2's unshard, DeepSpeed's fetch)
    fire once around the tiled computation, as they do for a patched module.
    """

    def __init__(self, mlp: nn.Module, *, num_shards: NumShards = "auto", accumulate_dtype: object = "auto") -> None:
        super().__init__()
        if not isinstance(mlp, nn.Module):
            raise TypeError(f"TiledMLP wraps an nn.Module (an MLP), got {type(mlp).__name__}")
        if _is_patched(mlp):
            raise ValueError("TiledMLP: this mlp is tiled already by tiledmlp.patch; use it as it is, or "
                             "tiledmlp.unpatch(mlp) before wrapping it")
        options = TileOptions(num_shards, None, accumulate_dtype)
        options.validate()
        options.check_weights(mlp, type(mlp).__name__)
        spec, reason = spec_for(mlp)
        if reason:  # what patch() skips, e.g. a MoE block: tiled whole, its router's logits would lose their grads
            raise ValueError(f"TiledMLP cannot tile this {type(mlp).__name__}: {reason}")
        self.mlp = mlp
        self._tiled = TiledForward(mlp, spec if spec is not None else MLPSpec(), options)
        self._tiled.path()  # reads a GLU's weights: a malformed one is refused here, not at the first call

    def forward(self, hidden_states: torch.Tensor, *args: Any) -> Any:
        mlp = self.mlp
        had, previous = "forward" in mlp.__dict__, mlp.__dict__.get("forward")
        self._tiled.original = previous  # a forward set on the instance (accelerate's hooks) runs per tile
        mlp.forward = self._tiled
        try:
            return mlp(hidden_states, *args)
        finally:
            if had:
                mlp.forward = previous
            else:
                del mlp.forward
