"""tfpar: data, tensor and pipeline parallelism and gradient compression for TensorFlow + Keras 3.

From your own Keras script:

    strategy = tfpar.make_strategy()                      # tf.distribute, with tfpar's fixes
    with strategy.scope():
        model = ...
        model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.Adam(),
                                                           compression="powersgd"), loss=...)
    model.fit(..., callbacks=[tfpar.callbacks.BackupAndRestore("backup", save_freq=50)])

`tfpar.PipelineModel.split(model, stages=2)` pipelines a model over devices. Importing
`tfpar` loads no TensorFlow; the names above load it on first use.
"""

import importlib
import os

# Keep TensorFlow's C++ start-up chatter out of users' logs unless they ask for it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfpar.config import ParallelConfig  # noqa: E402
from tfpar.errors import ConfigError, TfparError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ParallelConfig", "ConfigError", "TfparError", "make_strategy",
           "DistributedOptimizer", "PipelineModel", "wait_for_workers", "callbacks"]

# Public names that need TensorFlow, imported on first access (PEP 562).
_LAZY = {"make_strategy": ("tfpar.api", "make_strategy"),
         "DistributedOptimizer": ("tfpar.api", "DistributedOptimizer"),
         "PipelineModel": ("tfpar.pipeline.model", "PipelineModel"),
         "wait_for_workers": ("tfpar.strategy", "wait_for_workers")}
_SUBMODULES = ("callbacks", "compression", "recompute")


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tfpar.{name}")
    else:
        raise AttributeError(f"module 'tfpar' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
