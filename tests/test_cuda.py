"""The CUDA paths: matmul-fused float32 accumulation, the compiled per-tile kernels (on by default there), the
tiled loss, and in-process allocator peaks. Skipped where no CUDA device is visible; run by benchmarks/gpu.sh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tiledmlp
from conftest import assert_rel, rel_err
from tiledmlp import pointwise
from tiledmlp.bench.configs import Config, make_step, predicted_bytes
from tiledmlp.glu import GLUWeights
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.measure import profiler_peak_bytes
from tiledmlp.precision import SplitSum, acc_mm, wide_mm_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda"


def test_matmul_accumulates_float32_grads_itself() -> None:
    """Four bf16 tile products summed by addmm(out_dtype=float32) into one float32 buffer: no bf16 rounding of any
    partial sum (which would leave ~4e-3 relative error), equal to the float64 sum to float32 precision."""
    assert wide_mm_available(DEV, torch.bfloat16)
    parts = [(torch.randn(96, 300, device=DEV).bfloat16(), torch.randn(300, 80, device=DEV).bfloat16())
             for _ in range(4)]
    acc = torch.empty(96, 80, device=DEV)
    for k, (a, b) in enumerate(parts):
        acc_mm(acc, a, b, first=k == 0)
    ref = sum(a.double() @ b.double() for a, b in parts)
    assert rel_err(acc, ref) <= 1e-6


def _spec(fused: bool, dtype: torch.dtype, h: int = 256, i: int = 704) -> GLUWeights:
    def p(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=DEV, dtype=torch.float64) * h**-0.5).to(dtype).requires_grad_()

    rows = 2 * i if fused else i
    return GLUWeights(p(rows, h), None, None if fused else p(i, h), None, p(h, i), None, F.silu)


def _untiled(spec: GLUWeights, x: torch.Tensor) -> torch.Tensor:
    gate, up = spec.gate_up(x)
    return F.linear(spec.act(gate) * up, spec.down_weight, spec.down_bias)


@pytest.mark.parametrize("fused_weights", [False, True])
def test_compiled_glu_path_float64_exact(fused_weights: bool) -> None:
    assert pointwise.fused_enabled(torch.device(DEV))
    spec = _spec(fused_weights, torch.float64, 64, 176)
    x = torch.randn(2, 301, 64, device=DEV, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    inputs = [x, *(t for t in spec.tensors() if t is not None)]
    ref = torch.autograd.grad(_untiled(spec, x), inputs, g)
    got = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, [151, 150, 150, 151]), inputs, g)
    for k, (a, b) in enumerate(zip(got, ref)):
        assert_rel(a, b, 1e-12, f"input {k}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_glu_path_16bit_error_no_worse_than_untiled(dtype: torch.dtype) -> None:
    spec = _spec(False, dtype)
    ref_spec = GLUWeights(*(None if t is None else t.detach().double().requires_grad_() for t in spec.tensors()),
                          act=F.silu)
    x = torch.randn(2, 2048, 256, device=DEV).to(dtype).requires_grad_()
    g = torch.randn_like(x)
    x64 = x.detach().double().requires_grad_()
    ref = torch.autograd.grad(_untiled(ref_spec, x64), [x64, *(t for t in ref_spec.tensors() if t is not None)],
                              g.double())
    inputs = [x, *(t for t in spec.tensors() if t is not None)]
    plain = torch.autograd.grad(_untiled(spec, x), inputs, g)
    tiled = torch.autograd.grad(tiledmlp.glu_tiled_call(spec, x, [512] * 8), inputs, g)
    for k, (t, u, r) in enumerate(zip(tiled, plain, ref)):
        assert t.dtype == dtype
        assert rel_err(t, r) <= 1.5 * rel_err(u, r), f"input {k}: tiled {rel_err(t, r):.2e} vs {rel_err(u, r):.2e}"


def test_tiled_loss_on_cuda_exact_and_16bit_no_worse_than_untiled() -> None:
    vocab, hidden = 1000, 64
    h = torch.randn(2, 300, hidden, device=DEV, dtype=torch.float64)
    w = torch.randn(vocab, hidden, device=DEV, dtype=torch.float64) * 0.3
    y = torch.randint(0, vocab, (2, 300), device=DEV)
    y[0, :100] = -100
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        for name in ("untiled", "tiled"):
            hd = h.to(dtype, copy=True).requires_grad_()
            wd = w.to(dtype, copy=True).requires_grad_()
            if name == "tiled":
                loss = tiledmlp.tiled_causal_lm_loss(hd, wd, y, num_shards=7) / 3
            else:
                logits = F.linear(hd, wd).float() if dtype != torch.float64 else F.linear(hd, wd)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), y[:, 1:].reshape(-1)) / 3
            loss.backward()
            results[(dtype, name)] = (loss.detach(), hd.grad, wd.grad)
    ref = results[(torch.float64, "untiled")]
    for a, b in zip(results[(torch.float64, "tiled")], ref):
        assert_rel(a, b, 1e-12)
    for t, u, r in zip(results[(torch.bfloat16, "tiled")], results[(torch.bfloat16, "untiled")], ref):
        assert rel_err(t, r) <= 1.5 * rel_err(u, r) + 1e-7


def test_float32_head_sum_becomes_the_bf16_grad_in_its_own_memory() -> None:
    """precision.SplitSum with CUDA's uncapped passes (the top block's 1M elements in doubling passes): bit-identical
    to the cast, in the top block's memory; and the tiled loss hands its bf16 head gradient over without a second
    weight-sized buffer (allocator peak: the float32 sum, one tile, dh; before, the cast added a bf16 copy)."""
    split = SplitSum((4097, 512), torch.float32, torch.bfloat16, torch.device(DEV))
    whole = torch.randn(4097, 512, device=DEV) * 1e-3
    for rows, block in split.blocks():
        block.copy_(whole[rows])
    g = torch.tensor(1 / 40, device=DEV)
    expected = torch.mul(whole, g).to(torch.bfloat16)
    top = split.top.data_ptr()
    narrowed = split.narrow_(g)
    assert torch.equal(narrowed, expected) and narrowed.data_ptr() == top
    vocab, hidden, tokens = 32768, 1024, 2048
    h = torch.randn(tokens, hidden, device=DEV).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=DEV) * hidden**-0.5).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=DEV)

    def step() -> None:
        (tiledmlp.tiled_causal_lm_loss(h, w, y, shift=False, num_shards=16) / 40).backward()
        h.grad = w.grad = None

    step()  # compiles the loss tile, allocates cuBLAS's workspace
    weight = vocab * hidden * 2
    peak = profiler_peak_bytes(step, device=DEV)
    assert peak < 2 * weight + weight // 2, (peak, weight)  # sum 2 weights; before: 3 weights at the cast


@pytest.mark.parametrize("seq", [8192, 2048], ids=["float32-sums", "stacks"])
def test_allocator_peak_of_the_compiled_path_matches_the_model(tmp_path: Path, seq: int) -> None:
    """LlamaMLP 1024/2816 bf16, 8192 tokens (float32 weight-grad sums) and 2048 (few enough tokens for the
    per-token stacks, memory.glu_stacks_fit): the in-process allocator peak is the model's (kernels='compiled'),
    and tiled at 4 tiles is below untiled: under 0.6x with the sums (the model: 0.38x), under 1x with the stacks,
    which hold three ``[T, I]`` operands for all tokens (the model: 0.64x)."""
    peaks = {}
    for impl, shards in (("untiled", "1"), ("tiledmlp", "4")):
        cfg = Config("swiglu", 1024, 2816, seq, 1, "bfloat16", impl, shards, DEV)
        # on an empty cache, as the bench measures each configuration: a cache left by earlier tests hands out
        # cached blocks up to 1 MiB larger than asked without splitting them, and the allocator counts them whole
        torch.cuda.empty_cache()
        step = make_step(**cfg.kwargs())
        step()
        peaks[impl] = profiler_peak_bytes(step, device=DEV)
        asked = _requested_peak_bytes(step)
        predicted = predicted_bytes(cfg)
        print(impl, peaks[impl], asked, predicted, asked / predicted)
        assert predicted is not None and abs(asked - predicted) <= 0.05 * predicted, (impl, asked, peaks[impl])
    assert peaks["tiledmlp"] < (0.6 if seq == 8192 else 1.0) * peaks["untiled"]


def _requested_peak_bytes(step: Any) -> int:
    """The step's peak of bytes its tensors asked for, above the pre-step level (the allocator's
    ``requested_bytes`` stats), which is what the model counts. ``max_memory_allocated`` counts whole blocks: an
    11 MiB ``[2048, 2816]`` bf16 buffer gets a 12 MiB segment (sizes over 10 MiB are rounded up to 2 MiB) whose
    1 MiB rest is too small to split off, so it counts 12 MiB; five such buffers live at the untiled peak made it
    5 MiB (6.3%) over the model on the H100 (2026-11-26), where at 8192 tokens (44 MiB buffers) it matched."""
    stats = torch.cuda.memory_stats
    if "requested_bytes.all.peak" not in stats(DEV):  # an older torch: whole blocks it is
        return profiler_peak_bytes(step, device=DEV)
    torch.cuda.synchronize(DEV)
    torch.cuda.reset_peak_memory_stats(DEV)
    before = stats(DEV)["requested_bytes.all.current"]
    step()
    torch.cuda.synchronize(DEV)
    return stats(DEV)["requested_bytes.all.peak"] - before


def test_bench_measures_in_process_on_cuda(tmp_path: Path) -> None:
    from tiledmlp.cli import main

    argv = ["bench", "--hidden", "256", "--intermediate", "704", "--seq", "4096", "--shards", "4", "--dtype",
            "bfloat16", "--impls", "untiled,tiledmlp", "--repeat", "2", "--no-progress", "--device", DEV,
            "--out", str(tmp_path)]
    assert main(argv) == 0
    import json

    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["untiled", "tiledmlp"]
    assert all(r["peak_bytes"] > 0 and r["ms"] > 0 for r in rows)
    assert rows[1]["mem_ratio"] < 1


def test_split_layers_on_cuda_same_loss_and_grads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 Llama (8 heads, 2 KV heads, 512 tokens) offloaded through pinned host memory, whole layers vs split
    layers with attention in two head groups: the same loss bit for bit (flash attention's forward is per head and
    deterministic) and the same grads up to flash attention's backward, whose dq is summed with atomics in any
    order (two whole-layer runs differ as much; the bound is set from them)."""
    import transformers as tf

    from tiledmlp import split_layers

    monkeypatch.setattr(split_layers, "TOKENS_PER_CHUNK", 128)
    config = tf.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(DEV, torch.bfloat16).train()
    tiledmlp.patch(model, num_shards=2, loss=True)
    ids = torch.randint(0, 512, (1, 512), device=DEV)
    runs = []
    for split in (False, False, True):
        with tiledmlp.offload_activations(model, min_bytes=0, split_layers=split) as off:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        runs.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}, off.stats))
        model.zero_grad(set_to_none=True)
    (l0, g0, _), (l1, g1, _), (l2, g2, stats) = runs
    assert torch.equal(l0, l2) and stats.offloaded > 0 and stats.waited == 0, stats
    for name in g0:
        noise = (g0[name] - g1[name]).abs().max().item()
        scale = g0[name].abs().max().item()
        assert (g2[name] - g0[name]).abs().max().item() <= max(4 * noise, 1e-2 * scale), name


