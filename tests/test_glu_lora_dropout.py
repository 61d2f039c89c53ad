"""LoRA dropout on the GLU fast path: each tile draws its masks, its backward redraws the same ones.

Exactness here means: the tiled grads are the grads of the tiled forward, masks included. The references apply
the masks the tiles drew (recorded from ``GLUWeights.draw_masks``) in independent untiled formulas, or in PEFT's
own untiled model with its dropout modules replaced by ones that apply them.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import tiledmlp
from conftest import assert_rel
from test_glu_lora import DEVICES, WHICH, _llama, _p, _peft, _phi3, _step
from tiledmlp import precision
from tiledmlp.adapters import LoRAFactors
from tiledmlp.glu import GLUWeights
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.offload import offload_activations

H, I, R, P = 24, 56, 4, 0.4


class _Recorder:
    """Wraps ``GLUWeights.draw_masks``: every tile's masks, forward and backward draws alike, in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.draws: list[tuple] = []
        original = GLUWeights.draw_masks

        def draw(spec: GLUWeights, rows: int, device: torch.device) -> tuple:
            masks = original(spec, rows, device)
            self.draws.append(masks)
            return masks

        monkeypatch.setattr(GLUWeights, "draw_masks", draw)

    def take(self) -> list[tuple]:
        draws, self.draws = self.draws, []
        return draws


def _joined(tiles: list[tuple], k: int) -> torch.Tensor | None:
    return None if tiles[0][k] is None else torch.cat([t[k] for t in tiles])


def _spec(fused: bool, which: str, base_trainable: bool, device: str = "cpu") -> GLUWeights:
    rows = 2 * I if fused else I
    gate, up, down = _p(rows, H, grad=base_trainable), None if fused else _p(I, H, grad=base_trainable), \
        _p(H, I, grad=base_trainable)
    loras = [LoRAFactors(_p(R, w.shape[1]), _p(w.shape[0], R), 0.7, P) if on and w is not None else None
             for on, w in zip(WHICH[which], (gate, up, down))]
    spec = GLUWeights(gate, _p(rows), up, None if fused else _p(I), down, _p(H), F.silu, lora=tuple(loras))
    moved = [None if t is None else t.detach().to(device).requires_grad_(t.requires_grad) for t in spec.all_tensors()]
    lora = tuple(None if moved[6 + 2 * k] is None else LoRAFactors(moved[6 + 2 * k], moved[7 + 2 * k], 0.7, P)
                 for k in range(3))
    return GLUWeights(*moved[:6], F.silu, lora=lora)


