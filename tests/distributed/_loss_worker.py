"""Worker for test_loss_distributed.py: ``main`` runs on 2 ranks (``torch.multiprocessing.spawn``, gloo, CPU).

Each rank trains on its own batch; the reference is one process, untiled, float64, fed both ranks' batches,
with each rank's loss scaled by ``1 / world`` -- the average DDP and FSDP2 compute. All jobs run in one spawn
(process start-up and imports dominate the time); each job's outcome ("ok" or its traceback) is written per
rank to a JSON file that the tests read.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import count_reduce_scatters

from tiledmlp.distributed import close_process_group

WORLD = 2
TOL = 1e-5  # float32 vs the float64 reference
H, V = 24, 40


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 19 + 6 * rank, H, generator=g)  # ranks hold different token counts
    labels = torch.randint(0, V, x.shape[:2], generator=g)
    labels[0, :5] = -100
    return x, labels


def _rel(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a.double() - b.double()).norm() / b.double().norm())
    if not err <= TOL:
        raise AssertionError(f"{what}: relative error {err:.3e} > {TOL:.0e}")


def _init(rank: int, port: int) -> None:
    # CPU jobs whatever the machine has: FSDP2 would otherwise put its device mesh on a visible GPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


class _HeadModel(torch.nn.Module):
    """A Linear producing the hidden states, then the tiled loss with an explicit lm_head weight and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(H, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from tiledmlp.loss import tiled_causal_lm_loss

        h = self.proj(x)
        h.retain_grad()
        return tiled_causal_lm_loss(h, self.head.weight, y, lm_head_bias=self.head.bias, num_shards=4), h


def ddp(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _HeadModel()
    ref = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    hid_ref = []
    for r in range(WORLD):  # untiled float64 reference over both ranks' batches
        x, y = _data(r)
        h = F.linear(x.double(), ref["proj.weight"], ref["proj.bias"])
        h.retain_grad()
        z = F.linear(h, ref["head.weight"], ref["head.bias"])[:, :-1]
        (F.cross_entropy(z.reshape(-1, V), y[:, 1:].reshape(-1)) * 0.25 / WORLD).backward()
        hid_ref.append(h.grad)

    fired: list[int] = []
    model.head.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    wrapped = DDP(model)  # no static_graph / find_unused_parameters: a double "ready" would raise
    loss, h = wrapped(*_data(rank))
    (loss * 0.25).backward()  # scaled after the fact: grads must follow
    if fired != [1]:
        raise AssertionError(f"lm_head weight grad landed {len(fired)} times, expected once")
    _rel(h.grad, hid_ref[rank] * WORLD, "hidden grad")  # DDP averages params' grads, not activations'
    for n, p in model.named_parameters():
        _rel(p.grad, ref[n].grad, f"DDP {n}")


def _llama() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=V, max_position_embeddings=128)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model.train()


def _ids(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(0, V, (2, 17 + 8 * rank), generator=g)
    labels = ids.clone()
    labels[1, :6] = -100
    return ids, labels


def _llama_reference() -> dict[str, torch.Tensor]:
    """Untiled float64 grads of the mean over ranks of each rank's loss."""
    ref_model = _llama().double()
    for r in range(WORLD):
        ids, labels = _ids(r)
        (ref_model(input_ids=ids, labels=labels).loss / WORLD).backward()
    return {n: p.grad for n, p in ref_model.named_parameters()}


def ddp_hf(rank: int) -> None:
    """A Llama wrapped in DDP, then patched through the wrapper."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tiledmlp.loss_patching import patch_loss

    ref = _llama_reference()
    model = _llama()
    wrapped = DDP(model)
    if patch_loss(wrapped, num_shards=3) != 1:
        raise AssertionError("patch_loss should find the Llama inside DDP")
    ids, labels = _ids(rank)
    out = wrapped(input_ids=ids, labels=labels)
    if out.logits is not None:
        raise AssertionError("patched training forward should return logits=None")
    (out.loss / 40).backward()
    for n, p in model.named_parameters():
        _rel(p.grad * 40, ref[n], f"DDP+HF {n}")


def fsdp2(rank: int) -> None:
    """FSDP2 with lm_head as its own unit (sharded outside its forward) + the root; the HF model is patched."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tiledmlp.loss_patching import patch_loss

    ref = _llama_reference()

    model = _llama()
    fully_shard(model.lm_head)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if patch_loss(model, num_shards=3) != 1:  # after wrapping: the class is now FSDPLlamaForCausalLM
        raise AssertionError("patch_loss should find the FSDP2-wrapped Llama")
    if not isinstance(model.lm_head.weight, DTensor):
        raise AssertionError("lm_head.weight should be a sharded DTensor outside its forward")
    counter = [0]
    count_reduce_scatters(counter)
    ids, labels = _ids(rank)
    out = model(input_ids=ids, labels=labels)
    if out.logits is not None:
        raise AssertionError("patched training forward should return logits=None")
    (out.loss * 3.0).backward()  # a loss scaler: divided out below
    units = 2 + len(model.model.layers)
    if counter[0] != units:
        raise AssertionError(f"{counter[0]} reduce-scatters for {units} FSDP units, expected one each")
    full = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # all ranks gather first
            for n, p in model.named_parameters()}
    for n, g in full.items():
        _rel(g / 3.0, ref[n], f"FSDP2 {n}")


def bf16(rank: int) -> None:
    """bf16 weights, so the head's float32 dW sum is narrowed into its bf16 gradient in its own memory
    (precision.SplitSum): DDP and FSDP2 average the very per-rank gradients one process computes, within the bf16
    rounding of that average."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tiledmlp.loss_patching import patch_loss

    def run(wrap: Callable[[torch.nn.Module], torch.nn.Module], r: int) -> dict[str, torch.Tensor]:
        model = _llama().bfloat16()
        wrapped = wrap(model)
        patch_loss(wrapped, num_shards=3)
        ids, labels = _ids(r)
        wrapped(input_ids=ids, labels=labels).loss.backward()
        return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
                for n, p in model.named_parameters()}

    def fsdp(model: torch.nn.Module) -> torch.nn.Module:
        fully_shard(model.lm_head)
        return fully_shard(model)

    local = [run(lambda m: m, r) for r in range(WORLD)]
    expected = {n: sum(grads[n] for grads in local) / WORLD for n in local[0]}
    for name, wrap in (("DDP", DDP), ("FSDP2", fsdp)):
        for n, g in run(wrap, rank).items():
            err = float((g - expected[n]).norm() / expected[n].norm())
            if not err <= 1e-2:
                raise AssertionError(f"bf16 {name} {n}: relative error {err:.3e} > 1e-2")


def _mixtral() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=V, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.5, max_position_embeddings=128,
                           experts_implementation="eager")  # grouped_mm has no float64 kernel
    return tf.MixtralForCausalLM(cfg).train()


def fsdp2_moe(rank: int) -> None:
    """A Mixtral (``loss += coef * aux_loss`` in its forward, in place) under FSDP2, final norm and lm_head one
    unit as accelerate groups them, resharded after forward (fully_shard's default); the Trainer's tensor
    ``num_items_in_batch``. The lm_head call's output was a view of the loss, FSDP2's pre-backward hook on it was
    lost to the in-place add, and both ranks died in the backward (SIGSEGV)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tiledmlp.loss_patching import patch_loss

    batches = [_ids(r) for r in range(WORLD)]
    count = torch.tensor(float(sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)))
    ref = _mixtral().double()
    for ids, labels in batches:  # each rank's share of the global count: the sum is the mean over all tokens
        ref(input_ids=ids, labels=labels, num_items_in_batch=count.double()).loss.backward()
    model = _mixtral()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.norm, model.lm_head])
    fully_shard(model)
    if patch_loss(model, num_shards=3) != 1:
        raise AssertionError("patch_loss should find the FSDP2-wrapped Mixtral")
    ids, labels = batches[rank]
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=count).loss
    if loss._is_view():
        raise AssertionError("the patched forward's loss is a view: FSDP2 loses its hook to an in-place change")
    (loss * WORLD).backward()  # FSDP2 averages over ranks; the reference summed them
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        _rel(g, ref.get_parameter(n).grad, f"FSDP2 MoE {n}")


