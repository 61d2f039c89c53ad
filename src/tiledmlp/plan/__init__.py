"""``tiledmlp plan``: the whole-step memory model (``model``, its per-layer terms in ``layers``), what it reads from a
config (``shapes``, a norm's saved bytes probed by ``probe``), the longest sequence that fits (``search``), how a
step's real peak is measured to check it (``measure``), and the command (``cli``, its flag checks in ``checks``)."""

from .model import Prediction, Setup, predict_loss_peak, predict_step_peak
from .shapes import ModelShape

__all__ = ["ModelShape", "Setup", "Prediction", "predict_step_peak", "predict_loss_peak"]
