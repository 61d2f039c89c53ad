"""Flag names: the spellings users bring from other tools, and an unknown flag named with the one it likely meant.

Hugging Face's example scripts (``run_clm.py``) and TRL spell several of ``tiledmlp train``'s options otherwise
(``--model_name_or_path``, ``--dataset_name``, ``--max_length``): those are aliases, the same option under another
name (listed in ``--help``, accepted as ``--config`` keys). Any other unknown flag is refused by name, with the option
it is closest to, rather than with HfArgumentParser's "Some specified arguments are not used" and its value beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, Sequence

from transformers import TrainingArguments

__all__ = ["aliases", "argument_message", "config_keys", "option_names", "refuse_in_one_line", "split_config",
           "unknown_flags_message"]

_TRAINER_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainingArguments))

# other tools' names whose meaning differs a little from, or is wider than, the option's (not aliases): named in the
# error, so the user picks the option knowingly
_MEANT = {
    "batch_size": "per_device_train_batch_size",
    "micro_batch_size": "per_device_train_batch_size",  # Axolotl
    "train_batch_size": "per_device_train_batch_size",
    "lr": "learning_rate",
    "epochs": "num_train_epochs",
    "num_epochs": "num_train_epochs",
    "use_peft": "lora_r",  # TRL: LoRA on; here a rank above 0 is
    "base_model": "model",  # Axolotl
    "sequence_len": "max_seq_length",  # Axolotl
    "seq_len": "max_seq_length",
    "tiled_mlp": "use_tiled_mlp",  # Axolotl
    "load_in_8bit": "load_in_4bit",  # TRL
}
_HINTS = {
    "use_peft": " A rank above 0 trains LoRA adapters",
    "load_in_8bit": " An 8-bit base is not supported: on CUDA LLM.int8() picks its outlier columns from all the tokens "
                    "of each call, so a tile's would differ from the untiled step's",
}


def aliases(*names: str) -> dict[str, list[str]]:
    """Field metadata giving an option the other names ``names`` (each also with dashes, as HfArgumentParser spells
    every option), except a name TrainingArguments has: a transformers that adds one keeps its own option."""
    spelled = [f"--{n}" for n in names if n not in _TRAINER_FIELDS]
    return {"aliases": spelled + [s.replace("_", "-") for s in spelled if "_" in s]}


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every long option name of ``parser`` (aliases and dashed spellings included, without ``--``) -> its dest."""
    return {s[2:]: a.dest for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _suggestion(name: str, names: dict[str, str]) -> str:
    """`` (did you mean --x?)`` for the option ``name`` most likely meant (by its own name, not an alias), or
    empty."""
    key = name.replace("-", "_")
    meant = _MEANT.get(key)
    if meant not in names:
        close = difflib.get_close_matches(key, [n for n in names if "-" not in n], n=1, cutoff=0.75)
        meant = names[close[0]] if close else None
    if meant is None:
        return ""
    return f" (did you mean --{meant}?{_HINTS.get(key, '')})"


def _is_flag(arg: str) -> bool:
    if not arg.startswith("-") or arg == "-":
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False  # a negative number: a value


def unknown_flags_message(extra: Sequence[str], parser: argparse.ArgumentParser, command: str) -> str:
    """One line naming the flags in ``extra`` (what ``parse_known_args`` left) that ``command`` does not take, each
    with the option it is closest to; or, with no flag among them, the values no flag took."""
    names = option_names(parser)
    flags = [a.partition("=")[0] for a in extra if _is_flag(a)]
    if not flags:
        return (f"unexpected value{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}: each value follows "
                f"its flag (--flag value or --flag=value); {command} --help lists the flags")
    named = ", ".join(f"{f}{_suggestion(f.lstrip('-'), names)}" for f in flags)
    return f"unknown flag{'s' if len(flags) > 1 else ''} {named}; {command} --help lists the flags"


def refuse_in_one_line(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` raise its errors instead of printing its usage and exiting: Python before 3.12 does that for
    an ambiguous abbreviation even with ``exit_on_error=False`` (``--lr`` matches four options), whose usage here
    runs to a hundred lines. The error names the option meant, as for an unknown flag."""

    def error(message: str) -> None:
        flag = message.removeprefix("ambiguous option: ").partition(" ")[0] if message.startswith("ambiguous") else ""
        raise argparse.ArgumentError(None, message + _suggestion(flag.lstrip("-"), option_names(parser)) if flag
                                     else message)

    parser.error = error  # type: ignore[method-assign]


def argument_message(exc: BaseException) -> str:
    """``exc``'s message; an argparse error names its option once, where argparse joins every name and spelling
    (``argument --max_seq_length/--max-seq-length/--max_length/--block_size/...: invalid int value``)."""
    if not isinstance(exc, argparse.ArgumentError):
        return str(exc) or type(exc).__name__
    name = (exc.argument_name or "").split("/")[0]
    return f"argument {name}: {exc.message}" if name else exc.message


def split_config(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--config FILE`` taken out of ``argv`` (parsed apart from the rest, whose values it supplies), and the rest;
    ``--config`` without its file is a ``ValueError`` saying so (argparse printed its own usage and exited)."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--config", default=None)
    try:
        known, rest = pre.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ValueError("--config needs the file: --config FILE (a YAML or JSON mapping of option names to "
                         "values)") from exc
    return known.config, rest


def config_keys(config: dict[str, Any], parser: argparse.ArgumentParser, path: str,
                renames: dict[str, str] | None = None) -> dict[str, Any]:
    """``config``'s keys as the parser's dests (an alias or a dashed spelling names its option, and ``renames``
    map a spelling to the one this transformers reads); an unknown key, or two keys for one option, is one line
    naming them."""
    names = option_names(parser)
    for old, new in (renames or {}).items():
        for spelling in (old, old.replace("_", "-")):
            if new in names:
                names[spelling] = names[new]
    unknown = [k for k in config if k not in names]
    if unknown:
        named = ", ".join(f"{k}{_suggestion(k, names)}".replace("(did you mean --", "(did you mean ")
                          for k in sorted(unknown))
        raise ValueError(f"--config {path}: unknown option{'s' if len(unknown) > 1 else ''}: {named}")
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in config.items():
        dest = names[key]
        if dest in given:
            raise ValueError(f"--config {path}: {given[dest]} and {key} set the same option; keep one")
        given[dest], out[dest] = key, value
    return out
