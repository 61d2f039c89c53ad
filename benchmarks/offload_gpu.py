"""Activation offloading on one GPU: peak memory and step time with and without it, side by side in one process.

A Llama-3.2-1B-shaped model (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 kv heads, vocab 128256, tied
embeddings) with random weights, bf16, AdamW, non-reentrant activation checkpointing, tiled MLP + tiled loss
(``tiledmlp.patch(model, loss=True)``), one sequence per step. The two modes share the model and the optimizer
and are interleaved (A B, B A, ...); each step's peak is ``max_memory_allocated`` since the step began (weights,
grads and AdamW state included), its time the median of the timed steps. Targets (issue 12): peak <= 0.6x and
step time <= 1.10x the run without offloading.

    python benchmarks/offload_gpu.py                 # --seq 128k,256k, 1 warm-up + 2 timed steps per mode
    python benchmarks/offload_gpu.py --warmup 0      # host buffers pre-pinned (prepin), no warm-up step
    python benchmarks/offload_gpu.py --tiny          # CPU smoke test in seconds (copies forced through the host path)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any, Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.bench.timing import time_interleaved
from tiledmlp.measure import resolve_device

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)
MODES = ("checkpointing", "+ offload", "+ offload, split")  # split: offload_activations(split_layers=True)
GIB = 2**30


def tokens(text: str) -> int:
    """``131072``, ``128k`` or ``1m`` tokens."""
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024**2}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def build(shape: dict[str, Any], max_tokens: int, device: torch.device) -> torch.nn.Module:
    config = LlamaConfig(**shape, max_position_embeddings=max_tokens, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    tiledmlp.patch(model, num_shards="auto", loss=True)
    return model


class Runner:
    """One training step per call in either mode; remembers each step's peak, the offload figures and OOMs."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.module = torch.get_device_module(device) if device.type != "cpu" else None
        self.ids: torch.Tensor | None = None
        self.peaks: dict[str, list[int]] = {m: [] for m in MODES}
        self.moved: dict[str, dict[str, int]] = {}  # per offloading mode, its last step
        self.failed: dict[str, str] = {}

    def prime(self, vocab: int) -> None:
        """AdamW's state as every step after the first has it (zero grads, one step), and one short step per mode
        (compiles the tiles' kernels), so that even a first timed step at a long length is a steady-state one."""
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ids = torch.randint(0, vocab, (1, 4096), device=self.device)
        for mode in MODES:
            self.step(mode)()
        self.peaks = {m: [] for m in MODES}

    def step(self, mode: str) -> Callable[[], None]:
        def run() -> None:
            if mode in self.failed:
                return
            if self.module is not None:
                self.module.reset_peak_memory_stats(self.device)
            offload = mode != MODES[0]
            cpu = self.module is None  # the smoke test: every tensor through the copy path, none too small
            ctx = tiledmlp.offload_activations(self.model, checkpointing=False, min_bytes=0 if cpu else 2**20,
                                               split_layers=mode == MODES[2], _copy_on_cpu=cpu) \
                if offload else contextlib.nullcontext()
            try:
                with ctx as off:
                    self.model(input_ids=self.ids, labels=self.ids).loss.backward()
                self.opt.step()
            except torch.OutOfMemoryError as exc:
                self.failed[mode] = f"OOM ({str(exc).splitlines()[0][:60]})"
            self.opt.zero_grad(set_to_none=True)
            if mode in self.failed:
                self.module.empty_cache()
                return
            if self.module is not None:
                self.module.synchronize(self.device)
                self.peaks[mode].append(self.module.max_memory_allocated(self.device))
            if offload:
                self.moved[mode] = {"bytes": off.stats.offloaded_bytes, "tensors": off.stats.offloaded,
                              "waited": off.stats.waited}

        return run


def prepin(runner: Runner, seq: int) -> None:
    """Pin, and free into torch's pinned-host cache, the host buffers an offloaded step at ``seq`` tokens takes
    (every layer's input, twice with split layers, and the final norm's, ``[seq, hidden]`` in bf16), so that a
    timed step without a warm-up at that length is a steady-state one, as every training step after the first is:
    pinning 8-17 GiB for the first time took seconds (in the 2026-11-23 128k figure)."""
    if runner.module is None:
        return
    config = runner.model.config
    held = [torch.empty((seq, config.hidden_size), dtype=torch.bfloat16, pin_memory=True)
            for _ in range(2 * config.num_hidden_layers + 2)]
    del held


def measure(runner: Runner, seq: int, vocab: int, warmup: int, steps: int) -> list[str]:
    runner.ids = torch.randint(0, vocab, (1, seq), device=runner.device)
    prepin(runner, seq)
    runner.peaks = {m: [] for m in MODES}
    runner.failed = {}
    times = time_interleaved({m: runner.step(m) for m in MODES}, warmup=warmup, repeat=steps, device=runner.device)
    rows, figures = [], {}
    for mode in MODES:
        if mode in runner.failed:
            rows.append(f"{seq:>8}  {mode:<18}  {runner.failed[mode]}")
            continue
        peak = max(runner.peaks[mode], default=0)  # none on CPU (no device allocator)
        median = statistics.median(times[mode])
        figures[mode] = (peak, median)
        got = runner.moved.get(mode)
        moved = (f"{got['tensors']} tensors, {got['bytes'] / 2**20:,.0f} MiB to host per step, {got['waited']} waits"
                 if got else "")
        shown = f"{peak / GIB:9.2f}" if peak else f"{'-':>9}"
        rows.append(f"{seq:>8}  {mode:<18}  {shown}  {median:9.2f}  {seq / median:9,.0f}  {moved}")
    verdict = {True: "met", False: "MISSED"}
    for mode in MODES[1:]:
        if mode in figures and MODES[0] in figures and figures[MODES[0]][0]:
            (p0, t0), (p1, t1) = figures[MODES[0]], figures[mode]
            rows.append(f"{'':>8}  {'ratio' + mode[1:]:<18}  {p1 / p0:9.3f}  {t1 / t0:9.3f}   targets: peak <= 0.60 "
                        f"({verdict[p1 / p0 <= 0.6]}), time <= 1.10 ({verdict[t1 / t0 <= 1.1]})")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default=None, help="comma-separated token counts (default 128k,256k; --tiny: 256)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps per mode at each length first (default 1; AdamW's state and the "
                             "kernels are primed by a short step anyway)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode (default 2)")
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU: a smoke test of this script")
    args = parser.parse_args(argv)
    seqs = [tokens(s) for s in (args.seq or ("256" if args.tiny else "128k,256k")).split(",")]
    device = torch.device("cpu") if args.tiny else resolve_device()
    if device.type == "cpu" and not args.tiny:
        print("no accelerator found: run with --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else LLAMA_1B
    start = time.perf_counter()
    runner = Runner(build(shape, max(seqs), device), device)
    runner.prime(shape["vocab_size"])
    name = torch.get_device_module(device).get_device_name(device) if device.type != "cpu" else "cpu"
    print(f"Llama-3.2-1B shape{' (tiny)' if args.tiny else ''}: {shape}; bf16, AdamW, non-reentrant checkpointing, "
          f"tiled MLP + tiled loss; {args.warmup} warm-up + {args.steps} timed step(s) per mode, interleaved; {name}")
    print(f"{'tokens':>8}  {'mode':<18}  {'peak GiB':>9}  {'step s':>9}  {'tok/s':>9}")
    for seq in seqs:
        for row in measure(runner, seq, shape["vocab_size"], args.warmup, args.steps):
            print(row, flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
