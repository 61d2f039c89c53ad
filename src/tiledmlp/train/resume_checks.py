"""Checks of a checkpoint given to ``--resume_from_checkpoint``, before anything loads: it must be a complete one
(``trainer_state.json``), hold the training state Trainer would otherwise replace without a word (optimizer,
scheduler, this process's random state), and be of the model and LoRA settings given now (Trainer finds a mismatch
only after loading the model, with a traceback, or not at all)."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from transformers import TrainingArguments

from .args import ModelArguments, UsageError
from .preemption import last_complete_checkpoint

__all__ = ["validate_resume"]


def validate_resume(train_args: TrainingArguments, model_args: ModelArguments) -> None:
    """A resume needs a complete Trainer checkpoint (``trainer_state.json``, written last) with the optimizer,
    scheduler and random state, of the model and LoRA settings given now; Trainer finds a mismatch only after
    loading the model, or not at all. ``true``/``last`` become the last complete one."""
    value = train_args.resume_from_checkpoint
    if value and value.lower() == "false":  # YAML's resume_from_checkpoint: false (a config template): a new run
        train_args.resume_from_checkpoint = value = None
    if not value:
        return
    if value.lower() in ("true", "last"):
        last = last_complete_checkpoint(train_args.output_dir)
        if last is None:
            raise UsageError(f"--resume_from_checkpoint {value}: no checkpoint in {train_args.output_dir} to resume "
                             "from; drop --resume_from_checkpoint")
        train_args.resume_from_checkpoint = value = last
    elif not os.path.isdir(value):
        raise UsageError(f"--resume_from_checkpoint not found: {value}")
    elif not os.path.isfile(os.path.join(value, "trainer_state.json")):
        inside = last_complete_checkpoint(value)
        fix = f"pass {inside}, its last checkpoint" if inside else "pass a checkpoint-N folder a run saved"
        raise UsageError(f"--resume_from_checkpoint {value} holds no trainer_state.json: not a complete checkpoint "
                         f"(a final model, or a save cut short); {fix}")
    _require_training_state(value)
    _steps_left(value, train_args)
    adapter = os.path.join(value, "adapter_config.json")
    if not os.path.isfile(adapter):
        if model_args.lora_r:
            raise UsageError(f"--resume_from_checkpoint {value} trained all weights (no adapter_config.json); "
                             "pass --lora_r 0")
        _same_model(value, model_args.model)
        return
    saved = _read_json(adapter)
    rank = saved.get("r") if isinstance(saved.get("r"), int) else "N"
    if model_args.lora_r == 0 or (rank != "N" and model_args.lora_r != rank):
        raise UsageError(f"--resume_from_checkpoint {value} holds a LoRA adapter of rank {rank} "
                         f"(adapter_config.json); pass --lora_r {rank}")
    for key in ("lora_alpha", "lora_dropout"):
        was, now = saved.get(key), getattr(model_args, key)
        if isinstance(was, (int, float)) and not isinstance(was, bool) and not math.isclose(was, now, abs_tol=1e-12):
            raise UsageError(f"--resume_from_checkpoint {value} holds a LoRA adapter trained with {key} {was} "
                             f"(adapter_config.json), not {now}; pass --{key} {was}")
    _same_lora_model(value, model_args, saved.get("target_modules"))


# what Trainer saves of the optimizer: optimizer.pt (one process, DDP); DeepSpeed: global_stepN/ (optimizer and
# scheduler); FSDP (accelerate): optimizer.bin (full state dict), optimizer_0/ (sharded), optimizer_0_rankK.bin
_DEEPSPEED_STATE = re.compile(r"global_step\d+")
_OPTIMIZER_STATE = re.compile(r"optimizer(\.pt|\.bin|_\d+|_\d+_rank\d+\.bin)")


def _require_training_state(folder: str) -> None:
    """``--save_only_model true`` checkpoints hold the weights only; Trainer resumes them with a fresh optimizer,
    learning-rate schedule and random state, without a word, and the run goes on differently. The random state
    alone can be missing too (:func:`_require_rng_state`)."""
    names = os.listdir(folder)
    deepspeed = any(_DEEPSPEED_STATE.fullmatch(n) and os.path.isdir(os.path.join(folder, n)) for n in names)
    if deepspeed:  # DeepSpeed's engine keeps the scheduler with the optimizer
        missing = ""
    elif not any(_OPTIMIZER_STATE.fullmatch(n) for n in names):
        missing = "optimizer state (optimizer.pt; FSDP: optimizer.bin or optimizer_0; DeepSpeed: global_stepN)"
    elif "scheduler.pt" not in names:
        missing = "learning-rate scheduler state (scheduler.pt)"
    else:
        missing = ""
    start = f", or start a new run from its weights with --model {folder}" \
        if os.path.isfile(os.path.join(folder, "config.json")) else ""
    if missing:
        raise UsageError(f"--resume_from_checkpoint {folder} holds no {missing}: a --save_only_model true "
                         f"checkpoint, which would resume with a fresh optimizer and schedule; resume one saved "
                         f"without --save_only_model{start}")
    _require_rng_state(folder, names, start)


def _steps_left(folder: str, train_args: TrainingArguments) -> None:
    """Trainer checks ``max_steps`` only after a step, so a checkpoint already at ``--max_steps`` (the last one of a
    finished run) resumes into one step past it, and that step's weights overwrite the final model; one at the end
    of ``--num_train_epochs`` trains nothing and reports an empty run."""
    state = _read_json(os.path.join(folder, "trainer_state.json"))
    step, epoch = state.get("global_step"), state.get("epoch")
    max_steps, epochs = train_args.max_steps, train_args.num_train_epochs
    if max_steps > 0 and isinstance(step, int) and not isinstance(step, bool) and step >= max_steps:
        raise UsageError(f"--resume_from_checkpoint {folder} is at step {step}, and --max_steps is {max_steps}: "
                         f"nothing left to train (Trainer would run step {step + 1} anyway); pass --max_steps "
                         f"above {step} to train on")
    if max_steps <= 0 and isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and epoch >= epochs:
        raise UsageError(f"--resume_from_checkpoint {folder} is at epoch {epoch:g}, and --num_train_epochs is "
                         f"{epochs:g}: nothing left to train; pass --num_train_epochs above {epoch:g} to train on")


_RNG_STATE = re.compile(r"rng_state(_\d+)?\.pth")


def _require_rng_state(folder: str, names: list[str], start: str) -> None:
    """The random state this process resumes with, named as Trainer's ``_load_rng_state`` reads it:
    ``rng_state.pth`` in one process, ``rng_state_<rank>.pth`` when there are several. Trainer only logs its
    absence and goes on with a fresh one: dropout and random sampling then differ from the uninterrupted run."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    name = "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"
    if name in names:
        return
    ours = {"rng_state.pth"} if world <= 1 else {f"rng_state_{k}.pth" for k in range(world)}
    other = sorted((n for n in names if _RNG_STATE.fullmatch(n) and n not in ours), key=lambda n: (len(n), n))
    which = f" for process {rank} of {world}" if world > 1 else ""
    fix = (f"it holds {', '.join(other)} instead, saved by a run of another number of processes: resume it with "
           f"as many processes as that run had") if other else \
        f"copy it back from where the checkpoint was saved (Trainer writes it beside optimizer.pt){start}"
    raise UsageError(f"--resume_from_checkpoint {folder} holds no random state{which} ({name}): Trainer would "
                     f"resume with a fresh one, and dropout and random sampling would differ from the uninterrupted "
                     f"run; {fix}")


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``; empty where it cannot be read (Trainer then says what is wrong with it)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _model_config(name: str) -> Any:
    from .models import load_config

    return load_config(name)


