"""patch_loss on Hugging Face causal LMs: the model's own loss and grads, logits never built, the Trainer's kwargs."""

from __future__ import annotations

import inspect
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from conftest import assert_rel
from models import TINY, build

import tiledmlp
from tiledmlp.loss_patching import patch_loss, tiled_loss_refusal, unpatch_loss


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100  # a masked prompt
    return ids, labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _compare(model: torch.nn.Module, tol: float, **kw: object) -> None:
    """Unpatched vs patched on the same batch: same loss, same grads for every parameter, logits None."""
    ids, labels = _batch()
    ref = model(input_ids=ids, labels=labels, **kw)
    ref.loss.backward()
    ref_grads = _grads(model)
    assert patch_loss(model, num_shards=3) == 1
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = _grads(model)
    assert out.logits is None and ref.logits is not None
    assert_rel(out.loss, ref.loss, tol, "loss")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_rel(grads[name], ref_grads[name], tol, name)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3", "phi3", "gpt2"])
def test_patched_model_matches_transformers_loss_and_grads(arch: str) -> None:
    model = build(arch, torch.float32)  # gemma2 keeps its final_logit_softcapping (30.0)
    _compare(model, 1e-5)


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "gpt-oss", "deepseek-v2", "glm4-moe", "llama4"])
def test_moe_models_keep_their_aux_loss(arch: str) -> None:
    """The model's own forward runs around the tiled loss, so a MoE model's router aux loss is added as before."""
    model = build(arch, torch.float32)
    ids, labels = _batch()
    aux = getattr(model(input_ids=ids, labels=labels), "aux_loss", None)  # before 5.23 some return no such field
    assert (aux is not None and aux > 0) == (arch in ("qwen3-moe", "mixtral", "gpt-oss"))
    _compare(model, 1e-5)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and model.forward.last_used_tiled
    if aux is not None:
        assert_rel(out.aux_loss, aux, 1e-6, "aux_loss")


def _tiled_against_float64(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """patch_loss's loss and grads against the float64 cross-entropy of the unpatched model's own logits
    (transformers upcasts logits with .float(), i.e. *down* to float32 for a float64 model); the batch's ids and
    those logits, returned."""
    ids, labels = _batch()
    logits = model(input_ids=ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))
    ref.backward()
    ref_grads = _grads(model)
    assert patch_loss(model, num_shards=4) == 1
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert_rel(out.loss, ref.detach(), 1e-12, "loss")
    for name, g in _grads(model).items():
        assert_rel(g, ref_grads[name], 1e-12, name)
    return ids, logits.detach()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_patched_model_float64_matches_float64_reference(arch: str) -> None:
    """GPT-2's ``GPT2LMHeadModel`` (no ``*ForCausalLM`` in its name) too: its head is tied to ``wte``, so the
    embedding's grad takes both the loss's head grad and the input's (refused until 2026-11-29)."""
    _tiled_against_float64(build(arch, torch.float64))


_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
OLDER = {  # forwards with the legacy ``if not return_dict: output = (logits,) + ...`` branch, Falcon's
    # ``lm_logits``, OPT's ``.contiguous()``: refused until 2026-11-29
    "bloom": lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=96),
    "falcon": lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=96),
    "gpt_neo": lambda: tf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, vocab_size=96, embed_dropout=0.0,
                                       attention_types=[[["global", "local"], 1]], attention_dropout=0.0,
                                       resid_dropout=0.0),
    "gptj": lambda: tf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=96, rotary_dim=4, **_NO_DROPOUT),
    "codegen": lambda: tf.CodeGenConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=96, rotary_dim=4, **_NO_DROPOUT),
    "mpt": lambda: tf.MptConfig(d_model=32, n_layers=2, n_heads=4, vocab_size=96),
    "openai-gpt": lambda: tf.OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=96, **_NO_DROPOUT),
    "opt": lambda: tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                vocab_size=96, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0),
    # XGLM passes pad_token_id to ForCausalLMLoss, which ignores it: refused until 2026-11-29
    "xglm": lambda: tf.XGLMConfig(d_model=32, ffn_dim=64, num_layers=2, attention_heads=4, vocab_size=96,
                                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
}
NO_MLP_MODULE = {"opt", "xglm"}  # fc1/fc2 in the decoder layer: patch() finds no MLP, their loss alone is tiled


