"""``hollow_matmuls`` changes what 16-bit CPU matmuls compute, never what anything allocates.

Each case is a small twin of a ``hollow_matmuls``-marked test's step (the same code paths: bf16 loss tiles with
float32, 16-bit and per-tile sums, LoRA GLU tiles over a bf16 base with and without dropout, autocast MLP tiles on
the GLU path and the generic engine, Llama training steps in bf16 and under bf16 autocast, untiled, tiled with
checkpointing, tiled with offloading: the recipes of tests/distributed/_plan_fsdp_job.py too). The profiler's
sequence of allocations and frees must be the same with the arithmetic and without it, and so the peak. Two
differences are left out: the hollow run wraps a few scalars more (4-8 bytes, freed at once: the kernel's early
return scales by ``beta``), and a run of frees with no allocation between may come in another order (the kernel's
Python frame lets go of its tensors last); neither can move the running sum's peak.
"""

from __future__ import annotations

import gc
import itertools
from collections import Counter
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from hollow_matmul import hollow_matmuls, reference_kernel_only
from torch.profiler import ProfilerActivity, profile

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.loss import tiled_causal_lm_loss
from tiledmlp.measure import _no_gc
from tiledmlp.plan.measure import build_training_step
from tiledmlp.train.models import tiny_llama_config

from test_loss_vlm import tiny  # noqa: E402 (tests/: the planned steps' models)
from test_plan import CONFIGS, RECIPES, VARIANTS, prepared  # noqa: E402
from test_plan_alibi import CONFIGS as ALIBI  # noqa: E402
from test_plan_families import FAMILIES  # noqa: E402
from test_plan_layer_mlps import prepared as layer_mlp_model  # noqa: E402
from test_plan_sliding import gemma3, mistral  # noqa: E402
from test_plan_ungated import CONFIGS as UNGATED  # noqa: E402

# where oneDNN runs 16-bit matmuls (float32 scratch buffers beside the output) the mode is off for the marked tests
reference_only = pytest.mark.skipif(not reference_kernel_only(), reason="this CPU's 16-bit matmuls are oneDNN's: "
                                    "hollow_matmuls is off here, the marked tests do the arithmetic")

SCALARS = 64  # bytes: the early return's wrapped scalars and smaller


def _events(step: Callable[[], None], hollow: bool) -> list[int]:
    """The step's allocations and frees in time order, measured as ``profiler_peak_bytes`` measures the marked
    tests' steps: with no garbage collection during it (the kernels' Python frames make garbage collections come
    at other moments, and a collection mid-step frees a cycle's tensors early: earlier tests leave such cycles)."""
    step()  # warm-up: optimizer states, lazy inits
    with _no_gc(), hollow_matmuls(hollow), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    return [n for _, n in events]


def _canonical(events: list[int]) -> list[int]:
    """Allocations (+) and frees (-) above the scalars' size, each run of one sign in a fixed order."""
    kept = [n for n in events if abs(n) > SCALARS]
    return [n for _, run in itertools.groupby(kept, key=lambda n: n > 0) for n in sorted(run)]


def _assert_same(hollow: list[int], real: list[int]) -> None:
    """Equal sequences, or a failure that says where they part and which sizes only one of them has."""
    if hollow == real:
        return
    at = next((i for i, (h, r) in enumerate(zip(hollow, real)) if h != r), min(len(hollow), len(real)))
    only_hollow, only_real = Counter(hollow) - Counter(real), Counter(real) - Counter(hollow)
    pytest.fail(f"the sequences part at event {at} of {len(hollow)} (hollow) / {len(real)} (real): hollow "
                f"{hollow[max(0, at - 4):at + 6]}, real {real[max(0, at - 4):at + 6]}; sizes only in the hollow run "
                f"{dict(only_hollow)}, only in the real run {dict(only_real)}")


def _peak(events: list[int]) -> int:
    running = peak = 0
    for n in events:
        running += n
        peak = max(peak, running)
    return peak


