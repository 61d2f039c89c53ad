"""offload_activations(split_layers=True): each decoder layer checkpointed as an attention half and an MLP half,
attention run per KV-head group (tiledmlp.split_layers). Exactness is bit-for-bit against the same offloaded run
with whole-layer checkpoints; ``TOKENS_PER_CHUNK`` is lowered so the tiny models' attention really is split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import tiledmlp
from models import TINY, build
from test_offload import _assert_identical, _ids, _offload, _step
from tiledmlp import split_layers
from tiledmlp.hf_compat import enable_checkpointing

SPLIT = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "qwen3-moe", "mixtral", "gpt-oss", "olmo2"]


@pytest.fixture
def head_groups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Split attention at 8+ tokens per group (tiny models) and record each split's group count."""
    monkeypatch.setattr(split_layers, "TOKENS_PER_CHUNK", 8)
    calls: list[int] = []
    real = split_layers._by_head_groups
    monkeypatch.setattr(split_layers, "_by_head_groups", lambda chunks, *a: calls.append(chunks) or real(chunks, *a))
    return calls


def _setup(arch: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model = build(arch, dtype)
    tiledmlp.patch(model, num_shards=3, loss=True)
    enable_checkpointing(model)
    return model


@pytest.mark.parametrize("arch", SPLIT)
def test_split_layers_bit_identical_to_whole_layers(arch: str, head_groups: list[int]) -> None:
    """float64, two micro-batches of uneven length (batch 2): loss and every grad equal; one more checkpointed input
    per layer left the device; SDPA models ran attention in two head groups (forward and recompute)."""
    batches = [_ids(), _ids(seq=24)]
    model = _setup(arch)
    with _offload(model) as whole:
        reference = _step(model, batches)
    with _offload(model, split_layers=True) as split:
        got = _step(model, batches)
    _assert_identical(got, reference)
    layers = model.config.num_hidden_layers
    assert split.stats.offloaded - whole.stats.offloaded == layers * len(batches), (split.stats, whole.stats)
    assert split.stats.waited == 0
    sdpa = model.config._attn_implementation == "sdpa"
    assert head_groups == ([2] * (2 * layers * len(batches)) if sdpa else []), head_groups


def test_bf16_autocast_and_lora_bit_identical(head_groups: list[int]) -> None:
    from test_offload import _lora

    batches = [_ids(seq=64)]
    model = build("llama", torch.float32)
    tiledmlp.patch(model, num_shards=3, loss=True)
    model = _lora(model)
    enable_checkpointing(model)
    with _offload(model):
        reference = _step(model, batches, autocast=True)
    with _offload(model, split_layers=True):
        got = _step(model, batches, autocast=True)
    _assert_identical(got, reference)
    assert head_groups


def test_head_groups_follow_the_kv_heads_and_the_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """As many groups as KV heads allow, fewer for short sequences; the same numbers as one call, causal or
    masked (a [b, 1, s, s] mask and a per-head one); dropout keeps attention whole (its mask spans all heads)."""
    monkeypatch.setattr(split_layers, "TOKENS_PER_CHUNK", 16)
    q, k, v = torch.randn(2, 8, 64, 4), torch.randn(2, 4, 64, 4), torch.randn(2, 4, 64, 4)
    options = {"enable_gqa": True}
    assert split_layers._chunks(q, k, options) == 4  # 64 // 16 = 4 groups of one KV head
    assert split_layers._chunks(q[:, :, :40], k[:, :, :40], options) == 2
    assert split_layers._chunks(q, k, {"dropout_p": 0.1}) == 1
    masks = {"causal": None, "shared": torch.rand(2, 1, 64, 64) > 0.3, "per-head": torch.rand(2, 8, 64, 64) > 0.3}
    for name, mask in masks.items():
        kw = {"is_causal": True} if mask is None else {"attn_mask": mask}
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        with split_layers.AttentionByHeadGroups():
            got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        assert torch.equal(got, want), name
        assert got.transpose(1, 2).is_contiguous(), "the fused kernels' [batch, tokens, heads, dim] layout"


def test_models_without_the_two_halves_are_refused_and_remove_restores() -> None:
    """GPT-2, Phi-3 (a residual dropout between attention and the add) and Granite (its residual branch scaled by
    residual_multiplier: same children, other arithmetic) are not split; remove() puts the whole-layer checkpoint
    back; a bad flag is refused."""
    granite = tf.GraniteForCausalLM(tf.GraniteConfig(**TINY, residual_multiplier=0.5))
    for model in (build("gpt2"), build("phi3"), granite):
        with pytest.raises(ValueError, match="split_layers=False"):
            tiledmlp.offload_activations(model, split_layers=True)
    model = build("llama")
    off = tiledmlp.offload_activations(model, split_layers=True)
    layers = [m for m in model.modules() if split_layers.splittable(m)]
    assert layers and all(isinstance(m._gradient_checkpointing_func, split_layers.SplitLayerCheckpoint) for m in layers)
    off.remove()
    assert not any(isinstance(m._gradient_checkpointing_func, split_layers.SplitLayerCheckpoint) for m in layers)
    with pytest.raises(TypeError, match="split_layers must be a bool"):
        tiledmlp.offload_activations(build("llama"), split_layers="yes")


def test_split_again_after_checkpointing_is_re_enabled(head_groups: list[int]) -> None:
    """The Trainer enables checkpointing when training starts, which puts transformers' whole-layer function
    back: the next forward splits again."""
    model = _setup("llama")
    with _offload(model, split_layers=True):
        enable_checkpointing(model)
        _step(model, [_ids()])
    assert head_groups


def test_train_flag_same_losses_and_both_halves_saved(tmp_path, monkeypatch, head_groups: list[int]) -> None:
    """``tiledmlp train --activation_offloading true --activation_offloading_split_layers true``: the same losses
    as whole-layer offloading, two checkpointed inputs per layer and step; the flag alone is refused."""
    from test_train import losses, train
    from tiledmlp.train.args import UsageError, parse_args

    whole = train(tmp_path, monkeypatch, "--activation_offloading", "true", name="whole")
    split = train(tmp_path, monkeypatch, "--activation_offloading", "true", "--activation_offloading_split_layers",
                  "true", name="split")
    assert losses(split) == losses(whole) and len(losses(whole)) == 3
    assert split["offload"]["packed"] - whole["offload"]["packed"] >= 3 * 2, (split["offload"], whole["offload"])
    assert head_groups
    with pytest.raises(UsageError, match="needs --activation_offloading true"):
        parse_args(["--model", "tiny-llama", "--activation_offloading_split_layers", "true"])


def test_the_mlp_halfs_backward_holds_no_attention_tensors() -> None:
    """CPU profiler peak of a one-layer step (4096 tokens, hidden 256, 8 heads / 2 KV heads, tiled MLP and loss,
    float32): whole-layer checkpointing recomputes attention before the MLP's backward, whose peak then holds
    attention's x, norm output, q, k, v and output (4.5 [t, h] tensors); split, the peak is lower by about that."""
    from tiledmlp.measure import profiler_peak_bytes

    config = tf.LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).train()
    tiledmlp.patch(model, num_shards=4, loss=True)
    enable_checkpointing(model)
    ids = torch.randint(0, 64, (1, 4096))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    peaks = {}
    for split in (False, True):
        with tiledmlp.offload_activations(model, split_layers=split):
            step()
            peaks[split] = profiler_peak_bytes(step, device="cpu")
    tensor = 4096 * 256 * 4
    assert peaks[False] - peaks[True] >= 4 * tensor, {k: v / tensor for k, v in peaks.items()}


def test_the_group_before_an_attention_half_comes_back_after_attentions_backward(head_groups: list[int]) -> None:
    """Offloaded groups are fetched one ahead, except the one before an attention half's input: it is fetched once
    that attention's backward has produced the query's gradient (so it is not on the device at the layer's widest
    point), still before it is used: no waits."""
    model = _setup("llama")
    with _offload(model, split_layers=True) as off:
        off.trace = []
        _step(model, [_ids()])
    trace, layers = off.trace, model.config.num_hidden_layers
    done = [i for i, (kind, _) in enumerate(trace) if kind == "attention backward done"]
    assert len(done) == layers and off.stats.waited == 0, (trace, off.stats)
    for i in done:
        group = trace[i][1]
        assert trace[i + 1] == ("fetch", group), trace
        uses = [j for j, e in enumerate(trace) if e == ("use", group)]
        assert ("fetch", group) not in trace[:i] and uses and uses[0] > i + 1, trace
