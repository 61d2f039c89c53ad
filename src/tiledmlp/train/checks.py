"""Checks of ``tiledmlp train``'s arguments that need no model or data: bad flags fail in milliseconds, as one
:class:`~tiledmlp.train.args.UsageError` line, before anything is loaded or written (Trainer would find most of
them only after loading the model, with a traceback)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

from transformers import TrainingArguments

from .args import (TRAIN_DEFAULTS, DataArguments, ModelArguments, TilingArguments, UsageError, check_accumulate,
                   checkpointing, has_accelerator, hub_dataset_id)
from ..plan.search import MAX_TOKENS
from .quantization import check_quantization, check_quantization_record
from .resume_checks import validate_resume
from .wrapping import check_fsdp_on_cpu

__all__ = ["validate", "FINAL_MODEL_FILES", "deepspeed_settings_from_flags"]

FINAL_MODEL_FILES = ("config.json", "adapter_config.json", "model.safetensors", "adapter_model.safetensors")


def validate(model_args: ModelArguments, data_args: DataArguments, tiling: TilingArguments,
             train_args: TrainingArguments) -> None:
    """Checks that need no model or data, so bad flags fail in milliseconds. Resolves ``--resume_from_checkpoint
    true|last`` to the last complete checkpoint in ``--output_dir``."""
    if data_args.max_seq_length < 2:
        raise UsageError(f"--max_seq_length must be at least 2 (one input and one label token), "
                         f"got {data_args.max_seq_length}")
    tiling.num_shards()
    check_accumulate(tiling.tiled_accumulate_dtype)
    if tiling.tiled_mlp_target_gb is not None and not 0 < tiling.tiled_mlp_target_gb < math.inf:
        raise UsageError(f"--tiled_mlp_target_gb must be a finite number > 0, got {tiling.tiled_mlp_target_gb}")
    if model_args.lora_r < 0:
        raise UsageError(f"--lora_r must be >= 0, got {model_args.lora_r}")
    if not model_args.lora_alpha > 0:
        raise UsageError(f"--lora_alpha must be > 0, got {model_args.lora_alpha}")
    if not 0 <= model_args.lora_dropout < 1:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {model_args.lora_dropout}")
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(train_args, flag) < 1:  # Trainer fails on them only after the model is loaded, with a traceback
            raise UsageError(f"--{flag} must be >= 1, got {getattr(train_args, flag)}")
    tokens = data_args.max_seq_length * train_args.per_device_train_batch_size
    if tokens > MAX_TOKENS:  # packing would repeat the text until the host's memory ran out
        batch = f" x --per_device_train_batch_size {train_args.per_device_train_batch_size}" \
            if train_args.per_device_train_batch_size > 1 else ""
        raise UsageError(f"--max_seq_length {data_args.max_seq_length}{batch} is {tokens:,} tokens a step, past the "
                         f"{MAX_TOKENS:,} that tiledmlp plans and packs; pass a shorter --max_seq_length"
                         + (" or a smaller --per_device_train_batch_size" if batch else ""))
    strategy = str(getattr(train_args.save_strategy, "value", train_args.save_strategy))
    if strategy == "steps" and not train_args.save_steps > 0:  # Trainer would save only at the end: work lost
        raise UsageError(f"--save_steps must be > 0 under --save_strategy steps (a number of steps, or below 1 a "
                         f"fraction of the run), got {train_args.save_steps:g}")
    if train_args.max_steps == 0:  # Trainer checks max_steps only after a step: it trained one ("step 1/0")
        raise UsageError("--max_steps 0 would still train one step (Trainer checks it after each step); pass a "
                         "positive number of steps, or -1 to train --num_train_epochs epochs")
    if train_args.max_steps < -1:  # Trainer reads any negative as "not set": a typo'd -5 trained whole epochs
        raise UsageError(f"--max_steps must be a positive number of steps, or -1 (the default) to train "
                         f"--num_train_epochs epochs, got {train_args.max_steps}")
    if train_args.max_steps < 0 and not train_args.num_train_epochs > 0:  # 0 steps, then an untrained "final model"
        raise UsageError(f"--num_train_epochs {train_args.num_train_epochs:g} trains nothing; pass a positive number "
                         "of epochs, or --max_steps N")
    if model_args.dtype == "auto":  # run_clm's --torch_dtype auto: the dtype the model's config names
        from .models import config_dtype

        model_args.dtype = config_dtype(model_args.model)
    if model_args.dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype must be float32, bfloat16, float16 or auto (the model config's), got "
                         f"{model_args.dtype!r}")
    _validate_fp16(train_args)
    _validate_attention(model_args.attn_implementation, train_args)
    _validate_half_weights(model_args, train_args)
    _validate_deepspeed(train_args)
    check_fsdp_on_cpu(train_args)
    zero = (_deepspeed_config(train_args) or {}).get("zero_optimization")
    check_quantization(model_args, train_args, int(str(zero.get("stage", 0))) if isinstance(zero, dict) else 0)
    _validate_trainer_settings(train_args)
    _refuse_data_parallel(train_args, tiling)
    for flag in ("dataset", "eval_dataset"):
        path = getattr(data_args, flag)
        if path is not None and path.startswith("~"):  # quoted, or from --config: the shell did not expand it
            path = os.path.expanduser(path)
            setattr(data_args, flag, path)
        if path is not None and not os.path.exists(path) and not hub_dataset_id(path):
            raise UsageError(f"--{flag} not found: {path}")
    _validate_eval(data_args, train_args)
    if tiling.activation_offloading:
        _validate_offloading(train_args)
    _validate_label_smoothing(train_args.label_smoothing_factor, data_args.sequence_parallel_size,
                              tiling.use_tiled_loss)
    _validate_liger(train_args, tiling)
    if tiling.activation_offloading_split_layers and not tiling.activation_offloading:
        raise UsageError("--activation_offloading_split_layers needs --activation_offloading true")
    if tiling.compare and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--compare launches its two phases itself; launch it without torchrun")
    if tiling.compare and train_args.resume_from_checkpoint:
        raise UsageError("--compare measures both phases from the first step and saves no checkpoints; drop "
                         "--resume_from_checkpoint (or drop --compare to continue a run)")
    from .sequence_parallel import check_args

    world = data_args.sequence_parallel_size if tiling.compare else int(os.environ.get("WORLD_SIZE", "1"))
    check_args(data_args.sequence_parallel_size, data_args.max_seq_length, train_args,
               model_args.attn_implementation, world)
    _validate_output_dir(train_args.output_dir)
    validate_resume(train_args, model_args)
    if train_args.resume_from_checkpoint:  # with or without --ignore_data_skip: the base, not the data
        check_quantization_record(train_args.resume_from_checkpoint, model_args)
    # resolved to a complete checkpoint folder by now; --ignore_data_skip resumes at the data's first batch, so no
    # data position of the checkpoint's is kept and other data is what it is for
    if train_args.resume_from_checkpoint and not train_args.ignore_data_skip:
        from .data_record import check_data_record

        check_data_record(train_args.resume_from_checkpoint, data_args)
    if not tiling.compare:  # --compare writes only compare.json there (its phases: subfolders, no checkpoints)
        _refuse_overwriting_an_earlier_run(train_args, model_args.save_final_model)


def _validate_fp16(train_args: TrainingArguments) -> None:
    """On CPU accelerate drops fp16 autocast and trains in float32 without a word; bf16 autocast does run there."""
    if train_args.fp16 and (train_args.use_cpu or not has_accelerator()):
        raise UsageError("--fp16 true needs a GPU (on CPU it would silently train in float32); use --bf16 true on "
                         "CPU")


def _validate_attention(attn: str | None, train_args: TrainingArguments) -> None:
    """torch's FlexAttention has no backward on the CPU: the run would fail at its first backward, after the load."""
    if attn == "flex_attention" and (train_args.use_cpu or not has_accelerator()):
        raise UsageError("--attn_implementation flex_attention: FlexAttention has no backward on the CPU; train "
                         "there with sdpa (the default) or eager")