def _loss(accumulate: object, shards: object) -> Callable[[], None]:
    torch.manual_seed(0)
    h = torch.randn(96, 64).bfloat16().requires_grad_()
    w = (torch.randn(1001, 64) * 0.125).bfloat16().requires_grad_()
    y = torch.randint(0, 1001, (96,))

    def step() -> None:
        (tiled_causal_lm_loss(h, w, y, shift=False, num_shards=shards, accumulate_dtype=accumulate) / 3).backward()
        h.grad = w.grad = None

    return step


def _mlp_step(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list, autocast: bool
              ) -> Callable[[], None]:
    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = forward(x)
        out.backward(torch.ones_like(out))
        x.grad = None
        for p in params:
            p.grad = None

    return step


def _lora_tile(dropout: float) -> Callable[[], None]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                                               num_attention_heads=4, vocab_size=16)).to(torch.bfloat16)
    config = LoraConfig(r=8, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=dropout)
    mlp = get_peft_model(model, config).base_model.model.model.layers[0].mlp
    tiledmlp.patch(model, num_shards=4)
    x = torch.randn(1, 512, 64, dtype=torch.bfloat16, requires_grad=True)
    return _mlp_step(mlp, x, list(mlp.parameters()), autocast=False)


def _autocast_mlp(path: str) -> Callable[[], None]:
    from transformers.models.llama.modeling_llama import LlamaMLP

    from tiledmlp import TiledMLP
    from tiledmlp.engine import tiled_call

    torch.manual_seed(0)
    mlp = LlamaMLP(tf.LlamaConfig(hidden_size=64, intermediate_size=176))
    params = list(mlp.parameters())
    forward = TiledMLP(mlp, num_shards=3) if path == "glu" else \
        lambda t: tiled_call(mlp.forward, t, params=params, splits=[70, 70, 60])
    return _mlp_step(forward, torch.randn(1, 200, 64, requires_grad=True), params, autocast=True)


def _llama(dtype: torch.dtype, tiled: bool, autocast: bool = False, offload: str = "") -> Callable[[], None]:
    """A Trainer-like step (``plan.measure``) of a 2-layer Llama: untiled, or tiled MLP and loss under
    checkpointing (or offloading, whole or split layers); ``autocast``: bf16 autocast over its weights."""
    config = tiny_llama_config()
    config.num_hidden_layers, config._attn_implementation = 2, "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    model.train()
    if tiled:
        tiledmlp.patch(model, num_shards=2)
        tiledmlp.patch_loss(model, num_shards=2)
        if offload:
            tiledmlp.offload_activations(model, split_layers=offload == "split")
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, config.vocab_size, (1, 256))
    return build_training_step(model, ids, autocast_dtype=torch.bfloat16 if autocast else None)[0]


CASES = {
    "loss-float32-sums": lambda: _loss("auto", "auto"), "loss-float32-sums-3-tiles": lambda: _loss("auto", 3),
    "loss-param-sums-3-tiles": lambda: _loss("param", 3), "loss-bf16-sums-3-tiles": lambda: _loss(torch.bfloat16, 3),
    "lora-glu-tile": lambda: _lora_tile(0.0), "lora-glu-tile-dropout": lambda: _lora_tile(0.1),
    "autocast-glu": lambda: _autocast_mlp("glu"), "autocast-generic": lambda: _autocast_mlp("generic"),
    "llama-bf16": lambda: _llama(torch.bfloat16, False), "llama-bf16-tiled": lambda: _llama(torch.bfloat16, True),
    "llama-autocast": lambda: _llama(torch.float32, False, True),
    "llama-autocast-tiled": lambda: _llama(torch.float32, True, True),
    "llama-bf16-offloaded": lambda: _llama(torch.bfloat16, True, offload="whole"),
    "llama-bf16-offloaded-split-layers": lambda: _llama(torch.bfloat16, True, offload="split"),
}


