"""torchrun job: ``tiledmlp train`` (the flags in argv) where only rank ``SIGNAL_RANK`` sends itself SIGUSR1 while
step 2 runs, as a scheduler's signal reaching one node first. Exits with ``tiledmlp train``'s code."""

from __future__ import annotations

import os
import signal
import sys

import transformers as tf

from tiledmlp.train.cli import main

real_step = tf.Trainer.training_step
sent: list[int] = []


def step_that_gets_a_signal(self: tf.Trainer, *args: object, **kwargs: object) -> object:
    if self.state.global_step == 1 and not sent and os.environ["RANK"] == os.environ["SIGNAL_RANK"]:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGUSR1)
    return real_step(self, *args, **kwargs)


tf.Trainer.training_step = step_that_gets_a_signal
sys.exit(main(sys.argv[1:]))
