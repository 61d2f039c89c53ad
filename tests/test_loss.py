"""tiled_causal_lm_loss against an untiled float64 cross-entropy: scaled, masked, bf16, bad arguments."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel, rel_err

import tiledmlp.loss as loss_mod
from tiledmlp.loss import AUTO_TILE_LOGITS, FUSED_TILE_FACTOR, plan_loss_tiles, tiled_causal_lm_loss

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
V, H = 50, 16


def make(bs: int = 2, seq: int = 37, bias: bool = False, mask: bool = False, dtype: torch.dtype = torch.float64,
         two_d: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """float64 masters (rounded to ``dtype`` so the reference sees the same values) and labels."""
    h = torch.randn(bs, seq, H, dtype=torch.float64).to(dtype).double()
    w = (torch.randn(V, H, dtype=torch.float64) * 0.5).to(dtype).double()
    b = torch.randn(V, dtype=torch.float64).to(dtype).double() if bias else None
    y = torch.randint(0, V, (bs, seq))
    if mask:
        y[0, : seq // 2] = -100  # a prompt-masked half row
        y[:, -3] = -100
    if two_d:
        h, y = h.reshape(bs * seq, H), y.reshape(-1)
    return h, w, b, y


def leaves(dtype: torch.dtype, *ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().to(dtype, copy=True).requires_grad_() for t in ts]


def reference(h, w, b, y, *, shift=True, ignore_index=-100, reduction="mean", num_items=None, softcap=None, post=None,
              logit_scale=None, label_smoothing=0.0):
    """Untiled float64 loss and the grads of ``post(loss)``."""
    h64, w64, b64 = leaves(torch.float64, h, w, b)
    z = F.linear(h64, w64, b64)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if shift:
        y = F.pad(y, (0, 1), value=ignore_index)[..., 1:]
    summed = num_items is not None or reduction == "sum"
    loss = F.cross_entropy(z.reshape(-1, V), y.reshape(-1), ignore_index=ignore_index,
                           reduction="sum" if summed else "mean", label_smoothing=label_smoothing)
    if num_items is not None:
        loss = loss / num_items
    (post(loss, h64, w64) if post else loss).backward()
    return loss.detach(), [None if t is None else t.grad for t in (h64, w64, b64)]


def tiled(h, w, b, y, dtype, *, post=None, **kw):
    hd, wd, bd = leaves(dtype, h, w, b)
    loss = tiled_causal_lm_loss(hd, wd, y, lm_head_bias=bd, **kw)
    (post(loss, hd, wd) if post else loss).backward()
    return loss.detach(), [None if t is None else t.grad for t in (hd, wd, bd)]


def check(got, ref, tol):
    (loss, grads), (rloss, rgrads) = got, ref
    assert_rel(loss.double(), rloss, tol, "loss")
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert_rel(None if g is None else g.double(), r, tol, name)


CASES = {
    "bs1-one-tile": dict(make=dict(bs=1), kw=dict(num_shards=1)),
    "bs1-uneven": dict(make=dict(bs=1, seq=33), kw=dict(num_shards=4)),
    "bs2-bias": dict(make=dict(bias=True), kw=dict(num_shards=5)),
    "bs2-masked": dict(make=dict(mask=True), kw=dict(num_shards=6)),
    "no-shift": dict(make=dict(mask=True), kw=dict(num_shards=7, shift=False)),
    "softcap": dict(make=dict(bias=True), kw=dict(num_shards=3, logit_softcap=4.0)),
    "sum": dict(make=dict(mask=True), kw=dict(num_shards=3, reduction="sum")),
    "num-items-int": dict(make=dict(mask=True), kw=dict(num_shards=3, num_items_in_batch=91)),
    "num-items-tensor": dict(make=dict(), kw=dict(num_shards=4, num_items_in_batch=torch.tensor(150))),
    "ignore-index-0": dict(make=dict(), kw=dict(num_shards=4, ignore_index=0)),
    "more-shards-than-tokens": dict(make=dict(bs=1, seq=6), kw=dict(num_shards=50)),
    "2d-input": dict(make=dict(two_d=True, mask=True), kw=dict(num_shards=5)),
    "logit-scale": dict(make=dict(bias=True, mask=True), kw=dict(num_shards=4, logit_scale=0.3)),
    "logit-scale-num-items": dict(make=dict(), kw=dict(num_shards=3, logit_scale=2.5,
                                                      num_items_in_batch=torch.tensor(150))),
    "smoothing": dict(make=dict(bias=True, mask=True), kw=dict(num_shards=4, label_smoothing=0.1)),
    "smoothing-softcap-scale": dict(make=dict(mask=True), kw=dict(num_shards=5, label_smoothing=0.25,
                                                                  logit_softcap=3.0, logit_scale=0.7)),
    "smoothing-num-items": dict(make=dict(bias=True), kw=dict(num_shards=3, label_smoothing=0.1,
                                                              num_items_in_batch=torch.tensor(99))),
    "smoothing-sum-full": dict(make=dict(mask=True), kw=dict(num_shards=2, label_smoothing=1.0, reduction="sum")),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_untiled_reference(case: str, dtype: torch.dtype, kernels: str) -> None:
    spec = CASES[case]
    h, w, b, y = make(**spec["make"], dtype=dtype)
    kw = dict(spec["kw"])
    ref_kw = {k: v for k, v in kw.items() if k in ("shift", "ignore_index", "reduction")}
    ref_kw.update(num_items=kw.get("num_items_in_batch"), softcap=kw.get("logit_softcap"),
                  logit_scale=kw.get("logit_scale"), label_smoothing=kw.get("label_smoothing", 0.0))
    check(tiled(h, w, b, y, dtype, **kw), reference(h, w, b, y, **ref_kw), TOL[dtype])


def test_logits_never_whole_and_auto_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_mod, "fused_enabled", lambda device: False)  # the eager tile's rule
    splits = plan_loss_tiles(16384, 49152)
    assert len(splits) == 25 and max(splits) * 49152 <= AUTO_TILE_LOGITS and sum(splits) == 16384
    assert plan_loss_tiles(10, 50) == [10] and plan_loss_tiles(0, 50) == [] and plan_loss_tiles(5, 7, 9) == [1] * 5
    fused = plan_loss_tiles(16384, 49152, fused=True)  # the compiled tile keeps 16-bit logits only: 4x the tokens
    assert len(fused) == 7 and max(fused) * 49152 <= FUSED_TILE_FACTOR * AUTO_TILE_LOGITS
    shapes: list[tuple[int, ...]] = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: (lambda out: shapes.append(tuple(out.shape)) or out)(real(*a)))
    h, w, b, y = make(bs=2, seq=40, bias=True)
    check(tiled(h, w, b, y, torch.float64, num_shards=8), reference(h, w, b, y), 1e-12)
    assert len(shapes) == 9 and max(s[0] for s in shapes[:8]) == 10, shapes  # 78 labelled tokens: 8 tiles + ref
    monkeypatch.setattr(loss_mod, "AUTO_TILE_LOGITS", 7 * V)  # "auto" -> tiles of <= 7 tokens
    shapes.clear()
    hd = h.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    assert not hd.is_contiguous()
    check(tiled(hd, w, b, y, torch.float64), reference(h, w, b, y), 1e-12)
    assert len(shapes) == 13 and max(s[0] for s in shapes[:12]) == 7, shapes  # 12 tiles + the reference


POSTS = {
    "scaled-1/40": lambda loss, h, w: loss / 40,
    "loss-scaler": lambda loss, h, w: loss * 65536.0,
    "plus-other-loss": lambda loss, h, w: 0.3 * loss + (h**2).sum() * 0.01 + w.sum() * 0.1,
    "used-twice": lambda loss, h, w: 3 * loss + loss / 7,
}


@pytest.mark.parametrize("post", list(POSTS))
def test_grads_right_whatever_happens_to_the_loss(post: str) -> None:
    h, w, b, y = make(bias=True, mask=True)
    check(tiled(h, w, b, y, torch.float64, post=POSTS[post], num_shards=5),
          reference(h, w, b, y, post=POSTS[post]), 1e-12)


def test_two_micro_batches_accumulate_and_weight_grad_lands_once() -> None:
    h, w, b, y = make(bias=True)
    h2, _, _, y2 = make(bias=True)
    hd, wd, bd = leaves(torch.float64, h, w, b)
    fired = []
    wd.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    for hh, yy in ((hd, y), (h2, y2)):
        tiled_causal_lm_loss(hh, wd, yy, lm_head_bias=bd, num_shards=6).backward()
    assert len(fired) == 2  # once per backward, not once per tile
    _, g1 = reference(h, w, b, y)
    _, g2 = reference(h2, w, b, y2)
    assert_rel(wd.grad, g1[1] + g2[1], 1e-12, "weight")
    assert_rel(bd.grad, g1[2] + g2[2], 1e-12, "bias")


def test_all_masked_batch_gives_zero_not_nan() -> None:
    h, w, b, y = make(bias=True)
    y[:] = -100
    loss, grads = tiled(h, w, b, y, torch.float64, num_shards=4)
    assert loss.item() == 0.0
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)
    assert torch.isnan(F.cross_entropy(torch.randn(3, V), torch.full((3,), -100)))  # what torch does instead


def test_fully_masked_row_inside_a_batch() -> None:
    h, w, b, y = make()
    y[0] = -100  # a naive cut over B*S would give all-masked tiles here
    loss, grads = tiled(h, w, b, y, torch.float64, num_shards=4)
    assert torch.isfinite(loss) and torch.count_nonzero(grads[0][0]) == 0
    check((loss, grads), reference(h, w, b, y), 1e-12)


def _spy_passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool, bool]]:
    seen: list[tuple[bool, bool, bool]] = []
    real = loss_mod._tile_pass
    monkeypatch.setattr(loss_mod, "_tile_pass", lambda *a: seen.append(a[-1]) or real(*a))
    return seen


def test_no_grad_builds_no_function_and_does_no_gradient_work(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy_passes(monkeypatch)
    h, w, b, y = make(bias=True, mask=True)
    hd, wd, bd = leaves(torch.float64, h, w, b)
    with torch.no_grad():
        loss = tiled_causal_lm_loss(hd, wd, y, lm_head_bias=bd, num_shards=3)
    plain = tiled_causal_lm_loss(h, w, y, lm_head_bias=b, num_shards=3)  # grad enabled, nothing requires grad
    assert loss.grad_fn is None and plain.grad_fn is None
    assert seen == [(False, False, False)] * 2
    assert_rel(loss, reference(h, w, b, y)[0], 1e-12, "loss")


def test_frozen_head_computes_no_weight_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy_passes(monkeypatch)
    h, w, b, y = make(mask=True)
    hd = h.clone().requires_grad_()
    tiled_causal_lm_loss(hd, w, y, num_shards=3).backward()
    assert seen == [(True, False, False)] and w.grad is None
    assert_rel(hd.grad, reference(h, w, b, y)[1][0], 1e-12, "hidden")


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_accumulates_in_fp32_and_is_no_worse_than_untiled(monkeypatch: pytest.MonkeyPatch, kernels: str,
                                                                smoothing: float) -> None:
    acc_dtypes = []
    real = loss_mod._add_weight_grad
    monkeypatch.setattr(loss_mod, "_add_weight_grad", lambda acc, *a: acc_dtypes.append(acc.dtype) or real(acc, *a))
    h, w, b, y = make(bs=2, seq=64, bias=True, mask=True, dtype=torch.bfloat16)
    rloss, rgrads = reference(h, w, b, y, label_smoothing=smoothing)
    hb, wb, bb = leaves(torch.bfloat16, h, w, b)
    untiled = F.cross_entropy(F.linear(hb, wb, bb).float()[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1),
                              label_smoothing=smoothing)
    untiled.backward()
    tloss, tgrads = tiled(h, w, b, y, torch.bfloat16, num_shards=8, label_smoothing=smoothing)
    assert set(acc_dtypes) == {torch.float32} and len(acc_dtypes) == 8
    assert tloss.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in tgrads)
    assert rel_err(tloss, rloss) <= 1.5 * rel_err(untiled, rloss) + 1e-6
    for name, t, u, r in zip(("hidden", "weight", "bias"), tgrads, (hb.grad, wb.grad, bb.grad), rgrads):
        assert rel_err(t, r) <= 1.5 * rel_err(u, r), f"{name}: tiled {rel_err(t, r):.2e} untiled {rel_err(u, r):.2e}"


def test_bf16_weight_dtype_accumulation_is_within_one_rounding_per_tile(monkeypatch: pytest.MonkeyPatch,
                                                                          kernels: str) -> None:
    """``accumulate_dtype=torch.bfloat16`` (Liger's choice): the head's weight grad is summed in bf16, so each of
    the n tiles adds one bf16 rounding (unit roundoff 2^-8) on top of the untiled error; the rest is unchanged."""
    acc_dtypes = []
    real = loss_mod._add_weight_grad
    monkeypatch.setattr(loss_mod, "_add_weight_grad", lambda acc, *a: acc_dtypes.append(acc.dtype) or real(acc, *a))
    h, w, b, y = make(bs=2, seq=64, bias=True, mask=True, dtype=torch.bfloat16)
    rloss, rgrads = reference(h, w, b, y)
    f32_loss, f32_grads = tiled(h, w, b, y, torch.bfloat16, num_shards=8)
    acc_dtypes.clear()
    tloss, tgrads = tiled(h, w, b, y, torch.bfloat16, num_shards=8, accumulate_dtype=torch.bfloat16)
    assert set(acc_dtypes) == {torch.bfloat16} and len(acc_dtypes) == 8
    assert torch.equal(tloss, f32_loss) and torch.equal(tgrads[0], f32_grads[0])  # loss and d hidden untouched
    for name, t, f, r in zip(("weight", "bias"), tgrads[1:], f32_grads[1:], rgrads[1:]):
        assert t.dtype == torch.bfloat16
        assert rel_err(t, r) <= rel_err(f, r) + 8 * 2**-8, f"{name}: {rel_err(t, r):.2e} vs {rel_err(f, r):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gradients_are_handed_over_in_place_and_a_retained_graph_still_works(dtype: torch.dtype,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward scales the forward's gradient buffers in place and returns them (no second weight-sized
    buffer; 16-bit ones through the compiled kernel) unless the graph is retained; then a second backward adds
    exactly the same gradients again."""
    from tiledmlp import pointwise

    monkeypatch.setattr(pointwise, "_MODE", dtype == torch.bfloat16)
    h, w, b, y = make(dtype=dtype)
    hd, wd = leaves(dtype, h, w)
    acc = dict(accumulate_dtype=dtype)
    loss = tiled_causal_lm_loss(hd, wd, y, num_shards=3, **acc) / 40
    dw_ptr = loss.grad_fn.next_functions[0][0].grads[1].data_ptr()  # DivBackward0 -> the tiled loss node
    loss.backward()
    assert wd.grad.data_ptr() == dw_ptr  # the accumulator itself became .grad (autograd steals a lone tensor)
    once = (hd.grad.clone(), wd.grad.clone())
    assert_rel(hd.grad.double(), reference(h, w, b, y, post=lambda x, *_: x / 40)[1][0], 2e-2 if dtype ==
               torch.bfloat16 else 1e-5, "hidden")
    hd.grad = wd.grad = None
    loss = tiled_causal_lm_loss(hd, wd, y, num_shards=3, **acc) / 40
    loss.backward(retain_graph=True)
    assert torch.equal(hd.grad, once[0]) and torch.equal(wd.grad, once[1])
    loss.backward()
    assert torch.equal(hd.grad, once[0] + once[0]) and torch.equal(wd.grad, once[1] + once[1])


def test_autocast_matches_untiled_autocast_error(kernels: str) -> None:
    h, w, b, y = make(bs=2, seq=64, dtype=torch.float32)
    rloss, rgrads = reference(h, w, b, y)
    results = []
    for fn in (lambda hh, ww: F.cross_entropy(F.linear(hh, ww).float()[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1)),
               lambda hh, ww: tiled_causal_lm_loss(hh, ww, y, num_shards=4)):
        hf, wf = leaves(torch.float32, h, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(hf, wf)
        loss.backward()
        assert hf.grad.dtype == wf.grad.dtype == torch.float32
        results.append([rel_err(loss, rloss), rel_err(hf.grad, rgrads[0]), rel_err(wf.grad, rgrads[1])])
    (untiled, tiled_errs) = results
    assert untiled[1] > 1e-4  # the matmuls really ran in bf16
    assert all(t <= 1.5 * u + 1e-7 for t, u in zip(tiled_errs, untiled)), results

def test_double_backward_is_refused() -> None:
    h, w, b, y = make()
    hd, wd = leaves(torch.float64, h, w)
    loss = tiled_causal_lm_loss(hd, wd, y, num_shards=2)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, hd, create_graph=True)


def test_loss_step_peak_memory_is_a_fraction_of_untiled() -> None:
    """Deterministic (profiler allocation events, not RSS or time): 2048 tokens, vocab 4096, 8 tiles."""
    from tiledmlp.measure import profiler_peak_bytes

    h = torch.randn(2, 1024, 64, requires_grad=True)
    w = torch.randn(4096, 64, requires_grad=True)
    y = torch.randint(0, 4096, (2, 1024))

    def untiled() -> None:
        z = F.linear(h, w).float()
        F.cross_entropy(z[:, :-1].reshape(-1, 4096), y[:, 1:].reshape(-1)).backward()

    base = profiler_peak_bytes(untiled, device="cpu")
    tiled = profiler_peak_bytes(lambda: tiled_causal_lm_loss(h, w, y, num_shards=8).backward(), device="cpu")
    assert base >= 2 * 2048 * 4096 * 4  # logits and their grad at least
    assert tiled <= 0.2 * base, f"tiled {tiled / 2**20:.1f} MiB vs untiled {base / 2**20:.1f} MiB"

def test_one_tile_of_logits_at_a_time(kernels: str) -> None:
    """Profiler peak of a tiled loss step (float32, 8 tiles of 256 tokens, vocab 4096): the gradients, the input's
    rows and one tile's logits. A compiled tile's logits once stayed bound until the next tile's were allocated
    (two tiles alive: on an H100 at 32k tokens and vocab 128k, 256 MiB above Liger's loss)."""
    from tiledmlp.measure import profiler_peak_bytes

    h = torch.randn(2048, 64, requires_grad=True)
    w = torch.randn(4096, 64, requires_grad=True)
    y = torch.randint(0, 4096, (2048,))

    def step() -> None:
        tiled_causal_lm_loss(h, w, y, num_shards=8, shift=False).backward()
        h.grad = w.grad = None

    step()
    tile = 256 * 4096 * 4
    grads = h.numel() * 4 + w.numel() * 4
    peak = profiler_peak_bytes(step, device="cpu")
    assert tile + grads <= peak < 1.5 * tile + grads, f"{kernels}: {peak / tile:.2f} tiles of logits"


def test_a_compiled_tile_this_torch_cannot_build_falls_back_to_the_eager_path(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """torch 2.11's CPU code generation fails on the loss tile (InductorError). The loss then warns once, runs the
    eager path with its tiles (not the compiled body run eagerly: that held 4.65 tiles of float32 logits where the
    test above allows 1.5) and stays exact; later calls plan eager tiles from the start."""
    from tiledmlp import pointwise
    from tiledmlp.measure import profiler_peak_bytes

    class CodegenBug(Exception):
        pass

    def cannot_build(*args: object) -> None:
        raise CodegenBug("KeyError: 'buf3'")

    pointwise._compiled.cache_clear()
    monkeypatch.setattr(pointwise.torch, "compile", lambda fn, **kw: cannot_build)  # every kernel variant
    monkeypatch.setattr(pointwise, "_UNBUILDABLE", set())
    monkeypatch.setattr(pointwise, "_compile_errors", lambda: (CodegenBug,))
    h = torch.randn(2048, 64, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4096, 64, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 4096, (2048,))
    ref = torch.autograd.grad(F.cross_entropy(F.linear(h, w), y) / 3, (h, w))
    pointwise.set_fused(True)
    try:
        with pytest.warns(RuntimeWarning, match="could not build .*cross_entropy.* eager path instead"):
            loss = tiled_causal_lm_loss(h, w, y, num_shards=8, shift=False) / 3
        assert not pointwise.cross_entropy_kernel()
        for got, want in zip(torch.autograd.grad(loss, (h, w)), ref):
            assert_rel(got, want, 1e-12)
        hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()

        def step() -> None:
            tiled_causal_lm_loss(hf, wf, y, num_shards=8, shift=False).backward()
            hf.grad = wf.grad = None

        peak = profiler_peak_bytes(step, device="cpu")
    finally:
        pointwise.set_fused("auto")
        pointwise._compiled.cache_clear()
    tile, grads = 256 * 4096 * 4, hf.numel() * 4 + wf.numel() * 4
    assert tile + grads <= peak < 1.5 * tile + grads, f"{peak / tile:.2f} tiles of logits"


BAD = [
    (dict(num_shards=0), ValueError, "num_shards"),
    (dict(num_shards="many"), ValueError, "num_shards"),
    (dict(reduction="none"), ValueError, "reduction"),
    (dict(reduction="sum", num_items_in_batch=3), ValueError, "num_items_in_batch"),
    (dict(num_items_in_batch=-4), ValueError, "num_items_in_batch must be >= 0"),
    (dict(logit_softcap=-1.0), ValueError, "logit_softcap"),
    (dict(logit_scale=0.0), ValueError, "logit_scale"),
    (dict(labels=torch.zeros(2, 37)), TypeError, "labels must be an integer"),
    (dict(labels=torch.zeros(2, 36, dtype=torch.long)), ValueError, "labels must have shape"),
    (dict(labels=torch.full((2, 37), 50)), ValueError, r"labels must be in \[0, 50\)"),
    (dict(weight=torch.zeros(V, H + 1, dtype=torch.float64)), ValueError, "lm_head_weight must be"),
    (dict(weight=torch.zeros(V, H)), TypeError, "same dtype"),
    (dict(lm_head_bias=torch.zeros(V + 1, dtype=torch.float64)), ValueError, "lm_head_bias"),
    (dict(accumulate_dtype="fp32"), ValueError, "accumulate_dtype"),
    (dict(accumulate_dtype=torch.int32), TypeError, "accumulate_dtype"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be a number in \[0, 1\]"),
    (dict(label_smoothing=True), ValueError, "label_smoothing.*got True"),
    (dict(weight=torch.zeros(V, H, dtype=torch.float64, device="meta")), ValueError, "one real device"),
    (dict(lm_head_bias=torch.zeros(V)), TypeError, "lm_head_bias .* must have lm_head_weight's dtype"),
    (dict(ignore_index=None), TypeError, "ignore_index must be an int"),
    (dict(num_items_in_batch=torch.tensor([7, 7])), ValueError, "num_items_in_batch must be a number or a one-el"),
]


@pytest.mark.parametrize("kw, exc, match", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_are_refused(kw: dict, exc: type, match: str) -> None:
    h, w, _, y = make()
    kw = dict(kw)
    labels, weight = kw.pop("labels", y), kw.pop("weight", w)
    with pytest.raises(exc, match=match):
        tiled_causal_lm_loss(h, weight, labels, **kw)


def test_zero_items_give_inf_as_an_int_or_a_tensor() -> None:
    """``num_items_in_batch=0`` (a batch with no labelled token) divides like transformers' loss: inf, never a
    ZeroDivisionError for an int and NaN-free for a tensor."""
    h, w, _, y = make()
    for zero in (0, torch.tensor(0)):
        assert tiled_causal_lm_loss(h, w, y, num_items_in_batch=zero).item() == float("inf")