def _describe(config: Any) -> tuple[Any, Any, Any]:
    """(model_type, hidden size, layers) of a transformers config (a multimodal one's text model's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (config.model_type, getattr(text, "hidden_size", None), getattr(text, "num_hidden_layers", None))


def _same_model(folder: str, model: str) -> None:
    """A full checkpoint's ``config.json`` must describe the ``--model`` given now: another one fails deep in
    loading the weights (or, of the same shape, trains on silently from the wrong start)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return
    from transformers import AutoConfig

    try:
        saved = _describe(AutoConfig.from_pretrained(folder))
    except (OSError, ValueError, KeyError):
        return  # Trainer will say what is wrong with it
    given = _describe(_model_config(model))
    if saved != given:
        raise UsageError(f"--resume_from_checkpoint {folder} holds a {_shape_words(saved)} model (config.json), but "
                         f"--model {model} is a {_shape_words(given)} one; pass the --model it was trained from")


def _shape_words(shape: tuple[Any, Any, Any]) -> str:
    return f"{shape[0]} (hidden size {shape[1]}, {shape[2]} layers)"


def _meta_model(config: Any) -> Any:
    """The model of ``config`` on the meta device: its module tree and shapes, no memory, no weights read."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _lora_targets(model: Any, targets: Any) -> set[str]:
    """The modules PEFT puts adapters on for ``target_modules``: ``all-linear`` (every linear layer but the output
    head), a regex (full match), or names that equal a module's qualified name or end it after a dot."""
    import torch
    from transformers.pytorch_utils import Conv1D

    names = dict(model.named_modules())
    if targets == "all-linear":
        head = model.get_output_embeddings()
        return {n for n, m in names.items() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}
    if isinstance(targets, str):
        return {n for n in names if re.fullmatch(targets, n)}
    return {n for n in names if any(n == t or n.endswith("." + t) for t in targets)}


