"""tfpar: data, tensor and pipeline parallelism and gradient compression for TensorFlow + Keras 3."""

import os

# Keep TensorFlow's C++ start-up chatter out of users' logs unless they ask for it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfpar.config import ParallelConfig
from tfpar.errors import ConfigError, TfparError

__version__ = "0.1.0"
__all__ = ["ParallelConfig", "ConfigError", "TfparError"]
