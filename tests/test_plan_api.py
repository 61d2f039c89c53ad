"""The plan's Python API on its own (no measurement): bad arguments refused by name, and the attention split it
models under split layers and Ulysses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from tiledmlp.plan import ModelShape, Setup, predict_loss_peak, predict_step_peak
from tiledmlp.train.models import tiny_llama_config


@pytest.mark.parametrize("attn, sp, kv, groups_of", [("sdpa", 1, 8, (32, 8)), ("sdpa", 2, 8, (16, 4)),
                                                     ("sdpa", 8, 4, (4, 1)), ("eager", 1, 8, None),
                                                     ("flash_attention_2", 2, 8, None)])
def test_split_attention_planned_per_rank_head_groups(monkeypatch: pytest.MonkeyPatch, attn: str, sp: int, kv: int,
                                                      groups_of: tuple[int, int] | None) -> None:
    """Split layers run sdpa (and only sdpa) per KV-head group of the heads one rank holds: under Ulysses, heads / sp
    query heads and kv / sp key/value heads (one where kv < sp, replicated); the plan splits the same way."""
    import tiledmlp.plan.model as plan_model

    seen: list[tuple[int, int]] = []
    real = plan_model.head_groups
    monkeypatch.setattr(plan_model, "head_groups", lambda q, k, t: seen.append((q, k)) or real(q, k, t))
    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=kv, vocab_size=128256)
    setup = Setup(dtype=torch.bfloat16, checkpointing=True, offload=True, split_layers=True, tiled_mlp=True,
                  tiled_loss=True, sequence_parallel_size=sp, world_size=sp, zero_stage=3 if sp > 1 else 0)
    shape = dataclasses.replace(ModelShape.from_config(cfg, "llama"), attn_impl=attn)
    predict_step_peak(shape, setup, 1 << 16)
    assert set(seen) == ({groups_of} if groups_of else set())


@pytest.mark.parametrize("call, error, message", [
    ("predict_step_peak(shape, Setup(), 0)", ValueError, "seq must be an int >= 1, got 0"),
    ("predict_step_peak(shape, Setup(), -4)", ValueError, "seq must be an int >= 1, got -4"),
    ("predict_step_peak(shape, Setup(), '128')", TypeError, "seq must be an int >= 1, got str '128'"),
    ("predict_step_peak(shape, Setup(), 128, batch=0)", ValueError, "batch must be an int >= 1, got 0"),
    ("Setup(dtype=torch.int8)", ValueError, "Setup.dtype must be one of torch.float32, torch.bfloat16"),
    ("Setup(sequence_parallel_size=0)", ValueError, "Setup.sequence_parallel_size must be an int >= 1"),
    ("Setup(accumulate='fp32')", ValueError, "Setup.accumulate must be 'auto' or 'param'"),
    ("Setup(lora_r=8, lora_dropout=1.5)", ValueError, "Setup.lora_dropout must be a number in [0, 1)"),
    ("Setup(device_type='tpu')", ValueError, "Setup.device_type must be a device type torch knows"),
    ("Setup(device_type='cuda:0')", ValueError, "(no index), got 'cuda:0'"),
    ("Setup(mlp_num_shards=0)", ValueError, "Setup.mlp_num_shards: num_shards must be >= 1"),
    ("Setup(dtype=torch.bfloat16, autocast=True)", ValueError, "autocasts float32 weights"),
    ("Setup(mlp_target_gb=True)", ValueError, "Setup.mlp_target_gb must be None or a finite number > 0"),
    ("Setup(mlp_target_gb=float('inf'))", ValueError, "Setup.mlp_target_gb must be None or a finite number > 0"),
    ("predict_loss_peak(0, 64, 128)", ValueError, "tokens must be an int >= 1, got 0"),
    ("predict_loss_peak(100, 64, 128, accumulate='x')", ValueError, "accumulate must be 'auto' or 'param'"),
])
def test_plan_api_refuses_bad_input_by_name(call: str, error: type, message: str) -> None:
    """The Python API names a bad argument and what it takes, where it planned 0 or negative tokens, an unknown
    accumulate or device silently, or failed with a KeyError, ZeroDivisionError or a formatting TypeError."""
    scope = dict(shape=ModelShape.from_config(tiny_llama_config()), Setup=Setup, torch=torch,
                 predict_step_peak=predict_step_peak, predict_loss_peak=predict_loss_peak)
    with pytest.raises(error) as info:
        eval(call, scope)
    assert message in str(info.value)


def test_lora_dropout_is_planned_by_device(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tiledmlp plan --lora_dropout` counts the masks each adapter saves (since 2026-11-26; before, it named them
    as left out): a float32 noise tensor per adapter input on CPU, a bool mask on CUDA, so dropout costs more on
    CPU; a dropout outside [0, 1) is refused."""
    import json

    from tiledmlp.plan.cli import main

    tiny_llama_config().save_pretrained(tmp_path)
    flags = ["--model", str(tmp_path), "--seq", "4096", "--lora_r", "8", "--json"]
    peaks = {}
    for device in ("cpu", "cuda"):
        for dropout in ("0", "0.05"):
            assert main([*flags, "--device", device, "--lora_dropout", dropout]) == 0
            out = json.loads(capsys.readouterr().out)
            assert "dropout" not in out["assumptions"]["excluded"]
            peaks[device, dropout] = out["recipes"]["untiled"]["peak_bytes"]["4096"]
    cpu, cuda = (peaks[d, "0.05"] - peaks[d, "0"] for d in ("cpu", "cuda"))
    assert cpu > cuda > 0
    assert main([*flags, "--lora_dropout", "1.5"]) == 2
    assert "--lora_dropout must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_the_command_plans_for_every_device_type_the_api_does(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tiledmlp plan --device`` took cuda or cpu only, where ``Setup(device_type=)`` plans XPU and MPS too (XPU's
    compiled tile kernels, MPS's memory shared with the host, where offloading moves nothing); any other name is
    one error line naming the four."""
    import json

    from tiledmlp.plan.cli import main

    tiny_llama_config().save_pretrained(tmp_path)
    offloaded = {}
    for device in ("xpu", "mps"):  # cuda and cpu: every other test of the command
        assert main(["--model", str(tmp_path), "--seq", "65536", "--device", device, "--json"]) == 0
        recipes = json.loads(capsys.readouterr().out)["recipes"]
        peak = {name: recipe["peak_bytes"]["65536"] for name, recipe in recipes.items()}
        offloaded[device] = peak["+ split layers"] < peak["tiled MLP + loss"]
    assert offloaded == {"xpu": True, "mps": False}
    assert main(["--model", str(tmp_path), "--device", "tpu"]) == 2
    assert "--device must be one of cuda, xpu, cpu, mps, got 'tpu'" in capsys.readouterr().err


def test_plan_config_plans_the_train_run_the_file_describes(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tiledmlp plan --config train.yaml``: the options that change a step's memory, with train's defaults where
    the file is silent (float32 weights, no checkpointing, 4096 tokens), a DeepSpeed file's ZeRO stage; learning
    rates and the like left aside; flags given beside it win; its keys checked as train checks them."""
    import json

    from tiledmlp.plan.cli import main

    def planned(argv: list[str]) -> dict:  # a small device: a shorter search for the longest sequence
        assert main([*argv, "--device_memory_gb", "0.2", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["recipes"]

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    run = tmp_path / "run.yaml"
    run.write_text("model_name_or_path: tiny-llama\nmax-seq-length: 2048\nbf16: true\nlora_r: 8\nlora_dropout: 0.1\n"
                   "gradient_checkpointing: true\nper_device_train_batch_size: 2\nlearning_rate: 1.0e-4\n"
                   "deepspeed: ds.json\nlogging_steps: 5\n")
    flags = ["--model", "tiny-llama", "--dtype", "float32", "--bf16", "true", "--lora_r", "8", "--lora_dropout",
             "0.1", "--activation_checkpointing", "true", "--per_device_train_batch_size", "2", "--zero_stage", "2"]
    assert planned(["--config", str(run)]) == planned([*flags, "--seq", "2048"])
    assert planned(["--config", str(run), "--seq", "1024", "--zero_stage", "0"]) == \
        planned([*flags, "--seq", "1024", "--zero_stage", "0"])
    silent = tmp_path / "silent.yaml"
    silent.write_text("model: tiny-llama\n")
    assert planned(["--config", str(silent)]) == planned(["--model", "tiny-llama", "--dtype", "float32",
                                                         "--activation_checkpointing", "false", "--seq", "4096"])
    bad = tmp_path / "bad.yaml"
    for text, message in (("lr: 1\n", "bad.yaml: unknown option: lr (did you mean learning_rate?)"),
                          ("deepspeed: missing.json\n", "bad.yaml: deepspeed: cannot read"),
                          ('deepspeed: {"zero_optimization": {"stage": "x"}}\n', "stage must be 0-3, got 'x'")):
        bad.write_text(text)
        assert main(["--config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_plan_takes_trains_tile_options(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--tiled_mlp_num_shards`` and ``--tiled_mlp_target_gb``, as train's (and in a ``--config`` file): the tiled
    recipes tile so, as ``Setup(mlp_num_shards=, mlp_target_gb=)`` plans them; the untiled row is unchanged."""
    import json

    from tiledmlp.plan.cli import main

    tf.LlamaConfig(hidden_size=64, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=128).save_pretrained(tmp_path)
    shape = ModelShape.from_config(tf.AutoConfig.from_pretrained(tmp_path))

    def rows(*flags: str) -> dict[str, int]:
        assert main(["--model", str(tmp_path), "--seq", "4096", "--device_memory_gb", "0.2", *flags, "--json"]) == 0
        return {k: v["peak_bytes"]["4096"] for k, v in json.loads(capsys.readouterr().out)["recipes"].items()}

    auto, one, target = rows(), rows("--tiled_mlp_num_shards", "1"), rows("--tiled_mlp_target_gb", "0.001")
    setup = Setup(dtype=torch.bfloat16, checkpointing=True, tiled_mlp=True, tiled_loss=True)
    for got, options in ((auto, {}), (one, {"mlp_num_shards": 1}), (target, {"mlp_target_gb": 0.001})):
        assert got["tiled MLP + loss"] == predict_step_peak(shape, dataclasses.replace(setup, **options),
                                                            4096).peak_bytes
    assert one["tiled MLP + loss"] > auto["tiled MLP + loss"] and one["untiled"] == auto["untiled"]
    (tmp_path / "run.yaml").write_text(f"model: {tmp_path}\nmax_seq_length: 4096\ntiled_mlp_num_shards: 1\n"
                                       "activation_checkpointing: true\ndtype: bfloat16\n")
    assert rows("--config", str(tmp_path / "run.yaml")) == one


@pytest.mark.parametrize("text, row", [("", "tiled MLP + loss"), ("activation_offloading: true\n", "+ offload"),
                                       ("activation_offloading: true\nactivation_offloading_split_layers: true\n",
                                        "+ split layers"),
                                       ("use_tiled_mlp: false\nuse_tiled_loss: false\n", "untiled"),
                                       ("use_tiled_loss: false\n", "tiled MLP"),
                                       ("use_tiled_mlp: false\n", None)])  # a tiled loss over untiled MLPs: no row
def test_plan_config_marks_the_row_of_the_files_run(tmp_path, capsys: pytest.CaptureFixture[str], text: str,
                                                    row: str | None) -> None:
    import json

    from tiledmlp.plan.cli import main

    (tmp_path / "run.yaml").write_text("model: tiny-llama\n" + text)
    argv = ["--config", str(tmp_path / "run.yaml"), "--seq", "1024", "--device_memory_gb", "0.2"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out).get("this_run") == row
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert (f"{row} *" in table and f"*: the --config file's run ({row})" in table) if row else "*" not in table


@pytest.mark.parametrize("text, flags, notes", [
    ("deepspeed: {zero_optimization: {stage: 3}}\n", [], ["the file's ZeRO stage shards", "pass --world_size N"]),
    ("deepspeed: {zero_optimization: {stage: 3}}\n", ["--world_size", "4"], []),
    ("deepspeed: {zero_optimization: {stage: 0}}\n", [], []),
    ("fsdp: full_shard auto_wrap\n", [], ["the file's fsdp (full_shard auto_wrap) shards", "pass --world_size N"]),
    ("fsdp: [shard_grad_op]\n", [], ["the file's fsdp (shard_grad_op) shards", "pass --world_size N"]),
    ("fsdp: full_shard\n", ["--world_size", "8"], []),
    ("fsdp: no_shard\n", [], []),
    ("", [], []),
])
def test_plan_config_says_what_the_file_leaves_to_the_launcher(tmp_path, capsys: pytest.CaptureFixture[str],
                                                               text: str, flags: list[str], notes: list[str]) -> None:
    """A ZeRO or FSDP run shards over the ranks the launcher starts (the file does not say how many: planned for
    one): said in the table's caption and the JSON."""
    import json

    from tiledmlp.plan.cli import main

    (tmp_path / "run.yaml").write_text("model: tiny-llama\n" + text)
    argv = ["--config", str(tmp_path / "run.yaml"), "--seq", "1024", *flags]
    assert main([*argv, "--json"]) == 0
    said = json.loads(capsys.readouterr().out).get("config_notes", [])
    assert len(said) == min(1, len(notes)) and all(n in said[0] for n in notes)
    if said:
        assert main(argv) == 0
        table = " ".join(capsys.readouterr().out.split())
        assert " ".join(f"note: {said[0]}".split()) in table


def test_fsdp_setups_shard_as_trainer_names_them() -> None:
    """Trainer's --fsdp spellings map to the plan's two strategies; per rank, FSDP shards weights, grads and states
    without ZeRO's float32 master weights, and shard_grad_op holds every layer gathered where full_shard holds two
    (the measured side: tests/distributed/test_plan_fsdp.py)."""
    from tiledmlp.plan.sharding import fsdp_mode

    # auto_wrap alone: Trainer's reshard_after_forward defaults to true (until 2026-11-27 planned unsharded)
    assert [fsdp_mode(v) for v in ("full_shard auto_wrap", ["shard_grad_op", "auto_wrap"], True, False, "no_shard",
                                   "", "auto_wrap", ["auto_wrap"])] == ["full_shard", "shard_grad_op", "full_shard",
                                                                        "", "", "", "full_shard", "full_shard"]
    config = tiny_llama_config()
    config.num_hidden_layers = 8  # more layers than the two full_shard holds gathered
    shape = ModelShape.from_config(config)
    base = Setup(dtype=torch.bfloat16, tiled_mlp=True, tiled_loss=True, checkpointing=True, world_size=8)
    full, grad_op = (predict_step_peak(shape, dataclasses.replace(base, fsdp=f), 256)
                     for f in ("full_shard", "shard_grad_op"))
    zero3 = predict_step_peak(shape, dataclasses.replace(base, zero_stage=3), 256)
    one = predict_step_peak(shape, dataclasses.replace(base, world_size=1), 256)
    assert full.peak_bytes < one.peak_bytes and full.peak_bytes < grad_op.peak_bytes
    w = 2 * shape.num_params
    assert zero3.terms["weights"] == full.terms["weights"] == w // 8
    # AdamW's two bf16 states, sharded; ZeRO's are float32, beside its float32 master weights (DeepSpeed steps a
    # float32 copy of the partition: tests/distributed/test_plan_zero.py)
    assert full.terms["optimizer_states"] == 2 * w // 8 and zero3.terms["optimizer_states"] == 3 * 2 * w // 8
    assert grad_op.terms["fsdp_gathered"] == w > full.terms["fsdp_gathered"]
    # --bf16 over float32 weights: the bf16 step (no autocast copies of the weights) over float32 shards and states
    mixed = predict_step_peak(shape, dataclasses.replace(base, dtype=torch.float32, autocast=True, fsdp="full_shard"),
                              256)
    assert "autocast_weight_copies" not in mixed.terms and mixed.terms["weights"] == 2 * full.terms["weights"]
    assert mixed.terms["optimizer_states"] == 2 * full.terms["optimizer_states"]
    assert mixed.terms["fsdp_gathered"] == full.terms["fsdp_gathered"]  # gathered in bf16
    with pytest.raises(ValueError, match="one of FSDP and DeepSpeed ZeRO"):
        Setup(fsdp="full_shard", zero_stage=2)
    with pytest.raises(ValueError, match="Setup.fsdp must be one of"):
        Setup(fsdp="hybrid_shard")


@pytest.mark.parametrize("text, fsdp_config, planned", [
    ("fsdp: full_shard auto_wrap\n", None, "full_shard auto_wrap"),
    ("fsdp: true\nfsdp_config: fsdp.json\n", {"fsdp_version": 2, "reshard_after_forward": False}, "shard_grad_op"),
    ("fsdp: true\nfsdp_config: fsdp.json\n", {"fsdp_cpu_offload": True}, None),
])
def test_plan_config_reads_fsdp_as_train_does(tmp_path, capsys: pytest.CaptureFixture[str], text: str,
                                              fsdp_config: dict | None, planned: str | None) -> None:
    """A config file's FSDP strategy is read where transformers reads it (the words, or ``fsdp_config``'s
    ``reshard_after_forward``, its file beside the config file), and CPU offload is refused by name."""
    import json

    from tiledmlp.plan.cli import main

    if fsdp_config is not None:
        (tmp_path / "fsdp.json").write_text(json.dumps(fsdp_config))
    (tmp_path / "run.yaml").write_text("model: tiny-llama\n" + text)
    argv = ["--config", str(tmp_path / "run.yaml"), "--seq", "1024", "--world_size", "4", "--json"]
    if planned is None:
        assert main(argv) == 2
        assert "FSDP's CPU offload of weights and optimizer states is not modelled" in capsys.readouterr().err
        return
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["assumptions"]["fsdp"] == planned and result["assumptions"]["world_size"] == 4


def test_plan_and_train_read_a_config_file_alike(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where plan and train had read one file two ways (2026-11-27): both checkpointing spellings in one file (plan
    took the old one's value, train the new one's) are refused by both as two keys for one option; a ZeRO stage
    written as a string that DeepSpeed and train read ("3") is planned, not refused; and ``--fsdp auto_wrap``, which
    Trainer runs fully sharded, is planned so (it was planned unsharded)."""
    import json

    from tiledmlp.plan.cli import main
    from tiledmlp.train.args import UsageError, parse_args

    both = tmp_path / "both.yaml"
    both.write_text("model: tiny-llama\nactivation_checkpointing: true\ngradient_checkpointing: false\n")
    assert main(["--config", str(both)]) == 2
    assert "activation_checkpointing and gradient_checkpointing set the same option; keep one" in \
        capsys.readouterr().err
    with pytest.raises(UsageError, match="activation_checkpointing and gradient_checkpointing set the same option"):
        parse_args(["--config", str(both), "--output_dir", str(tmp_path / "run")])
    # one option, whichever spelling: the command line's overrides the file's
    one = tmp_path / "one.yaml"
    one.write_text("model: tiny-llama\nactivation_checkpointing: true\n")
    train_args = parse_args(["--config", str(one), "--gradient_checkpointing", "false", "--output_dir",
                             str(tmp_path / "run")])[3]
    assert train_args.activation_checkpointing is False and train_args.gradient_checkpointing is False
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": "3"}}))
    (tmp_path / "ds.yaml").write_text("model: tiny-llama\ndeepspeed: ds.json\n")
    assert main(["--config", str(tmp_path / "ds.yaml"), "--world_size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["assumptions"]["zero_stage"] == 3
    peaks = []
    for fsdp in ("auto_wrap", "full_shard auto_wrap"):
        assert main(["--model", "tiny-llama", "--seq", "1024", "--world_size", "4", "--fsdp", fsdp, "--json"]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["recipes"]["untiled"]["peak_bytes"])
    assert peaks[0] == peaks[1]


def test_bf16_beside_a_zero_stage_is_planned_as_deepspeeds_bf16_model(tmp_path, capsys: pytest.CaptureFixture[str]
                                                                      ) -> None:
    """``--bf16`` with DeepSpeed: the engine casts the model to bf16 itself (no autocast; float32 master weights),
    so plan and train plan the run as ``--dtype bfloat16``; until 2026-11-29 as autocast over float32 weights (the
    examples' ZeRO-3 configs: float32 weights, ``bf16: true``). Without a ZeRO stage ``--bf16`` stays autocast."""
    import json

    from tiledmlp.plan.cli import main
    from tiledmlp.train.args import parse_args
    from tiledmlp.train.runner import prepare

    def planned(*flags: str) -> dict:
        assert main(["--model", "tiny-llama", "--seq", "1024", "--device_memory_gb", "0.2", "--json", *flags]) == 0
        return {name: row["peak_bytes"]["1024"] for name, row in json.loads(capsys.readouterr().out)["recipes"].items()}

    zero3 = ("--zero_stage", "3", "--world_size", "2")
    assert planned(*zero3, "--dtype", "float32", "--bf16", "true") == planned(*zero3, "--dtype", "bfloat16")
    assert planned("--dtype", "float32", "--bf16", "true") != planned("--dtype", "bfloat16")
    assert main(["--model", "tiny-llama", "--seq", "1024", *zero3, "--bf16", "true"]) == 0
    assert "bf16 (DeepSpeed casts the model)" in " ".join(capsys.readouterr().out.split())  # the title wraps
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    data = tmp_path / "d.txt"
    data.write_text("a page of long text " * 40)
    m, d, t, a = parse_args(["--model", "tiny-llama", "--max_seq_length", "64", "--dataset", str(data),
                             "--deepspeed", str(ds), "--output_dir", str(tmp_path / "out")])
    a.bf16 = True  # set after parsing, as test_the_plan_counts_either_16_bit_autocast: not a GPU here
    setup = prepare(m, d, t, a).plan_setup
    assert (setup.dtype, setup.autocast, setup.zero_stage) == (torch.bfloat16, False, 2)
