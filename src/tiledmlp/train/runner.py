"""One training run of ``tiledmlp train``: prepare everything that can fail on bad input, then hand it to Trainer.

:func:`prepare` loads data and model, applies LoRA, tiled MLP and tiled loss and packs the data — all before any
``Trainer`` exists, so bad input stops the command before ``output_dir`` is created. :func:`run` trains and
returns a JSON-able summary (losses per step, peak memory, tiles per layer) that ``--compare`` diffs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import (PrinterCallback, ProgressCallback, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator, set_seed)

from .. import offload_activations, patch
from .args import (DataArguments, ModelArguments, TilingArguments, UsageError, checkpointing, first_line,
                   one_line)
from .callbacks import NonFiniteLoss, PeakMemory, StepReporter, format_bytes
from .checks import deepspeed_settings_from_flags
from .data import load_raw_text, pack
from .data_record import RecordData, data_record
from .fit import (RunOutOfMemory, after_out_of_memory, check_before_training, is_out_of_memory,
                  planned_vs_measured, process_overhead)
from .models import DTYPES, load_model_and_tokenizer, save_with_use_cache
from .preemption import StopOnSignal
from .quantization import prepare_quantized, quant_storage, quantization_config, quantization_record
from .sequence_parallel import SequenceParallelTrainer, collate_with_position_ids, sp_size
from .wrapping import fsdp_on_cpu, rank_weight_bytes, wrapped_as

__all__ = ["Prepared", "prepare", "run", "REPORT_ENV"]

REPORT_ENV = "TILEDMLP_TRAIN_REPORT"  # where a run also writes its JSON summary (used by --compare's phases)


@dataclass
class Prepared:
    model: torch.nn.Module
    tokenizer: Any
    dataset: Any
    tiled: dict[str, Any]  # qualified module name -> its TiledForward (to read tiles used)
    tiled_loss: bool
    tokens_per_step: int
    offloader: Any = None  # the ActivationOffloader of --activation_offloading
    plan_setup: Any = None  # tiledmlp.plan.Setup of this run, to print the planned peak next to the measured one
    seq_length: int = 0
    eval_dataset: Any = None  # packed --eval_dataset sequences
    data_record: dict[str, Any] | None = None  # the data flags, written into each checkpoint (data_record.py)
    use_cache: bool | None = None  # the model's own config.use_cache, off while training, kept in what is saved


def _apply_lora(model: torch.nn.Module, m: ModelArguments, train_args: TrainingArguments) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets: Any = m.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(task_type="CAUSAL_LM", r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                        target_modules=targets)
    try:
        model = get_peft_model(model, config)
    except ValueError as exc:
        raise UsageError(f"--lora_r {m.lora_r}: {first_line(exc)}") from exc
    if checkpointing(train_args)[0]:
        # Frozen embeddings give checkpointed layers inputs without grad; reentrant checkpointing needs them.
        model.enable_input_require_grads()
    return model


def _apply_tiled_loss(model: torch.nn.Module, tiling: TilingArguments, label_smoothing: float,
                      tile_eval: bool) -> None:
    try:
        from ..loss_patching import patch_loss  # issue 6
    except ImportError as exc:
        raise UsageError(f"--use_tiled_loss needs tiledmlp.loss_patching.patch_loss, not available here ({exc}); "
                         "pass --use_tiled_loss false") from exc

    try:
        # the loss plans its own tiles (over labelled tokens, bounded by the vocabulary), never the MLPs' count:
        # --tiled_mlp_num_shards 4 would have made 4 tiles of [tokens / 4, vocab] float32 logits
        count = patch_loss(model, accumulate_dtype=tiling.tiled_accumulate_dtype, label_smoothing=label_smoothing,
                           tile_eval=tile_eval)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--use_tiled_loss: {first_line(exc)}; pass --use_tiled_loss false") from exc
    if not count:
        raise UsageError(f"--use_tiled_loss: no causal-LM head to tile in {type(model).__name__}; "
                         "pass --use_tiled_loss false")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


STALE_LOCK_S = 15 * 60  # a DeepSpeed op builds in seconds to a few minutes


def stale_build_locks(max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Lock files of torch's JIT extension builds older than ``max_age_s``. DeepSpeed JIT-builds its ops (on CPU
    its shared-memory comm op at every launch) under such a lock; a build killed midway leaves it, and every later
    launch then waits on it forever, printing nothing."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time()
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return sorted(p for p in locks if p.is_file() and now - p.stat().st_mtime > max_age_s)


def _warn_stale_build_locks() -> None:
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    for lock in stale_build_locks():
        minutes = (time.time() - lock.stat().st_mtime) / 60
        print(f"tiledmlp train: warning: {lock} is {minutes:.0f} minutes old. A build of {lock.parent.name} killed "
              f"midway leaves it, and DeepSpeed then waits on it forever; if no build is running, delete it.",
              file=sys.stderr, flush=True)


# learned absolute position tables: GPT-2 and GPT-Neo (wpe), OPT (embed_positions), BERT-style (position_embeddings)
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def _check_past_trained_positions(model: torch.nn.Module, seq_length: int) -> None:
    """A model with a learned position table has no embedding past its last row: refuse (an IndexError in the
    embedding otherwise). Training RoPE models past ``max_position_embeddings`` is a context extension, done on
    purpose with a larger RoPE base or a RoPE scaling in the model's config, never by accident: say so once (rank
    0) and go on."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not (isinstance(limit, int) and 0 < limit < seq_length):
        return
    if any(isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
           for name, module in model.named_modules()):
        raise UsageError(f"--max_seq_length {seq_length} is past the model's {limit} learned positions "
                         f"(max_position_embeddings): it has no embedding for later ones; pass --max_seq_length "
                         f"{limit} or less")
    if os.environ.get("LOCAL_RANK", "0") == "0":
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        print(f"tiledmlp train: warning: --max_seq_length {seq_length} is past the model's max_position_embeddings "
              f"{limit} (RoPE: {rope or 'none'}): it never saw those positions in pre-training. Extending its context "
              "this way usually goes with a larger rope_theta or a rope scaling set in its config.json.",
              file=sys.stderr, flush=True)