@pytest.fixture
def float64_default() -> Iterator[None]:
    """float64 as the default dtype: XGLM's attention clamps its scores by ``torch.full((), finfo(dtype).min)``,
    which is built in the default dtype and overflows float32 for a float64 model."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


@pytest.mark.parametrize("family", list(OLDER))
def test_older_causal_lm_forwards_take_the_tiled_loss_float64(family: str, request: pytest.FixtureRequest) -> None:
    """Their legacy tuple-output branch never runs under the patched forward (it calls with ``return_dict=True``),
    so the tiled loss stands in: loss and every grad as the float64 cross-entropy of the model's own logits, with
    their MLPs tiled too (OPT's and XGLM's fc1/fc2 sit in their decoder layers, no MLP module: ``patch()`` refuses
    them, so their loss alone)."""
    if family == "xglm":
        request.getfixturevalue("float64_default")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(OLDER[family]()).double().train()
    ids, labels = _batch()
    ref = F.cross_entropy(model(input_ids=ids).logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))
    ref.backward()
    ref_grads = _grads(model)
    if family in NO_MLP_MODULE:
        with pytest.raises(ValueError, match="found no MLP to tile"):
            tiledmlp.patch(model)
        assert patch_loss(model, num_shards=4) == 1
    else:
        report = tiledmlp.patch(model, num_shards=3, loss=True)
        assert len(report) == 2 and {path for _, _, path in report.patched} == {"generic"}
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert_rel(out.loss, ref.detach(), 1e-12, "loss")
    for name, g in _grads(model).items():
        if ref_grads[name].norm() < 1e-10:  # a key projection's bias: softmax ignores what it adds, its grad is 0
            assert g.norm() < 1e-10, (name, g.norm())
        else:
            assert_rel(g, ref_grads[name], 1e-12, name)
    assert model.forward.last_used_tiled and model(input_ids=ids, labels=labels).logits is None
    assert model(input_ids=ids, labels=labels, return_dict=False)[0].dim() == 0  # the tuple output: the loss first


def test_label_smoothing_float64_and_as_trainers_label_smoother() -> None:
    """``patch_loss(label_smoothing=s)``: float64 equal to ``F.cross_entropy(label_smoothing=s)`` on the model's own
    logits, and to Trainer's ``LabelSmoother`` (which sums its smoothing term in float32) with num_items_in_batch."""
    from transformers.trainer_pt_utils import LabelSmoother

    model = build("llama", torch.float64)
    ids, labels = _batch()
    logits = model(input_ids=ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1), label_smoothing=0.15)
    ref.backward()
    ref_grads = _grads(model)
    trainers = LabelSmoother(epsilon=0.15)({"logits": logits.detach()}, labels, shift_labels=True,
                                           num_items_in_batch=torch.tensor(21))
    patch_loss(model, num_shards=3)
    patch_loss(model, num_shards=3, label_smoothing=0.15)  # patching again updates it
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None
    assert_rel(out.loss, ref.detach(), 1e-12, "loss")
    for name, g in _grads(model).items():
        assert_rel(g, ref_grads[name], 1e-12, name)
    with torch.no_grad():
        model.train()
        assert_rel(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(21)).loss, trainers, 1e-6,
                   "LabelSmoother")
    with pytest.raises(ValueError, match="label_smoothing must be a number in"):
        patch_loss(model, label_smoothing=-0.1)


