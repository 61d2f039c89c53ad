"""``patch(target_gb=...)`` cuts tiles that hold no more than the target, on every path.

Until 2026-11-27 every MLP's tiles were sized by the GLU path's model: routed experts' tiles held up to 5.3x the
target (a token reaches ``top_k`` experts; Qwen3-MoE-like, bf16, top-4), an ungated GPT-2 MLP's 1.04-1.25x and a
gated MLP on the generic path (a hooked activation) 1.16x in bf16. Here each tile's cost per token is measured
(profiler peaks of one MLP's forward and backward at 2 and 4 tiles: the difference is 256 tokens of tile), a target
allowing 200 such tokens is set, and the tiles patch() then cuts are checked: at most 200 tokens (the target
holds) and at least 100 (the model is not so cautious that it doubles the tiles).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import tiledmlp
from tiledmlp.measure import profiler_peak_bytes
from tiledmlp.memory import tile_activation_bytes
from tiledmlp.patching import TiledForward

TOKENS, HIDDEN = 1024, 128


def _llama(hooked: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=352, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    mlp = model.model.layers[0].mlp
    if hooked:  # a hooked activation sends the MLP to the generic path (the hook must see the activation)
        mlp.act_fn.register_forward_hook(lambda module, args, out: None)
    return model, mlp


def _gpt2() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=HIDDEN, n_layer=1, n_head=4, vocab_size=64, bos_token_id=0,
                                             eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return model, model.transformer.h[0].mlp


def _experts(top_k: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tf.Qwen3MoeConfig(hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=96, num_experts=4,
                               num_experts_per_tok=top_k, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, vocab_size=64, experts_implementation="eager")
    model = tf.Qwen3MoeForCausalLM(config)
    return model, model.model.layers[0].mlp  # the sparse block: router untiled, its experts tiled


def _lora(dropout: float, base_dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """PEFT LoRA on the projections (GLU path). Adapters made over a bf16 base stay float32 (PEFT's default:
    "mixed"); a model cast after PEFT wrapped it (the test's bf16) has bf16 adapters."""
    import peft

    base, _ = _llama(False)
    model = peft.get_peft_model(base.to(base_dtype), peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"]))
    return model, model.base_model.model.model.layers[0].mlp


MLPS = {"llama": lambda: _llama(False), "llama-hooked-act": lambda: _llama(True), "gpt2": _gpt2,
        "experts-top2": lambda: _experts(2), "experts-top4": lambda: _experts(4),
        "llama-lora": lambda: _lora(0.0), "llama-lora-dropout": lambda: _lora(0.1)}
MIXED = {"llama-lora-mixed": lambda: _lora(0.0, torch.bfloat16),
         "llama-lora-mixed-dropout": lambda: _lora(0.1, torch.bfloat16)}
CASES = [(name, dtype) for name in MLPS for dtype in ("fp32", "bf16", "autocast")] + \
    [(name, "mixed") for name in MIXED]


def _tiled_forwards(model: torch.nn.Module) -> list[TiledForward]:
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, dtype", CASES)
def test_target_gb_tiles_hold_no_more_than_the_target(name: str, dtype: str, device: str) -> None:
    """``autocast``: float32 weights under bf16 autocast (the tile's casts: experts held 1.33x their bf16 model).
    ``mixed``: float32 adapters over a bf16 base (their float32 copies). On CUDA the GLU path runs its compiled
    kernels (peaks: the allocator's)."""
    torch.manual_seed(0)
    model, block = {**MLPS, **MIXED}[name]()
    if dtype == "bf16":
        model.to(torch.bfloat16)
    model.to(device)
    x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.bfloat16 if dtype in ("bf16", "mixed") else torch.float32,
                    device=device, requires_grad=True)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "autocast"):
            out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    def peak(**options: object) -> int:
        tiledmlp.unpatch(model)
        tiledmlp.patch(model, norms=False, **options)
        step()
        return profiler_peak_bytes(step, device=device)

    per_token = (peak(num_shards=2) - peak(num_shards=4)) / (TOKENS // 2 - TOKENS // 4)
    assert per_token > 0
    tiledmlp.patch(model, norms=False, target_gb=200 * per_token / 2**30)
    step()
    tiles = max(f.last_num_tiles for f in _tiled_forwards(model))
    largest = -(-TOKENS // tiles)
    assert 100 <= largest <= 200, (name, per_token, tiles)


def test_the_models_of_a_tile_by_path() -> None:
    """The per-token terms (H 128, I 352, bytes): GLU eager work plus the kept tile; 16-bit, the float32 upcast
    phase; generic, its fitted moment less the weight grads; experts, k routed copies; an ungated MLP's probed
    activation (GPT-2's tanh GELU holds 28 bytes an element in float32) where it is the larger; under autocast
    the float32 input of the tile (and experts' routed copies of it)."""
    h, i = 128, 352
    assert tile_activation_bytes(1, h, i, dtype=torch.float32) == 7 * i * 4
    assert tile_activation_bytes(1, h, i, dtype=torch.bfloat16) == 12 * i + 4 * h + 2 * i * 2
    for dtype in (torch.float32, torch.bfloat16):  # on CUDA no upcast; compiled: gate, up, one product buffer
        assert tile_activation_bytes(1, h, i, dtype=dtype, device_type="cuda") == 7 * i * dtype.itemsize
        assert tile_activation_bytes(1, h, i, dtype=dtype, kernels="compiled", device_type="cuda") \
            == 5 * i * dtype.itemsize
    assert tile_activation_bytes(1, h, i, dtype=torch.bfloat16, kernels="compiled") == 12 * i + 4 * h + 2 * i * 2
    assert tile_activation_bytes(1, h, i, dtype=torch.float32, path="generic") == 4 * (6 * i + h)
    assert tile_activation_bytes(1, h, i, dtype=torch.bfloat16, path="generic") == 2 * (7 * i + 3 * h)
    assert tile_activation_bytes(1, h, 96, dtype=torch.float32, path="generic", top_k=4) == 4 * 4 * (6 * 96 + 3 * h)
    assert tile_activation_bytes(1, h, 4 * h, dtype=torch.float32, path="generic", activation=(20, 28)) \
        == 28 * 4 * h + 4 * h
    assert tile_activation_bytes(10, h, i, dtype=torch.float32, path="generic") \
        == 10 * tile_activation_bytes(1, h, i, dtype=torch.float32, path="generic")
    autocast = dict(dtype=torch.bfloat16, path="generic", weight_dtype=torch.float32)  # + the tile's float32 input
    assert tile_activation_bytes(1, h, i, **autocast) == 2 * (7 * i + 3 * h) + 4 * h
    assert tile_activation_bytes(1, h, 96, top_k=2, **autocast) == 2 * 2 * (6 * 96 + 3 * h) + 3 * 4 * h


def test_lora_copies_stop_growing_past_one_row_block() -> None:
    """Float32 adapters over a bf16 base copy in row blocks (32M elements on CUDA): the tile is the largest whose
    bytes fit, past the block too (a per-token division would cut it at the first block's rate)."""
    h, i, tokens, budget = 4096, 14336, 10**6, 2**30
    model = dict(dtype=torch.bfloat16, lora=(True, 0), device_type="cuda")
    splits = tiledmlp.plan_shards(tokens, target_gb=budget / 2**30, hidden_size=h, intermediate_size=i, **model)
    assert max(splits) > 32 * 2**20 // i  # past one block
    assert tile_activation_bytes(max(splits), h, i, **model) <= budget  # fits
    assert tile_activation_bytes(-(-tokens // (len(splits) - 1)), h, i, **model) > budget  # one tile fewer does not
    assert len(splits) < -(-tokens // (budget // tile_activation_bytes(1, h, i, **model)))  # fewer than per token


@pytest.mark.parametrize("kwargs, match", [
    (dict(lora=(1, 0)), "lora must be None or"),
    (dict(lora=(True, -1)), "lora must be None or"),
    (dict(top_k=0), "top_k must be None or an int >= 1"),
    (dict(top_k=True), "top_k must be None or an int >= 1"),
    (dict(activation=(20,)), "activation must be None or"),
    (dict(activation=(20, -1)), "activation must be None or"),
    (dict(kernels="fused"), "kernels must be 'eager' or 'compiled'"),
])
def test_plan_shards_refuses_a_bad_top_k_or_activation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiledmlp.plan_shards(100, target_gb=1.0, hidden_size=8, intermediate_size=16, path="generic", **kwargs)


def test_tile_activation_bytes_refuses_an_unknown_path() -> None:
    with pytest.raises(ValueError, match="path must be 'glu' or 'generic'"):
        tile_activation_bytes(1, 8, 16, dtype=torch.float32, path="experts")


def test_the_activation_probe_runs_once_at_patch_and_not_through_the_hooks() -> None:
    """patch(target_gb=) probes a generic-path MLP's activation once, on the CPU, past its hooks: a user's hook on
    the activation sees no probe tensors."""
    model, mlp = _gpt2()
    seen: list[torch.Size] = []
    mlp.act.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    tiledmlp.patch(model, target_gb=1e-3, norms=False)
    (tiled,) = _tiled_forwards(model)
    assert seen == [] and set(tiled.activation) == {4, 2}
    assert tiled.activation[4] == (20, 28)  # GPT-2's tanh GELU in Python ops: saves 5 elements, holds 7
    tiledmlp.patch(model, target_gb=2e-3, norms=False)  # options updated: the probe is kept, not run again
    assert seen == [] and tiled.activation[4] == (20, 28)


class _UpcastingGELU(torch.nn.Module):
    """What CUDA's autocast makes of GPT-2's tanh GELU (it runs ``pow`` in float32): under autocast, a float32
    result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x.float() if torch.is_autocast_enabled("cpu") else x, approximate="tanh")


@pytest.mark.parametrize("upcasting", [False, True])
def test_under_autocast_an_activation_computing_in_float32_is_sized_by_its_float32_probe(upcasting: bool) -> None:
    """Tiles computing in bf16 under autocast, over an activation whose output is float32 there, hold float32
    elements (GPT-2 under CUDA autocast: 2x its bf16 probe, measured): the float32 probe sizes them."""
    model, mlp = _gpt2()
    if upcasting:
        mlp.act = _UpcastingGELU()
    tiledmlp.patch(model, target_gb=1e-3, norms=False)
    (tiled,) = _tiled_forwards(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chosen = tiled._activation(torch.bfloat16, torch.float32, torch.device("cpu"))
    assert chosen == tiled.activation[4 if upcasting else 2]
    assert tiled._activation(torch.bfloat16, None, torch.device("cpu")) == tiled.activation[2]  # no autocast


def test_the_autocast_check_leaves_the_generator_as_it_found_it() -> None:
    """It runs inside a forward, once: an activation that draws (RReLU) must not move the stream dropout reads."""
    from tiledmlp.plan.activation import activation_output_size

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.RReLU(), torch.nn.Linear(16, 8)).train()
    before = torch.get_rng_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert activation_output_size(mlp, torch.device("cpu"), torch.bfloat16) == 2
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("device, kernels", [("cuda", "compiled"), ("xpu", "compiled"), ("cpu", "eager")])
def test_the_plan_cuts_a_devices_tiles_by_the_kernels_it_runs_there(device: str, kernels: str) -> None:
    """``tiledmlp plan`` / ``--tiled_mlp_target_gb``: CUDA and XPU run the compiled GLU kernels, which hold less
    a tile (the H100: 3.0 elements of ``I`` a token, against the eager tile's 5)."""
    from tiledmlp.plan.model import step_tiles
    from tiledmlp.plan.setup import Setup
    from tiledmlp.plan.shapes import ModelShape

    model, _ = _llama(False)
    target = 200 * 3 * 352 * 4 / 2**30
    setup = Setup(dtype=torch.float32, tiled_mlp=True, mlp_target_gb=target, device_type=device)
    expected = tiledmlp.plan_shards(TOKENS, target_gb=target, hidden_size=HIDDEN, intermediate_size=352,
                                    dtype=torch.float32, device_type=device, kernels=kernels)
    assert step_tiles(ModelShape.from_config(model.config), setup, TOKENS).mlp == expected
    assert len(expected) > 1 and expected != tiledmlp.plan_shards(
        TOKENS, target_gb=target, hidden_size=HIDDEN, intermediate_size=352, dtype=torch.float32,
        device_type=device, kernels="eager" if kernels == "compiled" else "compiled")
