"""tfpar: data, tensor and pipeline parallelism and gradient compression for TensorFlow + Keras 3."""

from tfpar.config import ParallelConfig
from tfpar.errors import ConfigError, TfparError

__version__ = "0.1.0"
__all__ = ["ParallelConfig", "ConfigError", "TfparError"]
