"""The one place where tfpar patches Keras and TensorFlow internals.

Written for keras 3.15.1 on tensorflow 2.21.0 (pinned in requirements.txt). Each patch
checks that the code it replaces is still the code it was written against and refuses to
apply otherwise; `tests/test_patches.py` fails when an upgrade moves the target.

Patches:
- `multi_worker_fit`: stock `Model.fit` under `MultiWorkerMirroredStrategy` fails
  (keras-team/keras#20585, tensorflow#72388). `_maybe_symbolic_build` calls
  `strategy.reduce("MEAN", batch)` on a PerReplica tuple of data (only shapes are needed,
  and a cross-worker reduce of input data is a collective nobody asked for), and
  `reduce_per_replica` reduces each scalar log with `axis=0`, which a scalar has not.
  The patch builds from the first local replica's batch and reduces logs element-wise.
- `multi_worker_cpu_devices`: `MultiWorkerMirroredStrategy` uses one CPU device per worker
  whatever the logical-device split. With `cpu_devices(n)` set, each worker runs n
  replicas, one per logical CPU, so several simulated devices per worker work like GPUs.
"""

import inspect

import keras
from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.backend.tensorflow.optimizer import TFOptimizer

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _collective

from tfpar.errors import TfparError

WRITTEN_FOR = {"keras": "3.15.1", "tensorflow": "2.21.0"}

# Fragments of the original source the patches replace; if they vanish, Keras changed.
_EXPECTED = {
    "TensorFlowTrainer._maybe_symbolic_build": 'self.distribute_strategy.reduce(\n                        "MEAN",',
    "reduce_per_replica": 'strategy.reduce("MEAN", v, axis=0)',
    "CollectiveAllReduceExtended._initialize_local_devices": "num_local_devices = 1",
    # Not patched but overridden by subclasses (tfpar.nan_guard, tfpar.compression): they
    # re-implement this step around Keras's all-reduce hook.
    "TFOptimizer._backend_update_step":
        "grads_and_vars = self._all_reduce_sum_gradients(grads_and_vars)",
}
_Extended = _collective.CollectiveAllReduceExtended
_original_initialize_local_devices = _Extended._initialize_local_devices
_cpu_devices_per_worker = 1

_applied = False
_original_reduce_per_replica = tf_trainer.reduce_per_replica
_original_maybe_symbolic_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build


def check_targets():
    """Returns a list of problems: patch targets whose source no longer matches."""
    targets = {
        "TensorFlowTrainer._maybe_symbolic_build": _original_maybe_symbolic_build,
        "reduce_per_replica": _original_reduce_per_replica,
        "CollectiveAllReduceExtended._initialize_local_devices":
            _original_initialize_local_devices,
        "TFOptimizer._backend_update_step": TFOptimizer._backend_update_step,
    }
    problems = []
    for name, fn in targets.items():
        if _EXPECTED[name] not in inspect.getsource(fn):
            problems.append(
                f"keras {keras.__version__}: {name} changed; tfpar's multi-worker fit patch "
                f"was written for keras {WRITTEN_FOR['keras']}")
    return problems


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if self._distribute_strategy is None:
        return
    if iterator is not None:
        for _, _, it in iterator:
            batch = next(it)
            # Shapes are all the symbolic build needs: take the first local replica's part
            # instead of reducing input data across workers.
            data_batch = tree.map_structure(
                lambda x: (self.distribute_strategy.experimental_local_results(x)[0]
                           if isinstance(x, tf.distribute.DistributedValues) else x),
                batch)
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _reduce_per_replica(values, strategy, reduction):
    if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(
            strategy) and not isinstance(strategy, tf.distribute.TPUStrategy):
        # Element-wise mean across replicas, as the single-worker path computes it.
        return tree.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), values)
    return _original_reduce_per_replica(values, strategy, reduction)


def _initialize_local_devices(self, cluster_resolver, worker_device):
    devices, kind = _original_initialize_local_devices(self, cluster_resolver, worker_device)
    if kind == "CPU" and _cpu_devices_per_worker > 1:
        devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(_cpu_devices_per_worker))
    return devices, kind


def cpu_devices_per_worker(n):
    """Makes multi-worker strategies built after this call use `n` local CPU replicas."""
    global _cpu_devices_per_worker
    _cpu_devices_per_worker = max(1, int(n))


def apply():
    """Applies every patch once. Raises `TfparError` if a target changed under an upgrade."""
    global _applied
    if _applied:
        return
    problems = check_targets()
    if problems:
        raise TfparError("; ".join(problems) + ". Install the pinned versions from "
                         "requirements.txt or update tfpar/patches.py.")
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = _reduce_per_replica
    _Extended._initialize_local_devices = _initialize_local_devices
    _applied = True


def is_applied():
    return (_applied
            and tf_trainer.TensorFlowTrainer._maybe_symbolic_build is _maybe_symbolic_build
            and tf_trainer.reduce_per_replica is _reduce_per_replica
            and _Extended._initialize_local_devices is _initialize_local_devices)


_MIXED = {}


def mix_in(obj, mixin):
    """Makes `obj` an instance of a subclass of its class with `mixin` in front, in place
    (once; the subclass is cached). The subclass keeps the original's name and module, so
    `get_config` and saving see the original class: how tfpar hooks an optimizer the user
    already built without changing what gets saved."""
    cls = type(obj)
    if isinstance(obj, mixin):
        return obj
    if (cls, mixin) not in _MIXED:
        _MIXED[cls, mixin] = type(cls.__name__, (mixin, cls),
                                  {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    obj.__class__ = _MIXED[cls, mixin]
    return obj
