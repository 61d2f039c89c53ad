"""``tiledmlp train`` before and after memory runs out: the plan's warning before the first step, and after an
out-of-memory error the changes that would fit and the checkpoint to resume from (exit 1, no work lost)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as tf
from trainrun import TINY, one_thread, train  # noqa: F401 (autouse fixture)

from tiledmlp.plan import ModelShape, Setup, predict_step_peak
from tiledmlp.plan.cli import max_seq_that_fits
from tiledmlp.train.callbacks import format_bytes
from tiledmlp.train.cli import main
from tiledmlp.train.fit import MAX_SP, device_memory_bytes, fitting_changes, is_out_of_memory

# Llama-3.2-1B's shape (config only: the plan reads no weights), bf16 weights, AdamW, on a CUDA device
LLAMA_1B = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
CUDA_BF16 = Setup(dtype=torch.bfloat16, device_type="cuda")


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_config(LLAMA_1B)


def peak(shape: ModelShape, setup: Setup, seq: int, batch: int = 1) -> int:
    return predict_step_peak(shape, setup, seq, batch=batch).peak_bytes


def test_the_fewest_changes_in_order_of_their_cost(shape: ModelShape) -> None:
    seq = 65536
    loss = replace(CUDA_BF16, tiled_loss=True)
    tiled = replace(loss, tiled_mlp=True)
    ckpt = replace(tiled, checkpointing=True)
    offload = replace(ckpt, offload=True)
    split = replace(offload, split_layers=True)
    peaks = [peak(shape, s, seq) for s in (CUDA_BF16, loss, tiled, ckpt, offload, split)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks
    flags = ["--use_tiled_loss true", "--use_tiled_mlp true", "--activation_checkpointing true",
             "--activation_offloading true", "--activation_offloading_split_layers true"]
    for i, budget in enumerate(peaks[1:], start=1):  # each budget is met exactly by one more change
        assert fitting_changes(shape, CUDA_BF16, seq, 1, budget) == (flags[:i], budget)
        if i < len(flags):  # a byte less needs the next one too
            assert fitting_changes(shape, CUDA_BF16, seq, 1, budget - 1)[0][:i + 1] == flags[:i + 1]
    # what is on already is not suggested again
    assert fitting_changes(shape, tiled, seq, 1, peaks[3]) == (["--activation_checkpointing true"], peaks[3])
    # past split layers: more devices, the fewest Ulysses ranks whose plan fits
    flags_sp, planned = fitting_changes(shape, CUDA_BF16, seq, 1, peaks[-1] - 1)
    sp = int(flags_sp[-1].split()[1])
    assert flags_sp[:-1] == flags
    assert flags_sp[-1] == f"--sequence_parallel_size {sp} --deepspeed ds.json (over {sp} devices)"
    with_sp = replace(split, sequence_parallel_size=sp, world_size=sp)
    assert planned == peak(shape, with_sp, seq) <= peaks[-1] - 1
    if sp > 2:
        assert peak(shape, replace(with_sp, sequence_parallel_size=sp // 2, world_size=sp // 2), seq) > peaks[-1] - 1
    assert fitting_changes(shape, CUDA_BF16, seq, 1, 1) is None  # nothing up to MAX_SP ranks fits one byte
    assert MAX_SP >= 8


def test_a_batch_becomes_gradient_accumulation_first(shape: ModelShape) -> None:
    tiled = replace(CUDA_BF16, checkpointing=True, tiled_mlp=True, tiled_loss=True)
    one = peak(shape, tiled, 32768, batch=1)
    assert peak(shape, tiled, 32768, batch=4) > one
    flags, planned = fitting_changes(shape, tiled, 32768, 4, one)
    assert flags == ["--per_device_train_batch_size 1 --gradient_accumulation_steps 4 (batch 4 x accumulation 1: "
                     "the same 4 sequences per step)"]
    assert planned == one


def test_out_of_memory_is_recognised() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator refuses it: a plain RuntimeError
    assert is_out_of_memory(info.value)
    assert not is_out_of_memory(RuntimeError("Expected all tensors to be on the same device"))


def test_device_memory_of_this_machine() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 2**30 < device_memory_bytes(torch.device("cpu")) <= physical  # a container's limit when lower
    if torch.cuda.is_available():
        assert device_memory_bytes(torch.device("cuda")) == torch.cuda.get_device_properties(0).total_memory


def test_warns_before_training_when_the_plan_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A device smaller than the plan: one warning with the longest sequence that fits and the flags that would
    make this one fit, then training goes on (the plan is a prediction, not a refusal)."""
    from tiledmlp.train.models import tiny_llama_config

    tiny = ModelShape.from_config(tiny_llama_config())
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where Trainer puts the run
    untiled = Setup(dtype=torch.float32, mlp_num_shards=4, device_type=device)  # the run's, as prepare() builds it
    budget = peak(tiny, replace(untiled, tiled_mlp=True, tiled_loss=True), 2048)
    assert peak(tiny, replace(untiled, tiled_loss=True), 2048) > budget  # both changes are needed
    longest = max_seq_that_fits(tiny, untiled, budget)
    assert 0 < longest < 2048
    monkeypatch.setattr("tiledmlp.train.fit.device_memory_bytes", lambda device: budget)
    summary = train(tmp_path, monkeypatch, "--use_tiled_mlp", "false", "--use_tiled_loss", "false",
                    "--max_seq_length", "2048", "--max_steps", "1")
    assert summary["steps"] == 1
    err = capsys.readouterr().err
    assert "tiledmlp train: warning: tiledmlp plan predicts a" in err and "will likely run out of memory" in err
    assert f"with these flags the longest sequence the plan fits is {longest:,} tokens" in err
    assert f"to fit 2,048 tokens add: --use_tiled_loss true --use_tiled_mlp true  (planned {format_bytes(budget)})" in err
    # a run the plan fits prints nothing of the kind
    monkeypatch.setattr("tiledmlp.train.fit.device_memory_bytes", lambda device: 10 * budget)
    train(tmp_path, monkeypatch, "--max_seq_length", "2048", "--max_steps", "1", name="fits")
    assert "likely run out of memory" not in capsys.readouterr().err


