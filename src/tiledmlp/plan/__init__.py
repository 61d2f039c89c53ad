"""``tiledmlp plan``: the whole-step memory model (``model``), what it reads from a config (``shapes``), how a
step's real peak is measured to check it (``measure``) and the command (``cli``)."""

from .model import Prediction, Setup, predict_loss_peak, predict_step_peak
from .shapes import ModelShape

__all__ = ["ModelShape", "Setup", "Prediction", "predict_step_peak", "predict_loss_peak"]