@pytest.mark.parametrize("split", [False, True])
def test_offloading_on_cuda_same_loss_and_grads_as_without(split: bool) -> None:
    """float64 (SDPA's math kernel), tiled MLP + loss, 3 checkpointed layers: with every checkpoint copied to
    pinned host memory on the side stream and prefetched a layer ahead, the loss and grads are those of the same run
    without offloading: within 4x the gap between two runs without offloading, or 1e-12 relative (split layers
    run attention per KV-head group, a different batched matmul). A copy read before it finished, or memory
    reused under a pending copy, would be off by far more."""
    import transformers as tf

    from tiledmlp import split_layers

    split_layers.TOKENS_PER_CHUNK, saved = 128, split_layers.TOKENS_PER_CHUNK
    config = tf.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(DEV, torch.float64).train()
    tiledmlp.patch(model, num_shards=3, loss=True)
    enable_checkpointing(model)
    ids = torch.randint(0, 256, (2, 384), device=DEV)

    def run(offload: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
        off = tiledmlp.offload_activations(model, min_bytes=0, split_layers=split) if offload else None
        try:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        finally:
            if off is not None:
                off.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, None if off is None else off.stats

    try:
        (l0, g0, _), (l1, g1, _), (l2, g2, stats) = run(False), run(False), run(True)
    finally:
        split_layers.TOKENS_PER_CHUNK = saved
    assert stats.offloaded >= 3 * (1 + split) and stats.waited == 0, stats
    assert abs(l2 - l0).item() <= max(4 * abs(l1 - l0).item(), 1e-12 * abs(l0).item()), (l2, l1, l0)
    for name in g0:
        noise = (g0[name] - g1[name]).abs().max().item()
        scale = g0[name].abs().max().item()
        assert (g2[name] - g0[name]).abs().max().item() <= max(4 * noise, 1e-12 * scale), name


def test_offloaded_strided_views_come_back_as_saved_on_cuda() -> None:
    """Gapped halves (chunk), a transpose, an unaligned slice and an expanded row, saved in float64 on the GPU, go
    to pinned host memory and back through the side stream (gapped ones gathered and scattered by ``copy_``): each
    returns with its sizes, strides and 512-byte residue, and the grads equal those without offloading, bit for
    bit. A scatter into the wrong layout, or a copy read before it finished, would change them."""
    from test_offload_strides import _Views, _recording

    torch.manual_seed(0)
    x = torch.randn(4096, 12, dtype=torch.float64, device=DEV, requires_grad=True)
    _Views()(x).backward()
    reference, x.grad = x.grad.clone(), None
    model = _Views()
    with tiledmlp.offload_activations(model, min_bytes=0) as off:
        before, pairs, _, _ = _recording(off)
        model(x).backward()
    assert torch.equal(x.grad, reference), f"max diff {(x.grad - reference).abs().max():.3e}"
    assert pairs and all(a == b for a, b in pairs), [(a, b) for a, b in pairs if a != b]
    assert {(12, 1), (1, 6), (0, 1)} <= {stride for _, stride, _ in before.values()}
    assert off.stats.offloaded >= 4 and off.stats.prefetched + off.stats.waited >= 1, off.stats
