"""Which modules are MLPs, and how each is tiled: the registry.

An entry says how to read a module's gated weights (for the GLU fast path) and how many token-wise
arguments its forward takes after the hidden states (MoE experts take routing indices and weights). Modules
not in the registry are recognised by shape, so new Hugging Face models need no entry:

- routed experts: a class named ``...Experts`` whose forward takes the hidden states and the per-token routing
  (``top_k_index, top_k_weights``, as transformers' shared experts implementation does, or GPT-OSS's
  ``router_indices, routing_weights``): tiled by the generic path, routing arguments cut with the tokens;
- MoE blocks: a module with a router child (a class named ``...Router``) or with routed experts among its children
  is never tiled whole, whatever its name (GPT-OSS calls its block ``GptOssMLP``): the router's logits must keep
  their gradients for the aux loss, and transformers records them with a hook that must fire once;
- MLPs: a class named ``...MLP`` whose forward takes one tensor: the generic path, or the GLU fast path when its
  forward is literally Llama's; not one whose forward moves the token dims (a transpose, a pixel shuffle) or that
  holds a convolution: a tile of tokens would not be its input (reported as skipped);
- residual MLPs: such a class whose forward also takes the residual it adds (``forward(hidden_states, residual)``,
  named as in :data:`RESIDUAL_ARGS`; Bloom and MPT dropout-add it inside): the generic path, the residual cut with
  the tokens. Any other second input (a mask, a scale, indices) is no token tensor for certain: reported as skipped.

Register a new class in a few lines::

    tiledmlp.register_mlp("MyMLP", glu=tiledmlp.glu_from_attrs("w1", "w3", "w2", "act"))
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .adapters import LoRAFactors
from .distributed import is_zero3_param
from .glu import GLUWeights, plain_activation
from .quantized import Dequantized, dequantized_weight

__all__ = ["MLPSpec", "register_mlp", "spec_for", "glu_from_attrs", "fused_glu_from_attrs", "MOE_BLOCK_SUFFIXES",
           "ROUTING_ARGS", "RESIDUAL_ARGS", "token_wise", "flat_routing"]

GLUReader = Callable[[nn.Module], "GLUWeights | None"]

# Sparse MoE blocks are not tiled whole: their router stays untiled (its logits keep their gradients for
# the aux loss, and transformers records them with a hook that must fire once), their experts are tiled.
MOE_BLOCK_SUFFIXES = ("SparseMoeBlock", "MoeBlock", "MoE")
# The token-wise routing arguments experts take after the hidden states (transformers' names).
ROUTING_ARGS = (("top_k_index", "top_k_weights"), ("router_indices", "routing_weights"),
                ("selected_experts", "routing_weights"))
# The name of the residual an MLP's forward takes after the hidden states and adds to its output (Bloom's and MPT's
# MLPs): a name, not a shape, says it is one tensor per token; a mask or indices shaped alike would be no residual.
RESIDUAL_ARGS = ("residual",)


@dataclass(frozen=True)
class MLPSpec:
    """How to tile one MLP class."""

    glu: GLUReader | None = None
    num_token_args: int = 0
    intermediate_size: Callable[[nn.Module, int], int | None] | None = None  # (module, hidden size)
    # routed experts: the first token argument holds each token's top-k expert indices ([..., k]), and a tile's
    # memory grows with k (``target_gb`` sizes tiles by it)
    routed: bool = False


def _unhooked(module: nn.Module) -> bool:
    """No module hook (forward, backward) and no ``forward`` replaced on the instance (accelerate's device-alignment
    and offloading hooks) on ``module`` or its children: nothing that must see the module's own call."""
    modules = module.modules() if module._modules else (module,)  # a Linear: itself (read per call, kept cheap)
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   or "forward" in m.__dict__ for m in modules)


