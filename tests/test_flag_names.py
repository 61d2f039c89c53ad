"""Flag names users bring from Hugging Face's example scripts and TRL: aliases of train's and plan's options, and
unknown or ambiguous flags refused in one line naming the option meant (parsing only: nothing loads or trains)."""

from __future__ import annotations

import json

import pytest

from tiledmlp.plan.cli import _parse as parse_plan
from tiledmlp.plan.cli import main as plan_main
from tiledmlp.train.args import UsageError, parse_args
from tiledmlp.train.flags import aliases

TINY = ["--model", "tiny-llama", "--max_steps", "1"]


def _data(tmp_path) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"body": "some text"}) + "\n")
    return str(path)


def test_other_tools_names_set_the_same_options_as_ours(tmp_path) -> None:
    data = _data(tmp_path)
    ours = parse_args(["--model", "tiny-llama", "--dtype", "bfloat16", "--dataset", data, "--dataset_config", "c",
                       "--dataset_split", "train[:50%]", "--text_field", "body", "--max_seq_length", "64",
                       "--output_dir", str(tmp_path / "o")])
    for theirs in (
        ["--model_name_or_path", "tiny-llama", "--torch_dtype", "bfloat16", "--dataset_name", data,
         "--dataset_config_name", "c", "--dataset_train_split", "train[:50%]", "--dataset_text_field", "body",
         "--max_length", "64"],
        ["--model-name-or-path", "tiny-llama", "--torch-dtype", "bfloat16", "--dataset-name", data,
         "--dataset-config-name", "c", "--dataset-train-split", "train[:50%]", "--dataset-text-field", "body",
         "--block_size", "64"],
    ):
        got = parse_args([*theirs, "--output_dir", str(tmp_path / "o")])
        assert got[:3] == ours[:3]
    assert parse_args(["--model_name_or_path", "tiny-llama", "--model", "smollm2-135m"])[0].model == "smollm2-135m"


def test_an_alias_never_shadows_a_trainer_option() -> None:
    """A transformers that adds one of these names to TrainingArguments keeps its own option."""
    assert aliases("output_dir", "learning_rate") == {"aliases": []}
    assert aliases("max_length") == {"aliases": ["--max_length", "--max-length"]}


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "2", "--use_peft", "--foo=3"],
     "unknown flags --epochs (did you mean --num_train_epochs?), --use_peft (did you mean --lora_r? A rank above 0 "
     "trains LoRA adapters), --foo; tiledmlp train --help lists the flags"),
    (["--batch-size", "2"], "unknown flag --batch-size (did you mean --per_device_train_batch_size?)"),
    (["--max_lenght", "64"], "unknown flag --max_lenght (did you mean --max_seq_length?)"),  # an alias, misspelt
    (["--base_model", "x", "--sequence_len", "8"],
     "--base_model (did you mean --model?), --sequence_len (did you mean --max_seq_length?)"),  # Axolotl's keys
    (["stray"], "unexpected value 'stray': each value follows its flag (--flag value or --flag=value)"),
    (["--lr", "1e-3"], "ambiguous option: --lr could match --lr_scheduler_type"),
    (["--load_in_8bit", "true"], "unknown flag --load_in_8bit (did you mean --load_in_4bit? An 8-bit base is not "
     "supported: on CUDA LLM.int8() picks its outlier columns from all the tokens of each call, so a tile's would "
     "differ from the untiled step's)"),  # TRL's flag
])
def test_unknown_flags_are_named_with_the_option_meant(flags: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError) as info:
        parse_args([*TINY, *flags])
    assert message in str(info.value) and "\n" not in str(info.value)
    if flags[0] == "--lr":  # not argparse's usage (a hundred lines) and exit
        assert str(info.value).endswith("(did you mean --learning_rate?)")
        assert capsys.readouterr().err == ""


def test_config_keys_take_aliases_and_dashes_and_name_unknown_ones(tmp_path) -> None:
    def config(text: str) -> list[str]:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return ["--config", str(path)]

    got = parse_args(config("model_name_or_path: tiny-llama\nmax-length: 96\nmax_steps: 1\n"))
    assert (got[0].model, got[1].max_seq_length) == ("tiny-llama", 96)
    with pytest.raises(UsageError, match=r"c.yaml: model_name_or_path and model set the same option; keep one"):
        parse_args(config("model_name_or_path: tiny-llama\nmodel: smollm2-135m\n"))
    with pytest.raises(UsageError, match=r"c.yaml: unknown options: epochs \(did you mean num_train_epochs\?\), "
                                         r"zzz$"):
        parse_args(config("epochs: 2\nzzz: 1\n"))


def test_plan_takes_trains_names_and_refuses_others_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A train command line's length and model name carry over to plan; a flag that does not change the step's
    memory is named (plan has no option it could mean)."""
    args = parse_plan(["--model_name_or_path", "tiny-llama", "--max_seq_length", "1024"])
    assert (args.model, args.seqs()) == ("tiny-llama", [1024])
    assert plan_main(["--model", "tiny-llama", "--learning_rate", "1e-5"]) == 2
    assert capsys.readouterr().err == ("tiledmlp plan: error: unknown flag --learning_rate; tiledmlp plan --help "
                                       "lists the flags\n")
    assert plan_main(["--model", "tiny-llama", "--lora", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiledmlp plan: error: ambiguous option: --lora could match") and err.count("\n") == 1


def test_config_without_its_file_is_one_line_in_train_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse printed ``usage: tiledmlp [--config CONFIG]`` (neither command's name) and exited."""
    with pytest.raises(UsageError, match=r"^--config needs the file: --config FILE"):
        parse_args(["--model", "tiny-llama", "--config"])
    assert plan_main(["--config"]) == 2
    assert capsys.readouterr().err.startswith("tiledmlp plan: error: --config needs the file: --config FILE")


def test_dtype_auto_is_the_dtype_the_models_config_names(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """run_clm's ``--torch_dtype auto``: resolved from the config before anything loads, so every check (fp16 with
    Adam, autocast over float32) sees the dtype the run loads; float32 where the config names none."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1, vocab_size=100,
                dtype="bfloat16").save_pretrained(tmp_path)
    assert parse_args(["--model_name_or_path", str(tmp_path), "--torch_dtype", "auto"])[0].dtype == "bfloat16"
    assert parse_args(["--model", "tiny-llama", "--dtype", "auto"])[0].dtype == "float32"
    plans = []
    for dtype in ("auto", "bfloat16"):
        assert plan_main(["--model", str(tmp_path), "--dtype", dtype, "--seq", "1024", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out)["recipes"])
    assert plans[0] == plans[1]


def test_a_bad_value_names_its_option_once() -> None:
    """argparse joins every name of the option (``--max_seq_length/--max-seq-length/--max_length/...``)."""
    with pytest.raises(UsageError, match=r"^argument --max_seq_length: invalid int value: '3.5'$"):
        parse_args([*TINY, "--max_length", "3.5"])
