"""``tiledmlp train --load_in_4bit``: QLoRA, LoRA adapters over a bitsandbytes 4-bit base, tiled and untiled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tiledmlp.train.cli import main
from trainrun import TINY, assert_close_losses, losses, train

bnb = pytest.importorskip("bitsandbytes")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QLORA = ["--load_in_4bit", "true", "--lora_r", "4", "--max_seq_length", "256"]


def _saved_tiny(tmp_path: Path) -> Path:
    """tiny-llama written as a checkpoint folder: the path transformers quantizes as it loads."""
    from tiledmlp.train.models import _tiny

    model, tokenizer = _tiny("tiny-llama", torch.float32, None)
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("source", ["checkpoint", "built"])
def test_qlora_trains_tiled_as_untiled(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same 3 steps, tiled MLPs (4 tiles, generic engine over the 4-bit Linears) and tiled loss against neither:
    losses within 1e-5; only the adapters train; the saved adapter loads onto the 4-bit base with PEFT. A model
    read from a checkpoint is quantized as it loads; one built in code (as the embedded GGUF SmolLM2) is written
    out and read back in 4 bits."""
    model = ["--model", str(_saved_tiny(tmp_path))] if source == "checkpoint" else []
    untiled = train(tmp_path, monkeypatch, *QLORA, *model, "--use_tiled_mlp", "false", "--use_tiled_loss", "false",
                    name="untiled")
    tiled = train(tmp_path, monkeypatch, *QLORA, *model, "--save_final_model", "true", name="tiled")
    assert_close_losses(untiled, tiled)
    assert len(losses(tiled)) == 3 and tiled["tiles"] and set(tiled["tiles"].values()) == {4}
    adapter = tmp_path / "tiled"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    assert not (adapter / "model.safetensors").exists()  # the adapter only, not the 4-bit base

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if source == "checkpoint":
        base = AutoModelForCausalLM.from_pretrained(model[1], device_map="cpu", quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
        assert isinstance(base.model.layers[0].mlp.gate_proj, bnb.nn.Linear4bit)
        loaded = PeftModel.from_pretrained(base, adapter)
        assert sum(p.numel() for n, p in loaded.named_parameters() if "lora_" in n) > 0


def test_the_base_is_4_bit_and_frozen(tmp_path: Path) -> None:
    """What prepare() hands the Trainer: every decoder Linear a 4-bit bitsandbytes layer under a LoRA adapter, the
    adapters the only trainable weights (float32), the head, embeddings and norms float32."""
    from tiledmlp.train.args import parse_args
    from tiledmlp.train.checks import validate
    from tiledmlp.train.runner import prepare

    m, d, tiling, train_args = parse_args([*TINY, *QLORA, "--model", str(_saved_tiny(tmp_path)), "--dtype",
                                           "bfloat16", "--output_dir", str(tmp_path / "out")])
    validate(m, d, tiling, train_args)
    model = prepare(m, d, tiling, train_args).model
    quantized = [mod for mod in model.modules() if isinstance(mod, bnb.nn.Linear4bit)]
    assert len(quantized) == 7 * 2 and all(mod.compute_dtype == torch.bfloat16 for mod in quantized)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    others = [p for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point()]
    assert others and all(p.dtype == torch.float32 for p in others)


@pytest.mark.parametrize("case", ["no_lora", "quant_type", "nested_alone", "zero3", "fsdp1"])
def test_bad_qlora_flags_exit_2_with_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """fsdp1: as on a GPU (on this CPU accelerate's FSDP1 is refused first, train.wrapping)."""
    monkeypatch.setattr("tiledmlp.train.wrapping.has_accelerator", lambda: True)
    out = tmp_path / "out"
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    flags = {"no_lora": ["--load_in_4bit", "true"],
             "quant_type": [*QLORA, "--bnb_4bit_quant_type", "int4"],
             "nested_alone": ["--use_bnb_nested_quant", "true"],
             "zero3": [*QLORA, "--deepspeed", str(ds)],
             "fsdp1": [*QLORA, "--use_cpu", "false", "--fsdp", "--fsdp_config", '{"version": 1}']}[case]
    capsys.readouterr()
    rc = main([*TINY, *flags, "--output_dir", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tiledmlp train:")]
    assert rc == 2 and len(err) == 1, err
    expected = {"no_lora": "--load_in_4bit freezes the base model's weights in 4 bits: train LoRA adapters over "
                           "them (QLoRA) with --lora_r N",
                "quant_type": "--bnb_4bit_quant_type must be nf4 or fp4, got 'int4'",
                "nested_alone": "--use_bnb_nested_quant sets up 4-bit weights: pass --load_in_4bit true too",
                "zero3": "--load_in_4bit with --deepspeed ZeRO-3 is not supported here",
                "fsdp1": "--load_in_4bit with FSDP1 (fsdp_config version 1) is not supported here: use FSDP2"}[case]
    assert expected in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_qlora_under_ddp_zero2_and_fsdp2_trains_tiled_as_untiled(tmp_path: Path) -> None:
    """Two ranks (gloo, launched as torchrun launches them), each quantizing the built tiny-llama itself (written out
    and read back in 4 bits: rank 1 found no file when transformers wrote on rank 0 only): plain DDP untiled, and
    tiled MLP + loss under DDP, under DeepSpeed ZeRO-2 (adapter grads and AdamW states sharded, the 4-bit base whole
    on each rank) and under FSDP2 (``--fsdp``, refused before: the 4-bit weights in float32 storage, sharded with
    the rest, so a rank holds half the weight bytes DDP's does): the same losses within 1e-5, and FSDP2's saved
    adapter is DDP's."""
    import launch

    ds = tmp_path / "zero2.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto",
                              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}))
    fsdp = tmp_path / "fsdp2.json"
    fsdp.write_text(json.dumps({"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}))
    runs = {}
    for name, flags in {"untiled": ["--use_tiled_mlp", "false", "--use_tiled_loss", "false"], "tiled": [],
                        "zero2": ["--deepspeed", str(ds)], "fsdp2": ["--fsdp", "--fsdp_config", str(fsdp)]
                        }.items():
        report = tmp_path / f"{name}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
               "DS_ACCELERATOR": "cpu", "TILEDMLP_TRAIN_REPORT": str(report)}
        cmd = launch.forkrun(2, "-m", "tiledmlp.cli", "train", *TINY, *QLORA, "--use_cpu", "true", *flags,
                             "--output_dir", str(tmp_path / name))
        proc = launch.run(cmd, env=env, timeout=420, what=f"DDP QLoRA {name}")
        assert proc.returncode == 0, proc.stderr[-6000:]
        runs[name] = json.loads(report.read_text())
    for name in ("tiled", "zero2", "fsdp2"):
        assert_close_losses(runs["untiled"], runs[name])
        assert set(runs[name]["tiles"].values()) == {4}
        # the GLU engine over the 4-bit weights: under FSDP2 too (its gathered weight a plain tensor, since
        # 2026-11-30; the generic engine before)
        assert set(runs[name]["mlp_engines"].values()) == {"glu"}, runs[name]["mlp_engines"]
    assert [runs[n]["wrapped_as"] for n in runs] == ["ddp", "ddp", "deepspeed", "fsdp2"]
    assert runs["fsdp2"]["rank_weight_bytes"] <= 0.52 * runs["tiled"]["rank_weight_bytes"], runs
    from safetensors.torch import load_file

    # FSDP2 gathers the adapter's shards for rank 0 to write: the very adapter DDP trained
    saved, ddp = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("fsdp2", "tiled"))
    assert saved.keys() == ddp.keys() and all(saved[k].shape == ddp[k].shape for k in ddp)
    assert max(float((saved[k] - ddp[k]).abs().max()) for k in ddp) <= 1e-6
    assert min(float(ddp[k].abs().max()) for k in ddp if "lora_B" in k) > 0  # trained: B starts at zero


@pytest.mark.slow
def test_qlora_under_fsdp2_with_bf16_trains_tiled_as_untiled(tmp_path: Path) -> None:
    """The FSDP2 example's recipe (``--fsdp``, ``--bf16``: accelerate's mixed precision computing in bf16, casting each
    unit's outputs to bf16) over a 4-bit base, 2 ranks: tiled MLP + loss and untiled give the same bf16 losses (one
    bf16 step apart at most). Before 2026-11-29 the tiled loss was refused ("a forward hook on lm_head changed what
    it returned": FSDP2's cast to bf16), and both runs failed in the first matmul (``shape '[64, 32]' is invalid``:
    FSDP2 cast the packed 4-bit bytes, stored as float32, to bf16); now they are stored as bf16. Both runs are
    planned (``tiledmlp plan``'s peak printed beside the measured one; before 2026-11-29 this setup got no plan)."""
    import launch

    runs = {}
    for name, flags in {"untiled": ["--use_tiled_mlp", "false", "--use_tiled_loss", "false"], "tiled": []}.items():
        report = tmp_path / f"{name}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
               "TILEDMLP_TRAIN_REPORT": str(report)}
        cmd = launch.forkrun(2, "-m", "tiledmlp.cli", "train", "--config", str(EXAMPLES / "cpu" / "tiny-fsdp2.yaml"),
                             *QLORA, "--bf16", "true", "--max_steps", "2", "--disable_tqdm", "true", *flags,
                             "--output_dir", str(tmp_path / name))
        proc = launch.run(cmd, env=env, timeout=420, what=f"FSDP2 bf16 QLoRA {name}")
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert "(tiledmlp plan) vs measured" in proc.stdout, proc.stdout[-3000:]
        runs[name] = json.loads(report.read_text())
    assert runs["tiled"]["wrapped_as"] == runs["untiled"]["wrapped_as"] == "fsdp2"
    assert runs["tiled"]["tiled_loss"] and min(runs["tiled"]["tiles"].values()) >= 2
    # under --bf16's autocast the generic engine (bitsandbytes' product does not follow autocast's rule)
    assert set(runs["tiled"]["mlp_engines"].values()) == {"generic"}, runs["tiled"]["mlp_engines"]
    untiled, tiled = losses(runs["untiled"]), losses(runs["tiled"])
    assert len(tiled) == len(untiled) == 2
    assert all(abs(a - b) <= 2 ** -5 for a, b in zip(untiled, tiled)), (untiled, tiled)  # bf16's step at 4-8


