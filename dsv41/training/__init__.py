"""Training small DeepSeek-V4.1 models (docs/TRAINING.md): the cache-free forward, the objective, the loop,
export to the released layout."""

from .forward import backbone, dspark
from .model import TrainingModel
from .trainer import Trainer, TrainSettings

__all__ = ["TrainingModel", "Trainer", "TrainSettings", "backbone", "dspark"]
