"""What a recompute needs: the forward's RNG/autocast state, the saved inputs, and the per-tile grad sums.

Shared by the generic engine (:mod:`tiledmlp.engine`) and the gated fast path (:mod:`tiledmlp.glu`).

Saved inputs and activation checkpointing: under saved-tensor hooks (non-reentrant checkpointing, CPU offload)
a tiled Function keeps no activation by reference (the hooks could neither drop nor offload it), and its token
inputs are saved by a separate identity node applied *before* the tiles run (:func:`pack_inputs_first`).
Checkpointing's recompute stops as soon as the last tensor saved in the region is repacked; when that is the
MLP's input (Llama-like layers: the MLP output only meets a residual add), the recompute therefore ends before
the tiled forward and the MLP is not run a second time. A layer that saves something computed from the MLP
output (Gemma-2's post-feed-forward norm) recomputes it as before, so values are never guessed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Sequence

import torch

__all__ = ["autocast_on", "ReplayState", "GradSum", "resolve_accumulate_dtype", "check_accumulate_dtype", "LOW_PRECISION",
           "saved_tensor_hooks_active", "pack_inputs_first", "save_inputs", "saved_inputs", "tensor_versions",
           "check_unmodified", "generator_state", "set_generator_state"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``; False where there is none (``meta``, whose
    ``torch.is_autocast_enabled`` raises instead of answering)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def functorch_active() -> bool:
    """True inside ``torch.func``'s transforms (``grad``, ``vmap``, ``jvp``, ``jacrev``): they refuse an autograd
    Function without ``setup_context`` and a vmap rule, which the tiled ones are not, so the patched modules run
    their own forward there (exact, untiled), as for any call they cannot tile.

    Asks the check ``torch.autograd.Function.apply`` makes itself (a private accessor); if a torch lacks it, False.
    """
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return active is not None and active()


def saved_tensor_hooks_active() -> bool:
    """True while saved tensors go through hooks (non-reentrant checkpointing, ``save_on_cpu``, ...).

    Asks autograd's own hook stack (a private accessor); if a torch lacks it, assume hooks, the safe answer.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class _Inputs(torch.autograd.Function):
    """Identity whose node saves the token inputs of a tiled call, so they are packed before any tile runs."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*tensors)
        outs = tuple(t.view_as(t) for t in tensors)
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


def pack_inputs_first(inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``inputs`` routed through :class:`_Inputs` under saved-tensor hooks (see the module docstring), else as is."""
    if not saved_tensor_hooks_active() or not any(t.requires_grad for t in inputs):
        return tuple(inputs)
    return _Inputs.apply(*inputs)


def save_inputs(ctx: Any, inputs: Sequence[torch.Tensor]) -> None:
    """In a tiled Function's forward: refer to :class:`_Inputs`' saved tensors if it made ``inputs``, else save them."""
    node = inputs[0].grad_fn
    ctx.inputs_node = node if isinstance(node, _Inputs._backward_cls) else None
    if ctx.inputs_node is None:
        ctx.save_for_backward(*inputs)


def saved_inputs(ctx: Any) -> tuple[torch.Tensor, ...]:
    """The inputs :func:`save_inputs` kept (unpacking them may run a checkpoint's recompute)."""
    return ctx.inputs_node.saved_tensors if ctx.inputs_node is not None else ctx.saved_tensors


def tensor_versions(tensors: Iterable[torch.Tensor | None]) -> tuple[int | None, ...]:
    """The version counters of the weights a recompute will read, taken in the forward for :func:`check_unmodified`
    (None for an absent tensor, or an inference tensor, which has no counter)."""
    return tuple(None if t is None or t.is_inference() else t._version for t in tensors)