def test_trainer_kwargs_num_items_and_shift_labels_and_tuple_output() -> None:
    model = build("llama", torch.float32)
    ids, labels = _batch()
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    ref = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    ref_shift = model(input_ids=ids, labels=labels, shift_labels=shift).loss
    patch_loss(model)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))
    assert_rel(out.loss, ref, 1e-5, "num_items_in_batch")
    assert_rel(model(input_ids=ids, labels=labels, shift_labels=shift).loss, ref_shift, 1e-5, "shift_labels")
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].dim() == 0


def test_eval_and_logits_to_keep_run_the_original_forward() -> None:
    model = build("llama", torch.float32)
    ids, labels = _batch()
    patch_loss(model)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape == (2, 24, 96) and not model.forward.last_used_tiled
    model.train()
    assert model(input_ids=ids).logits is not None  # no labels: untouched
    assert model(input_ids=ids, labels=labels).logits is None and model.forward.last_used_tiled
    # logits_to_keep != 0 with labels is not a training loss transformers can compute: left to the original
    assert not model(input_ids=ids[:, :1], labels=labels[:, :1], logits_to_keep=1).logits is None


def test_tile_eval_tiles_the_no_grad_eval_loss_float64() -> None:
    """``tile_eval=True``: an eval-mode no-grad forward with labels returns the loss only, equal in float64 to the
    cross-entropy of the model's own logits (masked, with and without ``num_items_in_batch``); without labels the
    logits stay; ``tile_eval=False`` again restores the logits."""
    model = build("llama", torch.float64).eval()
    ids, labels = _batch()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))
        ref_sum = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1), reduction="sum")
        patch_loss(model, num_shards=3, tile_eval=True)
        out = model(input_ids=ids, labels=labels)
        assert out.logits is None and model.forward.last_used_tiled
        assert_rel(out.loss, ref, 1e-12, "eval loss")
        assert_rel(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(50)).loss, ref_sum / 50, 1e-12,
                   "eval loss / num_items_in_batch")
        assert torch.equal(model(input_ids=ids).logits, logits)  # no labels: untouched
        patch_loss(model, num_shards=3, tile_eval=False)  # patching again updates it
        assert model(input_ids=ids, labels=labels).logits is not None and not model.forward.last_used_tiled
    with pytest.raises(TypeError, match="tile_eval must be True or False"):
        patch_loss(model, tile_eval="yes")


def test_peft_lora_model_is_patched_through_the_wrapper() -> None:
    peft = pytest.importorskip("peft")
    model = build("llama", torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                      init_lora_weights=False))
    _compare(lora, 1e-5)
    assert all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)


