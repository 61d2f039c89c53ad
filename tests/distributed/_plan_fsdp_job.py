"""The plan's FSDP moments against FSDP2's measured step, one ``torchrun --nproc_per_node 2`` launch (gloo).

Each check builds a Llama (or reads one back in 4 bits under LoRA adapters, as QLoRA), wraps each decoder layer and
then the root in ``fully_shard`` (Trainer's auto wrap; with ``--bf16`` over float32 weights, accelerate's bf16
mixed-precision policy and autocast), runs a warm-up step (AdamW
states), and measures the next steps' peak on rank 0 (the other rank runs them unprofiled): the bytes its shards,
grads and states hold before a step plus the torch profiler's exact peak of the step, the least of ``REPEATS``
steps. gloo's worker threads free some blocks (their own buffers, and the last reference to a collective's tensors)
when the OS schedules them, so a step's measured peak is its program's peak plus, now and then, a block that
thread had not freed yet (CI on 2026-11-29: ``weights-mixed-full`` once 302 MB against 268 MB in every other run, a
32 MiB block; here under pytest, 2 runs in 5); the least of a few steps is the program's own. Rank 0 records it beside
the plan for the same setup, FSDP's and unsharded. Its 16-bit matmuls and flash attention skip their arithmetic
where this CPU has only ATen's reference kernel for them (``tests/hollow_matmul.py``: the same allocations, shown by
``tests/test_hollow_matmul.py`` for these recipes' steps; 307 s of the suite's time before, on an AVX2 CPU; the
attention, since 2026-11-29, took this job from 51 s to 31 s).
"""

from __future__ import annotations

import gc
import tempfile
from typing import Any

import torch
import transformers as tf
from _common import run_plan_checks
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import tiledmlp
from tiledmlp.measure import profiler_peak_bytes
from tiledmlp.plan import ModelShape, Setup, predict_step_peak
from tiledmlp.plan.measure import build_training_step

# name: (recipe, weights' dtype, FSDP strategy, tokens, vocabulary, --bf16). 256 tokens over a 32k vocabulary: the
# weights, and the root's reduce, are the step's peak; 1024 over 8k: the activations and the loss (2048 until
# 2026-11-28: the same moments, plan / measured 0.99-1.02 there, 0.98-1.03 here, at twice the CPU time: bf16 matmuls
# are slow on a CPU without bf16 instructions). --bf16 over float32 weights runs as accelerate sets it up: a bf16
# mixed-precision policy and the forward under autocast
REPEATS = 3  # measured steps per check: scheduling adds to a step's peak, never takes away
CHECKS = {
    "weights-fp32-full": ("untiled", torch.float32, "full_shard", 256, 32768, False),
    "tiled-fp32-full": ("tiled+loss+ckpt", torch.float32, "full_shard", 1024, 8192, False),
    "untiled-bf16-full": ("untiled", torch.bfloat16, "full_shard", 1024, 8192, False),
    "tiled-bf16-grad-op": ("tiled+loss+ckpt", torch.bfloat16, "shard_grad_op", 1024, 8192, False),
    "weights-mixed-full": ("untiled", torch.float32, "full_shard", 256, 32768, True),
    "tiled-mixed-full": ("tiled+loss+ckpt", torch.float32, "full_shard", 1024, 8192, True),
    # QLoRA as tiledmlp train runs it under --fsdp: the 4-bit weights in float32 storage (sharded), LoRA r 8 on every
    # Linear, PEFT's k-bit preparation; what a rank holds includes the 4-bit weights' scales (on their modules)
    "qlora-fp32-full": ("untiled", "4bit", "full_shard", 256, 8192, False),
    "qlora-tiled-fp32-full": ("tiled+loss+ckpt", "4bit", "full_shard", 1024, 8192, False),
    # and under --bf16 (2026-11-29; refused before): the packed weights stored in bf16, FSDP2's all-gather dtype
    # (train.quantization.quant_storage), the matmuls in float32 (--dtype); the LoRA adapters gathered in bf16 like
    # every other weight, as they are over a plain float32 base ("lora": LoRA r 8 on every Linear, no 4 bits), which
    # the plan had taken for PEFT's float32 (1.14x that rank's measured step)
    "qlora-mixed-full": ("untiled", "4bit", "full_shard", 256, 8192, True),
    "qlora-tiled-mixed-full": ("tiled+loss+ckpt", "4bit", "full_shard", 1024, 8192, True),
    "lora-mixed-full": ("untiled", "lora", "full_shard", 256, 8192, True),
}


