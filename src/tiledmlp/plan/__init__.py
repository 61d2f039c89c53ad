"""``tiledmlp plan``: the whole-step memory model (``model``, its per-layer terms in ``layers``, the recipe it plans
for in ``setup``), what it reads from a config (``shapes``, a norm's saved bytes probed by ``probe``), the longest
sequence that fits (``search``), how a step's real peak is measured to check it (``measure``), and the command
(``cli``, its flag checks in ``checks``)."""

from .model import predict_loss_peak, predict_step_peak
from .setup import Prediction, Setup
from .shapes import ModelShape

__all__ = ["ModelShape", "Setup", "Prediction", "predict_step_peak", "predict_loss_peak"]