def _planned(model: str, recipe: str, variant: str = "") -> Callable[[], None]:
    """A 128-token step of a model test_plan.py / test_plan_alibi.py measure in bf16 (or a variant's dtype)."""
    options = dict(VARIANTS[variant]) if variant else {"dtype": torch.bfloat16}
    config = {**CONFIGS, **ALIBI}[model]()
    if model not in ALIBI:  # as the tests set them: SDPA but for the eager variant; Bloom's and MPT's own
        config._attn_implementation = options.pop("attn", "sdpa")
    autocast = options.pop("autocast", False)
    step = prepared(config, options.pop("dtype"), recipe, **options)
    return build_training_step(step, torch.randint(0, config.vocab_size, (1, 128)),
                               autocast_dtype=torch.bfloat16 if autocast else None)[0]


PLANNED = {
    **{f"tiny-llama-{recipe}": (lambda r=recipe: _planned("tiny-llama", r)) for recipe in RECIPES},
    **{f"{model}-{recipe}": (lambda m=model, r=recipe: _planned(m, r)) for model in ("olmo2", "gemma")
       for recipe in ("untiled", "tiled+loss+ckpt")},
    **{f"{model}-{recipe}": (lambda m=model, r=recipe: _planned(m, r)) for model in ALIBI
       for recipe in ("untiled", "tiled+ckpt")},
    **{f"{variant}-{recipe}": (lambda v=variant, r=recipe: _planned("tiny-llama", r, v)) for variant in VARIANTS
       for recipe in ("untiled", "tiled+loss+ckpt") if VARIANTS[variant]["dtype"] == torch.bfloat16 or
       VARIANTS[variant].get("autocast")},  # the float32 variants have no 16-bit matmul
}


def _step(model: torch.nn.Module, vocab: int, low: int = 0) -> Callable[[], None]:
    return build_training_step(model, torch.randint(low, vocab, (1, 128)))[0]


def _family(config: tf.PretrainedConfig, recipe: str) -> Callable[[], None]:
    """test_plan_families.py's and test_plan_sliding.py's bf16 steps (sdpa; a sliding window under 128 tokens)."""
    config._attn_implementation = "sdpa"
    return _step(prepared(config, torch.bfloat16, recipe), config.vocab_size)


def _ungated(model: str, ckpt: bool) -> Callable[[], None]:
    """test_plan_ungated.py's bf16 steps: the generic engine's 2 tiles over an ungated MLP."""
    config = UNGATED[model]()
    torch.manual_seed(0)
    lm = tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    lm.train()
    tiledmlp.patch(lm, num_shards=2)
    if ckpt:
        enable_checkpointing(lm, {"use_reentrant": False})
    return _step(lm, config.vocab_size)


def _vlm(model_type: str) -> Callable[[], None]:
    """test_plan_vlm.py's bf16 step, tiled, with the tiled loss, checkpointed (text tokens only)."""
    model = tiny(model_type, vocab_size=257, intermediate_size=172).to(torch.bfloat16)
    tiledmlp.patch(model, loss=True)
    enable_checkpointing(model, {"use_reentrant": False})
    return _step(model, 90, low=3)


