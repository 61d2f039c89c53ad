"""Single-process check of the grad-ready order under DeepSpeed ZeRO-1/2, whatever a call's tile count.

ZeRO-2 (and ZeRO-1 with ``overlap_comm``) packs each grad into a reduce bucket when it becomes ready and reduces
the bucket by position, so every rank must make its grads ready in the same order. Plain autograd makes a gated
MLP's ready as down, up, gate; the tiled Functions all at once, in another order. Before 2026-11-26 a 1-tile (or
0-token) call ran plain while a longer one on another rank ran tiled, and the reduced grads mixed params up (1.16
relative off untiled; the 2-process proof: ``test_backends.py::test_zero2_ranks_with_different_tile_counts_exact``).
Here the params carry the ``param_idx_in_group`` DeepSpeed's ZeRO-1/2 optimizer gives every param it trains.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import tiledmlp

pytest.importorskip("deepspeed")  # the ZeRO-1/2 check looks for the attribute only once deepspeed is loaded

HIDDEN = 16
LENGTHS = (0, 5, 40)  # 0 tokens, 1 tile, 3 tiles (num_shards="auto" at hidden 16)


def _run(path: str, length: int, zero12: bool) -> tuple[list[str], list[torch.Tensor], str, int]:
    """Grad-ready order, grads (input's first), the output's grad_fn and the tiles planned, for one patched MLP."""
    config = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    mlp = tf.models.llama.modeling_llama.LlamaMLP(config).double()
    if path == "generic":
        mlp.forward = mlp.forward  # a forward set on the instance (as accelerate's hooks do): the generic path
    tiledmlp.patch(mlp, num_shards="auto")
    assert mlp.forward.path() == path
    ready: list[str] = []
    for k, (name, p) in enumerate(mlp.named_parameters()):
        if zero12:
            p.param_idx_in_group = k  # what DeepSpeed's ZeRO-1/2 optimizer sets on each param it trains
        p.register_post_accumulate_grad_hook(lambda _p, name=name: ready.append(name.split(".")[0]))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, length, HIDDEN, dtype=torch.float64, generator=gen).requires_grad_()
    y = mlp(x)
    y.backward(torch.randn(y.shape, dtype=torch.float64, generator=gen))
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    return ready, grads, type(y.grad_fn).__name__, mlp.forward.last_num_tiles


@pytest.mark.parametrize("path", ["glu", "generic"])
def test_zero12_grads_ready_in_one_order_at_any_tile_count(path: str) -> None:
    orders, grad_fns = {}, []
    for length in LENGTHS:
        ready, grads, grad_fn, tiles = _run(path, length, zero12=True)
        _, want, plain_fn, _ = _run(path, length, zero12=False)
        orders[(length, tiles)] = ready
        grad_fns.append((tiles, grad_fn, plain_fn))
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    assert [t for _, t in orders] == [0, 1, 3], orders
    assert len({tuple(o) for o in orders.values()}) == 1, orders
    for tiles, grad_fn, plain_fn in grad_fns:
        assert "TiledFunction" in grad_fn, grad_fn  # 0 tokens and 1 tile too, under ZeRO-1/2
        if tiles <= 1:  # elsewhere a short call stays plain autograd: no recompute for anyone else
            assert "TiledFunction" not in plain_fn, plain_fn
