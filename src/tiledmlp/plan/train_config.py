"""``tiledmlp plan --config FILE``: plan the run that a ``tiledmlp train`` config file describes.

The file is read as train reads it (its keys checked against train's options, aliases included). The options that
change a step's memory become plan's flags, with train's defaults where the file leaves them out (float32 weights,
no checkpointing, 4096 tokens, where plan's own describe the usual GPU run), ``deepspeed``'s ZeRO stage is read
from its config, and ``fsdp`` is taken as train takes it. The rest (learning rate, logging, saving) changes no
memory and is left aside. Flags given with ``--config`` come after these, so they win, as in train.
"""

from __future__ import annotations

import json
from typing import Any

from ..train.args import UsageError, read_config
from .sharding import fsdp_mode, trainer_fsdp

__all__ = ["config_flags", "config_notes", "config_recipe"]

# train's options that plan takes under the same name and meaning
_SAME = ("model", "dtype", "bf16", "optim", "lora_r", "lora_dropout", "use_tiled_norms", "tiled_accumulate_dtype",
         "tiled_mlp_num_shards", "tiled_mlp_target_gb", "sequence_parallel_size", "per_device_train_batch_size",
         "attn_implementation", "load_in_4bit", "use_bnb_nested_quant")
# train's defaults where plan's differ, and the length train packs to when the file names none
_TRAIN_DEFAULTS = {"dtype": "float32", "activation_checkpointing": False, "max_seq_length": 4096}


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _json_file(value: Any, path: str, key: str) -> Any:
    """A config's ``deepspeed`` or ``fsdp_config``: a JSON file's content (the file as train resolves it beside the
    config file), else the value itself."""
    if not isinstance(value, str):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--config {path}: {key}: cannot read {value}: {exc}") from exc


def _zero_stage(deepspeed: Any, path: str) -> int | None:
    """The ZeRO stage of a DeepSpeed config (a file or a mapping)."""
    deepspeed = _json_file(deepspeed, path, "deepspeed")
    stage = deepspeed.get("zero_optimization", {}).get("stage", 0) if isinstance(deepspeed, dict) else None
    if stage is None:
        return None
    if isinstance(stage, bool) or str(stage).strip() not in ("0", "1", "2", "3"):  # DeepSpeed reads "3" as 3 too
        raise UsageError(f"--config {path}: deepspeed: zero_optimization.stage must be 0-3, got {stage!r}")
    return int(stage)


def _on(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes", "y", "t")


def config_recipe(path: str) -> str | None:
    """The name of plan's recipe row that is the run the config file ``path`` describes (train's defaults: tiled MLP
    and loss on, no offloading), or None where no row is (offloading without both, say)."""
    config = read_config(path)
    mlp, loss = _on(config.get("use_tiled_mlp", True)), _on(config.get("use_tiled_loss", True))
    offload, split = _on(config.get("activation_offloading", False)), \
        _on(config.get("activation_offloading_split_layers", False))
    sp = int(config.get("sequence_parallel_size") or 1)
    if not offload and sp == 1:
        return {(False, False): "untiled", (True, False): "tiled MLP", (True, True): "tiled MLP + loss",
                (False, True): "tiled loss"}.get((mlp, loss))  # the last, a row only where patch() finds no MLP
    if not (mlp and loss and offload):
        return None
    if sp > 1:
        return f"+ SP {sp}" if split else None
    return "+ split layers" if split else "+ offload"


def config_flags(path: str) -> list[str]:
    """Plan's flags for the train run that the config file ``path`` describes."""
    config = {**_TRAIN_DEFAULTS, **{k: v for k, v in read_config(path).items() if v is not None}}
    if "gradient_checkpointing" in config:  # the old spelling, which transformers still takes
        config["activation_checkpointing"] = config.pop("gradient_checkpointing")
    flags = [f"--{key}={_text(config[key])}" for key in _SAME if key in config]
    flags += [f"--activation_checkpointing={_text(config['activation_checkpointing'])}",
              f"--seq={config['max_seq_length']}"]
    if config.get("deepspeed"):  # a relative file is read beside the config file, as train reads it
        stage = _zero_stage(config["deepspeed"], path)
        if stage is not None:
            flags.append(f"--zero_stage={stage}")
    if config.get("fsdp"):  # its strategy in the words or in fsdp_config (a file read as train's Trainer reads it)
        fsdp_config = _json_file(config.get("fsdp_config"), path, "fsdp_config")
        flags.append(f"--fsdp={trainer_fsdp(config['fsdp'], fsdp_config)}")
    return flags


def config_notes(path: str, argv: list[str]) -> list[str]:
    """What the plan of the config file ``path`` leaves to the user (``argv``: the flags given beside it): the ranks
    a sharded run (ZeRO, FSDP) shards over, which the launcher sets, not the file."""
    given = any(a.split("=")[0] in ("--world_size", "--world-size") for a in argv)
    flags = config_flags(path)
    zero = any(f.startswith("--zero_stage=") and f != "--zero_stage=0" for f in flags)
    fsdp = next((f.partition("=")[2] for f in flags if f.startswith("--fsdp=")), "")
    sharded = "ZeRO stage" if zero else f"fsdp ({fsdp})" if fsdp_mode(fsdp) else ""
    if given or not sharded:
        return []
    return [f"the file's {sharded} shards over the ranks the launcher starts, which the file does not say: planned "
            "for one; pass --world_size N"]
