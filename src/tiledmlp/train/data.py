"""Training data for ``tiledmlp train``: raw text from a local file or the standard library, packed into
``max_seq_length``-token causal-LM sequences with ``datasets``.

Packing (documents joined with the eos token, cut into equal blocks) is what long-sequence fine-tuning does, and it
makes every step the same length, so per-step memory and tokens/s are comparable.
"""

from __future__ import annotations

import os
from typing import Any

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk

from .args import UsageError, hub_dataset_id

__all__ = ["load_raw_text", "pack", "pydoc_documents"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text", ".parquet": "parquet",
             ".csv": "csv"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # datasets reads these transparently: data.jsonl.gz is JSON lines


def _builder(path: str) -> str | None:
    stem, ext = os.path.splitext(path.lower())
    if ext in _COMPRESSED:
        ext = os.path.splitext(stem)[1]
    return _BUILDERS.get(ext)


def _saved_with_save_to_disk(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("dataset_dict.json", "state.json"))


def pydoc_documents(doc_chars: int = 40_000) -> list[str]:
    """Real English with no download: the Python reference topics shipped in ``pydoc_data``, grouped in sorted
    order into documents of about ``doc_chars`` characters (long documents are what tiling is for)."""
    from pydoc_data.topics import topics

    docs: list[str] = []
    current: list[str] = []
    size = 0
    for key in sorted(topics):
        text = topics[key].strip()
        current.append(text)
        size += len(text)
        if size >= doc_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs


def load_raw_text(path: str | None, text_field: str, flag: str = "--dataset", config: str | None = None,
                  split: str = "train") -> Dataset:
    """A one-column ``datasets.Dataset`` named ``text_field``, from a local file or folder or (``config``,
    ``split``) a Hub dataset id; raises :class:`UsageError` naming ``flag`` if it cannot be read or lacks the
    column."""
    if path is None:
        return Dataset.from_dict({text_field: pydoc_documents()})
    try:
        if os.path.isdir(path) and _saved_with_save_to_disk(path):
            data: Any = load_from_disk(path)
        elif os.path.isdir(path) or hub_dataset_id(path):  # a folder of data files, or a Hub dataset
            data = load_dataset(path, name=config, split=split)
        else:
            builder = _builder(path)
            if builder is None:
                raise UsageError(f"{flag} {path}: unsupported file type (use .jsonl, .json, .txt, .parquet, "
                                 ".csv, optionally .gz/.bz2/.xz/.zst-compressed, a folder of them, a "
                                 "datasets.save_to_disk folder or a Hub dataset id)")
            data = load_dataset(builder, data_files=path, split="train")
    except UsageError:
        raise
    except Exception as exc:  # datasets raises many types for unreadable files; all are bad input here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{flag} {path}: cannot read it: {first}") from exc
    if isinstance(data, DatasetDict):  # from save_to_disk: the asked split, else its only one
        if split in data:
            data = data[split]
        elif len(data) == 1:
            data = next(iter(data.values()))
        else:
            raise UsageError(f"{flag} {path} has no split {split!r} (splits: {', '.join(data)}); pass "
                             f"{'--eval_split' if flag == '--eval_dataset' else '--dataset_split'} NAME")
    if text_field not in data.column_names:
        raise UsageError(f"{flag} {path} has no text field {text_field!r} (columns: "
                         f"{', '.join(data.column_names) or 'none'}); pass --text_field NAME")
    if len(data) == 0:
        raise UsageError(f"{flag} {path} is empty")
    kind = _field_kind(data.features[text_field])
    if kind is None:
        raise UsageError(f"{flag} {path}: field {text_field!r} holds {data.features[text_field]}, neither text nor "
                         "chat messages (a list of role/content records); pass --text_field naming a text column")
    return data.select_columns([text_field])


def _field_kind(feature: Any) -> str | None:
    """``"text"`` for a string column, ``"chat"`` for lists of ``{role, content}`` records, None otherwise."""
    from datasets import Value

    if isinstance(feature, Value):
        return "text" if feature.dtype in ("string", "large_string") else None
    # a list feature: datasets 4+ List/LargeList(...), 3.x Sequence(...) or a plain [record] list
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    if isinstance(inner, dict) and {"role", "content"} <= set(inner):
        return "chat"
    return None


def pack(raw: Dataset, tokenizer: Any, text_field: str, max_seq_length: int, min_sequences: int = 1,
         flag: str = "--dataset") -> Dataset:
    """Tokenize, join documents with eos and cut into ``max_seq_length`` blocks (``labels`` = ``input_ids``);
    a chat-messages column is rendered with the tokenizer's chat template first.

    Uses ``Dataset.map`` (batched, Arrow-backed), so large local datasets never sit in Python lists. Each map
    batch of documents drops its short tail. If the text yields fewer than ``min_sequences`` blocks, the
    tokenized documents are repeated, so a small corpus still fills the requested steps; ``min_sequences=0``
    (evaluation: repeated text would be scored twice) refuses text shorter than one block instead.
    """
    eos = tokenizer.eos_token_id
    chat = _field_kind(raw.features[text_field]) == "chat"
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{flag}: field {text_field!r} holds chat messages, but the model's tokenizer has no chat "
                         "template to render them with; use a chat model or a text column")

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        if chat:  # each conversation rendered by the model's own template, every token trained on
            texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch[text_field] if m]
        else:
            texts = [t for t in batch[text_field] if t]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return {"input_ids": [x + [eos] for x in ids]}

    def group(batch: dict[str, list]) -> dict[str, list]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        blocks = [flat[i:i + max_seq_length] for i in range(0, len(flat) - max_seq_length + 1, max_seq_length)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokens = raw.map(tokenize, batched=True, remove_columns=raw.column_names, desc="tokenizing")
    total = sum(len(ids) for ids in tokens["input_ids"])
    if total < 2:
        raise UsageError(f"{flag}: the {text_field!r} field holds no text")
    if min_sequences == 0 and total < max_seq_length:
        raise UsageError(f"{flag} holds {total} tokens, fewer than one --max_seq_length {max_seq_length} sequence; "
                         "give it more text or lower --max_seq_length")
    needed = max(min_sequences, 1) * max_seq_length
    if total < needed:
        tokens = concatenate_datasets([tokens] * (needed // total + 1))
    batch_size = max(1, len(tokens)) if total < 4 * needed else 1000
    blocks = tokens.map(group, batched=True, batch_size=batch_size, desc="packing")
    if len(blocks) == 0:
        raise UsageError(f"{flag}: no {max_seq_length}-token sequence could be packed from it; lower "
                         "--max_seq_length")
    return blocks
