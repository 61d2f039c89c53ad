"""How the Trainer wraps the model across processes, and ``--fsdp`` on CPU processes.

accelerate turns ``--fsdp`` into FSDP only on accelerators: under torchrun on CPUs (gloo) it takes the run as
``MULTI_CPU`` and wraps the model in DDP, without a word, so ``--fsdp`` there trained unsharded. PyTorch's FSDP1
and FSDP2 run on CPUs over gloo (``tests/distributed``), so :func:`fsdp_on_cpu` makes accelerate take the branch it
takes on GPUs; :func:`wrapped_as` says what the run really was (the train summary's ``wrapped_as``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from transformers import Trainer, TrainingArguments

from .args import UsageError, has_accelerator

__all__ = ["check_fsdp_on_cpu", "fsdp_on_cpu", "wrapped_as", "rank_weight_bytes"]


def check_fsdp_on_cpu(train_args: TrainingArguments) -> None:
    """What accelerate's FSDP cannot run on CPUs, refused before anything loads (else it fails at the first step):
    CPU offload, which moves the shards from an accelerator to host memory ("Cannot access accelerator device"),
    and FSDP1 ("Inconsistent compute device and `device_id`")."""
    from ..plan.sharding import trainer_fsdp

    on_cpu = train_args.use_cpu or not has_accelerator()
    if on_cpu and train_args.fsdp and (train_args.fsdp_plugin_args or {}).get("fsdp_version") == 1:
        raise UsageError("--fsdp with fsdp_config version 1 (FSDP1): accelerate sets FSDP1 up for GPUs only (its "
                         "device_id); on the CPU use version 2 (FSDP2, the default)")
    if on_cpu and "offload" in trainer_fsdp(train_args.fsdp, train_args.fsdp_config).split():
        raise UsageError("--fsdp offload (fsdp_config cpu_offload) moves FSDP's shards from a GPU to host memory; "
                         "this run is on the CPU, where they are already: drop it")


@contextlib.contextmanager
def fsdp_on_cpu(train_args: TrainingArguments) -> Iterator[None]:
    """While the Trainer builds its Accelerator: a CPU process group asked for FSDP gets it. accelerate's own
    FSDP branch (``AcceleratorState.__init__``), taken for multi-GPU runs, is repeated for ``MULTI_CPU`` ones:
    the distributed type becomes FSDP, the plugin is kept and given the mixed precision. Nothing changes for
    other runs."""
    if not train_args.fsdp or train_args.device.type != "cpu":
        yield
        return
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: AcceleratorState, *args: object, fsdp_plugin: object = None, **kwargs: object) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


def wrapped_as(trainer: Trainer) -> str:
    """The wrapper the model trained in: ``fsdp2``, ``fsdp1``, ``deepspeed``, ``ddp`` or ``none``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    model = trainer.model_wrapped
    if isinstance(model, FSDPModule):
        return "fsdp2"
    if isinstance(model, FullyShardedDataParallel):
        return "fsdp1"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "deepspeed"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    return "none"


def rank_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this rank holds: a sharded weight's local shard, others whole."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