def _plain_linear(module: object) -> bool:
    """Exactly ``nn.Linear`` that nothing intercepts: safe to read as ``F.linear`` of its weight.

    Not so: FSDP/ZeRO wrappers, hooked modules (:func:`_unhooked`; global hooks are checked by the caller), LoRA
    layers (read by :func:`_peft_lora` where they can be): those modules must be called, which the generic path does.
    """
    return type(module) is nn.Linear and _unhooked(module) and not is_zero3_param(module.weight)


def _peft_lora(module: object) -> tuple[torch.Tensor | Dequantized, torch.Tensor | None, LoRAFactors] | None:
    """(base weight, base bias, adapter) of a PEFT ``lora.Linear`` (or its layer over a bitsandbytes 4-bit base)
    that computes ``base(x) + s * B(A(dropout(x)))`` and nothing else: one active adapter, plain LoRA (no DoRA or
    other variant, no bias on B), a plain ``nn.Dropout`` (not in place) or none, not merged or disabled, the input
    cast to the adapter's dtype, an adapter as wide as its base or float32 over a 16-bit base. Else None: the
    generic path calls the module (exact, with a whole-MLP recompute per tile). Read at every call, so PEFT's
    ``disable_adapter()``, adapter switches and ``train()``/``eval()`` (which turns the dropout on and off) are
    seen."""
    layer, four_bit = sys.modules.get("peft.tuners.lora.layer"), sys.modules.get("peft.tuners.lora.bnb")
    rounded = four_bit is not None and type(module) is getattr(four_bit, "Linear4bit", None)
    if layer is None or (type(module) is not layer.Linear and not rounded) or not _unhooked(module):
        return None
    if module.disable_adapters or module.merged or module.fan_in_fan_out \
            or not getattr(module, "cast_input_dtype_enabled", True):
        return None
    active = [n for n in module.active_adapters if n in module.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    dropout = _dropout_p(module.lora_dropout[name])
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False) \
            or dropout is None:
        return None
    base, a, b = _base(module.base_layer), module.lora_A[name], module.lora_B[name]
    scaling = module.scaling.get(name)
    if base is None or not all(_plain_linear(m) for m in (a, b)) or a.bias is not None \
            or b.bias is not None or isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        return None
    adapter, weight = a.weight.dtype, base[0].dtype
    if b.weight.dtype != adapter or not (adapter == weight or (adapter == torch.float32 and weight.itemsize == 2)):
        return None
    return (*base, LoRAFactors(a.weight, b.weight, float(scaling), dropout, rounded=rounded))


def _dropout_p(module: object) -> float | None:
    """The probability a PEFT adapter's dropout module drops with now (0 for ``nn.Identity`` or in eval mode), or
    None for one the GLU path does not draw itself (in place, a subclass, ``p >= 1``)."""
    if isinstance(module, nn.Identity):
        return 0.0
    if type(module) is not nn.Dropout or module.inplace or not 0 <= module.p < 1:
        return None
    return float(module.p) if module.training else 0.0


def _base(module: object) -> tuple[torch.Tensor | Dequantized, torch.Tensor | None] | None:
    """(weight, bias) of a plain Linear, or of a bitsandbytes 4-bit one the GLU path reads (dequantizing: no bias),
    or None."""
    if _plain_linear(module):
        return module.weight, module.bias
    weight = dequantized_weight(module) if isinstance(module, nn.Module) and _unhooked(module) else None
    return None if weight is None else (weight, None)


def _projection(module: object) -> tuple[torch.Tensor | Dequantized, torch.Tensor | None, LoRAFactors | None] | None:
    """(weight, bias, adapter) of a plain or 4-bit Linear (no adapter) or of a PEFT LoRA layer the GLU path computes
    exactly (:func:`_peft_lora`), or None."""
    base = _base(module)
    if base is not None:
        return (*base, None)
    return _peft_lora(module)


def _global_module_hooks() -> bool:
    """Hooks registered for every module (``torch.nn.modules.module.register_module_*_hook``) that must fire on
    the projections too; tiledmlp's own (the offloader marks layers with one) need not."""
    m = torch.nn.modules.module
    hooks = (*m._global_forward_hooks.values(), *m._global_forward_pre_hooks.values(),
             *m._global_backward_hooks.values(), *m._global_backward_pre_hooks.values())
    return any(not getattr(getattr(h, "__func__", h), "__module__", "").startswith("tiledmlp.") for h in hooks)