def _same_lora_model(folder: str, model_args: ModelArguments, saved_targets: Any) -> None:
    """A LoRA checkpoint has no config.json: its adapter's modules and shapes (the safetensors header, no tensor
    read) must exist in ``--model``, and ``--lora_target_modules`` must pick the modules it was trained on (else
    Trainer fails loading the optimizer state, with a traceback)."""
    config = _model_config(model_args.model)
    try:
        model = _meta_model(config)
    except Exception:  # a model transformers cannot build from its config alone: loading will say what is wrong
        return
    modules = dict(model.named_modules())
    weights = os.path.join(folder, "adapter_model.safetensors")
    trained: set[str] = set()
    if os.path.isfile(weights):
        from safetensors import safe_open

        with safe_open(weights, framework="pt") as f:
            shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
        for key, shape in shapes.items():
            match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight", key)
            if match is None:
                continue
            name, part = match.groups()
            module = modules.get(name)
            trained.add(name)
            want = None if module is None else getattr(module, "in_features" if part == "A" else "out_features", None)
            got = shape[1] if part == "A" else shape[0]
            if module is None or (want is not None and want != got):
                found = "no such module" if module is None else f"{want} features, the adapter {got}"
                raise UsageError(f"--resume_from_checkpoint {folder} holds a LoRA adapter of another model ({name}: "
                                 f"{found} in --model {model_args.model}); pass the --model it was trained from")
    flag = model_args.lora_target_modules
    wanted = _lora_targets(model, flag if flag == "all-linear" else [t.strip() for t in flag.split(",") if t.strip()])
    if saved_targets is not None:
        trained = _lora_targets(model, saved_targets)
    if trained and wanted != trained:
        leaves = ",".join(sorted({n.rsplit(".", 1)[-1] for n in trained}))
        fix = "all-linear" if trained == _lora_targets(model, "all-linear") else leaves
        raise UsageError(f"--resume_from_checkpoint {folder} holds LoRA adapters on {leaves} (adapter_config.json "
                         f"target_modules), not on what --lora_target_modules {flag} picks; pass "
                         f"--lora_target_modules {fix}")