def test_resume_keeps_the_base_quantized_as_trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A QLoRA checkpoint resumes to the uninterrupted run's losses; resumed without --load_in_4bit (the adapter
    alone does not say what base it trained over) or with another quant type it is refused before anything loads,
    naming the flag."""
    model = ["--model", str(_saved_tiny(tmp_path))]
    out = ["--save_strategy", "steps", "--save_steps", "1"]
    whole = train(tmp_path, monkeypatch, *QLORA, *model, *out, name="whole")
    checkpoint = str(tmp_path / "whole" / "checkpoint-2")
    for flags, refusal in ((["--load_in_4bit", "false", "--lora_r", "4"], "--load_in_4bit true"),
                           ([*QLORA, "--bnb_4bit_quant_type", "fp4"], "--bnb_4bit_quant_type nf4")):
        capsys.readouterr()
        assert main([*TINY, *model, *flags, *out, "--resume_from_checkpoint", checkpoint,
                     "--output_dir", str(tmp_path / "resumed")]) == 2
        assert f"was trained with {refusal} (tiledmlp_data.json)" in capsys.readouterr().err
    resumed = train(tmp_path, monkeypatch, *QLORA, *model, *out, "--resume_from_checkpoint", checkpoint,
                    name="resumed")
    assert sorted(resumed["losses"], key=int) == ["3"]
    assert abs(resumed["losses"]["3"] - whole["losses"]["3"]) <= 1e-6, (whole["losses"], resumed["losses"])


def test_qlora_papers_optimizer_paged_adamw_8bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The QLoRA paper's recipe, bitsandbytes' paged 8-bit AdamW (on the CPU too, with bitsandbytes installed):
    tiled as untiled within 1e-5, and the adapters move (lr 1e-3)."""
    flags = [*QLORA, "--optim", "paged_adamw_8bit", "--learning_rate", "1e-3"]
    untiled = train(tmp_path, monkeypatch, *flags, "--use_tiled_mlp", "false", "--use_tiled_loss", "false",
                    name="untiled")
    tiled = train(tmp_path, monkeypatch, *flags, name="tiled")
    assert_close_losses(untiled, tiled)
    assert losses(tiled)[0] != losses(tiled)[-1]


