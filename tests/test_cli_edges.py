"""Edge cases of ``tiledmlp plan`` and ``tiledmlp bench`` input: unusual configs and flags that used to crash or
report numbers of the wrong module."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import transformers

from tiledmlp.bench.cli import main as bench_main
from tiledmlp.plan.cli import main as plan_main
from tiledmlp.plan.shapes import ModelShape

_SMALL = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256)


def _plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    rc = plan_main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn installed here")
def test_plan_flash_attention_without_its_package(capsys: pytest.CaptureFixture[str]) -> None:
    """The help offers flash_attention_2; planning it on a host without flash-attn (a login node, a laptop) raised
    transformers' ImportError as a traceback (exit 1) from the meta-device build."""
    result = _plan_json(["--model", "tiny-llama", "--seq", "2048", "--attn_implementation", "flash_attention_2"],
                        capsys)
    assert result["assumptions"]["model_shape"]["attn_impl"] == "flash_attention_2"
    sdpa = _plan_json(["--model", "tiny-llama", "--seq", "2048", "--attn_implementation", "sdpa"], capsys)
    assert set(result["recipes"]) == set(sdpa["recipes"])


def test_plan_config_without_intermediate_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-Neo keeps ``intermediate_size=None`` (4 x hidden); the plan refused it with 'intermediate_size must be
    an int >= 1, got 0'. The width is now read off its first layer's MLP."""
    config = transformers.GPTNeoConfig(hidden_size=64, num_heads=4, num_layers=2, vocab_size=256,
                                       attention_types=[[["global"], 2]], max_position_embeddings=512)
    config.save_pretrained(tmp_path)
    result = _plan_json(["--model", str(tmp_path), "--seq", "2048"], capsys)
    shape = result["assumptions"]["model_shape"]
    assert (shape["intermediate"], shape["mlp_gated"]) == (256, False)
    assert shape["mlp_linear_in"] == [64, 256] and shape["attn_impl"] == "eager"  # GPT-Neo has no sdpa
    assert all(row["max_seq"] > 0 for row in result["recipes"].values())


def test_plan_refuses_a_config_without_any_mlp_width(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT (``ffn_dim``, fc1/fc2 outside any MLP module) is planned since 2026-11-29 (it was refused here before);
    one whose config named no width, with no MLP module to read it off, gets one line naming what is missing, exit
    2 (its config key hidden from the plan)."""
    import tiledmlp.plan.shapes as shapes

    transformers.OPTConfig(ffn_dim=256, word_embed_proj_dim=64, **_SMALL).save_pretrained(tmp_path)
    assert plan_main(["--model", str(tmp_path), "--seq", "2048", "--json"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(shapes, "_intermediate", lambda text: 0)
    assert plan_main(["--model", str(tmp_path), "--seq", "2048"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tiledmlp plan: error:") and "no MLP width" in err


def test_plan_vision_language_model_reads_the_text_decoder() -> None:
    """Gemma 3 with a vision tower: layer 0 of the vision encoder was taken for the decoder's, so its MLP (SigLIP's,
    generic engine) set ``mlp_fast_path`` False and its attention inputs (width 32) joined the LoRA terms."""
    text = dict(intermediate_size=128, head_dim=16, num_key_value_heads=2, **_SMALL)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    vlm = ModelShape.from_config(transformers.Gemma3Config(text_config=text, vision_config=vision))
    alone = ModelShape.from_config(transformers.Gemma3TextConfig(**text))
    assert vlm.mlp_fast_path and vlm.attn_linear_in == (64, 64, 64, 64) == alone.attn_linear_in
    assert vlm.mlp_linear_in == alone.mlp_linear_in == (64, 64, 128)
    assert vlm.activation == alone.activation


@pytest.mark.parametrize("mlp", ["swiglu", "geglu", "gpt2", "swiglu-fused"])
def test_bench_mlp_of_a_hidden_size_the_default_heads_do_not_divide(mlp: str) -> None:
    """``tiledmlp bench --hidden 16``: LlamaConfig's 32 default heads refused the hidden size, so every row failed
    ('nothing ran', exit 1). The MLP has no heads; its config now has one."""
    import torch

    from tiledmlp.bench.configs import build_mlp

    module = build_mlp(mlp, 16, 32, torch.float32)
    assert module(torch.ones(3, 16)).shape == (3, 16)
    assert sum(p.numel() for p in module.parameters()) >= 2 * 16 * 32


def test_bench_preset_note_only_when_the_preset_seq_is_scaled() -> None:
    """``--preset seeds --seq 64,128`` on CPU runs 64 and 128, but the note said the preset's 32..2048 were run."""
    import torch

    from tiledmlp.bench.cli import build_parser, resolve

    parser, cpu = build_parser(), torch.device("cpu")
    settings, notes = resolve(parser.parse_args(["--preset", "seeds", "--seq", "64,128", "--impls", "untiled"]), cpu)
    assert settings["seq"] == [64, 128] and not any("scaled" in n for n in notes)
    settings, notes = resolve(parser.parse_args(["--preset", "seeds", "--impls", "untiled"]), cpu)
    assert settings["seq"][0] == 32 and any("scaled down 64x" in n for n in notes)


def test_bench_shards_of_a_digit_int_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    """``--shards ²``: str.isdigit() took it, int() then raised ValueError as a traceback; now exit 2, one line."""
    with pytest.raises(SystemExit) as exc:
        bench_main(["--shards", "²", "--device", "cpu", "--impls", "untiled"])
    assert exc.value.code == 2
    assert "--shards takes comma-separated positive ints" in capsys.readouterr().err


def test_plan_table_marks_a_peak_over_the_budget_in_text(capsys: pytest.CaptureFixture[str]) -> None:
    """A peak over ``--device_memory_gb`` is marked "(over)" in the table's text, not only in red (gone once the
    output is piped or logged; a peak of 80.004 GiB on 80 prints 80.00); peaks that fit are not marked."""
    flags = ["--model", "tiny-llama", "--seq", "1024,65536"]
    peaks = _plan_json(flags, capsys)["recipes"]["untiled"]["peak_bytes"]
    budget = (peaks["1024"] + peaks["65536"]) / 2 / 2**30  # the short one fits, the long one does not
    assert plan_main([*flags, "--device_memory_gb", f"{budget:.6f}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(ln for ln in lines if ln.strip("│ ").startswith("untiled"))
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert "(over)" in cells[2] and "(over)" not in cells[1], row
    assert any("(over): above the" in ln for ln in lines)
