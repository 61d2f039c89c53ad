"""``tiledmlp train --sequence_parallel_size N``: bad input fails before training, as one line with exit 2.

Single-process and fast; the multi-process SP runs are in ``tests/distributed/test_sequence_parallel.py`` and
``tests/test_train_distributed.py``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tiledmlp.train.args import UsageError, parse_args
from tiledmlp.train.cli import main
from tiledmlp.train.models import load_model_and_tokenizer
from tiledmlp.train.sequence_parallel import check_args, check_model, collate_with_position_ids

TINY = ["--model", "tiny-llama", "--max_seq_length", "64", "--max_steps", "2", "--disable_tqdm", "true"]


def _ds_config(tmp_path: Path, stage: int = 1, **zero: object) -> str:
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, **zero}, "train_batch_size": "auto",
                                "train_micro_batch_size_per_gpu": "auto"}))
    return str(path)


@pytest.mark.parametrize("case", ["size", "no_deepspeed", "fsdp", "zero3_no_reduce_scatter", "attention",
                                  "seq_len", "world_size"])
def test_bad_sp_input_exits_2_with_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: every SP run here is mis-launched on purpose
    ds = ["--deepspeed", _ds_config(tmp_path)]
    flags = {"size": ["--sequence_parallel_size", "0"],
             "no_deepspeed": ["--sequence_parallel_size", "2"],
             "fsdp": [*ds, "--sequence_parallel_size", "2", "--fsdp", "full_shard"],
             "zero3_no_reduce_scatter": ["--deepspeed", _ds_config(tmp_path, 3, reduce_scatter=False),
                                         "--sequence_parallel_size", "2"],
             "attention": [*ds, "--sequence_parallel_size", "2", "--attn_implementation", "eager"],
             "seq_len": [*ds, "--sequence_parallel_size", "3"],
             "world_size": [*ds, "--sequence_parallel_size", "2"]}[case]
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main([*TINY, *flags, "--output_dir", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tiledmlp train:")]
    assert rc == 2 and len(err) == 1 and err[0].startswith("tiledmlp train: error: "), err
    expected = {"size": "must be >= 1", "no_deepspeed": "needs --deepspeed",
                "fsdp": "runs on DeepSpeed; drop --fsdp",
                "zero3_no_reduce_scatter": '"reduce_scatter": true',
                "attention": "--attn_implementation eager cannot run under --sequence_parallel_size",
                "seq_len": "--max_seq_length 64 is not divisible by --sequence_parallel_size 3",
                "world_size": "does not divide the 1 process(es) launched"}[case]
    assert expected in err[0], err
    assert not out.exists()
    gc.collect()  # drop the DeepSpeed config's global reference (a later model load must not see ZeRO-3)
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()


def test_world_size_is_checked_for_the_launch() -> None:
    _, d, _, train_args = parse_args(TINY)
    train_args.deepspeed = "ds.json"  # only its presence matters to this check
    check_args(2, 64, train_args, "sdpa", world_size=4)  # SP=2 x DP=2
    with pytest.raises(UsageError, match="does not divide the 3 process"):
        check_args(2, 64, train_args, None, world_size=3)


def _llama(heads: int, kv_heads: int, attn: str = "sdpa") -> torch.nn.Module:
    config = LlamaConfig(hidden_size=16 * heads, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=32,
                         attn_implementation=attn)
    return LlamaForCausalLM(config)


def test_model_checks_heads_kv_heads_and_attention() -> None:
    """Ulysses gives each rank heads / N query heads; kv heads are split or replicated by a whole factor."""
    model, _ = load_model_and_tokenizer("tiny-llama")  # 4 heads, 2 kv heads
    assert check_model(model, 2) == "sdpa" and check_model(model, 4) == "sdpa"  # SP 4 replicates the 2 kv heads
    with pytest.raises(UsageError, match="more SP ranks than the model's 4 attention heads"):
        check_model(model, 8)
    with pytest.raises(UsageError, match="does not divide the model's 4 attention heads"):
        check_model(model, 3)
    with pytest.raises(UsageError, match="6 key/value heads: one must divide the other"):
        check_model(_llama(12, 6), 4)
    with pytest.raises(UsageError, match="attention is 'eager'.*--attn_implementation sdpa"):
        check_model(_llama(4, 2, "eager"), 2)


def test_collator_adds_global_position_ids() -> None:
    batch = collate_with_position_ids([{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}] * 2)
    assert torch.equal(batch["position_ids"], torch.arange(4).expand(2, 4))
    assert batch["input_ids"].shape == batch["position_ids"].shape