def _validate_half_weights(model_args: ModelArguments, train_args: TrainingArguments) -> None:
    """Adam-family optimizers step float16 weights in float16: eps (1e-8) rounds to 0 and small squared grads
    underflow, so ``m / (sqrt(v) + eps)`` is 0/0 for weights with tiny grads and the weights turn NaN at the first
    step. bfloat16 has float32's range; LoRA adapters are float32 (PEFT upcasts them); DeepSpeed's fp16 mode keeps
    float32 master weights of its own."""
    optim = str(getattr(train_args.optim, "value", train_args.optim))
    if model_args.dtype != "float16" or model_args.lora_r > 0 or train_args.deepspeed:
        return
    if "adam" in optim or "ademamix" in optim:
        raise UsageError(f"--dtype float16 with --optim {optim}: Adam's eps ({train_args.adam_epsilon:g}) rounds to 0 "
                         "in float16 and small squared grads underflow, so the weights turn NaN at the first step; "
                         "pass --dtype bfloat16, or keep float32 weights (--dtype float32), with --fp16 true mixed "
                         "precision on a GPU")


def _validate_output_dir(out: str) -> None:
    """Trainer creates ``--output_dir`` at init (a traceback when a parent is a file) and first writes into it at
    the first save, or at the final one: an unwritable folder would lose the whole run. The nearest existing
    ancestor must be a folder this process can create entries in."""
    if not out:
        raise UsageError("--output_dir is empty; pass the folder for checkpoints and the final model")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--output_dir {out} is a file, not a folder; pass another --output_dir")
    folder = os.path.abspath(out)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise UsageError(f"--output_dir {out}: {folder} is a file, not a folder; pass another --output_dir")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output_dir {out}: cannot write in {folder} (permission denied); pass an --output_dir "
                         "in a folder you can write to")