OTHER_PLANS = {  # the other bf16 plan tests' models, one step each of the recipe that takes most code paths
    **{f"{m}-tiled+loss+ckpt": (lambda m=m: _family(FAMILIES[m](), "tiled+loss+ckpt")) for m in FAMILIES},
    "gpt2-untiled": lambda: _family(FAMILIES["gpt2"](), "untiled"),
    **{f"{m.__name__}-sliding-{r}": (lambda m=m, r=r: _family(m(64), r)) for m in (mistral, gemma3)
       for r in ("untiled", "tiled+loss")},
    **{f"{m}-ungated-tiled+ckpt": (lambda m=m: _ungated(m, True)) for m in ("bloom-wide", "mpt-wide")},
    "neox-ungated-tiled": lambda: _ungated("neox", False),
    **{f"{m}-vlm-tiled+loss+ckpt": (lambda m=m: _vlm(m)) for m in ("qwen2_5_vl", "llava", "gemma3")},
    # test_plan_layer_mlps.py's: the MLP's matmuls in the decoder layer, untiled; OPT's loss tiled
    "opt-layer-mlp-loss+ckpt": lambda: _step(layer_mlp_model("opt", torch.bfloat16, True, True), 257, low=3),
    "opt-layer-mlp-untiled": lambda: _step(layer_mlp_model("opt", torch.bfloat16, False, False), 257, low=3),
    "biogpt-layer-mlp-ckpt": lambda: _step(layer_mlp_model("biogpt", torch.bfloat16, False, True), 257, low=3),
    # XGLM's own eager attention (bmm, a torch.max clamp, softmax), its loss tiled
    "xglm-layer-mlp-loss+ckpt": lambda: _step(layer_mlp_model("xglm", torch.bfloat16, True, True), 257, low=3),
    "xglm-layer-mlp-untiled": lambda: _step(layer_mlp_model("xglm", torch.bfloat16, False, False), 257, low=3),
}
CASES.update(PLANNED)
CASES.update({f"plan-{name}": case for name, case in OTHER_PLANS.items()})


@reference_only
@pytest.mark.parametrize("case", list(CASES))
def test_the_same_allocations_without_the_arithmetic(case: str) -> None:
    real, hollow = _events(CASES[case](), False), _events(CASES[case](), True)
    _assert_same(_canonical(hollow), _canonical(real))
    assert _peak(hollow) == _peak(real) > 0


# (batch, heads, kv heads, seq, head dim, mask, layout): sequences on either side of ATen's block-size thresholds
# (192 and 768 query rows, 512 keys), grouped-query attention, float and bool masks; q/k/v and the output's gradient
# as transformers makes them ("rows": [batch, seq, heads, dim] memory) or contiguous per head (the gradient copied)
ATTENTION = {
    "32-row-blocks": (1, 4, 4, 100, 64, None, "rows"),
    "64-row-blocks-gqa": (1, 4, 2, 256, 64, None, "rows"),
    "64-row-blocks-float-mask-batch-2": (2, 4, 4, 300, 64, "float", "rows"),
    "256-row-blocks-heads-layout": (1, 4, 4, 800, 32, None, "heads"),
    "two-key-blocks-bool-mask": (1, 4, 4, 1000, 64, "bool", "rows"),
}


def _attention(dtype: torch.dtype, batch: int, heads: int, kv_heads: int, seq: int, dim: int, mask: str | None,
               layout: str) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """A forward and backward through ``scaled_dot_product_attention`` (its CPU flash kernel), and the tensors
    whose values it writes (the output and the inputs' grads; the latest step's first)."""
    torch.manual_seed(0)
    make = (lambda n: torch.randn(batch, seq, n, dim, dtype=dtype).transpose(1, 2)) if layout == "rows" else \
        (lambda n: torch.randn(batch, n, seq, dim, dtype=dtype))
    q, k, v = (make(n).requires_grad_() for n in (heads, kv_heads, kv_heads))
    masks = {"float": lambda: torch.zeros(batch, 1, seq, seq, dtype=dtype),
             "bool": lambda: torch.ones(seq, seq, dtype=torch.bool).tril()}
    attn_mask = masks[mask]() if mask else None
    written: list[torch.Tensor] = []

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                             enable_gqa=heads != kv_heads)
        (out if layout == "heads" else out.transpose(1, 2).reshape(batch, seq, heads * dim)).sum().backward()
        written[:0] = [out.detach(), q.grad, k.grad, v.grad]  # the last step's kept: frees only of this step's
        q.grad = k.grad = v.grad = None

    return step, written