def check_unmodified(tensors: Sequence[torch.Tensor | None], versions: Sequence[int | None]) -> None:
    """Raise autograd's error when a weight was modified in place between the forward and the backward.

    Untiled, autograd saves the weights (or what was computed from them) and refuses such a backward; a tiled
    Function keeps the weights by reference and recomputes from them, so it would differentiate the changed weights
    and return silently wrong gradients."""
    for t, version in zip(tensors, versions):
        if t is not None and version is not None and t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead. "
                "tiledmlp: a tiled MLP recomputes from its weights in the backward; do not change them in place "
                "(optimizer.step(), copy_, ...) between the forward and the backward")


class ReplayState:
    """RNG and autocast state captured when the forward starts, replayed around the recompute.

    The forward runs tiles in order, each drawing from the generators in turn; the backward restores the
    captured state once and recomputes the tiles in the same order, so every tile redraws the very mask it
    drew in the forward (``torch.utils.checkpoint`` does the same for one region). Autocast is thread-local
    and off during backward, so the recompute re-enters the forward's autocast state explicitly.
    """

    def __init__(self, device: torch.device, rng: bool = True) -> None:
        """``rng=False`` for a recompute that draws no random numbers: the generators are then neither read nor
        restored (host time a GPU would wait on at a step's start)."""
        self.device = device
        self.rng = rng
        self.cpu_rng = torch.get_rng_state() if rng else None
        self.device_rng: torch.Tensor | None = None
        if rng and device.type not in ("cpu", "meta"):
            module = torch.get_device_module(device.type)
            if hasattr(module, "get_rng_state"):
                self.device_rng = module.get_rng_state(device)
        self.autocast: dict[str, tuple[bool, torch.dtype, bool]] = {}
        for device_type in {device.type, "cpu"}:
            if torch.amp.is_autocast_available(device_type):
                self.autocast[device_type] = (
                    torch.is_autocast_enabled(device_type),
                    torch.get_autocast_dtype(device_type),
                    torch.is_autocast_cache_enabled(),
                )

    @property
    def autocast_enabled(self) -> bool:
        return any(enabled for enabled, _, _ in self.autocast.values())

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Restore the forward's RNG state (restoring the caller's afterwards) and autocast state."""
        devices = [self.device] if self.device_rng is not None else []
        with contextlib.ExitStack() as stack:
            if self.rng:
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type=self.device.type))
                torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.get_device_module(self.device.type).set_rng_state(self.device_rng, self.device)
            for device_type, (enabled, dtype, cache) in self.autocast.items():
                if enabled or torch.is_autocast_enabled(device_type):  # off then and now: nothing to enter
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                       cache_enabled=cache))
            yield


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default generator (the one a tensor made there draws from); empty on ``meta``,
    which draws nothing."""
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "meta":
        return torch.empty(0, dtype=torch.uint8)
    return torch.get_device_module(device.type).get_rng_state(device)


def set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    """Restore :func:`generator_state` (inside :meth:`ReplayState.replay`, which restores the caller's after)."""
    if device.type == "cpu":
        torch.set_rng_state(state)
    elif device.type != "meta":
        torch.get_device_module(device.type).set_rng_state(state, device)


def _narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether ``dtype`` holds less than ``than`` (coarser steps or a smaller range: float16 is narrower than
    bfloat16 and the reverse), so sums in it would lose what the weights' own grads keep."""
    if not than.is_floating_point:
        return False
    wide, base = torch.finfo(dtype), torch.finfo(than)
    return wide.eps > base.eps or wide.max < base.max


def resolve_accumulate_dtype(accumulate_dtype: object, param_dtype: torch.dtype) -> torch.dtype:
    """``"auto"``: float32 for 16-bit params, else the param dtype; ``"param"``: the param's own dtype (16-bit sums
    for 16-bit weights, the peers' precision and half the sums' memory, while float32 adapters keep float32); a
    floating ``torch.dtype`` is used as is, for every param (:func:`check_accumulate_dtype` refuses a narrower one)."""
    if isinstance(accumulate_dtype, str):
        if accumulate_dtype == "param":
            return param_dtype
        if accumulate_dtype != "auto":
            raise ValueError(f"accumulate_dtype must be 'auto', 'param' or a floating torch.dtype, got "
                             f"{accumulate_dtype!r}")
        return torch.float32 if param_dtype in LOW_PRECISION else param_dtype
    if not isinstance(accumulate_dtype, torch.dtype) or not accumulate_dtype.is_floating_point:
        raise TypeError(f"accumulate_dtype must be 'auto', 'param' or a floating torch.dtype, got "
                        f"{accumulate_dtype!r}")
    return accumulate_dtype