def test_out_of_memory_says_what_to_change_and_keeps_the_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Step 3 runs out of memory: exit 1 after the allocator's traceback and a report naming the checkpoint
    that step 2 saved; resuming from it finishes the run with the losses of one that never failed."""
    real_step = tf.Trainer.training_step
    calls = []

    def step_that_runs_out(self: tf.Trainer, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(self.state.global_step)
        if self.state.global_step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_step(self, *args, **kwargs)

    out = tmp_path / "run"
    flags = [*TINY, "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "1"]
    monkeypatch.setattr(tf.Trainer, "training_step", step_that_runs_out)
    assert main(flags) == 1
    err = capsys.readouterr().err
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB" in err
    report = err[err.index("tiledmlp train: error: "):]
    assert re.match(r"tiledmlp train: error: out of memory on \S+ during training, after 2 completed step\(s\)", report)
    assert "tiledmlp plan predicted" in report  # the tiny plan fits the device: the rest is outside the plan
    assert f"the last checkpoint is {out / 'checkpoint-2'}: add --resume_from_checkpoint last" in report
    assert not (out / "model.safetensors").exists()  # no final model from a run that failed

    monkeypatch.setattr(tf.Trainer, "training_step", real_step)
    report_file = tmp_path / "resumed.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report_file))
    assert main([*flags, "--resume_from_checkpoint", "last"]) == 0
    resumed = json.loads(report_file.read_text())
    whole = train(tmp_path, monkeypatch, name="whole")
    assert resumed["steps"] == 3 and list(resumed["losses"]) == ["3"]
    assert abs(resumed["losses"]["3"] - whole["losses"]["3"]) <= 1e-5


def test_out_of_memory_while_saving_names_the_last_whole_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Out of memory while checkpoint-2's optimizer state is written: checkpoint-2 is a folder without its
    trainer_state.json and cannot be resumed. The report names checkpoint-1, and ``last`` resumes from it."""
    real_save = tf.Trainer._save_optimizer_and_scheduler

    def save_that_runs_out(self: tf.Trainer, output_dir: str) -> None:
        if self.state.global_step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real_save(self, output_dir)

    out = tmp_path / "run"
    flags = [*TINY, "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "1"]
    monkeypatch.setattr(tf.Trainer, "_save_optimizer_and_scheduler", save_that_runs_out)
    assert main(flags) == 1
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-2" / "trainer_state.json").exists()
    assert f"the last checkpoint is {out / 'checkpoint-1'}: add --resume_from_checkpoint last" \
        in capsys.readouterr().err

    monkeypatch.setattr(tf.Trainer, "_save_optimizer_and_scheduler", real_save)
    report_file = tmp_path / "resumed.json"
    monkeypatch.setenv("TILEDMLP_TRAIN_REPORT", str(report_file))
    assert main([*flags, "--resume_from_checkpoint", "last"]) == 0
    assert list(json.loads(report_file.read_text())["losses"]) == ["2", "3"]


def test_out_of_memory_in_the_last_evaluation_keeps_the_trained_model(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The final model is saved before the evaluation after training, so one that runs out of memory loses no
    work (it was saved after it: ``--save_strategy no`` kept nothing)."""
    held_out = tmp_path / "held-out.txt"
    held_out.write_text("a page of long held-out text " * 20)

    def out_of_memory(self: tf.Trainer, *args: object, **kwargs: object) -> dict:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tf.Trainer, "evaluate", out_of_memory)
    out = tmp_path / "run"
    assert main([*TINY, "--eval_dataset", str(held_out), "--output_dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "in the evaluation after training" in err
    assert f"the trained model was saved to {out} before the evaluation" in err
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_no_checkpoint_is_said_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    def out_of_memory(self: tf.Trainer, *args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tf.Trainer, "training_step", out_of_memory)
    assert main([*TINY, "--output_dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "after 0 completed step(s)" in err and "no checkpoint was saved (--save_strategy steps" in err


def test_a_run_the_plan_cannot_model_trains_and_fails_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The advice is advisory: a plan that raises neither stops the run nor hides its out-of-memory error."""
    def broken_plan(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a model the plan has no formula for")

    monkeypatch.setattr("tiledmlp.train.fit.predict_step_peak", broken_plan)
    monkeypatch.setattr("tiledmlp.plan.model.predict_step_peak", broken_plan)  # the run's "planned peak" line
    monkeypatch.setattr("tiledmlp.train.fit.device_memory_bytes", lambda device: 1)  # nothing would fit
    assert train(tmp_path, monkeypatch)["steps"] == 3
    out = capsys.readouterr()
    assert "likely run out of memory" not in out.err
    assert "planned peak: n/a (a model the plan has no formula for)" in out.out

    def out_of_memory(self: tf.Trainer, *args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tf.Trainer, "training_step", out_of_memory)
    assert main([*TINY, "--output_dir", str(tmp_path / "oom")]) == 1
    err = capsys.readouterr().err
    assert "out of memory on" in err and "(tiledmlp plan cannot model this run: no advice on flags)" in err
    assert "no checkpoint was saved" in err


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Trainer takes --fsdp only in a process group: here one of one process, torn down after with Accelerate's
    state, so the tests after it train without one (FSDP2 over that one process: train.wrapping)."""
    import socket

    from accelerate.state import AcceleratorState

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)


def out_of_memory_step(self: tf.Trainer, *args: object, **kwargs: object) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory")


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("fsdp_config, mode", [({"fsdp_version": 2}, "full_shard"),
                                               ({"fsdp_version": 2, "reshard_after_forward": False}, "shard_grad_op")])
def test_fsdp_runs_are_planned_as_sharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str], fsdp_config: dict, mode: str) -> None:
    """An --fsdp run (FSDP2 itself on this CPU: ``wrapped_as``) is planned with its strategy as the Trainer read it
    (``fsdp_config``'s reshard_after_forward), so its planned peak, the warning before the first step and the advice
    after an out-of-memory error are FSDP's (before 2026-11-27 no FSDP run got them)."""
    import tiledmlp.train.runner as runner

    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(fsdp_config))
    fsdp = ["--fsdp", "full_shard", "--fsdp_config", str(path)]
    planned: list[object] = []
    real = runner.planned_vs_measured
    monkeypatch.setattr(runner, "planned_vs_measured", lambda model, setup, *a: planned.append(setup) or real(
        model, setup, *a))
    monkeypatch.setattr("tiledmlp.train.fit.device_memory_bytes", lambda device: 1)  # nothing fits
    summary = train(tmp_path, monkeypatch, *fsdp, "--max_steps", "1")
    assert summary["steps"] == 1 and summary["wrapped_as"] == "fsdp2"
    out = capsys.readouterr()
    assert "== tiledmlp train" in out.out
    assert [s.fsdp for s in planned] == [mode] and "planned peak" in out.out
    assert "tiledmlp plan predicts" in out.err and "this run will likely run out of memory" in out.err
    monkeypatch.setattr(tf.Trainer, "training_step", out_of_memory_step)
    assert main([*TINY, "--output_dir", str(tmp_path / "oom"), *fsdp]) == 1
    report = capsys.readouterr().err.split("tiledmlp train: error: ")[-1]
    assert report.startswith("out of memory on") and "no checkpoint was saved" in report
    assert "tiledmlp plan predicts" in report and "no recipe up to --sequence_parallel_size" in report


def test_fsdp_cpu_offload_is_not_planned_and_refused_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP's CPU offload, which the plan does not model, gets no plan and no advice on flags (a GPU run); on the
    CPU the run is refused before anything loads (FSDP2 failed at its first step, "Cannot access accelerator
    device"), and so is FSDP1, which accelerate sets up for a device (it failed at the Trainer's start). The refused
    runs name ``--use_cpu true``: on a machine with a GPU the run would otherwise be a GPU run (on the H200, 2026-11-29,
    Trainer then refused a one-process FSDP run and the test failed)."""
    from tiledmlp.train.args import parse_args
    from tiledmlp.train.fit import after_out_of_memory
    from tiledmlp.train.runner import prepare

    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_version": 2, "cpu_offload": True}))
    fsdp = ["--fsdp", "full_shard", "--fsdp_config", str(path)]
    with monkeypatch.context() as gpu:  # the checks a GPU run passes
        gpu.setattr("tiledmlp.train.checks.check_fsdp_on_cpu", lambda train_args: None)
        m, d, tiling, train_args = parse_args([*TINY, *fsdp, "--output_dir", str(tmp_path / "out")])
    assert prepare(m, d, tiling, train_args).plan_setup is None
    lines = after_out_of_memory(torch.nn.Linear(2, 2), None, 64, 1, torch.device("cuda"), "during training", "none")
    assert "(tiledmlp plan does not model this run's FSDP setup (CPU offload): no advice on flags)" in lines
    for flags in (fsdp, ["--fsdp", "full_shard offload"], ["--fsdp", "--fsdp_config", '{"version": 1}']):
        capsys.readouterr()
        assert main([*TINY, *flags, "--use_cpu", "true", "--output_dir", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert ("--fsdp with fsdp_config version 1 (FSDP1): accelerate sets FSDP1 up for GPUs only" in err
                if "version" in flags[-1] else "--fsdp offload (fsdp_config cpu_offload) moves FSDP's shards from a "
                "GPU to host memory; this run is on the CPU" in err), err
    assert not (tmp_path / "refused").exists()


def heads_config(heads: int, kv_heads: int) -> tf.LlamaConfig:
    return tf.LlamaConfig(hidden_size=64 * heads, intermediate_size=4096, num_hidden_layers=4, vocab_size=32000,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa")


def test_sequence_parallel_advice_is_what_the_run_accepts() -> None:
    """Ulysses gives each rank whole heads (and DeepSpeed replicates kv heads only by a whole factor): a suggested
    --sequence_parallel_size passes the run's own model check, and a run without DeepSpeed is told to add it."""
    from types import SimpleNamespace

    from tiledmlp.train.args import UsageError
    from tiledmlp.train.sequence_parallel import check_model

    config = heads_config(24, 6)  # SP 2 only: 4 and 8 divide 24 heads, not 6 kv heads (nor does 6 divide them)
    odd, seq = ModelShape.from_config(config), 65536
    everything = replace(CUDA_BF16, tiled_loss=True, tiled_mlp=True, checkpointing=True, offload=True,
                         split_layers=True)
    with pytest.raises(UsageError):
        check_model(SimpleNamespace(config=config), 8)
    sp8 = peak(odd, replace(everything, sequence_parallel_size=8, world_size=8), seq)
    assert sp8 < peak(odd, replace(everything, sequence_parallel_size=2, world_size=2), seq)
    assert fitting_changes(odd, CUDA_BF16, seq, 1, sp8) is None  # SP 8 would fit, the model cannot run it
    sp2 = peak(odd, replace(everything, sequence_parallel_size=2, world_size=2), seq)
    flags, _ = fitting_changes(odd, CUDA_BF16, seq, 1, sp2)
    assert flags[-1] == "--sequence_parallel_size 2 --deepspeed ds.json (over 2 devices)"
    check_model(SimpleNamespace(config=config), 2)
    zero3 = replace(CUDA_BF16, zero_stage=3)  # a DeepSpeed run already
    flags, _ = fitting_changes(odd, zero3, seq, 1, peak(odd, replace(everything, zero_stage=3,
                                                                     sequence_parallel_size=2, world_size=2), seq))
    assert flags[-1] == "--sequence_parallel_size 2 (over 2 devices)"
    fsdp = replace(CUDA_BF16, fsdp="full_shard", world_size=2)  # SP is DeepSpeed's: FSDP gives way to ZeRO-3
    # 4x the tokens: at 64k ZeRO-3 (the whole model gathered, float32 states and master weights) holds more than
    # FSDP with every trick, so only past that does FSDP need SP
    flags, _ = fitting_changes(odd, fsdp, 4 * seq, 1, peak(odd, replace(everything, zero_stage=3,
                                                                        sequence_parallel_size=2, world_size=2),
                                                            4 * seq))
    assert flags[-1] == "--sequence_parallel_size 2 --deepspeed ds.json (ZeRO-3) in place of --fsdp (over 2 devices)"


def test_micro_batch_advice_keeps_the_gradient_accumulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Batch 2 x accumulation 3 that runs out of memory: micro-batches of 1 with accumulation 6 keep its 6
    sequences per optimizer step."""
    from tiledmlp.train.models import tiny_llama_config

    tiny = ModelShape.from_config(tiny_llama_config())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = Setup(dtype=torch.float32, mlp_num_shards=4, tiled_mlp=True, tiled_loss=True, device_type=device)
    budget = peak(tiny, run, 64)
    assert peak(tiny, run, 64, batch=2) > budget
    monkeypatch.setattr("tiledmlp.train.fit.device_memory_bytes", lambda device: budget)
    monkeypatch.setattr(tf.Trainer, "training_step", out_of_memory_step)
    assert main([*TINY, "--output_dir", str(tmp_path / "run"), "--per_device_train_batch_size", "2",
                 "--gradient_accumulation_steps", "3", "--max_steps", "1"]) == 1
    err = capsys.readouterr().err
    assert ("to fit 64 tokens add: --per_device_train_batch_size 1 --gradient_accumulation_steps 6 (batch 2 x "
            f"accumulation 3: the same 6 sequences per step)  (planned {format_bytes(budget)})") in err


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_no_offloading_advice_where_the_host_is_the_device(shape: ModelShape, device: str) -> None:
    """On CPU and MPS the device's memory is the host's: offloading moves nothing, so it is never advised."""
    tiled = replace(CUDA_BF16, tiled_loss=True, tiled_mlp=True, device_type=device)
    for budget in (peak(shape, replace(tiled, checkpointing=True), 65536) - 1, peak(shape, tiled, 65536) // 3):
        changes = fitting_changes(shape, tiled, 65536, 1, budget)
        assert changes is not None and not any("offloading" in flag for flag in changes[0]), changes


def test_suggested_flags_are_the_documented_ones(shape: ModelShape) -> None:
    """Every flag the advice names (before sequence parallelism) parses as it is, with no deprecation warning."""
    import warnings

    from tiledmlp.train.args import checkpointing, parse_args

    split = replace(CUDA_BF16, tiled_loss=True, tiled_mlp=True, checkpointing=True, offload=True, split_layers=True)
    flags, _ = fitting_changes(shape, CUDA_BF16, 65536, 4, peak(shape, split, 65536))
    argv = [word for flag in flags for word in flag.split(" (")[0].split()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, tiling, train_args = parse_args([*TINY, "--output_dir", "unused", *argv])
    assert checkpointing(train_args)[0] and tiling.activation_offloading_split_layers


def test_out_of_memory_in_an_evaluation_during_training_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation at --eval_steps, and below the final model's save, are not training steps: the report names
    them."""
    held_out = tmp_path / "held-out.txt"
    held_out.write_text("a page of long held-out text " * 20)
    monkeypatch.setattr(tf.Trainer, "evaluate", out_of_memory_step)
    assert main([*TINY, "--eval_dataset", str(held_out), "--eval_strategy", "steps", "--eval_steps", "2",
                 "--output_dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "out of memory on" in err and "in the evaluation after step 2" in err


def test_out_of_memory_while_saving_the_final_model_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tf.Trainer, "save_model", out_of_memory_step)
    assert main([*TINY, "--output_dir", str(tmp_path / "save")]) == 1
    err = capsys.readouterr().err
    assert "out of memory on" in err and "while saving the final model after step 3" in err


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_the_plan_counts_either_16_bit_autocast(flag: str, tmp_path: Path) -> None:
    """--bf16 and --fp16 (on a GPU) both autocast float32 weights to 16-bit matmuls: the plan must model both."""
    from tiledmlp.train.args import parse_args
    from tiledmlp.train.runner import prepare

    data = tmp_path / "d.txt"
    data.write_text("a page of long text " * 40)
    m, d, t, a = parse_args([*TINY, "--dataset", str(data), "--output_dir", str(tmp_path / "out")])
    setattr(a, flag, True)  # set after parsing: parse_args refuses --fp16 on this CPU
    assert prepare(m, d, t, a).plan_setup.autocast
