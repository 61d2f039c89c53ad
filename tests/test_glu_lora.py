"""LoRA adapters on the GLU fast path (adapters.py): exact against untiled PEFT, and the cases it leaves alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import tiledmlp
from conftest import assert_rel
from tiledmlp import precision
from tiledmlp.adapters import LoRAFactors
from tiledmlp.glu import GLUWeights

H, I, R = 24, 56, 4
# CUDA runs the compiled tiles and matmul-fused float32 sums by default: the same checks there (benchmarks/gpu.sh)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
WHICH = {"all": (True, True, True), "down": (False, False, True), "gate-up": (True, True, False)}


def _p(*shape: int, dtype: torch.dtype = torch.float64, grad: bool = True) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float64) * 0.3).to(dtype).requires_grad_(grad)


def make_spec(fused: bool, which: str, base_trainable: bool) -> GLUWeights:
    rows = 2 * I if fused else I
    gate, up, down = _p(rows, H, grad=base_trainable), None if fused else _p(I, H, grad=base_trainable), \
        _p(H, I, grad=base_trainable)
    loras = [LoRAFactors(_p(R, w.shape[1]), _p(w.shape[0], R), 0.7) if on and w is not None else None
             for on, w in zip(WHICH[which], (gate, up, down))]
    return GLUWeights(gate, _p(rows), up, None if fused else _p(I), down, _p(H), F.silu, lora=tuple(loras))


def reference(spec: GLUWeights, x: torch.Tensor) -> torch.Tensor:
    """An independent formula: each projection with its merged weight ``W + s B A``."""
    def merged(w: torch.Tensor | None, lora: LoRAFactors | None) -> torch.Tensor | None:
        return w if lora is None else w + lora.scaling * lora.b @ lora.a

    gate_w, up_w, down_w = (merged(w, lora) for w, lora in zip((spec.gate_weight, spec.up_weight, spec.down_weight),
                                                             spec.lora))
    gate = F.linear(x, gate_w, spec.gate_bias)
    gate, up = gate.chunk(2, dim=-1) if spec.fused else (gate, F.linear(x, up_w, spec.up_bias))
    return F.linear(F.silu(gate) * up, down_w, spec.down_bias)


@pytest.mark.parametrize("which", sorted(WHICH))
@pytest.mark.parametrize("fused", [False, True], ids=["gate+up", "gate_up"])
@pytest.mark.parametrize("base_trainable", [False, True], ids=["frozen", "trainable"])
def test_lora_glu_parity_float64(which: str, fused: bool, base_trainable: bool, kernels: str) -> None:
    """bs 2, uneven tiles, one-token tiles; frozen base (LoRA) and trainable (the compiled tiles' stacks then form
    the base's grads, the adapters' still per tile): outputs and every grad within 1e-12 of untiled."""
    spec = make_spec(fused, which, base_trainable)
    x = torch.randn(2, 8, H, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 8, H, dtype=torch.float64)
    inputs = [x, *(t for t in spec.all_tensors() if t is not None and t.requires_grad)]
    ref_out = reference(spec, x)
    ref = torch.autograd.grad(ref_out, inputs, grad_out)
    for splits in ([9, 7], [6, 5, 5], [1] * 16):
        out = tiledmlp.glu_tiled_call(spec, x, splits)
        assert_rel(out, ref_out, 1e-12, f"output, splits={splits}")
        got = torch.autograd.grad(out, inputs, grad_out)
        for k, (g, r) in enumerate(zip(got, ref)):
            assert_rel(g, r, 1e-12, f"{which} fused={fused} splits={splits} input {k}")


def test_lora_factors_that_do_not_fit_their_weight_are_refused() -> None:
    gate, down = _p(I, H), _p(H, I)
    with pytest.raises(ValueError, match="up projection's LoRA factors .* A must be \\[r, in\\], B \\[out, r\\]"):
        GLUWeights(gate, None, _p(I, H), None, down, None, F.silu,
                   lora=(None, LoRAFactors(_p(R, I), _p(I, R), 1.0), None))
    with pytest.raises(ValueError, match="down projection's LoRA factors"):
        GLUWeights(gate, None, _p(I, H), None, down, None, F.silu,
                   lora=(None, None, LoRAFactors(_p(R, I), _p(I, R), 1.0)))


def _llama(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    config = tf.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=97)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).to(dtype)


def _phi3() -> torch.nn.Module:
    config = tf.Phi3Config(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=97, pad_token_id=0)
    torch.manual_seed(0)
    return tf.Phi3ForCausalLM(config).double()


def _peft(model: torch.nn.Module, targets: list[str], **options: object) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=R, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                            **options))


def _step(model: torch.nn.Module, embeds: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    device = next(model.parameters()).device
    embeds = embeds.detach().to(device).requires_grad_()
    loss = model(inputs_embeds=embeds, labels=labels.to(device)).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads["inputs_embeds"] = embeds.grad
    return loss.detach(), grads


@pytest.mark.parametrize("arch, targets", [("llama", ["gate_proj", "up_proj", "down_proj", "q_proj"]),
                                           ("llama", ["down_proj"]), ("phi3", ["gate_up_proj", "down_proj"])],
                         ids=["llama-all", "llama-down", "phi3-gate_up"])
@pytest.mark.parametrize("device", DEVICES)
def test_peft_lora_mlps_take_the_glu_path_exactly(arch: str, targets: list[str], device: str) -> None:
    """PEFT's own layers, float64, bs 2, 37 tokens in 3 uneven tiles: the report says GLU, and the loss, every
    adapter's grad and the input grad match the unpatched PEFT model within 1e-12."""
    build = _llama if arch == "llama" else _phi3
    ref = _peft(build(), targets).to(device)
    model = _peft(build(), targets).to(device)
    model.load_state_dict(ref.state_dict())
    report = tiledmlp.patch(model, num_shards=3)
    assert {p for _, _, p in report.patched} == {"glu"}
    embeds = torch.randn(2, 37, H, dtype=torch.float64)
    labels = torch.randint(0, 97, (2, 37))
    ref_loss, want = _step(ref, embeds, labels)
    loss, got = _step(model, embeds, labels)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == want.keys() and sum("lora_B" in n for n in want) == 2 * len(targets)
    for name in want:
        assert_rel(got[name], want[name], 1e-12, name)


