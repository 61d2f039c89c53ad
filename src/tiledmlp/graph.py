"""What a tiled Function's recomputed graph may reach, checked by walking autograd's graph: a trainable tensor
``fn`` reads but ``params`` leaves out (its gradient would be lost), and one listed tensor computed from another
(a path's gradient would be counted twice). Apart from :mod:`tiledmlp.engine`, which runs the tiles: shared with
:mod:`tiledmlp.zero3`."""

from __future__ import annotations

from typing import Any, Collection, Sequence

import torch

__all__ = ["graph_leaves", "unlisted_leaves", "refuse_unlisted", "refuse_params_computed_from_params"]


def graph_leaves(outputs: Sequence[torch.Tensor], stop: Collection[Any] = ()) -> list[torch.Tensor]:
    """The leaf tensors whose grad accumulators the autograd graph of ``outputs`` reaches (not past ``stop`` nodes)."""
    seen, stack, found = set(), [o.grad_fn for o in outputs if o.grad_fn is not None], []
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def unlisted_leaves(outputs: Sequence[torch.Tensor], allowed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves requiring grad that the recomputed graph reaches but that were not declared: their grads would be lost.

    A declared tensor computed outside ``fn`` (a masked weight) gets its grad, which flows on from there: the walk
    stops at it."""
    allowed_ids = {id(t) for t in allowed}
    computed = {t.grad_fn for t in allowed if t.grad_fn is not None}
    return [t for t in graph_leaves(outputs, computed) if id(t) not in allowed_ids]


def refuse_params_computed_from_params(params: Sequence[torch.Tensor]) -> None:
    """Raise where one listed tensor is computed from another (``V = W.t()``, both in ``params``): each tile's grad
    of ``W`` already holds the path through ``V``, and ``V``'s grad, handed back, would flow on to ``W`` again (a
    silently doubled path). Walks the graphs of computed params only: leaves cost nothing."""
    computed = [p for p in params if p.grad_fn is not None]
    if not computed:
        return
    listed = {id(p): p for p in params}
    nodes = {p.grad_fn: p for p in computed}
    for p in computed:
        seen, stack = set(), [next_node for next_node, _ in p.grad_fn.next_functions]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            source = nodes.get(node)
            if source is None:
                source = listed.get(id(getattr(node, "variable", None)))
            if source is not None:
                raise ValueError(
                    f"tiledmlp: params lists a tensor {tuple(p.shape)} computed from another it lists "
                    f"{tuple(source.shape)}: the second's gradient would count the path through the first twice. "
                    "List the tensors fn reads that are not computed from each other: compute the first inside fn "
                    "from the second (then list the second only)")
            stack.extend(next_node for next_node, _ in node.next_functions)


def refuse_unlisted(outputs: Sequence[torch.Tensor], allowed: Sequence[torch.Tensor]) -> None:
    """Raise when the recomputed graph reaches a tensor requiring grad that is not in ``allowed``."""
    missing = unlisted_leaves(outputs, allowed)
    if missing:
        shapes = ", ".join(str(tuple(t.shape)) for t in missing[:4])
        raise RuntimeError(
            f"tiledmlp: the tiled fn uses {len(missing)} tensor(s) requiring grad that were not passed as params "
            f"(shapes {shapes}); their gradients would be lost. Pass every trainable tensor fn uses in params=, "
            "e.g. params=module.parameters()"
        )
