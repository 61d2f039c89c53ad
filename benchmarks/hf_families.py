"""What tiledmlp does on each transformers causal-LM family: a tiny float64 model per family, patched vs not.

For every family named (transformers model types), one random 2-layer model (hidden 32) is built and trained one
step three ways against the same model untouched:

- ``mlp``: ``tiledmlp.patch(model, num_shards=3)``: which classes were tiled, and the worst relative error of the
  loss and of any parameter's grad (float64: ~1e-15 when exact);
- ``loss``: ``tiledmlp.patch_loss(model)``: admitted or refused (with the reason), and the same error (transformers'
  own loss rounds the logits to float32, so ~1e-7 is the exact answer here);
- ``split``: ``offload_activations(model, split_layers=True)`` against whole-layer offloading under non-reentrant
  checkpointing, both seeded alike: bit-identical, different, or refused.

    python benchmarks/hf_families.py [--families llama,gpt_oss,...] [--json OUT]   # default: the families below

Families whose tiny config cannot be built or run untiled here are reported as such, not counted.
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from typing import Any, Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing

FAMILIES = (
    "llama,mistral,qwen2,qwen3,gemma,gemma2,gemma3_text,phi3,olmo2,olmo3,flex_olmo,granite,granitemoe,cohere,cohere2,"
    "stablelm,starcoder2,phi,gpt_neox,deepseek_v2,glm,glm4,glm4_moe,qwen2_moe,qwen3_moe,mixtral,olmoe,gpt_oss,smollm3,"
    "llama4_text,exaone4,exaone_moe,ernie4_5,ernie4_5_moe,hunyuan_v1_dense,hunyuan_v1_moe,minimax,arcee,apertus,"
    "seed_oss,dots1,nemotron,helium,lfm2,falcon_h1,bitnet,phimoe,gpt2"
)
TINY = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=256, head_dim=8, moe_intermediate_size=40, n_routed_experts=4,
            num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1,
            topk_group=1, output_router_logits=True, pad_token_id=0, shared_expert_intermediate_size=40)


def build(family: str) -> torch.nn.Module:
    """A seeded tiny float64 model of ``family`` (its config takes the TINY fields it has)."""
    fields = AutoConfig.for_model(family)
    config = AutoConfig.for_model(family, **{k: v for k, v in TINY.items() if hasattr(fields, k)},
                                  experts_implementation="eager")  # grouped_mm has no float64 kernel
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double().train()
    with torch.no_grad():
        for p in model.parameters():  # HF inits some weights to constants: randomise for sharper comparisons
            p.add_(torch.randn_like(p) * 0.02)
    return model


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(5)  # the same dropout draws in every run
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_error(a: tuple, b: tuple) -> float:
    (la, ga), (lb, gb) = a, b
    if ga.keys() != gb.keys():
        return float("inf")
    errors = [((la - lb).abs() / lb.abs()).item()]
    errors += [((ga[k] - gb[k]).norm() / gb[k].norm().clamp_min(1e-300)).item() for k in ga]
    return max(errors)


def mlp_check(model: torch.nn.Module, ids: torch.Tensor, ref: tuple) -> dict[str, Any]:
    report = tiledmlp.patch(model, num_shards=3, norms=False)
    return {"tiled": sorted({c for _, c, _ in report.patched}), "error": worst_error(step(model, ids), ref)}


def loss_check(model: torch.nn.Module, ids: torch.Tensor, ref: tuple) -> dict[str, Any]:
    try:
        tiledmlp.patch_loss(model, num_shards=3)
    except ValueError as exc:
        return {"refused": str(exc).split(": ", 2)[-1]}
    return {"error": worst_error(step(model, ids), ref)}


def split_check(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    enable_checkpointing(model, {"use_reentrant": False})
    with tiledmlp.offload_activations(model):
        whole = step(model, ids)
    try:
        with tiledmlp.offload_activations(model, split_layers=True):
            split = step(model, ids)
    except ValueError as exc:
        return {"refused": str(exc)}
    same = torch.equal(whole[0], split[0]) and whole[1].keys() == split[1].keys() \
        and all(torch.equal(whole[1][k], split[1][k]) for k in whole[1])
    return {"bit_identical": same, "error": 0.0 if same else worst_error(split, whole)}


def run(family: str) -> dict[str, Any]:
    """The three checks of one family, or ``{"not_built": reason}``."""
    try:
        model = build(family)
        ids = torch.randint(1, 96, (2, 24))
        ref = step(model, ids)
    except Exception as exc:  # a tiny config this script cannot build or run: not counted
        return {"not_built": f"{type(exc).__name__}: {str(exc)[:80]}"}
    checks: dict[str, Callable[[torch.nn.Module], dict[str, Any]]] = {
        "mlp": lambda m: mlp_check(m, ids, ref), "loss": lambda m: loss_check(m, ids, ref),
        "split": lambda m: split_check(m, ids)}
    result: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            result[name] = check(copy.deepcopy(model))
        except Exception as exc:
            result[name] = {"exception": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return result


def _cell(check: dict[str, Any]) -> str:
    if "exception" in check:
        return f"ERROR {check['exception'][:80]}"
    if "refused" in check:
        return f"refused: {check['refused'][:90]}"
    head = ", ".join(check["tiled"]) + ": " if "tiled" in check else ""
    if "bit_identical" in check:
        return "bit-identical" if check["bit_identical"] else f"DIFFERS ({check['error']:.1e})"
    return f"{head}{check['error']:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=FAMILIES)
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results = {}
    for family in args.families.split(","):
        results[family] = r = run(family)
        if "not_built" in r:
            print(f"{family:18} not built here ({r['not_built']})")
        else:
            print(f"{family:18} mlp [{_cell(r['mlp'])}]  loss [{_cell(r['loss'])}]  split [{_cell(r['split'])}]")
    built = [r for r in results.values() if "not_built" not in r]
    print(f"built: {len(built)}; MLPs tiled within 1e-12: {sum(r['mlp'].get('error', 1) <= 1e-12 for r in built)}; "
          f"loss admitted: {sum('error' in r['loss'] for r in built)}; split bit-identical: "
          f"{sum(r['split'].get('bit_identical', False) for r in built)}, refused: "
          f"{sum('refused' in r['split'] for r in built)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
