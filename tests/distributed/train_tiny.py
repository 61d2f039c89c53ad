"""A few training steps of a tiny patched Llama under any launcher and backend (the commands in docs/distributed.md).

    torchrun --nproc_per_node 2 tests/distributed/train_tiny.py --backend ddp      # or fsdp2, fsdp1
    torchrun --nproc_per_node 2 tests/distributed/train_tiny.py --backend accelerate      # CPU (gloo)
    accelerate launch --multi_gpu --num_processes 2 tests/distributed/train_tiny.py --backend accelerate  # GPUs
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 tests/distributed/train_tiny.py --backend zero3   # or zero1, zero2

Device-agnostic: it trains on the accelerator torch finds (one per rank), else on CPU over gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers as tf

import tiledmlp
from tiledmlp.distributed import close_process_group


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024)
    return tf.LlamaForCausalLM(config)


def device_and_backend() -> tuple[torch.device, str]:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        return torch.device("cpu"), "gloo"
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.accelerator.set_device_index(local)
    return torch.device(acc.type, local), {"cuda": "nccl", "xpu": "xccl"}.get(acc.type, "gloo")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["ddp", "fsdp2", "fsdp1", "accelerate", "zero1", "zero2", "zero3"],
                        default="ddp")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--num-shards", default="4")
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = parser.parse_args()
    shards = args.num_shards if args.num_shards == "auto" else int(args.num_shards)
    device, backend = device_and_backend()
    model = build()
    report = tiledmlp.patch(model, num_shards=shards)  # on every rank
    if os.environ.get("RANK", "0") == "0":
        print(report, flush=True)

    if args.backend == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device.type == "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = accelerator.prepare(model, opt)
        accelerator.print(f"accelerate: {accelerator.distributed_type}, model wrapped as {type(model).__name__}")
        device, backward, step = accelerator.device, accelerator.backward, opt.step
    elif args.backend.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": int(args.backend[-1])}}
        model, opt, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        device, backward, step = model.device, model.backward, model.step
    else:
        dist.init_process_group(backend)
        model.to(device)
        if args.backend == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif args.backend == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            layer = tf.models.llama.modeling_llama.LlamaDecoderLayer
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer}), use_orig_params=True, device_id=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        backward, step = (lambda loss: loss.backward()), opt.step

    rank = dist.get_rank()
    for it in range(3):
        # ranks see different sequence lengths on purpose: tiledmlp keeps them in step where needed
        ids = torch.randint(0, 128, (1, args.tokens + 32 * rank), device=device)
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        step()
        if not args.backend.startswith("zero"):
            opt.zero_grad(set_to_none=True)
        print(f"rank {rank} step {it} tokens {ids.shape[1]} loss {loss.item():.4f}", flush=True)
    close_process_group()


if __name__ == "__main__":
    main()