@dataclass(frozen=True)
class _GLUReader:
    """Reads ``down(act(gate(x)) * up(x))`` from three Linears, or from one fused ``gate_up`` (``up`` empty), each
    possibly a PEFT LoRA layer over one.

    A plain class, not a closure, so that a patched model still pickles (``torch.save(model)``).
    """

    gate: str
    up: str
    down: str
    act: str

    def __call__(self, module: nn.Module) -> GLUWeights | None:
        names = (self.gate, self.up, self.down) if self.up else (self.gate, self.down)
        projections = [_projection(getattr(module, n, None)) for n in names]
        if any(p is None for p in projections) or _global_module_hooks():
            return None
        act = getattr(module, self.act)
        # a hooked activation is called by the generic path: the GLU path writes ``act(gate) * up`` over what the
        # activation returned (a forward hook's record of it) and its compiled kernels skip the module's hooks
        if not plain_activation(act) or (isinstance(act, nn.Module) and not _unhooked(act)):
            return None
        (g, g_bias, g_lora), (d, d_bias, d_lora) = projections[0], projections[-1]
        u, u_bias, u_lora = projections[1] if self.up else (None, None, None)
        name = f"{type(module).__name__}.{self.gate}"  # named in GLUWeights' shape error
        return GLUWeights(g, g_bias, u, u_bias, d, d_bias, act, name, lora=(g_lora, u_lora, d_lora))


def glu_from_attrs(gate: str, up: str, down: str, act: str) -> GLUReader:
    """Reader for ``down(act(gate(x)) * up(x))`` with three separate Linear projections."""
    _check_names(gate=gate, up=up, down=down, act=act)
    return _GLUReader(gate, up, down, act)


def fused_glu_from_attrs(gate_up: str, down: str, act: str) -> GLUReader:
    """Reader for ``down(act(gate) * up)`` where ``gate, up = gate_up(x).chunk(2, -1)``."""
    _check_names(gate_up=gate_up, down=down, act=act)
    return _GLUReader(gate_up, "", down, act)


def _check_names(**names: object) -> None:
    for arg, value in names.items():
        if not isinstance(value, str) or not value:
            raise TypeError(f"{arg} must be the name of the module's attribute (a non-empty str), got {value!r}")


def _experts_intermediate(module: nn.Module, hidden: int) -> int | None:
    """The expert width from the 3-D ``down_proj`` (``[E, H, I]``, or ``[E, I, H]`` transposed as in GPT-OSS)."""
    down = getattr(module, "down_proj", None)
    shape = tuple(getattr(down, "ds_shape", getattr(down, "shape", ())))  # ZeRO-3 keeps the full shape in ds_shape
    if len(shape) != 3:
        return None
    return int(shape[1]) if shape[2] == hidden and shape[1] != hidden else int(shape[2])


_EXPERTS = MLPSpec(num_token_args=2, intermediate_size=_experts_intermediate, routed=True)


_REGISTRY: dict[str, MLPSpec] = {}
_BUILTIN: set[str] = set()  # names registered here: they stand for transformers' classes of that name only