def test_peft_modules_to_save_lm_head_float64() -> None:
    """LoRA with ``modules_to_save=["lm_head", "embed_tokens"]`` (extended vocabularies train both): the tiled loss
    reads the adapter's trained copy of the head (its grad lands there, none on the frozen original), float64-equal
    to the cross-entropy of the untiled model's logits; with the adapter disabled, the original head's. A LoRA
    adapter *on* lm_head is refused, naming the fix."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build("llama", torch.float64), peft.LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"], init_lora_weights=False))
    head = model.base_model.model.lm_head
    with torch.no_grad():  # the trained copy must differ from the original, or reading the wrong one would pass
        head.modules_to_save["default"].weight.add_(0.1 * torch.randn_like(head.original_module.weight))
    ids, labels = _batch()

    def reference() -> torch.Tensor:
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))

    ref = reference()
    ref.backward()
    ref_grads = _grads(model)
    with model.disable_adapter(), torch.no_grad():
        ref_original = reference()
    patch_loss(model, num_shards=3)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = _grads(model)
    assert out.logits is None and grads.keys() == ref_grads.keys()
    assert "base_model.model.lm_head.modules_to_save.default.weight" in grads
    assert_rel(out.loss, ref.detach(), 1e-12, "loss")
    for name in ref_grads:
        assert_rel(grads[name], ref_grads[name], 1e-12, name)
    with model.disable_adapter(), torch.no_grad():
        assert_rel(model(input_ids=ids, labels=labels).loss, ref_original, 1e-12, "original head")
    lora_head = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"A LoRA adapter on lm_head is not supported: .*modules_to_save"):
        patch_loss(lora_head)


SCALED = {  # models whose forward scales the logits by a number they hold, set away from 1 here
    "granite": (lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**TINY, logits_scaling=3.0)), "config.logits_scaling"),
    "granitemoe": (lambda: tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**TINY, logits_scaling=3.0,
                                                                        num_local_experts=4, num_experts_per_tok=2)),
                   "config.logits_scaling"),
    "cohere": (lambda: tf.CohereForCausalLM(tf.CohereConfig(**TINY, logit_scale=0.3)), "logit_scale"),
    "falcon-h1": (lambda: tf.FalconH1ForCausalLM(tf.FalconH1Config(**TINY, head_dim=8, lm_head_multiplier=0.7,
                  mamba_d_ssm=64, mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16)),
                  "model.lm_head_multiplier"),
}


@pytest.mark.parametrize("arch", list(SCALED))
def test_models_that_scale_their_logits(arch: str) -> None:
    """The tiled loss scales the logits by the model's own number; the forward's statement sees 1 during the call
    (so it leaves the loss as it is) and the number is back afterwards."""
    make, path = SCALED[arch]
    torch.manual_seed(0)
    model = make().float().train()
    refusal = tiled_loss_refusal(model)
    if refusal and arch == "falcon-h1" and not hasattr(tf.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip(f"before transformers 5.23 Falcon-H1 scales its logits in a statement that is refused: {refusal}")

    def number() -> float:
        owner = model
        for name in path.split("."):
            owner = getattr(owner, name)
        return owner

    before = number()
    _compare(model, 1e-5)
    assert number() == before != 1


class _ZLossLlama(tf.LlamaForCausalLM):
    """A forward that adds a z-loss over the logits: the tiled loss cannot stand in for it."""

    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs) + logits.logsumexp(-1).pow(2).mean()
        return tf.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_unsupported_models_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="no \\*ForCausalLM in GPT2Model"):  # a base model: no head, no loss
        patch_loss(build("gpt2", torch.float32).transformer)
    biogpt = tf.BioGptForCausalLM(tf.BioGptConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                  intermediate_size=64, vocab_size=96))
    with pytest.raises(ValueError, match=r"BioGptForCausalLM.*does more with the logits.*self\.output_projection"):
        patch_loss(biogpt)  # its head is not self.lm_head
    with pytest.raises(ValueError, match=r"_ZLossLlama.*does more with the logits.*\+ logits\.lo"):
        patch_loss(_ZLossLlama(tf.LlamaConfig(**TINY)))
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(build("llama", torch.float32), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="lm_head is a .*not an nn.Linear"):
        patch_loss(lora)
    custom = build("llama", torch.float32)
    custom.loss_function = lambda *a, **k: torch.zeros(())
    with pytest.raises(ValueError, match="custom loss_function"):
        patch_loss(custom)
    with pytest.raises(ValueError, match="num_shards"):
        patch_loss(build("llama", torch.float32), num_shards=0)
    assert tiled_loss_refusal(build("llama", torch.float32)) == ""


def test_patch_is_idempotent_and_unpatch_restores() -> None:
    model = build("llama", torch.float32)
    ids, labels = _batch()
    ref = model(input_ids=ids, labels=labels)
    params = list(inspect.signature(model.forward).parameters)
    assert patch_loss(model, num_shards=2) == 1
    assert list(inspect.signature(model.forward).parameters) == params  # Trainer keeps its dataset columns
    assert patch_loss(model, num_shards=5) == 1
    assert model.forward.num_shards == 5 and model.forward.original is None  # not nested
    assert unpatch_loss(model) == 1 and unpatch_loss(model) == 0
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and torch.equal(out.loss, ref.loss)


@pytest.mark.parametrize("mode", ["tile_eval", "train"])
def test_the_tiled_loss_under_inference_mode_float64(mode: str) -> None:
    """``torch.inference_mode()``: an eval harness's usual context, where ``tile_eval=True`` is meant to be used (and
    a model left in train mode takes the tiled loss there too). Its tensors have no version counter, which the
    check of the lm_head's hooks read (RuntimeError "Inference tensors do not track version counter" until
    2026-11-27): the loss is the float64 cross-entropy of the model's own logits, and a hook changing it in place is
    still refused."""
    model = build("llama", torch.float64).train(mode == "train")
    ids, labels = _batch()
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))
    patch_loss(model, num_shards=3, tile_eval=mode == "tile_eval")
    with torch.inference_mode():
        out = model(input_ids=ids, labels=labels)
    assert out.logits is None and model.forward.last_used_tiled and out.loss.is_inference()
    assert_rel(out.loss, ref, 1e-12, "inference-mode loss")
    model.lm_head.register_forward_hook(lambda module, args, out: out.div_(2))
    with torch.inference_mode(), pytest.raises(ValueError, match="a forward hook on lm_head changed what it returned"):
        model(input_ids=ids, labels=labels)


@pytest.mark.parametrize("patched", ["patch(loss=True)", "patch_loss"])
def test_compiled_loss_patched_model_without_labels_returns_the_logits(patched: str) -> None:
    """``torch.compile`` of a loss-patched model, called without labels (evaluation, generation): the patched
    forward hands the call to the class's forward. It reached it as ``forward.__get__(model)``, which Dynamo
    resolved to the instance's attribute, the patched forward itself: RecursionError until 2026-11-27. Now the same
    logits as the uncompiled model's, and with labels the same loss."""
    import tiledmlp

    model = build("llama", torch.float64)
    ids, labels = _batch()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    tiledmlp.patch(model, num_shards=3, loss=True) if patched == "patch(loss=True)" else patch_loss(model)
    with torch.no_grad():
        ref_loss = model(input_ids=ids, labels=labels).loss
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    try:
        with torch.no_grad():
            assert torch.equal(compiled(input_ids=ids).logits, logits)
            loss = compiled(input_ids=ids, labels=labels).loss
        assert model.forward.last_used_tiled
        assert_rel(loss, ref_loss, 1e-12, "compiled loss")
    finally:
        torch._dynamo.reset()


