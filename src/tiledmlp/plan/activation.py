"""What an MLP's activation keeps and holds, and in which dtype it runs under autocast: probed, not assumed.

An ungated MLP (GPT-2, GPT-NeoX, Bloom, Phi-2) is tiled by the generic engine, whose tile holds what its activation
holds between the two matmuls, and untiled it keeps what the activation saves. Both depend on the activation's
class: SiLU and GELU save their input, GPT-2's tanh GELU in Python ops saves five elements per input element. So the
activation (the MLP's one child without parameters that is not a dropout) runs alone on the CPU over a few rows, in
float32 and bf16, and what it saves and holds is counted per element.

Under autocast over float32 weights the activation's input is bf16, but it need not run in bf16: CUDA's, XPU's and MPS's
autocast run ``pow``, ``exp``, ``softplus`` and others in float32, so GPT-2's tanh GELU (``pow``) and squared ReLU
hold float32 elements there, twice their bf16 probe (measured on an H100, 2026-11-27). CPU autocast does not. Which
dtype a device's autocast gives is found without the device (:func:`autocast_output_sizes`): torch's own autocast
policy applies to shape-only tensors of that device type. Every probe leaves the CPU generator as it found it, so planning or
patching does not move the random stream a run draws its data order and dropout masks from.
"""

from __future__ import annotations

import torch
from torch import nn

from .checks import DEVICE_TYPES
from .probe import PROBE_SIZES, ShapeTracker, keeps_cpu_rng

__all__ = ["probe_activation", "probe_activation_peak", "activation_output_size", "activation_bytes",
           "autocast_output_sizes"]


def _activation(mlp: nn.Module) -> nn.Module | None:
    """The MLP's activation: its one child with no parameters that is not a dropout; None where there is not one."""
    acts = [m for m in mlp.children() if not list(m.parameters()) and not isinstance(m, nn.Dropout)]
    return acts[0] if len(acts) == 1 else None