def register_mlp(cls: type | str, spec: MLPSpec | None = None, *, glu: GLUReader | None = None,
                 num_token_args: int = 0) -> MLPSpec:
    """Register how to tile the MLP class ``cls`` (a class or its name); returns the spec.

    Give either ``spec`` or ``glu``/``num_token_args``. Subclasses are tiled with the same spec unless they
    override ``forward`` (then they are recognised afresh, like any unregistered class).
    """
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"cls must be a class or a class name, got {cls!r}")
    if spec is not None:
        if not isinstance(spec, MLPSpec):
            raise TypeError(f"spec must be a tiledmlp.MLPSpec, got {type(spec).__name__}")
        if glu is not None or num_token_args:
            raise ValueError("give either spec=MLPSpec(...) or glu=/num_token_args=, not both")
    else:
        if glu is not None and not callable(glu):
            raise TypeError(f"glu must be a reader such as tiledmlp.glu_from_attrs(...), got {type(glu).__name__}")
        if isinstance(num_token_args, bool) or not isinstance(num_token_args, int) or num_token_args < 0:
            raise ValueError(f"num_token_args must be an int >= 0 (token-wise inputs after the hidden states), "
                             f"got {num_token_args!r}")
        if glu is not None and num_token_args:
            raise ValueError("a GLU reader tiles hidden_states-only MLPs: num_token_args must be 0 with glu=")
        spec = MLPSpec(glu=glu, num_token_args=num_token_args)
    _REGISTRY[name] = spec
    _BUILTIN.discard(name)
    return spec


_llama_like = glu_from_attrs("gate_proj", "up_proj", "down_proj", "act_fn")
for _name in ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP"):
    register_mlp(_name, glu=_llama_like)
register_mlp("Phi3MLP", glu=fused_glu_from_attrs("gate_up_proj", "down_proj", "activation_fn"))
register_mlp("GPT2MLP")
_BUILTIN.update(_REGISTRY)


def _registered(cls: type) -> MLPSpec | None:
    """The registry's spec for ``cls``: its own name's, or an ancestor's whose ``forward`` it still runs.

    A subclass that overrides ``forward`` computes something else than the registered formula, and a class that
    only shares a built-in entry's name (``LlamaMLP``) outside transformers may too: neither takes that entry.
    """
    for klass in cls.__mro__:
        spec = _REGISTRY.get(klass.__name__)
        if spec is None:
            continue
        if klass.__name__ in _BUILTIN and not klass.__module__.startswith("transformers."):
            return None
        return spec if cls.forward is klass.forward else None
    return None


def spec_for(module: nn.Module) -> tuple[MLPSpec | None, str]:
    """The spec to tile ``module`` with, or ``(None, reason)`` when it is MLP-like but cannot be tiled."""
    name = type(module).__name__
    spec = _registered(type(module))
    if spec is not None:
        return spec, ""
    if name.endswith("Experts"):
        if _routed_experts(type(module)):
            return _EXPERTS, ""
        return None, "experts whose forward does not take tokens with their routing (e.g. grouped by expert)"
    if name.endswith(MOE_BLOCK_SUFFIXES) or _is_moe_block(module):
        return None, "sparse MoE block: its experts are tiled instead, the router stays untiled"
    if not name.endswith("MLP"):
        return None, ""
    required = _required_positional(module)
    residual = _takes_residual(type(module))
    if required != 1 + residual:
        return None, (f"forward needs {required} positional inputs; only MLPs taking hidden_states (and a residual "
                      "to add) can be tiled")
    if _is_llama_like(type(module)):
        return MLPSpec(glu=_llama_like), ""
    mixing = _token_mixing(type(module)) or next(
        (f"a {type(m).__name__}" for m in module.modules() if isinstance(m, nn.modules.conv._ConvNd)), "")
    if mixing:
        return None, (f"not token-wise: it uses {mixing}, so a tile of tokens is not what it expects "
                      "(register_mlp it if it is token-wise)")
    return MLPSpec(num_token_args=int(residual)), ""


_LLAMA_FORWARD = ast.dump(
    ast.parse("self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))", mode="eval").body
)