def _refuse_data_parallel(train_args: TrainingArguments, tiling: TilingArguments) -> None:
    """One process seeing several GPUs makes Trainer wrap the model in torch.nn.DataParallel, whose replicas
    would compute with the original's tiled forwards (tiledmlp refuses them at the first call, after loading)."""
    if (tiling.use_tiled_mlp or tiling.use_tiled_loss) and int(os.environ.get("WORLD_SIZE", "1")) == 1 \
            and train_args.n_gpu > 1:
        raise UsageError(f"this process sees {train_args.n_gpu} GPUs, so Trainer would use torch.nn.DataParallel, "
                         f"which tiled modules do not support: launch torchrun --nproc_per_node {train_args.n_gpu} "
                         "(or accelerate launch) for DDP, or expose one GPU (CUDA_VISIBLE_DEVICES=0)")


def _refuse_overwriting_an_earlier_run(train_args: TrainingArguments, save_final_model: bool) -> None:
    """A new run into a folder holding an earlier run's checkpoints would overwrite them (same step numbers) and,
    with ``--save_total_limit``, rotate them away; its final model would replace the earlier one. Continue that
    run or pick another folder. Whatever ``--save_strategy``: a stop signal saves a checkpoint even under ``no``.
    Resuming a checkpoint of another folder is a new run here too: it would overwrite and rotate this one's."""
    from transformers.trainer_utils import get_last_checkpoint

    out, resume = train_args.output_dir, train_args.resume_from_checkpoint
    if not out or not os.path.isdir(out):
        return
    if resume and os.path.realpath(os.path.dirname(os.path.abspath(resume))) == os.path.realpath(out):
        return  # continuing the run this folder holds
    what = f"resuming {resume} there" if resume else "a new run there"
    last = get_last_checkpoint(out)
    if last is not None:
        raise UsageError(f"--output_dir {out} already holds checkpoints of an earlier run ({os.path.basename(last)}); "
                         f"pass --resume_from_checkpoint last to continue it, or another --output_dir ({what} would "
                         "overwrite them)")
    final = [name for name in FINAL_MODEL_FILES if os.path.isfile(os.path.join(out, name))] if save_final_model else []
    if final:
        continuing = "" if resume else ", --resume_from_checkpoint to continue that run"
        raise UsageError(f"--output_dir {out} already holds an earlier run's final model ({final[0]}); pass another "
                         f"--output_dir (this run's would replace it){continuing}, or --save_final_model false")


def _validate_eval(data_args: DataArguments, train_args: TrainingArguments) -> None:
    """Evaluation needs held-out text (Trainer would fail only after loading the model)."""
    strategy = str(getattr(train_args.eval_strategy, "value", train_args.eval_strategy))
    if strategy != "no" and data_args.eval_dataset is None:
        raise UsageError(f"--eval_strategy {strategy} needs --eval_dataset FILE (held-out text, formats as "
                         "--dataset)")
    if train_args.eval_on_start and data_args.eval_dataset is None:
        raise UsageError("--eval_on_start true needs --eval_dataset FILE (held-out text, formats as --dataset)")
    # Trainer leaves these to the script; run_clm's users expect an evaluation or predictions from them
    if train_args.do_eval and data_args.eval_dataset is None:
        raise UsageError("--do_eval true needs --eval_dataset FILE (held-out text, formats as --dataset): without it "
                         "nothing is evaluated")
    if train_args.do_predict:
        raise UsageError("--do_predict true: tiledmlp train writes no predictions (it trains, then scores "
                         "--eval_dataset); drop --do_predict")
    if train_args.per_device_eval_batch_size < 1:
        raise UsageError(f"--per_device_eval_batch_size must be >= 1, got {train_args.per_device_eval_batch_size}")


