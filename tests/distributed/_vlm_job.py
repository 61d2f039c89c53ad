"""ZeRO-3 on a vision-language model, run as ``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 _vlm_job.py`` (gloo).

A tiny Qwen2.5-VL whose vision-tower MLPs (hidden 32) run first, on the image's patches, and its text MLPs
(hidden 64) after, on the text tokens; ``num_shards="auto"`` plans about ``tokens / hidden`` tiles, so the two
streams need different tile counts, and the ranks (different image and text sizes) plan different ones. Each run
trains 2 micro-batches (one accumulation step) and records, per micro-batch and MLP, the rank's own plan for the
tokens it got, the tiles actually run (``gate_proj`` calls in the forward, one per tile under ZeRO-3) and
``last_num_tiles``; then the accumulated full grads. Runs: ZeRO-3 tiled, ZeRO-3 untiled (the reference).
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
import transformers as tf
from _common import Job, all_ranks, init, rel_err
from deepspeed.utils import safe_get_full_grad

import tiledmlp
from tiledmlp import distributed as tdist

# per rank, per micro-batch: (image grid t, h, w in patches, text tokens including the image's merged tokens)
BATCHES = {0: [((1, 4, 4), 300), ((1, 8, 12), 200)], 1: [((1, 8, 8), 640), ((1, 4, 4), 520)]}
IMAGE, START, END = 199, 197, 198


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=200, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], patch_size=2, temporal_patch_size=1, in_channels=3,
                           spatial_merge_size=2),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    return tf.Qwen2_5_VLForConditionalGeneration(config).float().train()


def batch(rank: int, micro: int) -> dict[str, torch.Tensor]:
    (t, h, w), length = BATCHES[rank][micro]
    g = torch.Generator().manual_seed(10 * rank + micro)
    ids = torch.randint(0, 190, (1, length), generator=g)
    merged = t * h * w // 4  # the 2x2 spatial merge
    ids[0, 10], ids[0, 11:11 + merged], ids[0, 11 + merged] = START, IMAGE, END
    pixels = torch.randn(t * h * w, 3 * 2 * 2, generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "pixel_values": pixels, "image_grid_thw": torch.tensor([[t, h, w]])}


def run(job: Job, tiled: bool) -> dict[str, Any]:
    """One accumulation step under ZeRO-3; returns the figures and the accumulated full grads."""
    m = model()
    report = tiledmlp.patch(m, num_shards="auto" if tiled else 1, loss=tiled)  # tiled: the loss too
    mlps = sorted(name for name, _, _ in report.patched)
    micro = len(BATCHES[job.rank])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config)
    calls: dict[str, int] = {}
    plans: dict[str, int] = {}
    for name in mlps:
        mlp = engine.module.get_submodule(name)
        mlp.gate_proj.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        mlp.register_forward_pre_hook(lambda module, args, name=name: plans.__setitem__(
            name, len(module.forward.plan(args[0].numel() // args[0].shape[-1], args[0]))))
    tiles, local, reported, collectives, logits = [], [], [], [], []
    for k in range(micro):
        calls.clear()
        before = tdist.TILE_AGREEMENT.collectives
        out = engine(**batch(job.rank, k))
        loss = out.loss
        logits.append(out.logits is not None)
        collectives.append(tdist.TILE_AGREEMENT.collectives - before)
        tiles.append(dict(calls))
        local.append(dict(plans))
        reported.append({name: engine.module.get_submodule(name).forward.last_num_tiles for name in mlps})
        engine.backward(loss)
        if k == micro - 1:
            grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()
                     if p.requires_grad}
        engine.step()
    engine.destroy()
    return {"mlps": mlps, "local_plan_per_rank": all_ranks(local), "tiles_run_per_rank": all_ranks(tiles),
            "last_num_tiles_per_rank": all_ranks(reported),
            "agreement_collectives_per_rank": all_ranks(collectives), "logits_built_per_rank": all_ranks(logits),
            "grads": grads}


def vlm_check(job: Job) -> dict[str, Any]:
    tiled, untiled = run(job, True), run(job, False)
    grads, ref = tiled.pop("grads"), untiled.pop("grads")
    tiled["grad_rel"], tiled["grad_worst"] = max((rel_err(grads[n], ref[n]), n) for n in ref)
    return {"tiled": tiled, "untiled": untiled} if job.rank == 0 else {}


def main() -> None:
    init()
    job = Job()
    job.check("vlm", lambda: vlm_check(job))
    job.write()
    tdist.close_process_group()


if __name__ == "__main__":
    main()