def fsdp2_mixed_precision(rank: int) -> None:
    """FSDP2 as accelerate sets it up for ``--bf16`` over float32 weights: MixedPrecisionPolicy computing in bf16 with
    bf16 outputs, the final norm and lm_head one unit. FSDP2 casts the loss lm_head returns to bf16, as it casts the
    untiled model's at the root; that cast was refused as "a forward hook on lm_head changed what it returned".
    Tiled grads within bf16 rounding (1e-2) of the untiled model's under the same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from tiledmlp.loss_patching import patch_loss

    def run(tiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = _llama()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                      output_dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard([model.model.norm, model.lm_head], mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if tiled and patch_loss(model, num_shards=3) != 1:
            raise AssertionError("patch_loss should find the FSDP2-wrapped Llama")
        ids, labels = _ids(rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
                               for n, p in model.named_parameters()}

    (loss, grads), (ref_loss, ref) = run(True), run(False)
    if loss.dtype != ref_loss.dtype or abs(float(loss) - float(ref_loss)) > 1e-2 * abs(float(ref_loss)):
        raise AssertionError(f"tiled loss {loss!r} vs untiled {ref_loss!r}")
    for n, g in grads.items():
        err = float((g - ref[n]).norm() / ref[n].norm())
        if not err <= 1e-2:
            raise AssertionError(f"FSDP2 mixed precision {n}: relative error {err:.3e} > 1e-2")


JOBS: dict[str, Callable[[int], None]] = {"ddp": ddp, "ddp_hf": ddp_hf, "fsdp2": fsdp2, "bf16": bf16,
                                            "fsdp2_moe": fsdp2_moe, "fsdp2_mixed_precision": fsdp2_mixed_precision}


def main(rank: int, port: int, out_dir: str) -> None:
    _init(rank, port)
    results = {}
    try:
        for name, job in JOBS.items():
            try:
                job(rank)
                results[name] = "ok"
            except Exception:  # recorded for the test to report; the other job still runs
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        close_process_group()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
