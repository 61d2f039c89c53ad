"""The plan's ZeRO terms against DeepSpeed's measured step, one ``torchrun --nproc_per_node 2`` launch (gloo, CPU).

Each check builds a Llama (under ``deepspeed.zero.Init`` for ZeRO-3, as transformers loads one), wraps it with
``deepspeed.initialize`` and a config as transformers fills ``examples/ds_zero3.json``'s ``"auto"`` values (bucket
sizes from the hidden size; ``bf16`` from ``--bf16``, which makes DeepSpeed cast the model to bf16 itself), runs a
warm-up step (AdamW states), and measures the next steps' peak: the bytes of every tensor alive before
the step (DeepSpeed's flat partitions and buffers are no parameters: all live tensors, found through the garbage
collector, less those alive before the model was built) plus the torch profiler's exact peak of the step, the least
of ``REPEATS`` steps (gloo's threads may free a block late). Rank 0 records the most a rank held beside the plan of
the same setup (ZeRO-1/2; until 2026-11-29 rank 0's own: the last rank holds more, its partition's grad buffer from
the head's grad on, and was planned 0.94-0.96 of its step at a layer's backward), or its own (ZeRO-3).
Its 16-bit matmuls and attention skip their arithmetic where this CPU has only ATen's reference kernels for them
(``tests/hollow_matmul.py``), as in ``_plan_fsdp_job.py``.
"""

from __future__ import annotations

import gc
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import transformers as tf
from _common import run_plan_checks

import tiledmlp
from tiledmlp.measure import profiler_peak_bytes
from tiledmlp.plan import ModelShape, Setup, predict_step_peak

REPEATS = 3
HIDDEN = 256
# name: (recipe, ZeRO stage, --bf16, tokens, vocabulary). 256 tokens over a 32k vocabulary: the loss's backward
# over the weights and states; 32 tokens: the optimizer step; 1024 over 8k: the tiled loss's forward
CHECKS = {
    "weights-fp32-z2": ("untiled", 2, False, 256, 32768),
    "step-fp32-z1": ("untiled", 1, False, 32, 32768),
    "step-bf16-z2": ("untiled", 2, True, 32, 32768),
    "weights-fp32-z3": ("untiled", 3, False, 256, 32768),
    "step-bf16-z3": ("untiled", 3, True, 32, 32768),
    "tiled-bf16-z3": ("tiled+loss+ckpt", 3, True, 1024, 8192),
    # 4096 tokens over a 1k vocabulary: the first layer's backward, where the last rank holds its partition's grad
    # buffer (2026-11-29; planned 0.94 of that rank before)
    "layer-fp32-z2": ("tiled+loss+ckpt", 2, False, 4096, 1024),
}


def _live_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor the garbage collector can reach."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _config(stage: int, bf16: bool) -> dict[str, Any]:
    h = HIDDEN
    return {"bf16": {"enabled": bf16}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                                  "stage3_param_persistence_threshold": 10 * h},
            "steps_per_print": 10**9}


def llama(stage: int, bf16: bool, seq: int, vocab: int, kv_heads: int = 4) -> tuple[Any, Any, dict[str, Any]]:
    """The checks' Llama (built under ``deepspeed.zero.Init`` for ZeRO-3, as transformers loads one), its config
    and the DeepSpeed config, seeded alike on every rank."""
    config = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=seq,
                            tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ds = _config(stage, bf16)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = tf.LlamaForCausalLM(config)
    else:
        model = tf.LlamaForCausalLM(config)
    model.train()
    return model, config, ds


def measured_peak(engine: Any, inputs: dict[str, torch.Tensor], before: int, stage: int) -> int:
    """A warm-up step (AdamW's states), then the least over ``REPEATS`` steps of the bytes held before the step
    plus the profiler's peak of it: under ZeRO-1/2 on the rank that holds the most (the last rank holds its
    partition's grad buffer from the head's grad on, rank 0 from far later); under ZeRO-3, whose partitions are
    static, on rank 0 as before: its steps here measure a gathered 32k x 256 bf16 weight (16 MB) more at the
    optimizer step in about one step in ten, on either rank (7 of 48; not traced: ZeRO-3 gathers asynchronously,
    where gloo's thread may free a block the profiler does not see), and a second rank doubles the odds of three
    such steps in a row, which failed one run of the job (0.942)."""
    every_rank = stage < 3

    def step() -> None:
        loss = engine(**inputs, use_cache=False).loss
        engine.backward(loss)
        del loss
        engine.step()

    step()
    peaks = []
    measured = every_rank or dist.get_rank() == 0
    for _ in range(REPEATS):
        held = _live_bytes() - before
        peaks.append(held + (profiler_peak_bytes(step, device="cpu") if measured else step() or 0))
    most = torch.tensor([min(peaks) if measured else 0], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def measure(recipe: str, stage: int, bf16: bool, seq: int, vocab: int, world: int, rank: int) -> dict[str, Any]:
    before = _live_bytes()
    model, config, ds = llama(stage, bf16, seq, vocab)
    tiled = recipe != "untiled"
    if tiled:
        tiledmlp.patch(model, loss=True)
        model.gradient_checkpointing_enable({"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, vocab, (1, seq))
    measured = measured_peak(engine, {"input_ids": ids, "labels": ids}, before, stage)
    del engine, model
    gc.collect()
    if rank != 0:
        return {}
    setup = Setup(dtype=torch.bfloat16 if bf16 else torch.float32, tiled_mlp=tiled, tiled_loss=tiled,
                  checkpointing=tiled, device_type="cpu", world_size=world, zero_stage=stage)
    planned = predict_step_peak(ModelShape.from_config(config), setup, seq)
    return {"measured": measured, "planned": planned.peak_bytes, "moment": planned.moment, "terms": planned.terms}


if __name__ == "__main__":
    run_plan_checks(CHECKS, measure)