def test_compiled_call_without_labels_breaks_the_graph_no_more_than_unpatched() -> None:
    """Generation calls the model without labels: the patched forward hands it straight to the class's, and Dynamo
    traces through it with no graph break of its own (the argument binding, which runs eagerly, is for calls with
    labels only)."""
    from torch._dynamo.utils import counters

    model = build("llama", torch.float32).eval()
    ids, _ = _batch()

    def graph_breaks() -> int:
        torch._dynamo.reset()
        counters.clear()
        try:
            with torch.no_grad():
                torch.compile(model, backend="eager")(input_ids=ids)
            return sum(counters["graph_break"].values())
        finally:
            torch._dynamo.reset()

    unpatched = graph_breaks()
    patch_loss(model)
    assert graph_breaks() == unpatched


def test_a_strict_config_takes_the_soft_cap_float64() -> None:
    """Gemma3n's config types ``final_logit_softcapping`` as a float: the tiled loss's neutral ``None`` for the call
    was refused (``StrictDataclassFieldValidationError``) by every training forward, and the failed call left the
    model's ``loss_function`` and the head's request set, so the next forward without labels returned a 0-d tensor
    as its logits. Now the loss is the float64 cross-entropy of the model's own soft-capped logits, and after it
    the config holds 30.0 again and a forward without labels returns the logits."""
    config = tf.Gemma3nTextConfig(
        hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, vocab_size=96, vocab_size_per_layer_input=96, hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0, 0.0], laurel_rank=4, sliding_window=8, max_position_embeddings=128)
    model = tf.Gemma3nForCausalLM(config).double().train()
    ids, logits = _tiled_against_float64(model)
    assert model.config.final_logit_softcapping == 30.0 and "_loss_function" not in model.__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)
