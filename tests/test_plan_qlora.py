"""``tiledmlp plan`` for QLoRA (``--load_in_4bit``): 4-bit Linears, float32 elsewhere, the generic MLP engine, against
exact CPU profiler peaks of a step as ``tiledmlp train`` builds it."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from trainrun import one_thread  # noqa: F401 (autouse)

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.plan import ModelShape, Setup, predict_step_peak
from tiledmlp.plan.cli import main
from tiledmlp.plan.measure import measure_step_peak

bnb = pytest.importorskip("bitsandbytes")

# weights a visible share of the peak: 4 layers of hidden 256 / intermediate 1024, an 8192-token vocabulary
CONFIG = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=8192, max_position_embeddings=65536, tie_word_embeddings=False)
RECIPES = {"untiled": (False, False), "tiled+loss": (True, False), "tiled+loss+ckpt": (True, True)}
TOLERANCE = 0.05  # |plan / measured - 1|


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qlora-plan")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).save_pretrained(folder)
    return folder


def _measured(folder: Path, recipe: str, seq: int, compute: torch.dtype, nested: bool) -> int:
    """The step ``tiledmlp train --load_in_4bit --lora_r 8`` runs: PEFT's k-bit preparation, LoRA on all Linears."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    tiled, ckpt = RECIPES[recipe]
    quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute,
                                  bnb_4bit_use_double_quant=nested)
    model = tf.LlamaForCausalLM.from_pretrained(folder, device_map="cpu", quantization_config=quant)
    model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False),
                           LoraConfig(r=8, target_modules="all-linear"))
    if tiled:
        tiledmlp.patch(model, loss=True)
    if ckpt:
        enable_checkpointing(model, {"use_reentrant": False})
    model.train()
    torch.manual_seed(1)
    peak = measure_step_peak(model, torch.randint(0, CONFIG["vocab_size"], (1, seq)))
    del model
    gc.collect()
    return peak


@pytest.mark.hollow_matmuls
@pytest.mark.parametrize("seq, compute, nested", [(256, torch.float32, False), (2048, torch.float32, False),
                                                  (1024, torch.bfloat16, True)], ids=["256-fp32", "2048-fp32",
                                                                                      "1024-bf16-nested"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_plan_of_a_qlora_step_matches_profiler_peak(checkpoint: Path, recipe: str, seq: int, compute: torch.dtype,
                                                    nested: bool) -> None:
    """Within 5%. Planned as a float32 LoRA model (the old plan for --load_in_4bit): 1.04-1.14 at 2048 tokens."""
    tiled, ckpt = RECIPES[recipe]
    setup = Setup(dtype=torch.float32, lora_r=8, tiled_mlp=tiled, tiled_loss=tiled, checkpointing=ckpt,
                  device_type="cpu", load_in_4bit=True, bnb_nested_quant=nested)
    planned = predict_step_peak(ModelShape.from_config(tf.LlamaConfig(**CONFIG)), setup, seq).peak_bytes
    measured = _measured(checkpoint, recipe, seq, compute, nested)
    assert abs(planned / measured - 1) <= TOLERANCE, f"plan {planned} vs measured {measured}: {planned / measured:.3f}"


def test_quantized_weights_are_counted_in_4_bits() -> None:
    """The weights term: the decoder's Linears at half a byte plus a float32 scale per 64 (one byte with nested
    quantization), everything else float32; and a QLoRA setup without adapters is refused."""
    shape = ModelShape.from_config(tf.LlamaConfig(**CONFIG))
    base = dict(dtype=torch.float32, lora_r=8, device_type="cpu")
    weights = {nested: predict_step_peak(shape, Setup(**base, load_in_4bit=True, bnb_nested_quant=nested), 64)
               .terms["weights"] for nested in (False, True)}
    plain = predict_step_peak(shape, Setup(**base), 64).terms["weights"]
    q = shape.quantizable_params
    assert q == CONFIG["num_hidden_layers"] * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 1024)
    assert plain - weights[False] == 4 * q - (q // 2 + 4 * q // 64)
    assert plain - weights[True] == 4 * q - (q // 2 + q // 64 + 4 * -(-q // 64 // 256))
    with pytest.raises(ValueError, match="lora_r > 0"):
        Setup(dtype=torch.float32, load_in_4bit=True)
    with pytest.raises(ValueError, match="ZeRO-1/2"):
        Setup(**base, load_in_4bit=True, zero_stage=3, world_size=2)
    zero2 = predict_step_peak(shape, Setup(**base, load_in_4bit=True, zero_stage=2, world_size=2), 64).terms
    assert zero2["weights"] == weights[False]  # ZeRO-2 leaves the weights whole on every rank
    # FSDP2 shards the packed weights (float32 storage) with the rest; their scales stay whole on each rank
    fsdp = {q4: predict_step_peak(shape, Setup(**base, load_in_4bit=q4, fsdp="full_shard", world_size=2), 64).terms
            for q4 in (False, True)}
    assert fsdp[False]["weights"] - fsdp[True]["weights"] == (4 * q - q // 2) // 2 - 4 * q // 64
    # under --bf16 (refused before 2026-11-29): the same shards (float32, packed bytes in bf16 storage), what FSDP
    # gathers in bf16, the packed bytes as they are (tests/distributed/test_plan_fsdp.py: the step as measured)
    mixed = predict_step_peak(shape, Setup(**base, load_in_4bit=True, fsdp="full_shard", world_size=2,
                                           autocast=True), 64).terms
    gathered = fsdp[True]["fsdp_gathered"]
    assert mixed["weights"] == fsdp[True]["weights"] and gathered > mixed["fsdp_gathered"] > gathered // 2


def test_plan_command_takes_load_in_4bit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tiledmlp plan --load_in_4bit --lora_r N`` and the same from a train config; lower than plain LoRA's in
    float32, which PEFT's preparation makes the rest of the weights; refused without --lora_r."""
    folder = tmp_path / "config"
    tf.LlamaConfig(**CONFIG).save_pretrained(folder)
    common = ["--model", str(folder), "--seq", "4096", "--json", "--lora_r", "8", "--dtype", "float32"]

    def peaks(*flags: str) -> dict[str, int]:
        assert main([*common, *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        return {name: row["peak_bytes"]["4096"] for name, row in out["recipes"].items()}

    qlora, lora = peaks("--load_in_4bit", "true"), peaks()
    assert all(qlora[name] < lora[name] for name in lora)
    train = tmp_path / "train.yaml"
    train.write_text(f"model: {folder}\nload_in_4bit: true\nlora_r: 8\nmax_seq_length: 4096\n")
    assert main(["--config", str(train), "--json"]) == 0
    from_config = json.loads(capsys.readouterr().out)["assumptions"]
    assert from_config["load_in_4bit"] is True and from_config["lora_r"] == 8
    assert main(["--model", str(folder), "--load_in_4bit", "true"]) == 2
    assert "--load_in_4bit plans QLoRA as tiledmlp train runs it: with --lora_r N" in capsys.readouterr().err
    sharded = ["--load_in_4bit", "true", "--fsdp", "full_shard", "--world_size", "2"]
    assert main([*common, *sharded]) == 0 and json.loads(capsys.readouterr().out)["assumptions"]["load_in_4bit"]
    bf16 = peaks(*sharded, "--bf16", "true")  # FSDP's bf16 mixed precision over float32 shards: a bf16 step
    assert all(bf16[name] < fp32 for name, fp32 in peaks(*sharded).items())
