"""dsv41: a readable PyTorch implementation of the DeepSeek-V4.1 language model."""

__version__ = "0.1.0"

from .config import ConfigError, ModelConfig, RuntimeConfig  # noqa: E402
from .model import ModelOutput, Transformer  # noqa: E402

__all__ = ["ConfigError", "ModelConfig", "RuntimeConfig", "ModelOutput", "Transformer", "load", "__version__"]


def load(path, runtime: RuntimeConfig | None = None, **kwargs) -> Transformer:
    """Load a model from a released-layout checkpoint directory (see dsv41.checkpoint.model_io.load_model)."""
    from .checkpoint.model_io import load_model

    return load_model(path, runtime, **kwargs)