@pytest.mark.parametrize("case", ["dora", "bias", "disabled"])
def test_lora_layers_the_glu_path_cannot_read_take_the_generic_path(case: str) -> None:
    """DoRA (a norm of the merged weight), a bias on B: called by the generic engine, exact (float64; dropout is
    read by the GLU path: test_glu_lora_dropout.py). ``disable_adapter()`` is seen at the call."""
    options = {"dora": dict(use_dora=True), "bias": dict(lora_bias=True), "disabled": {}}[case]
    targets = ["gate_proj", "up_proj", "down_proj"]
    ref, model = _peft(_llama(), targets, **options), _peft(_llama(), targets, **options)
    model.load_state_dict(ref.state_dict())
    tiledmlp.patch(model, num_shards=3)
    mlp = model.base_model.model.model.layers[0].mlp
    embeds, labels = torch.randn(2, 21, H, dtype=torch.float64), torch.randint(0, 97, (2, 21))
    if case == "disabled":
        assert mlp.forward.path() == "glu"
        with model.disable_adapter(), ref.disable_adapter():
            assert mlp.forward.path() == "generic"
            (ref_loss, want), (loss, got) = _step(ref, embeds, labels), _step(model, embeds, labels)
        assert mlp.forward.path() == "glu"
    else:
        assert mlp.forward.path() == "generic"
        ref_loss, want = _step(ref, embeds, labels)
        loss, got = _step(model, embeds, labels)
    assert_rel(loss, ref_loss, 1e-12, "loss")
    assert got.keys() == want.keys()
    for name in want:
        assert_rel(got[name], want[name], 1e-12, name)


