"""``tiledmlp bench`` end to end on a tiny shape, plus its option handling and the peer wrappers' correctness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import rel_err

from tiledmlp.bench.cli import CPU_SEQ_SCALE, SEEDS, UsageError, build_parser, main, out_note, resolve
from tiledmlp.bench.configs import LOW_ACC, Config, build_forward, build_mlp, predicted_bytes
from tiledmlp.cli import main as tiledmlp_main


def test_tiny_bench_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--hidden", "64", "--intermediate", "176", "--seq", "96,96", "--shards", "2,2",
            "--impls", "untiled,tiledmlp,liger", "--repeat", "1", "--threads", "1", "--clock", "cpu", "--no-progress",
            "--device", "cpu",
            "--out", str(out)]
    assert tiledmlp_main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"tiledmlp bench: writing {out / 'bench.json'}")  # said before the run
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"]
    assert [(r["seq"], r["impl"], r["shards"], r["tiles"]) for r in rows] == [(96, "untiled", "-", 1),
                                                                              (96, "tiledmlp", "2", 2)]
    untiled, tiled = rows
    assert untiled["time_ratio"] == 1.0 and untiled["mem_ratio"] == 1.0
    assert tiled["ms"] > 0 and tiled["time_ratio"] > 0
    for row in rows:  # the planner's column agrees with the measurement it is printed beside
        assert row["peak_bytes"] > 0 and row["rss_mib"] is not None
        assert abs(row["predicted_bytes"] - row["peak_bytes"]) <= 0.02 * row["peak_bytes"]
    assert any("liger skipped" in n for n in data["meta"]["notes"]) or _liger_importable()
    md = (out / "bench.md").read_text()
    assert "| seq | impl | shards | tiles | ms |" in md and "| 96 | tiledmlp | 2 | 2 |" in md
    assert md.count("\n| 96 |") == 2
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tiledmlp" in printed and "peak MiB" in printed
    assert data["meta"]["clock"] == "cpu" and "process CPU time" in md


TINY = ["--hidden", "64", "--intermediate", "176", "--impls", "tiledmlp", "--shards", "2", "--repeat", "1",
        "--threads", "1", "--no-progress", "--device", "cpu", "--no-rss"]


def test_a_failure_in_one_length_keeps_the_others_and_each_length_is_written_as_it_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's error of any kind (an ImportError from Triton, say) at one length is a note, not a lost table;
    a run stopped in its last length (a device call's time limit) leaves the lengths it finished on disk."""
    from tiledmlp.bench import cli

    real, calls = cli._time_seq, []

    def timing(cfgs, *args, **kwargs):
        calls.append(cfgs[0].seq)
        if cfgs[0].seq == 64:
            raise ImportError("cannot import name 'x' from 'triton'")
        if cfgs[0].seq == 128:
            raise KeyboardInterrupt
        return real(cfgs, *args, **kwargs)

    monkeypatch.setattr(cli, "_time_seq", timing)
    out = tmp_path / "bench"
    with pytest.raises(KeyboardInterrupt):
        main([*TINY, "--seq", "64,96,128", "--out", str(out)])
    assert calls == [64, 96, 128]
    data = json.loads((out / "bench.json").read_text())
    got = {(r["seq"], r["impl"]): r["ms"] for r in data["rows"]}
    assert set(got) == {(64, "tiledmlp"), (96, "tiledmlp")}
    assert got[(64, "tiledmlp")] is None and got[(96, "tiledmlp")] > 0
    assert "timing at seq 64 failed: cannot import name 'x' from 'triton'" in data["meta"]["notes"]


