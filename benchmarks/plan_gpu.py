"""Check ``tiledmlp plan`` against CUDA's allocator: a Llama-3.2-1B-shaped model, random weights, bf16, AdamW,
activation checkpointing, one measured step per (recipe, sequence) after a warm-up step. With ``--gpt2``: a
GPT-2-small-shaped model in float32 under bf16 autocast (``--bf16``), no checkpointing, where its MLP's activations
are the step's largest term and CUDA's autocast runs its tanh GELU in float32 (planned so since 2026-11-27). With
``--autocast``: the Llama shape in float32 under bf16 autocast, Trainer's usual ``--bf16`` run (the plan's autocast
terms were fitted on the CPU only).

    PYTHONPATH=src python benchmarks/plan_gpu.py            # CUDA, 32k..256k tokens (~3 min on one H100)
    PYTHONPATH=src python benchmarks/plan_gpu.py --gpt2     # CUDA, 8k and 16k tokens (under a minute)
    PYTHONPATH=src python benchmarks/plan_gpu.py --autocast # CUDA, 16k..128k tokens (about 2 minutes)
    PYTHONPATH=src python benchmarks/plan_gpu.py --tiny [--gpt2]  # CPU, tiny model (what the tests run)

Prints a markdown table: planned peak, measured peak (``max_memory_allocated``; CPU: profiler), their ratio.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

import tiledmlp  # noqa: E402
from tiledmlp.hf_compat import enable_checkpointing  # noqa: E402
from tiledmlp.plan import ModelShape, Setup, predict_step_peak  # noqa: E402
from tiledmlp.plan.measure import measure_step_peak  # noqa: E402

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=262144, tie_word_embeddings=True,
                rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=257, max_position_embeddings=65536, tie_word_embeddings=True)
GPT2_SMALL = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=65536)
GPT2_TINY = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=257, n_positions=4096)
RECIPES = {"untiled": (False, False), "tiled MLP": (True, False), "tiled MLP + loss": (True, True)}
GPU_RUNS = [("untiled", 32768), ("tiled MLP + loss", 32768), ("tiled MLP + loss", 65536),
            ("tiled MLP + loss", 131072), ("tiled MLP + loss", 262144)]
CPU_RUNS = [("untiled", 256), ("tiled MLP + loss", 256), ("tiled MLP + loss", 512)]
GPT2_GPU_RUNS = [("untiled", 8192), ("untiled", 16384), ("tiled MLP", 16384)]  # GPT-2's loss is not tiled
AUTOCAST_GPU_RUNS = [("untiled", 16384), ("tiled MLP + loss", 32768), ("tiled MLP + loss", 131072)]
GPT2_CPU_RUNS = [("untiled", 512), ("tiled MLP", 1024)]


def one(config: tf.PretrainedConfig, recipe: str, seq: int, device: torch.device, autocast: bool,
        checkpointing: bool) -> tuple[int, int]:
    """(planned, measured) peak bytes; ``autocast``: float32 weights under bf16 autocast (Trainer's ``--bf16``),
    else bf16 weights."""
    tiled, loss = RECIPES[recipe]
    dtype = torch.float32 if autocast else torch.bfloat16
    torch.manual_seed(0)
    with device:
        model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    model.train()
    if tiled:
        tiledmlp.patch(model)
    if loss:
        tiledmlp.patch_loss(model)
    if checkpointing:
        enable_checkpointing(model, {"use_reentrant": False})
    ids = torch.randint(0, config.vocab_size, (1, seq), device=device)
    setup = Setup(dtype=dtype, autocast=autocast, tiled_mlp=tiled, tiled_loss=loss, checkpointing=checkpointing,
                  device_type=device.type)
    planned = predict_step_peak(ModelShape.from_config(config), setup, seq).peak_bytes
    try:
        measured = measure_step_peak(model, ids, autocast_dtype=torch.bfloat16 if autocast else None)
    except torch.OutOfMemoryError:
        measured = -1
    del model, ids
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return planned, measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny model (a smoke test of this script)")
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 small, float32 weights under bf16 autocast, no "
                        "checkpointing")
    parser.add_argument("--autocast", action="store_true", help="the Llama shape in float32 under bf16 autocast")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    autocast, checkpointing = args.gpt2 or args.autocast, not args.gpt2
    if args.gpt2:
        config = tf.GPT2Config(**(GPT2_SMALL if cuda else GPT2_TINY), attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        runs = GPT2_GPU_RUNS if cuda else GPT2_CPU_RUNS
    else:
        config = tf.LlamaConfig(**(LLAMA_1B if cuda else TINY))
        runs = (AUTOCAST_GPU_RUNS if autocast else GPU_RUNS) if cuda else CPU_RUNS
    recipe_text = (f"{'float32 weights, bf16 autocast' if autocast else 'bf16 weights'}, "
                   f"{'activation checkpointing' if checkpointing else 'no checkpointing'}")
    config._attn_implementation = "sdpa"
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
          f"transformers {tf.__version__}, {type(config).__name__}, {recipe_text}, AdamW, sdpa")
    print("| recipe | seq | planned GiB | measured GiB | plan/measured |")
    print("|---|---:|---:|---:|---:|")
    for recipe, seq in runs:
        start = time.perf_counter()
        planned, measured = one(config, recipe, seq, device, autocast, checkpointing)
        ratio = f"{planned / measured:.3f}" if measured > 0 else "OOM"
        print(f"| {recipe} | {seq} | {planned / 2**30:.2f} | "
              f"{measured / 2**30 if measured > 0 else float('nan'):.2f} | {ratio} |", flush=True)
        print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
