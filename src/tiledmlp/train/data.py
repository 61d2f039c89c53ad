"""Training data for ``tiledmlp train``: raw text from a local file or the standard library, packed into
``max_seq_length``-token causal-LM sequences with ``datasets``.

Packing (documents joined with the eos token, cut into equal blocks) is what long-sequence fine-tuning does, and it
makes every step the same length, so per-step memory and tokens/s are comparable.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from .args import UsageError, data_file_builder, hub_dataset_id

__all__ = ["load_raw_text", "pack", "pydoc_documents"]

# datasets' text builder reads a line per record by default; a text file is one document (its newlines kept, one
# eos at its end), as long-sequence training wants
_WHOLE_FILES = {"sample_by": "document"}


def _folder_of_text_files(folder: str) -> bool:
    files = [os.path.join(root, f) for root, _, names in os.walk(folder) for f in names if not f.startswith(".")]
    return bool(files) and all(data_file_builder(f) == "text" for f in files)


_DEFAULT_SPLIT = {"--dataset_split": "train", "--eval_split": "validation"}


def _one_file_split(path: str, flag: str, split: str) -> str:
    """``datasets`` reads one data file as the split ``train``: the flag's default name takes it, ``train`` and
    slices of it (``train[90%:]``, ``train[:100]``) go to ``load_dataset`` as they are, other names are refused."""
    split_flag = "--eval_split" if flag == "--eval_dataset" else "--dataset_split"
    if split == _DEFAULT_SPLIT[split_flag]:
        return "train"
    if re.fullmatch(r"train(\[[^\]]*\])?", split):
        return split
    raise UsageError(f"{flag} {path} is one file, read as the split train, so {split_flag} {split} names nothing in "
                     f"it; pass {split_flag} train or a slice of it such as train[90%:]")


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
        elif os.path.isdir(path):  # a folder of data files: all its splits, one picked below
            data = load_dataset(path, name=config, **(_WHOLE_FILES if _folder_of_text_files(path) else {}))
        elif hub_dataset_id(path):
            data = load_dataset(path, name=config, split=split)
        else:
            builder = data_file_builder(path)
            if builder is None:
                raise UsageError(f"{flag} {path}: unsupported file type (use .jsonl, .json, .txt, .parquet or "
                                 ".csv, all but .parquet also .gz/.bz2/.xz/.zst-compressed, a folder of them, "
                                 "a datasets.save_to_disk folder or a Hub dataset id)")
            if os.path.getsize(path) == 0:
                raise UsageError(f"{flag} {path} is empty")
            data = load_dataset(builder, data_files=path, split=_one_file_split(path, flag, split),
                                **(_WHOLE_FILES if builder == "text" else {}))
    except UsageError:
        raise
    except Exception as exc:  # datasets raises many types for unreadable files; all are bad input here
        if isinstance(exc, StopIteration) or "corresponds to no data" in str(exc):  # what datasets says of no records
            raise UsageError(f"{flag} {path} is empty") from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{flag} {path}: cannot read it: {first}") from exc
    if isinstance(data, DatasetDict):  # local: the asked split, else (the flag's default asked) its only one
        split_flag = "--eval_split" if flag == "--eval_dataset" else "--dataset_split"
        if split in data:
            data = data[split]
        elif len(data) == 1 and split == _DEFAULT_SPLIT[split_flag]:
            data = next(iter(data.values()))
        else:
            raise UsageError(f"{flag} {path} has no split {split!r} (splits: {', '.join(data)}; slices such as "
                             f"train[:5%] are for Hub ids); pass {split_flag} NAME")
    if text_field not in data.column_names:
        raise UsageError(f"{flag} {path} has no text field {text_field!r} (columns: "
                         f"{', '.join(data.column_names) or 'none'}); pass --text_field NAME")
    if len(data) == 0:
        raise UsageError(f"{flag} {path} is empty")
    kind = _field_kind(data.features[text_field])
    if kind == "json" and _json_messages(data, text_field):
        kind = "chat"
    if kind not in ("text", "chat"):
        raise UsageError(f"{flag} {path}: field {text_field!r} holds {data.features[text_field]}, neither text nor "
                         "chat messages (a list of role/content records); pass --text_field naming a text column")
    return data.select_columns([text_field])


_SAMPLE_ROWS = 100  # rows of a JSON-typed column looked at to tell chat messages from other JSON


def _json_messages(data: Dataset, text_field: str) -> bool:
    """Whether a column of lists of JSON values holds chat messages: its first non-empty rows are lists of records
    with a ``role``."""
    rows = [r for r in data.select(range(min(len(data), _SAMPLE_ROWS)))[text_field] if r]
    return bool(rows) and all(isinstance(m, dict) and "role" in m for row in rows for m in row)


def _field_kind(feature: Any) -> str | None:
    """``"text"`` for a string column, ``"chat"`` for lists of ``{role, content}`` records, ``"json"`` for lists
    of JSON values (datasets 5 reads messages whose records differ in their keys, e.g. a ``name`` or
    ``tool_calls`` in some, as JSON, not records: :func:`_json_messages` decides), None otherwise."""
    from datasets import Value

    if isinstance(feature, Value):
        return "text" if feature.dtype in ("string", "large_string") else None
    # a list feature: datasets 4+ List/LargeList(...), 3.x Sequence(...) or a plain [record] list
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    if isinstance(inner, dict) and {"role", "content"} <= set(inner):
        return "chat"
    return "json" if type(inner).__name__ == "Json" else None


def pack(raw: Dataset, tokenizer: Any, text_field: str, max_seq_length: int, min_sequences: int = 1,
         flag: str = "--dataset") -> Dataset:
    """Tokenize, join documents with eos and cut into ``max_seq_length`` blocks (``labels`` = ``input_ids``);
    a chat-messages column is rendered with the tokenizer's chat template first.

    Tokenizing is a batched ``Dataset.map`` (Arrow-backed, cached); the blocks are fixed-size views of the
    tokens' one flat Arrow array, so every token but the last short tail lands in a block, and no corpus sits in
    Python lists. If the text yields fewer than ``min_sequences`` blocks, the tokens are repeated, so a small
    corpus still fills the requested steps; ``min_sequences=0`` (evaluation: repeated text would be scored twice)
    refuses text shorter than one block instead.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    eos = tokenizer.eos_token_id
    eos_text = getattr(tokenizer, "eos_token", None)
    chat = _field_kind(raw.features[text_field]) in ("chat", "json")  # load_raw_text let JSON through as messages
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{flag}: field {text_field!r} holds chat messages, but the model's tokenizer has no chat "
                         "template to render them with; use a chat model or a text column")

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        if chat:  # each conversation rendered by the model's own template (its bos included), every token trained on
            texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch[text_field] if m]
        else:
            texts = [t for t in batch[text_field] if t]
        # plain text takes the tokenizer's own special tokens (a bos, for models that expect one), as run_clm does
        ids = tokenizer(texts, add_special_tokens=not chat)["input_ids"] if texts else []
        # ChatML templates end each turn with the eos and a newline: such a document has its eos already
        ended = [bool(eos_text) and t.rstrip().endswith(eos_text) for t in texts]
        return {"input_ids": [x if (x and x[-1] == eos) or end else x + [eos] for x, end in zip(ids, ended)]}

    tokens = raw.map(tokenize, batched=True, remove_columns=raw.column_names, desc="tokenizing")
    if 0 < len(tokens) < len(raw) and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"tiledmlp train: warning: {flag}: {len(raw) - len(tokens)} of {len(raw)} records have no "
              f"{'messages' if chat else 'text'} in {text_field!r} and are skipped", file=sys.stderr, flush=True)
    # records that all lack text leave no rows, and then no input_ids column either
    flat = (pc.list_flatten(tokens.data.table.column("input_ids")).combine_chunks() if len(tokens)
            else pa.array([], pa.int64()))
    total = len(flat)
    if total < 2:
        raise UsageError(f"{flag}: the {text_field!r} field holds no text")
    if min_sequences == 0 and total < max_seq_length:
        raise UsageError(f"{flag} holds {total} tokens, fewer than one --max_seq_length {max_seq_length} sequence; "
                         "give it more text or lower --max_seq_length")
    needed = max(min_sequences, 1) * max_seq_length
    if total < needed:
        flat = pa.concat_arrays([flat] * (needed // total + 1))
    count = len(flat) // max_seq_length
    blocks = pa.FixedSizeListArray.from_arrays(flat.slice(0, count * max_seq_length), max_seq_length)
    return Dataset(pa.table({"input_ids": blocks, "labels": blocks}))