def test_a_length_skipped_last_is_noted_in_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator a length whose shared input cannot be made (out of memory, say) is skipped with a note.
    When it was the last length, the note reached the console only: the files kept the previous length's notes."""
    from tiledmlp.bench import cli

    real = cli._shared_inputs

    def inputs(cfg: Config, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor] | None:
        if cfg.seq == 96:
            raise MemoryError("out of memory making the input")
        return real(cfg, device)

    monkeypatch.setattr(cli, "_shared_inputs", inputs)
    out = tmp_path / "bench"
    assert main([*TINY, "--seq", "64,96", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert [r["seq"] for r in data["rows"]] == [64]
    assert "seq 96 skipped: out of memory making the input" in data["meta"]["notes"]
    assert "seq 96 skipped" in (out / "bench.md").read_text()


def test_the_in_process_measurement_matches_the_fresh_process_one() -> None:
    """What accelerators run (one shared MLP and input per length, measured in this process) gives the same peak
    as the CPU's fresh-process measurement of the same configuration."""
    from tiledmlp.bench import cli
    from tiledmlp.bench.configs import build_inputs

    for impl, shards in (("untiled", "1"), ("tiledmlp", "2")):
        cfg = Config("swiglu", 64, 176, 96, 1, "float32", impl, shards, "cpu")
        shared = cli._measure(cfg, torch.device("cpu"), rss=False, env={}, inputs=build_inputs(cfg))
        fresh = cli._measure(cfg, torch.device("cpu"), rss=False, env={}, inputs=None)
        assert shared["profiler_peak_bytes"] == fresh["profiler_peak_bytes"] > 0


def _liger_importable() -> bool:
    try:
        import liger_kernel  # noqa: F401
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def test_seeds_preset_scales_sequences_on_cpu_and_flags_override() -> None:
    args = build_parser().parse_args(["--preset", "seeds", "--impls", "untiled,tiledmlp"])
    settings, notes = resolve(args, torch.device("cpu"))
    assert (settings["hidden"], settings["intermediate"], settings["dtype"]) == (4096, 12288, "bfloat16")
    assert settings["seq"] == [s // CPU_SEQ_SCALE for s in SEEDS["seq"]] and settings["shards"] == ["4"]
    assert any("scaled down" in n for n in notes)
    cuda, cuda_notes = resolve(args, torch.device("cuda"))
    assert cuda["seq"] == SEEDS["seq"] and cuda["seq"][-1] == 131072 and not cuda_notes
    args = build_parser().parse_args(["--preset", "seeds", "--seq", "64", "--dtype", "float32"])
    settings, _ = resolve(args, torch.device("cpu"))
    assert settings["seq"] == [64] and settings["dtype"] == "float32" and settings["hidden"] == 4096


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="--shards takes"):
        resolve(build_parser().parse_args(["--shards", "0"]), torch.device("cpu"))
    with pytest.raises(UsageError, match="--impls: unknown impl 'nope'"):
        resolve(build_parser().parse_args(["--impls", "untiled,nope"]), torch.device("cpu"))
    # numbers are checked by the parser: exit 2 and one line naming the flag, not a traceback minutes later
    for flags, text in ((["--seq", "4096,-5"], "argument --seq: takes comma-separated positive integers"),
                        (["--seq", "abc"], "argument --seq"), (["--repeat", "0"], "argument --repeat"),
                        (["--hidden", "x"], "argument --hidden"), (["--batch", "0"], "argument --batch"),
                        (["--threads", "0"], "argument --threads")):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(flags)
        assert exc.value.code == 2 and text in capsys.readouterr().err
    assert build_parser().parse_args(["--seq", "64,128,"]).seq == [64, 128]


@pytest.mark.parametrize("flags, text", [
    pytest.param(["--device", "foo"], "--device foo: not a torch device", id="unknown-device"),
    pytest.param(["--device", "cuda"], "--device cuda: not available here", id="no-cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    pytest.param(["--device", "cpu:0", "--impls", "liger"],
                 "nothing to run: every impl in --impls is skipped on cpu:0 (liger skipped", id="all-skipped"),
    pytest.param(["--device", "cpu", "--shards", "2,x"], "--shards takes comma-separated positive ints or 'auto'",
                 id="shards"),
    pytest.param(["--device", "cpu", "--impls", "untiled,nope"], "--impls: unknown impl 'nope'", id="impls"),
])
def test_bad_options_exit_2_before_running(flags: list[str], text: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Usage errors found after parsing go through parser.error like the parser's own: exit 2, no traceback, no
    empty table written."""
    with pytest.raises(SystemExit) as exc:
        main([*flags, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"tiledmlp bench: error: {text}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["out", "out/bench"])
def test_an_out_that_is_a_file_exits_2_before_running(where: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """It had measured everything, then lost it all to a FileExistsError when writing."""
    (tmp_path / "out").write_text("a user's file")
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--seq", "64", "--out", str(tmp_path / where)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "is a file; give a directory (made if missing)" in err
    assert (tmp_path / "out").read_text() == "a user's file"


def test_an_out_folder_that_cannot_be_made_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Where the folder cannot be made (under /proc, as for any user, root included), it had measured the first
    length, then stopped on mkdir with a traceback (exit 1), the measurement lost (2026-11-27)."""
    if not Path("/proc/self").exists():
        pytest.skip("needs Linux's /proc, where nothing can be made")
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--seq", "64", "--out", "/proc/tiledmlp-none/out"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--out /proc/tiledmlp-none/out: cannot make it (No such file or directory)" in err


def test_repeated_values_run_once() -> None:
    args = build_parser().parse_args(["--seq", "64,128,64", "--shards", "2,auto,02,2", "--impls", "untiled,untiled"])
    settings, _ = resolve(args, torch.device("cpu"))
    assert settings["seq"] == [64, 128] and settings["shards"] == ["2", "auto"] and settings["impls"] == ["untiled"]


def test_out_note_says_what_it_replaces(tmp_path: Path) -> None:
    assert out_note(tmp_path / "new") == (f"tiledmlp bench: writing {tmp_path / 'new' / 'bench.json'}, "
                                          f"{tmp_path / 'new' / 'bench.md'}, {tmp_path / 'new' / 'bench.png'}")
    (tmp_path / "bench.md").write_text("old")
    assert out_note(tmp_path).endswith("(replacing the bench.md there)")


def test_bf16_sums_row_only_for_bf16_weights() -> None:
    """``tiledmlp-bf16acc`` (ours with bf16 weight-grad sums) is skipped, with a note, unless the weights are bf16."""
    args = ["--impls", f"untiled,{LOW_ACC}"]
    settings, notes = resolve(build_parser().parse_args(args), torch.device("cpu"))
    assert settings["impls"] == ["untiled"] and any(LOW_ACC in n and "bfloat16" in n for n in notes)
    settings, notes = resolve(build_parser().parse_args([*args, "--dtype", "bfloat16"]), torch.device("cpu"))
    assert settings["impls"] == ["untiled", LOW_ACC] and not notes


def test_prediction_only_for_modelled_paths() -> None:
    assert predicted_bytes(Config("swiglu", 64, 176, 96, 1, "float32", "deepspeed", "2")) is None
    assert predicted_bytes(Config("swiglu", 64, 176, 96, 1, "float32", "tiledmlp-generic", "2")) is not None
    assert predicted_bytes(Config("gpt2", 64, 176, 96, 1, "float32", "untiled", "1")) is None
    assert predicted_bytes(Config("geglu", 64, 176, 96, 1, "float32", "tiledmlp", "2")) is not None
    assert predicted_bytes(Config("swiglu-lora", 64, 176, 96, 1, "float32", "tiledmlp", "2")) is None


@pytest.mark.parametrize("mlp", ["swiglu", "gpt2", "swiglu-lora", "swiglu-fused", "moe"])
def test_every_impl_computes_the_same_function(mlp: str) -> None:
    """The table compares like with like: each implementation's output and grads match untiled (with LoRA: the
    adapters' grads, the frozen base weights getting none; MoE: the router's too, batch 2 cut along the sequence)."""
    impls = ["tiledmlp", "tiledmlp-generic"]
    try:
        import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401

        impls.append("deepspeed")
    except Exception:
        pass
    batch = 1 if mlp == "gpt2" else 2  # DeepSpeed chunks dim 1: GPT2's Conv1D .view() fails on those tiles
    model = build_mlp(mlp, 32, 64, torch.float64)
    x = torch.randn(batch, 24, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(batch, 24, 32, dtype=torch.float64)

    def run(impl: str) -> list[torch.Tensor]:
        x.grad = None
        model.zero_grad(set_to_none=True)
        out = build_forward(Config(mlp, 32, 64, 24, batch, "float64", impl, "3"), model)(x)
        out.backward(g)
        assert all((p.grad is None) != p.requires_grad for p in model.parameters()), impl
        return [out.detach(), x.grad.clone(), *(p.grad.clone() for p in model.parameters() if p.requires_grad)]

    ref = run("untiled")
    if mlp == "moe":  # the block's own forward runs, its experts tiled (3 tiles) and put back after the call
        experts = model.experts
        seen = []
        hook = model.register_forward_hook(lambda m, _i, _o: seen.append(m.experts._tiled.last_num_tiles))
        run("tiledmlp")
        hook.remove()
        assert seen == [3] and model.experts is experts
    for impl in impls:
        for a, b in zip(run(impl), ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=impl)


def test_the_qlora_mlp_is_patch_s_glu_path_and_every_impl_matches_untiled() -> None:
    """``--mlp swiglu-qlora``: PEFT's 4-bit LoRA layers over NF4 projections computing in the input's dtype, which
    ``TiledMLP`` runs on its GLU path; each implementation's output and adapter grads match untiled (float32:
    bitsandbytes computes in 16 or 32 bits: within 1e-6 of each tensor's norm), the 4-bit weights getting none."""
    pytest.importorskip("bitsandbytes")
    lora_bnb = pytest.importorskip("peft.tuners.lora.bnb")
    model = build_mlp("swiglu-qlora", 64, 128, torch.float32)
    assert all(type(getattr(model, n)) is lora_bnb.Linear4bit for n in ("gate_proj", "up_proj", "down_proj"))
    torch.manual_seed(0)
    x = torch.randn(2, 24, 64, requires_grad=True)
    g = torch.randn(2, 24, 64)

    def run(impl: str) -> tuple[object, list[torch.Tensor]]:
        x.grad = None
        model.zero_grad(set_to_none=True)
        forward = build_forward(Config("swiglu-qlora", 64, 128, 24, 2, "float32", impl, "3"), model)
        out = forward(x)
        out.backward(g)
        assert all((p.grad is None) != p.requires_grad for p in model.parameters()), impl
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return forward, [out.detach(), x.grad.clone(), *grads]

    _, ref = run("untiled")
    assert len(ref) == 2 + 6
    for impl in ("tiledmlp", "tiledmlp-generic"):
        forward, got = run(impl)
        if impl == "tiledmlp":
            assert (forward._tiled.last_path, forward._tiled.last_num_tiles) == ("glu", 3)
        for a, b in zip(got, ref):  # float32 sums in another order: relative to each tensor's norm
            assert float(rel_err(a, b)) <= 1e-6, impl