@pytest.mark.slow
def test_qlora_under_sequence_parallelism_trains_tiled_as_one_untiled_process(tmp_path: Path) -> None:
    """Ulysses SP over 2 ranks (DeepSpeed ZeRO-2, each rank 256 of the 512 tokens, the 4-bit base whole on each),
    tiled MLP (the GLU engine over the 4-bit weights) + loss, against one untiled process: the same losses within
    1e-5 (refused before 2026-11-30, as not tried)."""
    import launch

    ds = tmp_path / "zero2.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                              "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}))
    common = [*TINY, *QLORA[:-2], "--max_seq_length", "512", "--use_cpu", "true", "--attn_implementation", "sdpa",
              "--learning_rate", "1e-3", "--lr_scheduler_type", "constant"]
    runs = {}
    for name, processes, flags in (("one", 1, ["--use_tiled_mlp", "false", "--use_tiled_loss", "false"]),
                                   ("sp", 2, ["--sequence_parallel_size", "2", "--deepspeed", str(ds)])):
        report = tmp_path / f"{name}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
               "DS_ACCELERATOR": "cpu", "TILEDMLP_TRAIN_REPORT": str(report)}
        target = ["-m", "tiledmlp.cli", "train", *common, *flags, "--output_dir", str(tmp_path / name)]
        cmd = launch.forkrun(processes, *target) if processes > 1 else launch.plain(*target)
        proc = launch.run(cmd, env=env, timeout=420, what=f"QLoRA {name}")
        assert proc.returncode == 0, proc.stderr[-6000:]
        runs[name] = json.loads(report.read_text())
    assert runs["sp"]["wrapped_as"] == "deepspeed" and runs["sp"]["sequence_parallel_size"] == 2
    assert set(runs["sp"]["tiles"].values()) == {4} and set(runs["sp"]["mlp_engines"].values()) == {"glu"}
    assert_close_losses(runs["one"], runs["sp"])
