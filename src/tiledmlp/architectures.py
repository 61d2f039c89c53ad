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
  forward is literally Llama's.

Register a new class in a few lines::

    tiledmlp.register_mlp("MyMLP", glu=tiledmlp.glu_from_attrs("w1", "w3", "w2", "act"))
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .glu import GLUWeights

__all__ = ["MLPSpec", "register_mlp", "spec_for", "glu_from_attrs", "fused_glu_from_attrs", "MOE_BLOCK_SUFFIXES",
           "ROUTING_ARGS"]

GLUReader = Callable[[nn.Module], "GLUWeights | None"]

# Sparse MoE blocks are not tiled whole: their router stays untiled (its logits keep their gradients for
# the aux loss, and transformers records them with a hook that must fire once), their experts are tiled.
MOE_BLOCK_SUFFIXES = ("SparseMoeBlock", "MoeBlock", "MoE")
# The token-wise routing arguments experts take after the hidden states (transformers' names).
ROUTING_ARGS = (("top_k_index", "top_k_weights"), ("router_indices", "routing_weights"),
                ("selected_experts", "routing_weights"))


@dataclass(frozen=True)
class MLPSpec:
    """How to tile one MLP class."""

    glu: GLUReader | None = None
    num_token_args: int = 0
    intermediate_size: Callable[[nn.Module, int], int | None] | None = None  # (module, hidden size)


def _plain_linear(module: object) -> bool:
    """Exactly ``nn.Linear`` with no hooks: safe to call as ``F.linear`` (LoRA/FSDP/ZeRO wrappers are not)."""
    return (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not hasattr(module.weight, "ds_id")
    )


def glu_from_attrs(gate: str, up: str, down: str, act: str) -> GLUReader:
    """Reader for ``down(act(gate(x)) * up(x))`` with three separate Linear projections."""

    def read(module: nn.Module) -> GLUWeights | None:
        g, u, d = getattr(module, gate), getattr(module, up), getattr(module, down)
        if not all(_plain_linear(m) for m in (g, u, d)):
            return None
        return GLUWeights(g.weight, g.bias, u.weight, u.bias, d.weight, d.bias, getattr(module, act))

    return read


def fused_glu_from_attrs(gate_up: str, down: str, act: str) -> GLUReader:
    """Reader for ``down(act(gate) * up)`` where ``gate, up = gate_up(x).chunk(2, -1)``."""

    def read(module: nn.Module) -> GLUWeights | None:
        gu, d = getattr(module, gate_up), getattr(module, down)
        if not (_plain_linear(gu) and _plain_linear(d)):
            return None
        return GLUWeights(gu.weight, gu.bias, None, None, d.weight, d.bias, getattr(module, act))

    return read


def _experts_intermediate(module: nn.Module, hidden: int) -> int | None:
    """The expert width from the 3-D ``down_proj`` (``[E, H, I]``, or ``[E, I, H]`` transposed as in GPT-OSS)."""
    down = getattr(module, "down_proj", None)
    shape = tuple(getattr(down, "ds_shape", getattr(down, "shape", ())))  # ZeRO-3 keeps the full shape in ds_shape
    if len(shape) != 3:
        return None
    return int(shape[1]) if shape[2] == hidden and shape[1] != hidden else int(shape[2])


_EXPERTS = MLPSpec(num_token_args=2, intermediate_size=_experts_intermediate)


_REGISTRY: dict[str, MLPSpec] = {}


def register_mlp(cls: type | str, spec: MLPSpec | None = None, *, glu: GLUReader | None = None,
                 num_token_args: int = 0) -> MLPSpec:
    """Register how to tile the MLP class ``cls`` (a class or its name); returns the spec."""
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"cls must be a class or a class name, got {cls!r}")
    spec = spec or MLPSpec(glu=glu, num_token_args=num_token_args)
    _REGISTRY[name] = spec
    return spec


_llama_like = glu_from_attrs("gate_proj", "up_proj", "down_proj", "act_fn")
for _name in ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP"):
    register_mlp(_name, glu=_llama_like)
register_mlp("Phi3MLP", glu=fused_glu_from_attrs("gate_up_proj", "down_proj", "activation_fn"))
register_mlp("GPT2MLP")


def spec_for(module: nn.Module) -> tuple[MLPSpec | None, str]:
    """The spec to tile ``module`` with, or ``(None, reason)`` when it is MLP-like but cannot be tiled."""
    name = type(module).__name__
    for klass in type(module).__mro__:
        if klass.__name__ in _REGISTRY:
            return _REGISTRY[klass.__name__], ""
    if name.endswith("Experts"):
        if _routed_experts(type(module)):
            return _EXPERTS, ""
        return None, "experts whose forward does not take tokens with their routing (e.g. grouped by expert)"
    if name.endswith(MOE_BLOCK_SUFFIXES) or _is_moe_block(module):
        return None, "sparse MoE block: its experts are tiled instead, the router stays untiled"
    if not name.endswith("MLP"):
        return None, ""
    required = _required_positional(module)
    if required != 1:
        return None, f"forward needs {required} positional inputs; only hidden_states-only MLPs can be tiled"
    return (MLPSpec(glu=_llama_like) if _is_llama_like(type(module)) else MLPSpec()), ""


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