def _validate_label_smoothing(factor: float, sp: int, tiled_loss: bool) -> None:
    """With the tiled loss the smoothing is the loss's own (runner); without it, Trainer's smoother, which the
    sequence-parallel loss does not call."""
    from ..loss_support import check_label_smoothing

    try:
        check_label_smoothing(factor, "--label_smoothing_factor")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if factor and sp > 1 and not tiled_loss:
        raise UsageError("--label_smoothing_factor under --sequence_parallel_size > 1 needs --use_tiled_loss true: "
                         "the sequence-parallel loss does not call Trainer's label smoother; the tiled loss smooths "
                         "itself")


def _validate_liger(train_args: TrainingArguments, tiling: TilingArguments) -> None:
    """Trainer applies Liger's kernels after tiledmlp has patched the model, and they rebind the forwards of the
    same modules (MLP, norms, the causal LM's loss): the run would report tiles it no longer runs. Each Liger kernel
    that replaces something tiledmlp tiles must be off in ``liger_kernel_config`` (Liger's defaults otherwise)."""
    if not train_args.use_liger_kernel:
        return
    config = train_args.liger_kernel_config or {}
    wanted: list[tuple[str, bool]] = []  # (Liger kernel, Liger's default)
    if tiling.use_tiled_mlp:
        wanted += [("swiglu", True), ("geglu", True)] + ([("rms_norm", True)] if tiling.use_tiled_norms else [])
    if tiling.use_tiled_loss:
        wanted += [("fused_linear_cross_entropy", True), ("cross_entropy", False)]
    on = [name for name, default in wanted if config.get(name, default)]
    if on:
        off = ", ".join(f'"{name}": false' for name in on)
        raise UsageError(f"--use_liger_kernel would replace what tiledmlp tiles ({', '.join(on)} on): put "
                         f"liger_kernel_config: {{{off}}} in the --config file, or pass --use_liger_kernel false")


def _validate_offloading(train_args: TrainingArguments) -> None:
    """--activation_offloading wraps what non-reentrant checkpointing keeps; refuse what would bypass it."""
    _, kwargs = checkpointing(train_args)
    # the Trainer passes what is left after every_n_layers and offload to torch's checkpoint, or None (then
    # transformers picks non-reentrant) where nothing is; torch reads a missing use_reentrant as True
    forwarded = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")}
    if forwarded and forwarded.get("use_reentrant") is not False:
        raise UsageError("--activation_offloading needs non-reentrant activation checkpointing: set "
                         '"use_reentrant": false in --activation_checkpointing_kwargs (torch reads it as true when '
                         "it is left out)")
    if kwargs.get("offload", False):
        raise UsageError("--activation_offloading replaces transformers' own checkpoint offload: drop offload "
                         "from --activation_checkpointing_kwargs")


# the DeepSpeed settings transformers takes from Trainer's flags where a config says "auto" (train_batch_size too,
# which DeepSpeed works out itself where it is left out)
_FROM_FLAGS = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
               "gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "max_grad_norm"}


def _validate_trainer_settings(train_args: TrainingArguments) -> None:
    """What Trainer checks only once the model is loaded and the data packed, with a traceback and an empty
    ``--output_dir`` left behind: the seed, the data workers, the reporting integrations' packages, and the
    optimizer's settings and package (the optimizer --optim names, built here over one parameter; a DeepSpeed
    config's own optimizer is DeepSpeed's to check)."""
    if not 0 <= train_args.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32 - 1], got {train_args.seed}")
    if train_args.dataloader_num_workers < 0:
        raise UsageError(f"--dataloader_num_workers must be >= 0, got {train_args.dataloader_num_workers}")
    import torch
    from transformers import Trainer
    from transformers.integrations import get_reporting_integration_callbacks

    for callback in get_reporting_integration_callbacks(train_args.report_to):
        try:
            callback()
        except (ImportError, RuntimeError) as exc:  # the package is missing: its callback refuses to be made
            raise UsageError(f"--report_to {callback.__name__.removesuffix('Callback').lower()}: "
                             f"{str(exc).rstrip('.')}; or pass --report_to none") from exc
    config = _deepspeed_config(train_args) or {}
    if "optimizer" in config:
        return
    optim = getattr(train_args.optim, "value", train_args.optim)
    try:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(train_args)
    except ImportError as exc:
        raise UsageError(f"--optim {optim}: {exc}") from exc
    except ValueError:  # one that needs the model (GaLore, LOMO): Trainer checks it then
        return
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except ValueError as exc:
        raise UsageError(f"--optim {optim} ({cls.__name__}) refuses the settings: {exc}; check --learning_rate, "
                         "--weight_decay, --adam_beta1, --adam_beta2, --adam_epsilon and --optim_args") from exc
    except Exception:  # an optimizer that needs more than one CPU parameter (a device, a model): Trainer checks it
        return