@pytest.mark.parametrize("mode", ["bf16-base-fp32-adapters", "autocast-bf16", "bf16-base-fp32-adapters-row-blocks"])
@pytest.mark.parametrize("device", DEVICES)
def test_lora_glu_16_bit_error_no_worse_than_untiled(mode: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT's default (float32 adapters over a bf16 base, the input cast up, the sum rounded once) and ``--bf16``
    autocast over float32 weights: 4 tiles' grads against a float64 run within 1.5x the untiled PEFT model's error;
    also with the adapters' float32 copies made off CUDA in row blocks of 2 rows (``precision.NARROW_CHUNK``)."""
    from peft import LoraConfig, get_peft_model

    if mode.endswith("row-blocks"):
        monkeypatch.setattr(precision, "NARROW_CHUNK", 2 * I)

    targets = ["gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=R, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    exact = get_peft_model(_llama(), config).to(device)
    low_dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    plain, tiled = (get_peft_model(_llama(low_dtype), config).to(device) for _ in range(2))
    for model in (plain, tiled):
        model.load_state_dict(exact.state_dict())
    assert {p.dtype for n, p in tiled.named_parameters() if "lora_" in n} == {torch.float32}
    report = tiledmlp.patch(tiled, num_shards=4)
    assert {p for _, _, p in report.patched} == {"glu"}
    embeds, labels = torch.randn(2, 40, H, dtype=torch.float64), torch.randint(0, 97, (2, 40))
    _, ref = _step(exact, embeds, labels)
    results = []
    for model in (plain, tiled):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mode.startswith("autocast")):
            results.append(_step(model, embeds.to(low_dtype), labels)[1])
    for name in ref:
        errors = [float((r[name].double() - ref[name]).norm() / ref[name].norm()) for r in results]
        assert results[1][name].dtype == results[0][name].dtype
        assert errors[1] <= 1.5 * errors[0] + 1e-6, f"{name}: tiled {errors[1]:.2e} untiled {errors[0]:.2e}"


@pytest.mark.hollow_matmuls
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_tile_over_a_16_bit_base_holds_about_the_glu_tile(dropout: float) -> None:
    """PEFT's default dtypes (float32 adapters over a bf16 base), one LoRA LlamaMLP (h 256 / i 704), 32768 tokens
    in 4 tiles, CPU profiler: the adapters' float32 copies (down's input, the terms added into d(product), the
    recomputed projections' sums) are made in row blocks, so the peak is the eager GLU tile's model plus at most
    1 byte per ``[tile, I]`` element (before: 10.3), and with dropout the tile's bool masks (one byte per adapter
    input element) plus 1.5 more (the mask's inverse, a block's copies)."""
    from peft import LoraConfig, get_peft_model

    from tiledmlp.memory import predict_mlp_peak_bytes

    from tiledmlp.measure import profiler_peak_bytes

    h, i, tokens, tiles = 256, 704, 32768, 4
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=1,
                                               num_attention_heads=4, vocab_size=16)).to(torch.bfloat16)
    config = LoraConfig(r=8, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=dropout)
    mlp = get_peft_model(model, config).base_model.model.model.layers[0].mlp
    tiledmlp.patch(model, num_shards=tiles)
    x = torch.randn(1, tokens, h, dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        out = mlp(x)
        out.backward(torch.ones_like(out))
        x.grad = None
        for p in mlp.parameters():
            p.grad = None

    step()
    measured = profiler_peak_bytes(step, device="cpu")
    tile = tokens // tiles
    glu = predict_mlp_peak_bytes(tokens, h, i, splits=[tile] * tiles, dtype=torch.bfloat16,
                                 accumulate_dtype=torch.bfloat16) - 3 * h * i * 2  # frozen: no sums
    masks = (2 * h + i) * tile if dropout else 0
    extra = (measured - glu - masks) / (tile * i)
    assert mlp.forward.path() == "glu" and extra <= (1.5 if dropout else 1.0), f"{extra:.2f} bytes per [tile, I]"


@pytest.mark.parametrize("which", sorted(WHICH))
def test_a_tile_of_no_tokens_gives_zero_adapter_grads(which: str) -> None:
    """A ZeRO-1/2 rank without tokens still runs the Function, with one 0-token tile: each grad it returns is
    zeros (the sums are written, not left as allocated)."""
    from tiledmlp.glu import _GLUTiledFunction

    spec = make_spec(False, which, base_trainable=True)
    tensors = spec.all_tensors()
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    for t in wanted:  # what a sum left unwritten would hand back: whatever its memory held
        torch.empty_like(t).fill_(float("nan"))
    x = torch.randn(0, H, dtype=torch.float64, requires_grad=True)
    out = _GLUTiledFunction.apply(spec, [0], "auto", x, *tensors)
    grads = torch.autograd.grad(out.sum(), [x, *wanted])
    assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, [x, *wanted]))
