"""Ulysses sequence parallelism through ``tiledmlp train``'s own code path, checked against one untiled process.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node W _sp_job.py --sp N [--zero 1|3] [extra tiledmlp train flags]

For the tiny Llama (tiled MLP + tiled loss) and the tiny Qwen3-MoE (tiled experts, transformers' loss), the job
parses the flags with ``tiledmlp train``'s parser, runs its ``prepare`` (tiling, tiled loss, SP) and swaps in a
dataset whose labels are masked unevenly, so SP ranks hold different numbers of labelled tokens and some hold
none. Every rank records the shard each forward saw; rank 0 glues each SP group's shards back into full
sequences and trains an untiled copy of the initial model on them in one process: the step's loss is the sum of
token losses over every sequence of the step (all SP groups and accumulated micro-batches) over their labelled
tokens, as Trainer computes it without SP; torch AdamW. Extra flags (e.g. ``--activation_offloading true`` or
``--gradient_accumulation_steps 2``) are appended to every run's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import max_rel
from datasets import Dataset
from transformers import TrainerCallback

from tiledmlp import split_layers
from tiledmlp.distributed import close_process_group
from tiledmlp.train.args import parse_args
from tiledmlp.train.models import load_model_and_tokenizer
from tiledmlp.train.runner import prepare, run

SEQ = 64
STEPS = 3
LR = 1e-3


def masked_dataset(rows: int, vocab: int) -> Dataset:
    """Random ids; labels masked by row: none, a 3/4 prefix (early ranks get no label), scattered, the back half."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
    labels = ids.clone()
    for i in range(rows):
        kind = i % 4
        if kind == 1:
            labels[i, : 3 * SEQ // 4 + 1] = -100
        elif kind == 2:
            labels[i, torch.rand(SEQ, generator=g) < 0.5] = -100
        elif kind == 3:
            labels[i, SEQ // 2:] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


class Recorder(TrainerCallback):
    """Shards seen by the model, the first step's full grads and the final fp32 params (DeepSpeed's views)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shards: list[dict[str, torch.Tensor]] = []
        self.mlp_tokens: list[int] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.model = model
        model.register_forward_pre_hook(self._record, with_kwargs=True)
        mlp = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
        mlp.register_forward_pre_hook(lambda _m, args: self.mlp_tokens.append(int(args[0].shape[1])))

    def _record(self, _module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        self.shards.append({k: kwargs[k].detach().cpu().clone() for k in ("input_ids", "shift_labels",
                                                                            "position_ids")})

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """Accelerate's backward runs DeepSpeed's step too, so the grads are read inside the first engine step."""
        from deepspeed import DeepSpeedEngine
        from deepspeed.utils import safe_get_full_grad

        step = DeepSpeedEngine.step

        def first_step_reads_grads(engine: Any, *a: Any, **k: Any) -> Any:
            if not self.grads and engine.is_gradient_accumulation_boundary():
                self.grads = {n: safe_get_full_grad(p).detach().clone() for n, p in self.model.named_parameters()}
            return step(engine, *a, **k)

        DeepSpeedEngine.step = first_step_reads_grads
        self._restore = lambda: setattr(DeepSpeedEngine, "step", step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        from deepspeed.utils import safe_get_full_fp32_param

        self._restore()
        self.params = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in self.model.named_parameters()}


def full_sequences(shards: list[list[dict[str, torch.Tensor]]], groups: list[list[int]]) -> list[list[dict]]:
    """Per step, per SP group: the shards of its ranks (in SP-rank order) concatenated on the sequence dim."""
    steps = len(shards[0])
    return [[{k: torch.cat([shards[r][s][k] for r in ranks], dim=1) for k in shards[ranks[0]][s]}
             for ranks in groups] for s in range(steps)]


def reference(kind: str, state: dict[str, torch.Tensor], seqs: list[list[dict]], accumulation: int
              ) -> dict[str, Any]:
    """One process, untiled: per-step losses, the first step's grads, the final params."""
    model, _ = load_model_and_tokenizer(kind)
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8)
    losses, grads = [], {}
    for step in range(len(seqs) // accumulation):
        opt.zero_grad(set_to_none=True)
        sequences = [seq for forward in seqs[step * accumulation:(step + 1) * accumulation] for seq in forward]
        items = sum(int((seq["shift_labels"] != -100).sum()) for seq in sequences)
        total = 0.0
        for seq in sequences:
            logits = model(input_ids=seq["input_ids"], position_ids=seq["position_ids"]).logits
            token_sum = F.cross_entropy(logits.flatten(0, 1).float(), seq["shift_labels"].flatten(),
                                        ignore_index=-100, reduction="sum")
            (token_sum / items).backward()
            total += token_sum.item() / items
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def check(kind: str, sp: int, zero: int, extra: list[str], tmp: str) -> dict[str, Any]:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups as ds_groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = os.path.join(tmp, f"zero{zero}.json")
    with open(config, "w") as f:
        json.dump({"zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
                   "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}, f)
    flags = ["--model", kind, "--max_seq_length", str(SEQ), "--max_steps", str(STEPS), "--deepspeed", config,
             "--sequence_parallel_size", str(sp), "--tiled_mlp_num_shards", "2",
             "--use_tiled_loss", "true", "--learning_rate", str(LR),
             "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0",
             "--disable_tqdm", "true", "--save_strategy", "no", "--output_dir", os.path.join(tmp, kind), *extra]
    m, d, t, train_args = parse_args(flags)
    prepared = prepare(m, d, t, train_args)
    world = dist.get_world_size()
    accumulation = train_args.gradient_accumulation_steps
    prepared.dataset = masked_dataset(world * STEPS * accumulation, prepared.model.config.vocab_size)
    state = {k: v.detach().clone() for k, v in prepared.model.state_dict().items()}
    recorder = Recorder(prepared.model)
    halves: list[int] = []  # checkpointed halves run by split layers (--activation_offloading_split_layers)
    real_half = split_layers._half
    split_layers._half = lambda *a, **k: halves.append(1) or real_half(*a, **k)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        summary = run(prepared, train_args, callbacks=[recorder])
        group = dist.get_process_group_ranks(ds_groups._get_sequence_parallel_group())
    finally:  # one Trainer per process in real use; this job runs two, so undo DeepSpeed's global registrations
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        split_layers._half = real_half
        parallel_state_sp._release_sequence_parallel_groups()
    shards = [None] * world
    dist.all_gather_object(shards, recorder.shards)
    all_groups = [None] * world
    dist.all_gather_object(all_groups, group)
    mlp_tokens = [None] * world
    dist.all_gather_object(mlp_tokens, sorted(set(recorder.mlp_tokens)))
    if dist.get_rank() != 0:
        return {}
    groups = sorted({tuple(g) for g in all_groups})
    seqs = full_sequences(shards, [list(g) for g in groups])
    ref = reference(kind, state, seqs, accumulation)
    got = [summary["losses"][str(s + 1)] for s in range(STEPS)]
    rows = {tuple(r) for r in prepared.dataset["input_ids"]}
    labelled = [[int((shards[r][f]["shift_labels"] != -100).sum()) for r in range(world)]
                for f in range(STEPS * accumulation)]
    return {
        "sp_groups": [list(g) for g in groups],
        "mlp_tokens_per_rank": mlp_tokens,
        "labelled_tokens_per_rank_per_step": labelled,
        "sequences_from_dataset": all(tuple(seq["input_ids"][0].tolist()) in rows for g in seqs for seq in g),
        "position_ids_global": all(torch.equal(seq["position_ids"][0], torch.arange(SEQ)) for g in seqs for seq in g),
        "losses": got, "ref_losses": ref["losses"],
        "loss_abs": max(abs(a - b) for a, b in zip(got, ref["losses"])),
        "grad_rel": max_rel(recorder.grads, ref["grads"]),
        "param_rel": max_rel(recorder.params, ref["params"]),
        "tiled_loss": summary["tiled_loss"], "tiles": summary["tiles"], "offloading": summary["offload"] is not None,
        "split_halves": len(halves),
        "sequence_parallel_size": summary["sequence_parallel_size"], "gradient_accumulation_steps": accumulation,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", type=int, required=True)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--models", default="tiny-llama,tiny-qwen3-moe")
    args, extra = parser.parse_known_args()
    torch.set_num_threads(1)
    sys.stdout.reconfigure(line_buffering=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tiledmlp-sp-") as tmp:
        for kind in args.models.split(","):
            results[kind] = check(kind, args.sp, args.zero, extra, tmp)
            if dist.get_rank() == 0:
                print(f"[{kind}] {results[kind]}", flush=True)
    if dist.get_rank() == 0:
        with open(os.environ["TILEDMLP_RESULTS"], "w") as f:
            json.dump(results, f, indent=1)
    close_process_group()


if __name__ == "__main__":
    main()