@functools.lru_cache(maxsize=None)
def _is_llama_like(cls: type) -> bool:
    """True when ``cls.forward`` is literally ``return down_proj(act_fn(gate_proj(x)) * up_proj(x))``.

    Dozens of Hugging Face MLP classes are copies of LlamaMLP; reading the forward's syntax tree lets them all
    take the fast path without listing them, and anything that differs in the slightest takes the generic path.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    func = tree.body[0]
    if not isinstance(func, ast.FunctionDef) or len(func.args.args) != 2:
        return False
    arg = func.args.args[1].arg
    has_docstring = isinstance(func.body[0], ast.Expr) and isinstance(func.body[0].value, ast.Constant)
    body = func.body[1:] if has_docstring else func.body
    expr = None
    if len(body) == 1 and isinstance(body[0], ast.Return):
        expr = body[0].value
    elif (len(body) == 2 and isinstance(body[0], ast.Assign) and len(body[0].targets) == 1
          and isinstance(body[0].targets[0], ast.Name) and isinstance(body[1], ast.Return)
          and isinstance(body[1].value, ast.Name) and body[1].value.id == body[0].targets[0].id):
        expr = body[0].value
    if expr is None:
        return False
    renamed = ast.dump(expr).replace(f"Name(id='{arg}', ctx=Load())", "Name(id='x', ctx=Load())")
    return renamed == _LLAMA_FORWARD


# What moves tokens across the tiled dims (Llama-4's vision adapter pixel-shuffles its patches, GroupViT's mixer
# transposes tokens into features, Segformer's flattens an image): a tile would be a malformed input, not a batch.
_TOKEN_MOVES = frozenset({"transpose", "permute", "flatten", "movedim", "moveaxis", "swapaxes", "swapdims", "T", "mT",
                          "pixel_shuffle", "pixel_unshuffle", "unfold", "roll", "cumsum", "cumprod"})


@functools.lru_cache(maxsize=None)
def _token_mixing(cls: type) -> str:
    """The first of :data:`_TOKEN_MOVES` that ``cls.forward`` names (``x.transpose(1, 2)``, ``pixel_shuffle(x)``),
    or "": a module named ``...MLP`` is tiled as token-wise only when its forward moves no dims."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _TOKEN_MOVES:
            return node.attr
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _TOKEN_MOVES:
            return node.func.id
    return ""


@functools.lru_cache(maxsize=None)
def _routed_experts(cls: type) -> bool:
    """True when ``cls.forward(hidden_states, <routing index>, <routing weights>)`` (see :data:`ROUTING_ARGS`)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 3 and all(p.kind in kinds for p in params) \
        and tuple(p.name for p in params[1:]) in ROUTING_ARGS


@functools.lru_cache(maxsize=None)
def _takes_residual(cls: type) -> bool:
    """True when ``cls.forward(hidden_states, residual, ...)`` requires a second input named as in
    :data:`RESIDUAL_ARGS`: that one is cut with the tokens (the call runs untiled where it is not shaped so)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) >= 2 and params[1].name in RESIDUAL_ARGS and params[1].kind in kinds \
        and params[1].default is inspect.Parameter.empty


def _is_moe_block(module: nn.Module) -> bool:
    """A module that routes: a router among its children, or routed experts (GPT-OSS's ``GptOssMLP``)."""
    return any(type(c).__name__.endswith("Router")
               or (type(c).__name__.endswith("Experts") and _routed_experts(type(c))) for c in module.children())


def _required_positional(module: nn.Module) -> int:
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return -1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty) - 1


def token_wise(value: object, hidden_states: torch.Tensor) -> bool:
    """A token argument (a residual, routing ``[T, k]``) the tiles can cut: a tensor with the hidden states' leading
    token dims and no fewer dims. Anything else runs the module untiled: a tensor of other leading dims (a residual
    broadcast over the batch, a per-sequence tensor) or of fewer dims (broadcast against the features) is not cut
    with the tokens in the untiled call either."""
    n = hidden_states.dim() - 1
    return isinstance(value, torch.Tensor) and value.dim() > n and value.shape[:n] == hidden_states.shape[:n]


def flat_routing(hidden_states: object, args: tuple) -> bool:
    """Routing over the flattened tokens of batched hidden states: the experts flatten them as they route."""
    return (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() > 2 and bool(args)
            and isinstance(args[0], torch.Tensor) and args[0].dim() == 2
            and args[0].shape[0] == hidden_states.numel() // max(hidden_states.shape[-1], 1) != hidden_states.shape[0])
