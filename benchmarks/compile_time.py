"""Dynamo's graph breaks, graphs and time for ``torch.compile`` of a tiny patched Llama (tiled MLPs + tiled loss).

The tiled calls run eagerly under ``torch.compile`` (each a graph break); what Dynamo traces around them is
compile time a user pays for nothing. Compare two checkouts side by side:
``PYTHONPATH=OLD/src python benchmarks/compile_time.py`` then ``python benchmarks/compile_time.py``, alternating.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import transformers as tf
from torch._dynamo.utils import compile_times, counters

import tiledmlp


def one_compile(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """A fresh compile (eager backend: Dynamo alone) called once without labels and once with them."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    start = time.perf_counter()
    with torch.no_grad():
        compiled(input_ids=ids)
        compiled(input_ids=ids, labels=ids)
    return {"seconds": time.perf_counter() - start, "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="fresh compiles per model (the first warms Dynamo up)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=96, max_position_embeddings=256)
    model = tf.LlamaForCausalLM(config).double().train()
    tiledmlp.patch(model, num_shards=3, loss=True)
    ids = torch.randint(0, 96, (2, 12))
    runs = [one_compile(model, ids) for _ in range(args.repeat)]
    for i, r in enumerate(runs):
        print(f"compile {i}: {r['seconds']:.2f} s with both calls, {r['graph_breaks']} graph breaks, "
              f"{r['graphs']} graphs")
    dynamo = dict(line.split(", ") for line in compile_times(repr="str", aggregate=True).splitlines()[2:])
    print(f"Dynamo's own time over {args.repeat} compile(s): {float(dynamo['_compile.compile_inner']):.2f} s")


if __name__ == "__main__":
    main()
