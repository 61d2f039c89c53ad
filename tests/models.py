"""Tiny Hugging Face models built in code (random init), one per architecture family."""

from __future__ import annotations

import torch
import transformers as tf

TINY = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=256)


def _moe(extra: dict) -> dict:
    return {**TINY, "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1,
            "experts_implementation": "eager", **extra}  # grouped_mm has no float64 kernel


BUILDERS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**TINY)),
    "llama-mlp-bias": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, mlp_bias=True)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**TINY)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY, head_dim=8)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**TINY, head_dim=8)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**TINY, head_dim=8)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**TINY, head_dim=8)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**TINY, pad_token_id=0)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**TINY, pad_token_id=0)),  # norms after attention and MLP
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=256,
                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "qwen3-moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**_moe({"num_experts": 4, "moe_intermediate_size": 40,
                                                                          "head_dim": 8}))),
    "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**_moe({"num_local_experts": 4}))),
}

# Mixture-of-experts families whose blocks differ from Qwen3-MoE's/Mixtral's: GPT-OSS's block is named "...MLP" and
# returns (output, router scores); Llama-4's routed experts take tokens grouped by expert and its shared expert's
# output is added to in place; Granite-MoE, DeepSeek-V2 and GLM-4-MoE have experts under blocks named "...MoE" (the
# latter two beside shared-expert and dense MLPs).
_ROUTED = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1,
           "experts_implementation": "eager"}
MOE_FAMILIES = {
    "gpt-oss": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(**TINY, head_dim=8, num_local_experts=4, **_ROUTED)),
    "llama4": lambda: tf.Llama4ForCausalLM(tf.Llama4TextConfig(**{**TINY, "intermediate_size": 40}, head_dim=8,
                                                               intermediate_size_mlp=88, num_local_experts=4,
                                                               interleave_moe_layer_step=1, **_ROUTED)),
    "granitemoe": lambda: tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**TINY, num_local_experts=4, **_ROUTED)),
    "deepseek-v2": lambda: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **TINY, head_dim=8, moe_intermediate_size=40, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1,
        topk_group=1, **_ROUTED)),
    "glm4-moe": lambda: tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(
        **TINY, head_dim=8, moe_intermediate_size=40, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, **_ROUTED)),
    # DBRX's experts take the hidden states batched ([B, T, H]) and the routing flattened ([B*T, k])
    "dbrx": lambda: tf.DbrxForCausalLM(tf.DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, vocab_size=96, max_seq_len=256,
        ffn_config={"ffn_hidden_size": 88, "moe_num_experts": 4, "moe_top_k": 2},
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0})),
}
BUILDERS_ALL = {**BUILDERS, **MOE_FAMILIES}

EXPECTED_PATH = {"phi3": "glu", "gpt2": "generic", "qwen3-moe": "generic", "mixtral": "generic"}


def build(name: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = BUILDERS_ALL[name]().to(dtype)
    model.train()
    for p in model.parameters():  # HF inits some weights (norms, routers) to constants: randomise for sharper tests
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def loss_and_grads(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