def _zero_stage(train_args: TrainingArguments) -> int:
    ds = getattr(train_args, "hf_deepspeed_config", None) if train_args.deepspeed else None
    return int(ds.get_value("zero_optimization.stage", 0) or 0) if ds is not None else 0


def prepare(m: ModelArguments, d: DataArguments, tiling: TilingArguments, train_args: TrainingArguments) -> Prepared:
    """Load, patch and pack; raises :class:`UsageError` on bad input and writes nothing."""
    if train_args.deepspeed:
        _warn_stale_build_locks()
    deepspeed_settings_from_flags(train_args)
    raw = load_raw_text(d.dataset, d.text_field, "--dataset", d.dataset_config, d.dataset_split)
    raw_eval = None if d.eval_dataset is None else load_raw_text(d.eval_dataset, d.text_field, "--eval_dataset",
                                                                 d.eval_dataset_config(), d.eval_split)
    set_seed(train_args.seed)  # the tiny random model and LoRA init are then the same in every run
    quant = quantization_config(m, DTYPES[m.dtype], quant_storage(train_args)) if m.load_in_4bit else None
    model, tokenizer = load_model_and_tokenizer(m.model, m.dtype, m.attn_implementation, quant, train_args.device)
    if quant is not None:
        model = prepare_quantized(model)
    use_cache = getattr(getattr(model, "config", None), "use_cache", None)  # saves write it back (run)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
        _check_past_trained_positions(model, d.max_seq_length)
    if m.lora_r > 0:
        model = _apply_lora(model, m, train_args)
    tiled: dict[str, Any] = {}
    if tiling.use_tiled_mlp:
        try:
            report = patch(model, num_shards=tiling.num_shards(), target_gb=tiling.tiled_mlp_target_gb,
                           accumulate_dtype=tiling.tiled_accumulate_dtype, norms=tiling.use_tiled_norms)
        except ValueError as exc:
            raise UsageError(f"--use_tiled_mlp: {first_line(exc)}; pass --use_tiled_mlp false") from exc
        tiled = {name: model.get_submodule(name).forward for name, _, _ in report.patched}
    if tiling.use_tiled_loss:
        # evaluation needs only the loss: its logits ([tokens, vocab], float32 in transformers' loss) would not fit
        # at the lengths training reaches
        _apply_tiled_loss(model, tiling, train_args.label_smoothing_factor, tile_eval=raw_eval is not None)
    offloader = None
    if tiling.activation_offloading:
        # FSDP's own checkpoint wrapper (fsdp_config activation_checkpointing) is non-reentrant: keep it alone
        fsdp_checkpoints = bool((train_args.fsdp_config or {}).get("activation_checkpointing"))
        if fsdp_checkpoints and tiling.activation_offloading_split_layers:
            raise UsageError("--activation_offloading_split_layers splits transformers' layer checkpoints; FSDP's "
                             "own (fsdp_config activation_checkpointing) cannot be split: drop one of them")
        try:
            offloader = offload_activations(model, checkpointing=not fsdp_checkpoints,
                                            split_layers=tiling.activation_offloading_split_layers)
        except ValueError as exc:
            if not tiling.activation_offloading_split_layers:
                raise
            hint = first_line(exc).replace("pass split_layers=False", "drop --activation_offloading_split_layers")
            raise UsageError(f"--activation_offloading_split_layers: {hint}") from exc
    if d.sequence_parallel_size > 1:
        from .sequence_parallel import enable

        enable(train_args, model, d.sequence_parallel_size, d.max_seq_length)
    # each group of sequence-parallel ranks trains one sequence per micro-batch
    per_step = (train_args.per_device_train_batch_size * train_args.gradient_accumulation_steps * _world_size()
                // d.sequence_parallel_size)
    min_sequences = per_step * train_args.max_steps if train_args.max_steps > 0 else 1
    dataset = pack(raw, tokenizer, d.text_field, d.max_seq_length, min_sequences)
    eval_dataset = None
    if raw_eval is not None:
        eval_dataset = pack(raw_eval, tokenizer, d.text_field, d.max_seq_length, 0, "--eval_dataset")
        train_args.prediction_loss_only = True  # no metrics here: never gather [tokens, vocab] logits
    from ..plan.setup import Setup
    from ..plan.sharding import fsdp_mode, trainer_fsdp

    try:  # FSDP's strategy as the Trainer read it; a setup the plan does not model (CPU offload) gets no plan.
        # Beside --deepspeed the Trainer refuses --fsdp when it starts, with its own message: plan the ZeRO side
        fsdp = "" if train_args.deepspeed else fsdp_mode(trainer_fsdp(train_args.fsdp, train_args.fsdp_config))
    except ValueError:
        fsdp = None
    # QLoRA: float32 wherever not 4-bit (prepare_quantized)
    dtype = model.dtype if hasattr(model, "dtype") and not m.load_in_4bit else torch.float32
    half = torch.bfloat16 if train_args.bf16 else torch.float16 if train_args.fp16 else None
    if half is not None and train_args.deepspeed and not m.load_in_4bit:  # DeepSpeed casts the model itself
        dtype, half = half, None
    setup = None if fsdp is None else Setup(dtype=dtype,
                  autocast=bool(half is not None and (m.dtype == "float32" or m.load_in_4bit)),
                  load_in_4bit=m.load_in_4bit, bnb_nested_quant=m.use_bnb_nested_quant,
                  optim=str(getattr(train_args.optim, "value", train_args.optim)), lora_r=m.lora_r,
                  lora_dropout=m.lora_dropout if m.lora_r else 0.0,
                  checkpointing=checkpointing(train_args)[0] or offloader is not None, offload=offloader is not None,
                  split_layers=tiling.activation_offloading_split_layers, tiled_mlp=tiling.use_tiled_mlp,
                  tiled_loss=tiling.use_tiled_loss, tiled_norms=tiling.use_tiled_norms,
                  sequence_parallel_size=d.sequence_parallel_size, world_size=_world_size(),
                  zero_stage=_zero_stage(train_args), fsdp=fsdp, mlp_num_shards=tiling.num_shards(),
                  mlp_target_gb=tiling.tiled_mlp_target_gb, accumulate=tiling.tiled_accumulate_dtype,
                  device_type=train_args.device.type)
    return Prepared(model, tokenizer, dataset, tiled, tiling.use_tiled_loss, per_step * d.max_seq_length, offloader,
                    setup, d.max_seq_length, eval_dataset,
                    {**data_record(d), **quantization_record(m)}, use_cache)


def _tiles_summary(tiled: dict[str, Any]) -> str:
    if not tiled:
        return "off"
    counts = {name: fwd.last_num_tiles for name, fwd in tiled.items()}
    values = sorted(set(counts.values()))
    if len(values) == 1:
        return f"{values[0]} tile(s) in each of {len(counts)} MLPs"
    return ", ".join(f"{name}={n}" for name, n in counts.items())


def _check_it_fits(prep: Prepared, train_args: TrainingArguments) -> None:
    """Warn (local rank 0) before the first step when tiledmlp plan says this step does not fit the device (not
    where the plan does not model the run: FSDP's CPU offload)."""
    if os.environ.get("LOCAL_RANK", "0") != "0" or prep.plan_setup is None:
        return
    lines = check_before_training(prep.model, prep.plan_setup, prep.seq_length,
                                  train_args.per_device_train_batch_size, train_args.device,
                                  train_args.gradient_accumulation_steps)
    for i, line in enumerate(lines):
        print(f"tiledmlp train: {'warning: ' if i == 0 else '   '}{line}", file=sys.stderr, flush=True)


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def run(prep: Prepared, train_args: TrainingArguments, label: str = "",
        callbacks: Sequence[TrainerCallback] = (), save_final_model: bool = False) -> dict[str, Any]:
    """Train with ``transformers.Trainer``; print the per-step lines and the final report; return the summary.
    ``callbacks`` are added to the Trainer's (tests read grads and shards through them); ``save_final_model``
    saves the trained model (or adapter) and tokenizer to ``output_dir`` at the end."""
    sp = sp_size(train_args)
    try:
        with fsdp_on_cpu(train_args):
            trainer = (SequenceParallelTrainer if sp > 1 else Trainer)(
                model=prep.model, args=train_args, train_dataset=prep.dataset, eval_dataset=prep.eval_dataset,
                processing_class=prep.tokenizer,
                data_collator=collate_with_position_ids if sp > 1 else default_data_collator)
    except ValueError as exc:  # the Trainer's own checks of flags that go together (--fsdp with --deepspeed...)
        raise UsageError(f"transformers' Trainer refuses these flags: {one_line(exc)}") from exc
    save_with_use_cache(trainer, prep.use_cache)
    if prep.tiled_loss:
        # --label_smoothing_factor went into the tiled loss (prepare); Trainer's own smoother would take the labels
        # away from the model and smooth full logits instead
        trainer.label_smoother = None
    reporter = StepReporter(PeakMemory(train_args.device), prep.tokens_per_step)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(reporter)
    stop = StopOnSignal(trainer.accelerator)
    trainer.add_callback(stop)
    if prep.data_record is not None:
        trainer.add_callback(RecordData(prep.data_record))
    for callback in callbacks:
        trainer.add_callback(callback)
    overhead = process_overhead(prep.model, train_args.device)
    _check_it_fits(prep, train_args)
    when = "during training, after {} completed step(s)"
    saved = False
    try:
        # parse_args resolved true/last to the last complete checkpoint (Trainer's own "last" may be a save cut short)
        output = trainer.train(resume_from_checkpoint=train_args.resume_from_checkpoint)
        stopped = stop.stopped_at is not None  # by a signal: checkpoint saved, no final eval or model
        halted = stopped or reporter.non_finite_step is not None  # or by a NaN loss: nothing more saved
        if save_final_model and not halted:  # before the last evaluation, so a failing one loses no work
            when = "while saving the final model after step {}"
            trainer.save_model()  # every rank: FSDP and ZeRO-3 gather the weights for rank 0 to write
            saved = True
            if trainer.is_world_process_zero():
                print(f"saved the final {'LoRA adapter' if _is_peft(prep.model) else 'model'} and tokenizer to "
                      f"{train_args.output_dir}", flush=True)
        if prep.eval_dataset is not None and not halted and not reporter.evals_at(output.global_step):
            when = "in the evaluation after training"
            reporter.restart()
            trainer.evaluate()  # --eval_dataset without an --eval_strategy that just ran: once, after training
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        if trainer.control.should_evaluate:  # Trainer sets it at a step's end and clears it once that eval ran
            when = "in the evaluation after step {}"
        lines = after_out_of_memory(prep.model, prep.plan_setup, prep.seq_length,
                                    train_args.per_device_train_batch_size, train_args.device,
                                    when.format(trainer.state.global_step), train_args.output_dir,
                                    train_args.gradient_accumulation_steps)
        if saved:
            lines.append(f"the trained model was saved to {train_args.output_dir} before the evaluation")
        raise RunOutOfMemory("\n   ".join(lines)) from exc
    finally:
        stop.restore()
    outcome = stop.outcome(trainer.state.max_steps, train_args.output_dir) if trainer.is_world_process_zero() else None
    if outcome:
        print(f"tiledmlp train: {outcome}", file=sys.stderr, flush=True)
    records = reporter.records
    seconds = sum(r.seconds for r in records)
    summary = {
        "label": label,
        "steps": output.global_step,
        "losses": {str(r.step): r.loss for r in records},
        "final_loss": next((r.loss for r in reversed(records) if r.loss is not None), None),
        "peak_bytes": max((r.peak_bytes for r in records), default=0),
        "peak_kind": reporter.peak.kind,
        "tokens_per_second": sum(r.tokens for r in records) / seconds if seconds else 0.0,
        "train_seconds": seconds,
        "tiles": {name: fwd.last_num_tiles for name, fwd in prep.tiled.items()},
        "mlp_engines": {name: fwd.last_path for name, fwd in prep.tiled.items()},  # "glu" or "generic"
        "tiled_loss": prep.tiled_loss,
        "sequence_parallel_size": sp,
        "wrapped_as": wrapped_as(trainer),
        "rank_weight_bytes": rank_weight_bytes(trainer.model_wrapped),
        "offload": prep.offloader.stats.as_dict() if prep.offloader is not None else None,
        "records": [r.as_dict() for r in records],
        "evals": [e.as_dict() for e in reporter.evals],
        "stopped_by_signal": stopped,
        "non_finite_loss_step": reporter.non_finite_step,
    }
    if trainer.is_world_process_zero():
        final = summary["final_loss"]
        print(f"\n== tiledmlp train{' (' + label + ')' if label else ''}: {summary['steps']} steps, final loss "
              f"{'n/a' if final is None else f'{final:.4f}'}, peak {format_bytes(summary['peak_bytes'])} "
              f"({summary['peak_kind']}, rank 0), {summary['tokens_per_second']:,.0f} tok/s", flush=True)
        print(f"   tiled MLP: {_tiles_summary(prep.tiled)}; tiled loss: {'on' if prep.tiled_loss else 'off'}",
              flush=True)
        if sp > 1:
            print(f"   sequence parallel (Ulysses): {sp} ranks per sequence, each holding 1/{sp} of its tokens; "
                  "tiles per MLP are rank 0's", flush=True)
        if prep.offloader is not None:
            stats = prep.offloader.stats
            print(f"   activation offloading: {stats.offloaded} tensors ({format_bytes(stats.offloaded_bytes)}) to "
                  f"host memory, {stats.waited} fetched on demand"
                  f"{' (CPU: nothing to move)' if train_args.device.type == 'cpu' else ''}", flush=True)
        if reporter.evals:
            last = reporter.evals[-1]
            print(f"   eval: loss {last.loss:.4f} (perplexity {last.perplexity:.2f}) over {len(prep.eval_dataset)} "
                  f"sequences after step {last.step}, tiled loss {'on' if prep.tiled_loss else 'off'}", flush=True)
        if prep.plan_setup is not None:  # None: a run the plan does not model (see _check_it_fits)
            print(planned_vs_measured(prep.model, prep.plan_setup, prep.seq_length,
                                      train_args.per_device_train_batch_size, summary, overhead), flush=True)
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)
    if reporter.non_finite_step is not None:
        raise NonFiniteLoss(reporter.non_finite_message())
    return summary
