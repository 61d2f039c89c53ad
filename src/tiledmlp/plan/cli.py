"""``tiledmlp plan``: predicted peak device memory per recipe, and the longest sequence that fits, before any run.

Flags shared with ``tiledmlp train`` keep its names and meanings (``--model``, ``--dtype``, ``--bf16``,
``--optim``, ``--lora_r``, ``--activation_checkpointing``, ``--per_device_train_batch_size``), not all its
defaults: ``--dtype`` (bfloat16) and ``--activation_checkpointing`` (true) describe the usual GPU run, where train's
are float32 and off. The model's config is read, never its weights. Bad input: one ``tiledmlp plan: error: ...``
line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from transformers import HfArgumentParser

from ..train.args import DEFAULT_MODEL, UsageError, check_accumulate, one_line, parse_num_shards
from ..train.flags import aliases, argument_message, refuse_in_one_line, split_config, unknown_flags_message
from .checks import DEVICE_TYPES
from .model import predict_step_peak
from .search import MAX_TOKENS, SEARCH_LIMIT, max_seq_that_fits, searched_limit, step_of
from .setup import OPTIMIZER_STATE_BYTES, Setup
from .sharding import fsdp_mode
from .shapes import ModelShape
from .train_config import config_flags, config_notes, config_recipe

__all__ = ["PlanArguments", "main", "plan", "recipes", "max_seq_that_fits", "searched_limit", "MAX_TOKENS",
           "SEARCH_LIMIT"]

_GIB = 1024**3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PlanArguments:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "As tiledmlp train's --model; a folder holding only "
                                                               "config.json is enough (no weights are read).",
                                                       **aliases("model_name_or_path")})
    device_memory_gb: float = field(default=80.0, metadata={"help": "Device memory in GiB that a step must fit."})
    dtype: str | None = field(default=None, metadata={"help": "Weight dtype: float32, bfloat16, float16 or auto "
                                                             "(the model config's; default: bfloat16, float32 with "
                                                             "--bf16 true; tiledmlp train's default is float32).",
                                                     **aliases("torch_dtype")})
    bf16: bool = field(default=False, metadata={"help": "Autocast to bfloat16 (with float32 --dtype weights)."})
    optim: str = field(default="adamw_torch", metadata={"help": "Trainer optimizer name: "
                                                               + ", ".join(sorted(OPTIMIZER_STATE_BYTES))})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains all weights."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout, as tiledmlp train's: above 0 each "
                                                               "adapter saves its mask, each MLP tile draws its own."})
    load_in_4bit: bool = field(default=False, metadata={"help": "As tiledmlp train's (QLoRA, with --lora_r): the "
                                                                "decoder's Linears in 4 bits, the rest float32."})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "As tiledmlp train's: with --load_in_4bit, "
                                                                        "the 4-bit blocks' scales quantized too."})
    activation_checkpointing: bool = field(default=True, metadata={
        "aliases": ["--gradient_checkpointing", "--gradient-checkpointing"],  # train takes both spellings
        "help": "Checkpoint every decoder layer: true (here the default; tiledmlp train's is off) or false, as "
                "--no_activation_checkpointing; --gradient_checkpointing is the same flag, as in tiledmlp train."})
    use_tiled_norms: bool = field(default=True, metadata={"help": "As tiledmlp train's: tiled recipes row-tile "
                                                                  "RMSNorms past 256 MiB of float32 per tile."})
    tiled_accumulate_dtype: str = field(default="auto", metadata={"help": "As tiledmlp train's: the tiled "
                                                                          "recipes' weight-grad sums, auto or param."})
    tiled_mlp_num_shards: str = field(default="auto", metadata={"help": "As tiledmlp train's: the tiled recipes' "
                                                                        "MLP tiles, 'auto' or a number."})
    tiled_mlp_target_gb: float | None = field(default=None, metadata={
        "help": "As tiledmlp train's: MLP tiles sized to this many GiB each (overrides --tiled_mlp_num_shards)."})
    sequence_parallel_size: int = field(default=1, metadata={"help": "Ulysses sequence-parallel ranks (last recipe)."})
    world_size: int = field(default=1, metadata={"help": "Ranks in all (ZeRO or FSDP shard over them)."})
    zero_stage: int = field(default=0, metadata={"help": "DeepSpeed ZeRO stage 0-3."})
    fsdp: str = field(default="", metadata={"help": "torch FSDP's sharding over --world_size ranks, as train's "
                                                     "--fsdp: full_shard or shard_grad_op (auto_wrap may follow)."})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "Sequences per step per device."})
    seq: str = field(default="32768,131072", metadata={"help": "Comma-separated sequence lengths to predict (train's "
                                                               "--max_seq_length names one).",
                                                       **aliases("max_seq_length", "max_length", "block_size")})
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa, eager or flash_attention_2 "
                                                                            "(default: the config's, else sdpa)."})
    device: str = field(default="cuda", metadata={"help": "The device type the run trains on: cuda, xpu, mps or cpu "
                                                          "(kernels, buffers and optimizer temporaries differ)."})
    json: bool = field(default=False, metadata={"help": "Print one JSON object instead of the table."})

    def seqs(self) -> list[int]:
        try:
            values = [int(v) for v in self.seq.split(",") if v.strip()]
        except ValueError:
            raise UsageError(f"--seq must be comma-separated positive integers, got {self.seq!r}") from None
        if not values or any(v < 1 for v in values):
            raise UsageError(f"--seq must be comma-separated positive integers, got {self.seq!r}")
        return values


def _validate(a: PlanArguments) -> None:
    if a.dtype is None:  # as train: --bf16 autocasts float32 weights
        a.dtype = "float32" if a.bf16 else "bfloat16"
    if a.dtype == "auto":  # as train: the dtype the model's config names
        from ..train.models import config_dtype

        a.dtype = config_dtype(a.model)
    if not 0 < a.device_memory_gb < math.inf:
        raise UsageError(f"--device_memory_gb must be a finite number > 0, got {a.device_memory_gb}")
    if a.dtype not in _DTYPES:
        raise UsageError(f"--dtype must be float32, bfloat16, float16 or auto (the model config's), got {a.dtype!r}")
    if a.bf16 and a.dtype != "float32":
        raise UsageError("--bf16 true autocasts float32 weights; with it pass --dtype float32")
    if a.optim not in OPTIMIZER_STATE_BYTES:
        raise UsageError(f"--optim {a.optim!r} is not modelled; use one of {', '.join(sorted(OPTIMIZER_STATE_BYTES))}")
    for name in ("sequence_parallel_size", "world_size", "per_device_train_batch_size"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.lora_r < 0:
        raise UsageError(f"--lora_r must be >= 0, got {a.lora_r}")
    if not 0 <= a.lora_dropout < 1:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {a.lora_dropout}")
    if a.zero_stage not in (0, 1, 2, 3):
        raise UsageError(f"--zero_stage must be 0, 1, 2 or 3, got {a.zero_stage}")
    try:
        fsdp = fsdp_mode(a.fsdp)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    if fsdp and a.zero_stage:
        raise UsageError(f"--fsdp {a.fsdp} and --zero_stage {a.zero_stage}: a run shards with one of FSDP and "
                         "DeepSpeed ZeRO; drop one")
    if fsdp and a.sequence_parallel_size > 1:
        raise UsageError("--sequence_parallel_size runs on DeepSpeed; drop --fsdp (tiledmlp train refuses the two)")
    if a.world_size > 1 and a.world_size % a.sequence_parallel_size:
        raise UsageError(f"--world_size {a.world_size} must be a multiple of --sequence_parallel_size "
                         f"{a.sequence_parallel_size}")
    if a.use_bnb_nested_quant and not a.load_in_4bit:
        raise UsageError("--use_bnb_nested_quant sets up 4-bit weights: pass --load_in_4bit true too, or drop it")
    if a.load_in_4bit and (a.lora_r < 1 or a.zero_stage >= 3):
        raise UsageError("--load_in_4bit plans QLoRA as tiledmlp train runs it: with --lora_r N, on one process, DDP, "
                         "ZeRO-1/2 (with --sequence_parallel_size too) or --fsdp (no --zero_stage 3)")
    check_accumulate(a.tiled_accumulate_dtype)
    parse_num_shards(a.tiled_mlp_num_shards)
    if a.tiled_mlp_target_gb is not None and not 0 < a.tiled_mlp_target_gb < math.inf:
        raise UsageError(f"--tiled_mlp_target_gb must be a finite number > 0, got {a.tiled_mlp_target_gb}")
    if a.device not in DEVICE_TYPES:
        raise UsageError(f"--device must be one of {', '.join(DEVICE_TYPES)}, got {a.device!r}")
    for s in a.seqs():
        if s % a.sequence_parallel_size:
            default = " (the default --seq: pass lengths that are)" if a.seq == PlanArguments.seq else ""
            raise UsageError(f"--seq {s} is not divisible by --sequence_parallel_size {a.sequence_parallel_size}"
                             + default)
        if s * a.per_device_train_batch_size > MAX_TOKENS:
            batch = f" x --per_device_train_batch_size {a.per_device_train_batch_size}" \
                if a.per_device_train_batch_size > 1 else ""
            raise UsageError(f"--seq {s}{batch} is past the {MAX_TOKENS:,} tokens per device step the plan "
                             "evaluates; pass a shorter --seq")
    if a.per_device_train_batch_size * step_of(a.sequence_parallel_size) > MAX_TOKENS:
        raise UsageError(f"--per_device_train_batch_size {a.per_device_train_batch_size} x "
                         f"{step_of(a.sequence_parallel_size)} tokens (max seq's shortest) is past the {MAX_TOKENS:,} "
                         "tokens per device step the plan evaluates; pass a smaller batch")


def _check_sequence_parallel(shape: ModelShape, n: int) -> None:
    """``tiledmlp train``'s own check of heads, KV heads and attention kernel under Ulysses (the rule lives in
    ``train.sequence_parallel.check_model``, which reads a model's config: handed the planned shape's)."""
    if n == 1:
        return
    from ..train.sequence_parallel import check_model

    text = SimpleNamespace(_attn_implementation=shape.attn_impl, num_attention_heads=shape.heads,
                           num_key_value_heads=shape.kv_heads)
    check_model(SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text)), n)  # type: ignore[arg-type]


# tiledmlp train's switches of what the table's rows already vary
_RECIPE_FLAGS = {"use_tiled_mlp", "use_tiled_loss", "activation_offloading", "activation_offloading_split_layers"}


def recipes(a: PlanArguments, shape: ModelShape) -> dict[str, Setup]:
    """The recipes, each adding one trick to the previous; ``tiled MLP + loss`` only for models ``patch_loss``
    takes (BioGPT's it refuses: later rows build on ``tiled MLP``), ``tiled MLP`` only for models ``patch()`` finds
    an MLP in (OPT's and BioGPT's sit in the decoder layer: their rows tile the loss alone, ``tiled loss``),
    ``+ split layers`` only for models whose decoder layers split (``tiledmlp train`` refuses the flag otherwise:
    GPT-NeoX's parallel residual, GPT-2's)."""
    sp = a.sequence_parallel_size
    # QLoRA: PEFT makes every weight bitsandbytes leaves unquantized float32, and with it the residual stream
    cast = _deepspeed_casts(a)
    base = Setup(dtype=torch.float32 if a.load_in_4bit else torch.bfloat16 if cast else _DTYPES[a.dtype],
                 autocast=a.bf16 and not cast,
                 load_in_4bit=a.load_in_4bit, bnb_nested_quant=a.use_bnb_nested_quant, optim=a.optim,
                 lora_r=a.lora_r, lora_dropout=a.lora_dropout,
                 checkpointing=a.activation_checkpointing, world_size=max(a.world_size, sp), zero_stage=a.zero_stage,
                 fsdp=fsdp_mode(a.fsdp),
                 device_type=a.device, tiled_norms=a.use_tiled_norms, accumulate=a.tiled_accumulate_dtype,
                 mlp_num_shards=parse_num_shards(a.tiled_mlp_num_shards), mlp_target_gb=a.tiled_mlp_target_gb)
    tiled = replace(base, tiled_mlp=not shape.mlp_refusal)
    loss = replace(tiled, tiled_loss=not shape.loss_refusal)
    offload = replace(loss, checkpointing=True, offload=True)
    split = replace(offload, split_layers=True) if shape.splittable_layers else offload
    loss_row = "tiled loss" if shape.mlp_refusal else "tiled MLP + loss"
    return {"untiled": base, **({} if shape.mlp_refusal else {"tiled MLP": tiled}),
            **({} if shape.loss_refusal else {loss_row: loss}),
            "+ offload": offload, **({"+ split layers": split} if shape.splittable_layers else {}),
            f"+ SP {sp}": replace(split, sequence_parallel_size=sp)}


def plan(a: PlanArguments, shape: ModelShape) -> dict[str, Any]:
    """The ``--json`` object: per recipe the peak at each ``--seq`` (GiB to 3 decimals, and exact bytes) and the
    longest sequence that fits."""
    budget, batch = a.device_memory_gb * _GIB, a.per_device_train_batch_size
    out: dict[str, Any] = {"recipes": {}}
    for name, setup in recipes(a, shape).items():
        peaks = {str(s): predict_step_peak(shape, setup, s, batch=batch).peak_bytes for s in a.seqs()}
        longest = max_seq_that_fits(shape, setup, budget, batch)
        out["recipes"][name] = {"peak_gib": {s: round(b / _GIB, 3) for s, b in peaks.items()}, "peak_bytes": peaks,
                                "max_seq": longest,
                                "max_seq_at_limit": longest > 0 and longest == searched_limit(setup, batch)}
    out["assumptions"] = {
        **{k: v for k, v in asdict(a).items() if k not in ("json", "seq")},
        "max_seq": f"the longest multiple of 1024 tokens whose plan fits, searched up to {SEARCH_LIMIT:,} tokens "
                   "(max_seq_at_limit: that limit fits, so longer ones may too); a shorter one may not fit where "
                   "tiles split (the plan can drop with the length)",
        "model_shape": asdict(shape),
        "step": "steady-state optimizer step: weights and optimizer states exist, gradients start as None",
        "offload": "checkpointed layer inputs on the host",
        "split_layers": "offload_activations(split_layers=True): attention and MLP halves checkpointed apart",
        "tiled_mlp": f"no tiled MLP row: {shape.mlp_refusal}" if shape.mlp_refusal else "patch",
        "tiled_loss": f"no tiled MLP + loss row: {shape.loss_refusal}" if shape.loss_refusal else "patch_loss",
        "sliding_masks": _sliding_note(shape, a) or "none at these lengths",
        "multimodal": _VISION if shape.multimodal else "a text model",
        "sequence_parallel": "Ulysses: seq/N tokens per rank outside attention, full sequence x heads/N inside",
        "excluded": "CUDA context, allocator fragmentation and caching (max_memory_allocated, not reserved)",
        "fsdp_wrapping": "each decoder layer wrapped (Trainer's auto wrap), the rest in the root; with --bf16 over "
                         "float32 weights accelerate's bf16 mixed-precision policy (bf16 gathers, compute and "
                         "reduce; float32 shards, grads and optimizer states)",
        "deepspeed": "ZeRO steps a float32 copy of each rank's partition (master weights, AdamW states and the step's "
                     "grads float32); with --bf16 DeepSpeed casts the model to bf16 (no autocast); ZeRO-3 keeps "
                     "parameters gathered from the forward into the backward up to DeepSpeed's default "
                     "stage3_max_live_parameters (1e9)",
    }
    return out


_VISION = ("the text decoder's tokens (an image's or a clip's included, as its text positions); the vision or audio "
           "tower's weights are counted, its activations per image are not")


def _deepspeed_casts(a: PlanArguments) -> bool:
    """``--bf16`` beside a ZeRO stage: DeepSpeed casts the model to bf16 itself (no autocast: measured through
    tiledmlp train, the engine's weights bf16), keeping float32 master weights; a 4-bit base stays planned as
    autocast."""
    return a.bf16 and a.zero_stage >= 1 and not a.load_in_4bit


def _sliding_note(shape: ModelShape, a: PlanArguments) -> str:
    """What sdpa's sliding-window masks cost at the longest ``--seq`` (``ModelShape.sliding_note``)."""
    size = 2 if a.bf16 else _DTYPES[a.dtype].itemsize
    return shape.sliding_note(max(a.seqs()), a.per_device_train_batch_size, size, a.activation_checkpointing)


def _millions(n: int) -> str:
    """Parameters in millions: whole ones from 1M up, two significant digits below (a tiny model is not '0M')."""
    return f"{n / 1e6:,.0f}M" if n >= 999_500 else f"{n / 1e6:.2g}M"


def _print_table(result: dict[str, Any], a: PlanArguments, shape: ModelShape) -> None:
    from rich.console import Console
    from rich.table import Table

    seqs = [str(s) for s in a.seqs()]
    mode = fsdp_mode(a.fsdp)
    sharded = f", FSDP {mode}" if mode else f", ZeRO-{a.zero_stage}" if a.zero_stage else ""
    sharded += f" over {a.world_size} ranks" if sharded and a.world_size > 1 else " on one rank" if sharded else ""
    weights = f"QLoRA r {a.lora_r}: 4-bit Linears computing in {a.dtype}, the rest float32" if a.load_in_4bit \
        else a.dtype
    bf16 = ", bf16 (DeepSpeed casts the model)" if _deepspeed_casts(a) else ", bf16 autocast" if a.bf16 else ""
    table = Table(title=f"tiledmlp plan: {a.model} ({_millions(shape.num_params)} params, {weights}{bf16}, "
                        f"{a.optim}{sharded}) on {a.device_memory_gb:g} GiB")
    table.add_column("recipe")
    for s in seqs:
        table.add_column(f"peak GiB @ {int(s):,}", justify="right")
    table.add_column("max seq (tokens)", justify="right")
    budget = a.device_memory_gb * _GIB
    over = False
    for name, row in result["recipes"].items():
        cells = []
        for s in seqs:  # marked in text too: the colour is gone once the output is piped, and 80.004 prints 80.00
            miss = row["peak_bytes"][s] > budget
            over |= miss
            cells.append(f"[red]{row['peak_gib'][s]:,.2f} (over)[/red]" if miss else f"{row['peak_gib'][s]:,.2f}")
        table.add_row(f"{name} *" if name == result.get("this_run") else name, *cells,
                      f"{'>= ' if row['max_seq_at_limit'] else ''}{row['max_seq']:,}")
    notes = [f"no tiled MLP row: {shape.mlp_refusal}"] if shape.mlp_refusal else []
    notes += [f"no tiled MLP + loss row: {shape.loss_refusal}"] if shape.loss_refusal else []
    notes += [f"note: {n}" for n in [_sliding_note(shape, a), _VISION if shape.multimodal else ""] if n]
    if "this_run" in result:
        notes.append(f"*: the --config file's run ({result['this_run']})")
    notes += [f"note: {n}" for n in result.get("config_notes", [])]
    if over:
        notes.append(f"(over): above the {a.device_memory_gb:g} GiB budget")
    if any(row["max_seq_at_limit"] for row in result["recipes"].values()):
        notes.append(f">= N: the search for max seq stops at {SEARCH_LIMIT:,} tokens, and that fits")
    table.caption = "\n".join(notes) or None
    Console().print(table)


def _parse(argv: Sequence[str]) -> PlanArguments:
    parser = HfArgumentParser(PlanArguments, prog="tiledmlp plan", exit_on_error=False,
                              description="Predicted peak device memory of a training step, per recipe.")
    refuse_in_one_line(parser)
    try:
        config_file, argv = split_config(argv)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if config_file:  # the run a tiledmlp train config file describes; flags given beside it win
        argv = [*config_flags(config_file), *argv]
    try:
        _, extra = parser.parse_known_args(list(argv))
        if extra:  # named, with the option meant (a train flag that does not change the step's memory is not one)
            rows = [f for f in (a.partition("=")[0] for a in extra) if f[2:].replace("-", "_") in _RECIPE_FLAGS]
            if rows:  # train's recipe switches: here each recipe is a row of the table
                raise UsageError(f"{', '.join(rows)}: tiledmlp plan shows every recipe as a row (untiled, tiled MLP, "
                                 "+ loss, + offload, + split layers, + SP); drop the flag, or pass --config FILE to "
                                 "mark the row of the run that file describes")
            raise UsageError(unknown_flags_message(extra, parser, "tiledmlp plan"))
        (args,) = parser.parse_args_into_dataclasses(args=list(argv), look_for_args_file=False)
    except (argparse.ArgumentError, ValueError, TypeError) as exc:
        raise UsageError(one_line(argument_message(exc))) from exc
    _validate(args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        parser = HfArgumentParser(PlanArguments, prog="tiledmlp plan")
        parser.add_argument("--config", metavar="FILE", help="A tiledmlp train --config file: plan the run it "
                            "describes (train's defaults where it is silent); flags given with it override it.")
        parser.print_help()
        return 0
    try:
        args = _parse(argv)
        from ..train.models import load_config

        config = load_config(args.model)
        if args.attn_implementation:
            config._attn_implementation = args.attn_implementation
        shape = ModelShape.from_config(config, name=args.model)
        _check_sequence_parallel(shape, args.sequence_parallel_size)
        result = plan(args, shape)
        config_file = split_config(argv)[0]
        mark = config_recipe(config_file) if config_file else None
        if mark in result["recipes"]:  # the row that is the config file's own run
            result["this_run"] = mark
        if config_file and config_notes(config_file, argv):
            result["config_notes"] = config_notes(config_file, argv)
    except (UsageError, ValueError) as exc:
        print(f"tiledmlp plan: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result, args, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