def _reference(spec: GLUWeights, x: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Untiled, independent of the library's ops: ``W x + b + s B A (x * m / (1 - p))`` per projection."""
    def project(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lora: LoRAFactors | None,
                m: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(h, w, b)
        if lora is None:
            return y
        dropped = h if m is None else h * m.view_as(h) * (1 / (1 - lora.dropout))
        return y + lora.scaling * F.linear(F.linear(dropped, lora.a), lora.b)

    gate = project(x, spec.gate_weight, spec.gate_bias, spec.lora[0], masks[0])
    gate, up = gate.chunk(2, dim=-1) if spec.fused else \
        (gate, project(x, spec.up_weight, spec.up_bias, spec.lora[1], masks[1]))
    return project(F.silu(gate) * up, spec.down_weight, spec.down_bias, spec.lora[2], masks[2])


@pytest.mark.parametrize("which", sorted(WHICH))
@pytest.mark.parametrize("fused", [False, True], ids=["gate+up", "gate_up"])
@pytest.mark.parametrize("device", DEVICES)
def test_lora_dropout_glu_parity_float64(which: str, fused: bool, device: str, kernels: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """bs 2, uneven and one-token tiles (the kept last tile's backward goes first): each tile's backward redraws
    exactly its forward's masks, and the output and every grad match the untiled formula on those masks (1e-12)."""
    spec = _spec(fused, which, base_trainable=which == "all", device=device)
    _check_parity(_Recorder(monkeypatch), spec, device, f"{which} fused={fused}")


@pytest.mark.parametrize("fused", [False, True], ids=["gate+up", "gate_up"])
def test_lora_dropout_work_in_row_blocks_is_exact(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA the adapters' copies (dropped inputs, the terms added into d(product) and dx, the recomputed
    projections' sums) are made in row blocks of ``precision.NARROW_CHUNK`` elements: at 2 rows a block (many
    blocks, short last ones) the parity above holds (1e-12)."""
    monkeypatch.setattr(precision, "NARROW_CHUNK", 2 * I)
    _check_parity(_Recorder(monkeypatch), _spec(fused, "all", base_trainable=True), "cpu", f"fused={fused}")


def _check_parity(recorder: _Recorder, spec: GLUWeights, device: str, label: str) -> None:
    x = torch.randn(2, 8, H, dtype=torch.float64, device=device, requires_grad=True)
    grad_out = torch.randn(2, 8, H, dtype=torch.float64, device=device)
    inputs = [x, *(t for t in spec.all_tensors() if t is not None and t.requires_grad)]
    for splits in ([9, 7], [6, 5, 5], [1] * 16):
        out = tiledmlp.glu_tiled_call(spec, x, splits)
        forward = recorder.take()
        assert len(forward) == len(splits)
        got = torch.autograd.grad(out, inputs, grad_out)
        backward = recorder.take()
        order = [len(splits) - 1, *range(len(splits) - 1)]  # the kept last tile first
        assert len(backward) == len(splits)
        for t, masks in zip(order, backward):
            for mine, drawn in zip(masks, forward[t]):
                assert (mine is None) == (drawn is None) and (mine is None or torch.equal(mine, drawn)), t
        masks = [_joined(forward, k) for k in range(3)]
        ref_out = _reference(spec, x, masks)
        assert_rel(out, ref_out, 1e-12, f"output, splits={splits}")
        ref = torch.autograd.grad(ref_out, inputs, grad_out)
        for k, (g, r) in enumerate(zip(got, ref)):
            assert_rel(g, r, 1e-12, f"{label} splits={splits} input {k}")


def test_lora_dropout_masks_drop_at_the_rate_and_follow_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masks are real: about ``p`` of each adapter's inputs dropped, a different mask per adapter and per tile,
    and the same run under the same seed draws the same ones (the tiles use the device's default generator)."""
    recorder = _Recorder(monkeypatch)
    spec = _spec(False, "all", base_trainable=False)
    x = torch.randn(64, H, dtype=torch.float64, requires_grad=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        tiledmlp.glu_tiled_call(spec, x, [32, 32]).sum().backward()
        runs.append(recorder.take()[:2])  # the forward's draws
    gate, up, down = (torch.cat([t[k] for t in runs[0]]) for k in range(3))
    for mask in (gate, up, down):
        assert abs((~mask).double().mean().item() - P) < 0.05
    assert not torch.equal(gate, up) and not torch.equal(runs[0][0][0], runs[0][1][0])
    assert all(torch.equal(a, b) for t0, t1 in zip(*runs) for a, b in zip(t0, t1))


def _replaced(model: torch.nn.Module, names: list[str], masks_by_layer: list[list[torch.Tensor | None]]) -> None:
    """Replace PEFT's dropout of ``names`` in each layer's MLP by one applying the tiles' masks."""
    class Replay(torch.nn.Module):
        def __init__(self, mask: torch.Tensor) -> None:
            super().__init__()
            self.mask = mask

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.mask.view_as(x) * (1 / (1 - P))

    for layer, masks in zip(model.base_model.model.model.layers, masks_by_layer):
        for name, mask in zip(names, masks):
            getattr(layer.mlp, name).lora_dropout["default"] = Replay(mask)


@pytest.mark.parametrize("arch, mode", [("llama", "plain"), ("phi3", "plain"), ("llama", "checkpointed"),
                                        ("llama", "reentrant"), ("llama", "offloaded")])
@pytest.mark.parametrize("device", DEVICES)
def test_peft_lora_dropout_takes_the_glu_path_exactly(arch: str, mode: str, device: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT's own layers with ``lora_dropout``, float64, bs 2, 37 tokens in 3 tiles: the path is GLU in training
    mode; the loss and every grad match the unpatched model fed the tiles' masks (1e-12), also under activation
    checkpointing (non-reentrant: the recompute of a layer skips the tiled MLP; reentrant: it runs the tiles again,
    which redraw the forward's masks from the generator state checkpoint restores) and activation offloading. In
    eval mode the path draws nothing and matches PEFT's eval forward."""
    names = ["gate_proj", "up_proj", "down_proj"] if arch == "llama" else ["gate_up_proj", "down_proj"]
    build = _llama if arch == "llama" else _phi3
    ref, model = (_peft(build(), names, lora_dropout=P).to(device) for _ in range(2))
    model.load_state_dict(ref.state_dict())
    report = tiledmlp.patch(model, num_shards=3)
    assert {p for _, _, p in report.patched} == {"glu"}
    if mode in ("checkpointed", "reentrant"):
        enable_checkpointing(model, {"use_reentrant": mode == "reentrant"})
        model.enable_input_require_grads()  # reentrant checkpointing needs an input with grad
    recorder = _Recorder(monkeypatch)
    embeds, labels = torch.randn(2, 37, H, dtype=torch.float64), torch.randint(0, 97, (2, 37))
    with offload_activations(model, min_bytes=0, _copy_on_cpu=True) if mode == "offloaded" else nullcontext():
        loss, got = _step(model, embeds, labels)
    draws = recorder.take()  # forward (2 layers x 3 tiles), then per layer from the last: a reentrant recompute's
    assert len(draws) == (18 if mode == "reentrant" else 12)  # 3, then the backward's 3 (none recomputed else)
    if mode == "reentrant":
        recomputed = draws[6:9] + draws[12:15]
        assert all(torch.equal(a, b) for x, y in zip(recomputed, draws[3:6] + draws[:3]) for a, b in zip(x, y))
    draws = draws[:6]  # the forward's
    keys = [0, 1, 2] if arch == "llama" else [0, 2]
    _replaced(ref, names, [[_joined(draws[3 * n : 3 * n + 3], k) for k in keys] for n in range(2)])
    ref_loss, want = _step(ref, embeds, labels)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == want.keys() and sum("lora_B" in n for n in want) == 2 * len(names)
    for name in want:
        assert_rel(got[name], want[name], 1e-12, name)
    model.eval()
    plain = _peft(build(), names, lora_dropout=P).to(device).eval()
    plain.load_state_dict(model.state_dict())
    rng = torch.get_rng_state()
    with torch.no_grad():
        out = model(inputs_embeds=embeds.to(device)).logits
    assert torch.equal(torch.get_rng_state(), rng) and all(m is None for d in recorder.take() for m in d)
    with torch.no_grad():
        assert_rel(out, plain(inputs_embeds=embeds.to(device)).logits, 1e-12, "eval logits")


def test_lora_dropout_the_glu_path_cannot_draw_takes_the_generic_path() -> None:
    """An in-place dropout (it would overwrite the input the base projection and the other adapters read) is
    called by the generic engine; bad probabilities in hand-made factors are refused by name."""
    model = _peft(_llama(), ["gate_proj", "up_proj", "down_proj"], lora_dropout=P)
    model.base_model.model.model.layers[0].mlp.up_proj.lora_dropout["default"].inplace = True
    tiledmlp.patch(model, num_shards=3)
    layers = model.base_model.model.model.layers
    assert layers[0].mlp.forward.path() == "generic" and layers[1].mlp.forward.path() == "glu"
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="LoRAFactors.dropout must be a probability in \\[0, 1\\)"):
            LoRAFactors(_p(R, H), _p(I, R), 1.0, bad)


@pytest.mark.parametrize("passes", ["whole", "row-blocks"])
@pytest.mark.parametrize("mode", ["bf16-base-fp32-adapters", "autocast-bf16"])
def test_lora_dropout_16_bit_error_no_worse_than_untiled(mode: str, passes: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT's default dtypes with dropout: 4 tiles' grads against a float64 run on the same masks, within 1.5x
    the untiled PEFT model's error on those masks; also with the adapters' float32 copies made in row blocks of
    2 rows (``precision.NARROW_CHUNK``; whole tiles here otherwise)."""
    if passes == "row-blocks":
        monkeypatch.setattr(precision, "NARROW_CHUNK", 2 * I)
    names = ["gate_proj", "up_proj", "down_proj"]
    exact = _peft(_llama(), names, lora_dropout=P)
    low_dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    plain, tiled = (_peft(_llama(low_dtype), names, lora_dropout=P) for _ in range(2))
    for model in (plain, tiled):
        model.load_state_dict(exact.state_dict())
    tiledmlp.patch(tiled, num_shards=4)
    recorder = _Recorder(monkeypatch)
    embeds, labels = torch.randn(2, 40, H, dtype=torch.float64), torch.randint(0, 97, (2, 40))
    autocast = mode.startswith("autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        tiled_grads = _step(tiled, embeds.to(low_dtype), labels)[1]
    draws = recorder.take()[:8]
    masks = [[_joined(draws[4 * n : 4 * n + 4], k) for k in range(3)] for n in range(2)]
    for model in (exact, plain):
        _replaced(model, names, masks)
    _, ref = _step(exact, embeds, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain_grads = _step(plain, embeds.to(low_dtype), labels)[1]
    for name in ref:
        errors = [float((r[name].double() - ref[name]).norm() / ref[name].norm()) for r in (plain_grads, tiled_grads)]
        assert errors[1] <= 1.5 * errors[0] + 1e-6, f"{name}: tiled {errors[1]:.2e} untiled {errors[0]:.2e}"
