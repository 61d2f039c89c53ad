"""``tiledmlp train --sequence_parallel_size N`` refuses a MoE router load-balancing loss, before SP is set up.

The loss multiplies two means over the whole sequence; per SP shard, re-weighted by each shard's labelled tokens,
it gave router grads 14% off one untiled process (SP=2, ZeRO-1, coefficient 0.5; a shard with no labels
dropped its aux loss entirely). Single-process and fast: the refusal comes before any multi-process work.
"""

from __future__ import annotations

import pytest
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from tiledmlp.train.args import UsageError, parse_args
from tiledmlp.train.sequence_parallel import check_model, enable


def _moe(output_router_logits: bool, coef: float) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                            num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, vocab_size=32, attn_implementation="sdpa",
                            output_router_logits=output_router_logits, router_aux_loss_coef=coef)
    return Qwen3MoeForCausalLM(config)


REFUSAL = (r"--sequence_parallel_size 2 cannot train the model's router load-balancing loss \(output_router_logits="
           r"True, router_aux_loss_coef=0.5\).*\"output_router_logits\": false.*--sequence_parallel_size 1")


def test_sp_refuses_the_router_aux_loss() -> None:
    with pytest.raises(UsageError, match=REFUSAL):
        check_model(_moe(True, 0.5), 2)


def test_the_refusal_comes_before_sp_is_set_up() -> None:
    """``enable`` (where ``tiledmlp train`` turns SP on) refuses before it starts DeepSpeed's communication or
    configures Ulysses."""
    _, _, _, train_args = parse_args(["--model", "tiny-qwen3-moe", "--max_seq_length", "64"])
    with pytest.raises(UsageError, match=REFUSAL):
        enable(train_args, _moe(True, 0.5), 2, 64)
    assert train_args.parallelism_config is None


@pytest.mark.parametrize("logits,coef,n", [(False, 0.5, 2), (True, 0.0, 2), (True, 0.5, 1)])
def test_sp_accepts_moe_without_an_aux_loss(logits: bool, coef: float, n: int) -> None:
    """No router logits, a zero coefficient (the loss is the token loss alone: exact under SP), or no SP."""
    assert check_model(_moe(logits, coef), n) == "sdpa"