def _local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> int:
    """Distinct storages this rank holds (a DTensor's own shard): weights, grads, optimizer states, the ids."""
    seen: dict[int, int] = {}
    tensors = [ids, *model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()),
               *(v for state in opt.state.values() for v in state.values())]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _qlora(config: tf.LlamaConfig, storage: torch.dtype) -> torch.nn.Module:
    """The float32 model read back in 4 bits as ``tiledmlp train --load_in_4bit --lora_r 8 --fsdp`` loads it, the
    packed weights stored in ``storage``."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    with tempfile.TemporaryDirectory() as folder:
        model = tf.AutoModelForCausalLM.from_config(config)
        model.should_save_on_this_rank = lambda is_main_process: True  # every rank its own copy, as train's
        model.save_pretrained(folder)
        quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32,
                                      bnb_4bit_quant_storage=storage)
        model = tf.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", quantization_config=quant,
                                                        attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))


def _scales_bytes(model: torch.nn.Module) -> int:
    """The 4-bit weights' scales, which bitsandbytes keeps on each module whole (not a parameter FSDP shards)."""
    states = [m.quant_state for m in model.modules() if getattr(m, "quant_state", None) is not None]
    return sum(s.absmax.nbytes + (s.state2.absmax.nbytes if s.nested else 0) for s in states)


def measure(recipe: str, dtype: torch.dtype | str, mode: str, seq: int, vocab: int, mixed: bool,
            world: int, rank: int) -> dict[str, Any]:
    config = tf.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=seq,
                            tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    qlora, lora = dtype == "4bit", dtype in ("4bit", "lora")
    if qlora:
        model = _qlora(config, torch.bfloat16 if mixed else torch.float32)
    else:
        model = tf.AutoModelForCausalLM.from_config(config).to(torch.float32 if lora else dtype)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    model.train()
    tiled = recipe != "untiled"
    if tiled:
        tiledmlp.patch(model, loss=True)
        model.gradient_checkpointing_enable({"use_reentrant": False})
    bf16 = torch.bfloat16
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)} if mixed else {}
    for layer in (model.base_model.model if lora else model).model.layers:
        fully_shard(layer, reshard_after_forward=mode == "full_shard", **kw)
    fully_shard(model, reshard_after_forward=mode == "full_shard", **kw)
    ids = torch.randint(0, vocab, (1, seq))
    step, opt = build_training_step(model, ids, autocast_dtype=bf16 if mixed else None)
    step()
    if rank != 0:  # only rank 0's figures are checked: the other ranks run the same steps unprofiled (half the CPU)
        for _ in range(REPEATS):
            step()
        del model, opt, step
        gc.collect()
        return {}
    measured = (_local_bytes(model, opt, ids) + _scales_bytes(model)
                + min(profiler_peak_bytes(step, device="cpu") for _ in range(REPEATS)))
    setup = Setup(dtype=torch.float32 if lora else dtype, autocast=mixed, tiled_mlp=tiled, tiled_loss=tiled,
                  checkpointing=tiled, device_type="cpu", world_size=world, fsdp=mode, load_in_4bit=qlora,
                  lora_r=8 if lora else 0)
    shape = ModelShape.from_config(config)
    planned = predict_step_peak(shape, setup, seq)
    unsharded = predict_step_peak(shape, Setup(**{**setup.__dict__, "fsdp": "", "world_size": 1}), seq)
    del model, opt, step
    gc.collect()
    return {"measured": measured, "planned": planned.peak_bytes, "moment": planned.moment,
            "unsharded_plan": unsharded.peak_bytes}


if __name__ == "__main__":
    run_plan_checks(CHECKS, measure)
