"""Peak memory of one vision-language training step (forward + backward), untiled vs ``tiledmlp.patch(loss=True)``.

A Qwen2.5-VL with the real vocabulary (151936) and a small decoder (hidden 256, intermediate 1024, 2 layers), one
image (its tokens masked from the loss, as a chat template does) in a sequence of ``--tokens`` tokens, float32 on
the CPU. Peaks are exact allocation peaks above the pre-step baseline (the torch profiler's memory events,
``tiledmlp.measure.profiler_peak_bytes``); the loss and every parameter's grad are compared between the two.

    .venv/bin/python benchmarks/vlm_memory.py [--tokens 4096] [--check 0.5]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import transformers as tf

import tiledmlp
from tiledmlp.measure import profiler_peak_bytes

MIB = 2**20
VOCAB, IMAGE, START, END = 151936, 151655, 151652, 151653


def build() -> torch.nn.Module:
    config = tf.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                           fullatt_block_indexes=[1], spatial_merge_size=2),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    return tf.Qwen2_5_VLForConditionalGeneration(config).train()


def batch(tokens: int, grid: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """``tokens`` ids with one image of ``grid`` (t, h, w) patches after the first 8, the labels masking it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150000, (1, tokens), generator=g)
    merged = grid[0] * grid[1] * grid[2] // 4
    ids[0, 8], ids[0, 9:9 + merged], ids[0, 9 + merged] = START, IMAGE, END
    labels = ids.clone()
    labels[0, :10 + merged] = -100
    patch = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14
    pixels = torch.randn(grid[0] * grid[1] * grid[2], patch, generator=g)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels, "image_grid_thw": torch.tensor([grid])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--check", type=float, default=None, help="exit 1 if tiled/untiled exceeds this ratio")
    args = parser.parse_args(argv)
    inputs = batch(args.tokens, (1, 16, 16))  # 256 patches, 64 image tokens
    untiled = build()
    tiled = copy.deepcopy(untiled)
    report = tiledmlp.patch(tiled, loss=True)
    results = {}
    for name, model in (("untiled", untiled), ("tiled", tiled)):
        out: dict[str, torch.Tensor] = {}

        def step(model: torch.nn.Module = model, out: dict = out) -> None:
            model.zero_grad(set_to_none=True)
            loss = model(**inputs).loss
            loss.backward()
            out["loss"] = loss.detach()

        peak = profiler_peak_bytes(step, device="cpu")
        results[name] = (peak, out["loss"], {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (peak_u, _, grads_u), (peak_t, _, grads_t) = results["untiled"], results["tiled"]
    worst = max(float((grads_t[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in grads_u.items())
    ratio = peak_t / peak_u
    print(f"Qwen2.5-VL (hidden 256, vocab {VOCAB}), 1 x {args.tokens} tokens with a 64-token image, float32, CPU; "
          f"{len(report.patched)} MLPs tiled + the loss")
    for name, (peak, loss, _) in results.items():
        print(f"{name + ':':9}{peak / MIB:9.1f} MiB   loss {float(loss):.6f}")
    print(f"ratio:   {ratio:9.3f}   worst relative grad difference {worst:.2e} over {len(grads_u)} parameters")
    failed = args.check is not None and ratio > args.check
    if failed:
        print(f"FAIL: tiled/untiled {ratio:.3f} > --check {args.check}", file=sys.stderr)
    return int(failed)

if __name__ == "__main__":
    sys.exit(main())