def deepspeed_settings_from_flags(train_args: TrainingArguments) -> list[str]:
    """The batch and clipping settings a DeepSpeed config leaves out are taken from the flags, as ``"auto"`` would
    be (one note on stderr). Left out, DeepSpeed stopped on its batch-size assertion (a traceback; accelerate
    writes ``gradient_accumulation_steps: 1`` into such a config), and clipped at its own default, 1.0 in DeepSpeed
    0.19, whatever --max_grad_norm said: transformers fills only ``"auto"``, and the Trainer leaves clipping to
    DeepSpeed. Returns the settings so filled (none where there is no DeepSpeed config)."""
    config = _deepspeed_config(train_args)
    source = train_args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config is None or not source:
        return []
    from accelerate.utils.deepspeed import HfDeepSpeedConfig  # transformers' subclass would replace the global one

    written = HfDeepSpeedConfig(source).config  # the config as written, before accelerate added to it
    missing = [key for key in _FROM_FLAGS if key not in written]
    for key in missing:
        config[key] = getattr(train_args, _FROM_FLAGS[key]) or 0  # --max_grad_norm 0 (or None): no clipping
    if missing and os.environ.get("LOCAL_RANK", "0") == "0":
        print("tiledmlp train: the DeepSpeed config leaves out " + ", ".join(missing) + ": taken from "
              + ", ".join(f"--{_FROM_FLAGS[key]}" for key in missing), file=sys.stderr, flush=True)
    return missing


def _deepspeed_config(train_args: TrainingArguments) -> dict | None:
    """The DeepSpeed config this run hands to DeepSpeed (--deepspeed, or accelerate's), or None."""
    plugin = getattr(train_args, "deepspeed_plugin", None)
    config = getattr(getattr(plugin, "hf_ds_config", None), "config", None)
    return config if isinstance(config, dict) else None


def _validate_deepspeed(train_args: TrainingArguments) -> None:
    """A DeepSpeed config that contradicts a flag, or that transformers refuses with one (ZeRO-3 with
    --auto_find_batch_size). Its own optimizer or scheduler replaces --optim or --lr_scheduler_type without a word;
    a value that differs from a flag's, transformers raised as a traceback once training started, after the model had
    loaded (its list, read here: ``HfTrainerDeepSpeedConfig.mismatches``)."""
    config = _deepspeed_config(train_args)
    if config is None:
        return
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if str(stage).strip() not in ("0", "1", "2", "3"):  # DeepSpeed reads "3" as 3 too
        raise UsageError(f"--deepspeed {train_args.deepspeed or 'config'}: zero_optimization.stage must be 0, 1, 2 or "
                         f"3, got {stage!r}")
    if train_args.auto_find_batch_size and isinstance(zero, dict) and zero.get("stage") == 3:
        # transformers refuses it when the Trainer is made, with a traceback after the model has loaded
        source = train_args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "accelerate's config"
        raise UsageError(f"--auto_find_batch_size: transformers does not retry a DeepSpeed ZeRO-3 run ({source}) at a "
                         "smaller batch; use a ZeRO-1/2 config or FSDP, or drop --auto_find_batch_size and set "
                         "--per_device_train_batch_size (tiledmlp plan --per_device_train_batch_size N says what fits)")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)} | TRAIN_DEFAULTS
    for section, flag in (("optimizer", "optim"), ("scheduler", "lr_scheduler_type")):
        given = getattr(getattr(train_args, flag), "value", getattr(train_args, flag))
        if section in config and given != getattr(defaults[flag], "value", defaults[flag]):
            kind = config[section].get("type") if isinstance(config[section], dict) else None
            raise UsageError(f"--{flag} {given}, but the DeepSpeed config names its own {section} ({kind}), which "
                             f"DeepSpeed would use instead: drop \"{section}\" from the config, or drop --{flag}")
    wrong = getattr(getattr(train_args, "hf_deepspeed_config", None), "mismatches", None)
    if wrong:
        found = "; ".join(dict.fromkeys(m.removeprefix("- ds ").replace(" vs hf ", " vs flag ") for m in wrong))
        raise UsageError(f"--deepspeed {train_args.deepspeed} disagrees with the flags ({found}): set those values "
                         'to "auto" in the config, or pass the flags that match them')
