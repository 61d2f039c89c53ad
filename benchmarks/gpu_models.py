"""The tiled loss alone and a whole training step, tiledmlp vs Liger's recipe, side by side in one process.

Loss alone: ``tiled_causal_lm_loss`` (float32 dW sum; bf16 sum; float32 sum over half the auto tiles) vs
Liger's ``LigerFusedLinearCrossEntropyLoss`` (bf16 hidden states and lm_head, float32 loss), fwd+bwd,
interleaved, medians; peaks from the caching allocator above the baseline, and the planner's for the default.
Grads of both are compared with a float32 reference computed in tiles of logits.

Model level: a Llama-3.2-1B-shaped model (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads,
vocab 128256, tied embeddings), random weights, bf16, torch AdamW, non-reentrant activation checkpointing, SDPA,
one sequence per step: ``tiledmlp.patch(model, loss=True)`` (auto tiles) vs Liger's recipe (its fused linear
cross-entropy forward + ``LigerTiledSwiGLUMLP`` with the same ceil(seq/hidden) shards); untiled where it fits.
Each recipe gets its own model (same seed); steps are interleaved after one warm-up step each.

    python benchmarks/gpu_models.py --seq 32768,131072 --out out.json
    python benchmarks/gpu_models.py --tiny          # a CPU smoke run (tiny shapes, the peers skipped)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from typing import Any, Callable

import torch

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.loss import plan_loss_tiles
from tiledmlp.measure import profiler_peak_bytes, resolve_device, synchronize
from tiledmlp.pointwise import fused_enabled
from tiledmlp.plan import predict_loss_peak

GiB = 2**30


def _liger() -> Any:
    try:
        import liger_kernel.transformers as lt  # noqa: F401
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_llama
        from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP
    except Exception:  # liger needs triton and a GPU
        return None
    return LigerFusedLinearCrossEntropyLoss, apply_liger_kernel_to_llama, LigerTiledSwiGLUMLP


def _interleave(steps: dict[str, Callable[[], Any]], repeat: int, device: torch.device) -> dict[str, dict]:
    """Warm-up once each, then ``repeat`` rounds A B C / B C A ...; per step its time and peak above baseline."""
    out: dict[str, dict] = {n: {"s": [], "peak": []} for n in steps}
    for name, step in steps.items():
        step()
    names = list(steps)
    for r in range(repeat):
        for name in names[r % len(names):] + names[: r % len(names)]:

            def timed(step: Callable[[], Any] = steps[name], seconds: list = out[name]["s"]) -> None:
                t0 = time.perf_counter()  # the peak counter's reset and garbage collection stay outside
                step()
                synchronize(device)
                seconds.append(time.perf_counter() - t0)

            out[name]["peak"].append(profiler_peak_bytes(timed, device=device))
    return {n: {"ms": 1000 * statistics.median(v["s"]), "peak_gib": max(v["peak"]) / GiB} for n, v in out.items()}


def loss_alone(tokens: int, hidden: int, vocab: int, repeat: int, device: torch.device) -> dict[str, dict]:
    torch.manual_seed(0)
    h = (torch.randn(tokens, hidden, device=device) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device)
    y[:: 7] = -100  # some masked tokens

    # the float32 dW sum (default); the bf16 sum, Liger's precision (--tiled_accumulate_dtype param); the float32
    # sum over half as many, twice as large tiles (its per-tile float32 read and write of the sum halved, one more
    # tile of logits held: the trade to measure)
    auto = len(plan_loss_tiles(int((y != -100).sum()), vocab, "auto", fused=fused_enabled(device)))
    variants: dict[str, dict[str, Any]] = {
        "tiledmlp": {}, "tiledmlp-param": {"accumulate_dtype": "param"},
        "tiledmlp-halftiles": {"num_shards": max(1, auto // 2)}}

    def ours(kwargs: dict[str, Any]) -> Callable[[], None]:
        def step() -> None:
            tiledmlp.tiled_causal_lm_loss(h, w, y, shift=False, **kwargs).backward()
            h.grad = w.grad = None
        return step

    steps: dict[str, Callable[[], Any]] = {name: ours(kwargs) for name, kwargs in variants.items()}
    liger = _liger()
    if liger is not None and device.type == "cuda":
        flce = liger[0]()

        def theirs() -> None:
            flce(w, h, y).backward()
            h.grad = w.grad = None

        steps["liger"] = theirs
    result = _interleave(steps, repeat, device)
    # what tiledmlp plan predicts for the loss step with float32 and with bf16 sums (every token labelled)
    for name, accumulate in (("tiledmlp", "auto"), ("tiledmlp-param", "param")):
        result[name]["planned_gib"] = predict_loss_peak(tokens, hidden, vocab, dtype=torch.bfloat16,
                                                        device_type=device.type, accumulate=accumulate) / GiB
    # exactness of both against a float32 reference (logits in tiles, autograd)
    ref_h, ref_w = _reference_loss_grads(h, w, y)
    checks = [(name, lambda kw=kwargs: tiledmlp.tiled_causal_lm_loss(h, w, y, shift=False, **kw))
              for name, kwargs in variants.items()]
    for name, fn in checks + [("liger", (lambda: flce(w, h, y)) if "liger" in steps else None)]:
        if fn is None:
            continue
        fn().backward()
        result[name]["dh_rel_err"] = _rel(h.grad, ref_h)
        result[name]["dw_rel_err"] = _rel(w.grad, ref_w)
        h.grad = w.grad = None
    return result


def _reference_loss_grads(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    count = int((y != -100).sum())
    for rows in torch.split(torch.arange(h.shape[0], device=h.device), 2048):
        logits = hf[rows] @ wf.t()
        (torch.nn.functional.cross_entropy(logits, y[rows], reduction="sum") / count).backward()
    return hf.grad, wf.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def build_model(cfg: dict, recipe: str, seq: int, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**cfg, max_position_embeddings=max(seq, 8192), tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    if recipe == "tiledmlp":
        tiledmlp.patch(model, num_shards="auto", loss=True)
    elif recipe == "liger":
        _, apply, tiled = _liger()
        apply(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False, swiglu=False,
              model=model)
        shards = math.ceil(seq / config.hidden_size)
        for layer in model.model.layers:
            new = tiled(config, num_shards=shards).to(device=device, dtype=torch.bfloat16)
            new.load_state_dict(layer.mlp.state_dict())
            layer.mlp = new
    return model


def model_steps(cfg: dict, seq: int, recipes: list[str], repeat: int, device: torch.device) -> dict[str, dict]:
    models, steps = {}, {}
    ids = torch.randint(0, cfg["vocab_size"], (1, seq), device=device)
    for recipe in recipes:
        model = build_model(cfg, recipe, seq, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(model=model, opt=opt) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        models[recipe], steps[recipe] = (model, opt), step
    try:
        return _interleave(steps, repeat, device)
    finally:
        del models, steps
        gc.collect()
        if device.type != "cpu":
            torch.get_device_module(device).empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="32768,131072")
    p.add_argument("--untiled-max", type=int, default=0,
                   help="longest seq an untiled model is also run at (its own model: 0 = none)")
    p.add_argument("--repeat", default="2",
                   help="timed rounds per length after the warm-up: one count, or one per --seq (e.g. 2,1: a 128k "
                        "step takes 15 s on an H100, and one round there keeps gpu.sh in its 9 minutes)")
    p.add_argument("--loss-tokens", type=int, default=32768)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a smoke run")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    # --tiny runs on the CPU even where CUDA is there: a smoke run whose peers (Liger) are CUDA-only
    device = torch.device("cpu") if args.tiny else resolve_device()
    cfg = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)
    seqs = [int(s) for s in args.seq.split(",") if s]
    repeats = [int(r) for r in args.repeat.split(",") if r.strip().isdigit()]
    if len(repeats) != len(args.repeat.split(",")) or len(repeats) not in (1, len(seqs)) or min(repeats) < 1:
        p.error(f"--repeat takes one count >= 1 or one per --seq length ({len(seqs)}), got {args.repeat!r}")
    loss_shape = (args.loss_tokens, 2048, 128256)
    if args.tiny:
        cfg.update(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
        seqs, loss_shape = [256], (256, 64, 512)
    repeats = dict(zip(seqs, repeats * len(seqs) if len(repeats) == 1 else repeats))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
                               "torch": torch.__version__, "loss": {}, "model": {},
                               "repeat": {str(seq): n for seq, n in repeats.items()}}
    def save() -> None:  # after each part: a run cut at its time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    results["loss"] = loss_alone(*loss_shape, max(repeats.values()) + 1, device)
    print(f"loss alone, {loss_shape[0]} tokens, vocab {loss_shape[2]}: {json.dumps(results['loss'])}", flush=True)
    save()
    recipes = ["tiledmlp"] + (["liger"] if _liger() is not None and device.type == "cuda" else [])
    for seq in seqs:
        names = recipes + (["untiled"] if seq <= args.untiled_max else [])
        try:
            results["model"][str(seq)] = model_steps(cfg, seq, names, repeats[seq], device)
        except Exception as exc:  # e.g. out of memory at one length: the others still run and are reported
            results.setdefault("errors", {})[str(seq)] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"model step, seq {seq} failed: {results['errors'][str(seq)]}", flush=True)
            continue
        print(f"model step, seq {seq}: {json.dumps(results['model'][str(seq)])}", flush=True)
        save()
    save()

if __name__ == "__main__":
    main()