def check_accumulate_dtype(accumulate_dtype: object, params: Iterable[torch.Tensor] = (),
                           owner: str = "the weights") -> None:
    """ValueError/TypeError on a bad ``accumulate_dtype``, and ValueError on an explicit dtype narrower than a
    trainable floating tensor of ``params``: summing its grads over tiles in less than an untiled backward keeps
    would be a silent loss of precision. ``owner`` names the tensors in that error."""
    resolve_accumulate_dtype(accumulate_dtype, torch.float32)
    if isinstance(accumulate_dtype, str):  # "auto" and "param" are never narrower than the weights
        return
    for p in params:
        if p.requires_grad and p.is_floating_point() and _narrower(accumulate_dtype, p.dtype):
            raise ValueError(
                f"accumulate_dtype={accumulate_dtype} is narrower than {p.dtype}, the dtype of {owner}: their grads "
                f"would be summed over tiles in less precision than an untiled backward keeps; pass "
                f"accumulate_dtype='auto' (float32 for 16-bit weights, else their own dtype), 'param' or a dtype at "
                f"least as wide as {p.dtype}")


class GradSum:
    """Per-parameter sums of per-tile gradients, handed to autograd once at the end of the backward.

    Sums live in the accumulate dtype (float32 for 16-bit weights by default) and are cast to the parameter
    dtype exactly once, so a bf16 model's weight grads carry one rounding, not one per tile.
    """

    def __init__(self, params: Sequence[torch.Tensor], accumulate_dtype: object) -> None:
        self.params = list(params)
        check_accumulate_dtype(accumulate_dtype, self.params)
        self.dtypes = [resolve_accumulate_dtype(accumulate_dtype, p.dtype) for p in self.params]
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)

    def add(self, k: int, grad: torch.Tensor | None, pieces: int = 1) -> None:
        """Add a tile's grad to sum ``k``. A 16-bit grad into a float32 sum is upcast whole by ``add_`` (a float32
        copy of the grad for the moment); in ``pieces`` slices along its first dim that copy is one slice's."""
        if grad is None:
            return
        total = self.sums[k]
        if total is None:
            self.sums[k] = grad.to(self.dtypes[k], copy=True)
        elif pieces > 1 and grad.dtype != total.dtype and grad.dim() and grad.shape == total.shape:
            for part, piece in zip(total.chunk(pieces), grad.chunk(pieces)):
                part.add_(piece)
        else:
            total.add_(grad)

    def region(self, k: int, view: torch.Tensor) -> torch.Tensor:
        """The part of sum ``k`` that ``view`` (param ``k`` or a view of it) covers, for adding into in place."""
        param, total = self.params[k], self.sums[k]
        if total is None or total.stride() != param.stride():
            fresh = torch.zeros_like(param, dtype=self.dtypes[k], memory_format=torch.contiguous_format)
            self.sums[k] = total = fresh if total is None else fresh.copy_(total)
        if view is param:
            return total
        return total.as_strided(view.shape, view.stride(), view.storage_offset() - param.storage_offset())

    def results(self) -> list[torch.Tensor | None]:
        """The sums in the params' dtypes, each wider sum let go once cast: the casts never hold every sum and every
        result at once (MoE experts' 16-bit weights: float32 sums of twice their size)."""
        out = []
        for k, param in enumerate(self.params):
            total, self.sums[k] = self.sums[k], None
            out.append(None if total is None else total.to(param.dtype))
            del total
        return out
