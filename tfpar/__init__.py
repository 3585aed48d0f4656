"""tfpar: data, tensor and pipeline parallelism and gradient compression for TensorFlow + Keras 3.

From your own Keras script:

    strategy = tfpar.make_strategy()                      # tf.distribute, with tfpar's fixes
    with strategy.scope():
        model = ...
        model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.Adam(),
                                                           compression="powersgd"), loss=...)
    model.fit(..., callbacks=[tfpar.callbacks.BackupAndRestore("backup", save_freq=50)])

A script that builds its own strategy (`tf.distribute.MultiWorkerMirroredStrategy()`)
calls `tfpar.enable()` first: Keras 3's `fit` then works under it.

`tfpar.PipelineModel.split(model, stages=2)` pipelines a model over devices. Importing
`tfpar` loads no TensorFlow; the names above load it on first use.
"""

import importlib
import importlib.util
import os
import sys

# Keep TensorFlow's C++ start-up chatter out of users' logs unless they ask for it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class _ZooFinder:
    """Finds `tfpar.models` in a checkout: the model zoo is the repository's top-level
    `models/` folder. Installed (`pip install .`), the zoo is the subpackage `tfpar/models`
    (pyproject.toml's `package-dir`) and this finder is not used. tfpar never imports a
    module named `models`: a user's own `models` package stays theirs."""

    ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ZOO = os.path.join(ROOT, "models")

    @classmethod
    def in_checkout(cls):
        """tfpar/ without a models package of its own, next to the zoo and pyproject.toml."""
        return (not os.path.isfile(os.path.join(cls.ROOT, "tfpar", "models", "__init__.py"))
                and os.path.isfile(os.path.join(cls.ZOO, "__init__.py"))
                and os.path.isfile(os.path.join(cls.ROOT, "pyproject.toml")))

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "tfpar.models":
            return None  # tfpar.models.mlp and the rest: found on tfpar.models.__path__
        return importlib.util.spec_from_file_location(
            name, os.path.join(cls.ZOO, "__init__.py"), submodule_search_locations=[cls.ZOO])


# First on the path: a stale tfpar/models/__pycache__ of a checkout from before the zoo
# moved out would otherwise be imported as an empty namespace package.
if _ZooFinder.in_checkout() and _ZooFinder not in sys.meta_path:
    sys.meta_path.insert(0, _ZooFinder)

from tfpar.config import ParallelConfig  # noqa: E402
from tfpar.errors import ConfigError, TfparError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ParallelConfig", "ConfigError", "TfparError", "make_strategy", "enable",
           "DistributedOptimizer", "PipelineModel", "wait_for_workers", "callbacks"]

# Public names that need TensorFlow, imported on first access (PEP 562).
_LAZY = {"make_strategy": ("tfpar.api", "make_strategy"),
         "enable": ("tfpar.api", "enable"),
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