@reference_only
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(ATTENTION))
def test_flash_attention_allocates_the_same_without_the_arithmetic(case: str, threads: int) -> None:
    """ATen's CPU flash attention, forward and backward: the same allocations and frees in the same order (its
    per-thread buffers by the thread count); 16-bit inside the mode writes zeros, float32 the same bits as ATen."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            runs = []
            for hollow in (False, True):
                gc.collect()  # the last run's tensors freed before this one's profile, not during it
                step, written = _attention(dtype, *ATTENTION[case])
                runs.append((_events(step, hollow), [t.clone() for t in written[:4]]))
                del step, written
            (real_events, real), (hollow_events, hollow) = runs
            _assert_same(hollow_events, real_events)  # every event, in order
            if dtype == torch.float32:
                assert all(torch.equal(h, r) for h, r in zip(hollow, real))
            else:
                assert all(not h.any() for h in hollow) and all(r.any() for r in real)
    finally:
        torch.set_num_threads(before)


@reference_only
def test_a_qlora_step_allocates_the_same_without_the_arithmetic(tmp_path) -> None:
    """tests/test_plan_qlora.py's bf16 step (4-bit Linears computing in bf16, float32 LoRA, tiled, checkpointed)."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from tiledmlp.hf_compat import enable_checkpointing

    config = tf.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path)

    def step() -> Callable[[], None]:
        quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                                      bnb_4bit_use_double_quant=True)
        model = tf.LlamaForCausalLM.from_pretrained(tmp_path, device_map="cpu", quantization_config=quant)
        model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False),
                               LoraConfig(r=8, target_modules="all-linear"))
        tiledmlp.patch(model, loss=True, num_shards=2)
        enable_checkpointing(model, {"use_reentrant": False})
        model.train()
        return build_training_step(model, torch.randint(0, 512, (1, 256)))[0]

    real, hollow = _events(step(), False), _events(step(), True)
    _assert_same(_canonical(hollow), _canonical(real))
    assert _peak(hollow) == _peak(real) > 0


def _products(dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every overload the mode takes over, on one set of operands; and the ``self`` of those that have one."""
    torch.manual_seed(0)
    a, b, c = (torch.randn(5, 7).to(dtype), torch.randn(7, 3).to(dtype), torch.randn(5, 3).to(dtype))
    ba, bb, bc = a.expand(2, 5, 7), b.expand(2, 7, 3), c.expand(2, 5, 3)
    return [a @ b, torch.mm(a, b, out=torch.empty(5, 3, dtype=dtype)), torch.bmm(ba, bb),
            torch.bmm(ba, bb, out=torch.empty(2, 5, 3, dtype=dtype)), torch.addmm(c[0], a, b, beta=0.5, alpha=2),
            c.clone().addmm_(a, b, beta=0.5), torch.baddbmm(bc, ba, bb, alpha=2), bc.clone().baddbmm_(ba, bb)], c


def test_the_hollow_run_skips_the_products() -> None:
    """Inside the mode a 16-bit CPU product is the kernel's early return: zeros, or ``beta`` times ``self``; a
    float32 one is the same bits as without it (the kernels ATen's own call); outside it, products again."""
    (real32, _), (real16, _) = _products(torch.float32), _products(torch.bfloat16)
    with hollow_matmuls(True):
        (hollow32, _), (hollow16, c) = _products(torch.float32), _products(torch.bfloat16)
    assert all(torch.equal(h, r) for h, r in zip(hollow32, real32))
    zeros = torch.zeros(2, 5, 3, dtype=torch.bfloat16)
    early = [zeros[0], zeros[0], zeros, zeros, (0.5 * c[0]).expand(5, 3), 0.5 * c, c.expand(2, 5, 3),
             c.expand(2, 5, 3)]
    assert all(torch.equal(h, e) for h, e in zip(hollow16, early))
    assert all(torch.count_nonzero(r - e) > 0 for r, e in zip(real16, early))
    assert all(torch.equal(r, again) for r, again in zip(real16, _products(torch.bfloat16)[0]))