@keeps_cpu_rng
def probe_activation(mlp: nn.Module) -> tuple[tuple[int, int], ...]:
    """(element size, bytes per input element) the activation of ``mlp`` (a meta-device MLP's will do) keeps for
    the backward, its output included, in float32 and bf16: SiLU and GELU keep their input (2 elements with the
    output), GPT-2's tanh GELU in Python ops 5. Empty where none is found or runs."""
    act = _activation(mlp)
    if act is None:
        return ()
    found = []
    for size, dtype in PROBE_SIZES.items():
        x = torch.randn(3, 8, dtype=dtype, requires_grad=True)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = act.forward(x)  # not its hooks: a patched model's activation may have some
        except Exception:  # noqa: BLE001 - an activation that will not run alone: input and output, as SiLU's
            return ()
        saved[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
        found.append((size, sum(saved.values()) // x.numel()))
    return tuple(found)


class _ElementTracker(ShapeTracker):
    """Bytes alive in tensors of ``seq`` elements (one ``[rows, width]`` activation) created while ``on``."""

    def _tracked(self, t: torch.Tensor) -> bool:
        return t.numel() == self.seq


@keeps_cpu_rng
def probe_activation_peak(mlp: nn.Module) -> tuple[tuple[int, int], ...]:
    """(element size, bytes per element) the activation of ``mlp`` holds at once between two matmuls, as an ungated
    MLP tile's recompute and backward run it: the matmul's output it reads, what it saves, its output (saved by the
    next matmul until that one's backward), the gradients in and out and its backward's temporaries (GELU 12 in
    float32: input, d output, d input; GPT-2's tanh GELU in Python ops and Bloom's ``GeLUFunction`` 28). Empty
    where none is found or runs."""
    act = _activation(mlp)
    if act is None:
        return ()
    rows, width, found = 16, 64, []
    for size, dtype in PROBE_SIZES.items():
        x, up = torch.randn(rows, 1, dtype=dtype, requires_grad=True), torch.randn(1, width, dtype=dtype)
        down, grad = torch.randn(width, 1, dtype=dtype, requires_grad=True), torch.randn(rows, 1, dtype=dtype)
        tracker = _ElementTracker(rows * width)
        tracker.on = True
        try:
            with tracker:
                torch.autograd.grad(act.forward(x @ up.requires_grad_()) @ down, [x], grad)
        except Exception:  # noqa: BLE001 - an activation that will not run alone
            return ()
        found.append((size, tracker.peak // (rows * width)))
    return tuple(found)


def activation_output_size(mlp: nn.Module, device: torch.device, dtype: torch.dtype) -> int | None:
    """The element size of the output of ``mlp``'s activation on a ``dtype`` input on ``device``, under the
    autocast in force (``patch()``'s check at the call). None where no single activation is found or runs alone."""
    from ..recompute import generator_state, set_generator_state

    act = _activation(mlp)
    if act is None:
        return None
    state = generator_state(device)  # it runs inside a forward: one that draws (RReLU) must not move the stream
    try:
        with torch.no_grad():
            return act.forward(torch.zeros(1, 8, dtype=dtype, device=device)).element_size()
    except Exception:  # noqa: BLE001 - an activation that will not run alone
        return None
    finally:
        set_generator_state(device, state)


class _DeviceShaped(torch.Tensor):
    """A tensor of a device type that holds no memory: its ops run on a meta twin. Autocast decides by the device
    type's dispatch key, before an op reaches this, so the dtypes it gives are that device's. Unlike torch's
    ``FakeTensor`` it makes no device context: FakeTensor allocates on a ``cuda``/``xpu`` device once it sees CUDA,
    so on a GPU machine the XPU probe failed (and each probe put a CUDA context on device 0)."""

    meta: torch.Tensor

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device) -> "_DeviceShaped":
        made = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(), dtype=meta.dtype,
                                                   device=device)
        made.meta = meta
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 - torch's protocol
        from torch.utils._pytree import tree_leaves, tree_map

        device = next(a.device for a in tree_leaves((args, kwargs)) if isinstance(a, _DeviceShaped))
        args, kwargs = tree_map(lambda a: a.meta if isinstance(a, _DeviceShaped) else a, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map(lambda t: cls(t, device) if isinstance(t, torch.Tensor) and t.is_meta else t, out)


@keeps_cpu_rng
def autocast_output_sizes(mlp: nn.Module) -> tuple[tuple[str, int], ...]:
    """(device type, element size) of the output of ``mlp``'s activation on a bf16 input under that device type's
    bf16 autocast, for each device type a plan is made for (``plan.checks.DEVICE_TYPES``) where it runs: the
    plan's check, made where the device may be absent. Run on shape-only tensors of the device type
    (:class:`_DeviceShaped`: torch's autocast policy for a device type applies to them, nothing is computed or
    allocated) without grad, with that device type's autocast switched on directly (``torch.autocast`` turns
    itself off where the device is absent) and restored after. Empty where no single activation is found."""
    act = _activation(mlp)
    if act is None:
        return ()
    found = []
    for device_type in DEVICE_TYPES:
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        try:
            with torch.no_grad():
                x = _DeviceShaped(torch.empty(2, 8, dtype=torch.bfloat16, device="meta"), torch.device(device_type, 0))
                torch.set_autocast_enabled(device_type, True)
                torch.set_autocast_dtype(device_type, torch.bfloat16)
                found.append((device_type, act.forward(x).element_size()))
        except Exception:  # noqa: BLE001 - an activation that will not run alone, or on meta tensors
            pass
        finally:
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)
    return tuple(found)


def activation_bytes(mlp: nn.Module) -> dict[int, tuple[int, int]]:
    """{element size: (saved, held) bytes per element} of the activation of ``mlp`` (:func:`probe_activation`,
    :func:`probe_activation_peak`), whatever grad mode, CPU autocast or saved-tensor hooks surround the call; {}
    where either finds none. ``patch(target_gb=...)`` sizes an ungated MLP's tiles by it."""
    with torch.enable_grad(), torch.autocast("cpu", enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        saved, held = dict(probe_activation(mlp)), dict(probe_activation_peak(mlp))
    return {size: (saved[size], held[size]) for size in saved if size in held}
