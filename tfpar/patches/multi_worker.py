"""Patches of tf.distribute's multi-worker path and Keras's `fit` on it, and the reads and
calls of tf.distribute's private code (tensorflow 2.21.0, keras 3.15.1).

- `multi_worker_fit`: stock `Model.fit` under `MultiWorkerMirroredStrategy` fails
  (keras-team/keras#20585, tensorflow#72388). `_maybe_symbolic_build` calls
  `strategy.reduce("MEAN", batch)` on a PerReplica tuple of data (only shapes are needed,
  and a cross-worker reduce of input data is a collective nobody asked for), and
  `reduce_per_replica` reduces each scalar log with `axis=0`, which a scalar has not.
  Under any strategy it also reads that batch from an iterator it then drops, so `fit`
  trains on the dataset's second iterator: a shuffled dataset's second order, not the one
  a single device's `fit` sees (tensorflow.org's multi-worker tutorial ended 1.4e-4 from
  one device after 8 steps). The patch builds from the dataset's element spec (the first
  local replica's shapes; `TFEpochIterator._distributed_dataset`,
  `PerReplicaSpec._value_specs`), reading no batch, and reduces logs element-wise.
- `multi_worker_cpu_devices`: `MultiWorkerMirroredStrategy` uses one CPU device per worker
  whatever the logical-device split. With `cpu_devices(n)` set, each worker runs n
  replicas, one per logical CPU, so several simulated devices per worker work like GPUs.
- `heartbeat_error_text`: not a replacement but a reading. The launcher loses a host as a
  unit when the other hosts' workers name all its workers in TensorFlow's "The following
  tasks are unhealthy (stopped sending heartbeats):" (`tfpar.host_loss.UNHEALTHY`), written
  by the coordination service in C++: the check looks for the words in TensorFlow's
  library.
- `coordination_barrier`: not a replacement but a call. The eager context's
  `wait_at_barrier` and `coordination_service`, called as DTensor's own
  `mesh_util.barrier` calls them; `wait_at_barrier` is the one caller.
- `coordination_config`: not a replacement but a call. `tfpar.strategy` sets the
  coordination service's heartbeat and registration deadline before the strategy is built
  with the eager context's `configure_coordination_service` (no public call takes them);
  `configure_coordination_service` is the one caller; the check compares its signature.
- `strategy_workers`: not a replacement but a read. The number of workers of a
  tf.distribute strategy without a tfpar runtime is its extended's private
  `_num_workers`; `strategy_workers` is the one reader.
- `replica_tokens`: not a replacement but calls. ZeRO's and the hierarchical sum's
  (`tfpar.compression.hierarchical`) collectives take an ordering
  token per local replica: a plain `ResourceVariable` per device (not through the
  strategy's variable creator, which `tf.Variable` goes through), picked by the local
  replica index while a step is traced (`values_util.get_current_replica_id_as_int`, how
  tf.distribute's own variables pick their component). `plain_variable` and
  `replica_index` are the callers.
"""

import inspect

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.python.distribute import collective_all_reduce_strategy as _collective
from tensorflow.python.distribute import values as _values
from tensorflow.python.distribute import values_util as _values_util
from tensorflow.python.eager import context as _eager_context
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops

from tfpar.errors import TfparError
from tfpar.patches import keras_optimizer
from tfpar.patches.versions import WRITTEN_FOR, check_entries

# patch -> (what it replaces, what applies it).
ENTRIES = {
    "multi_worker_fit": ("TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica",
                         "tfpar.patches.apply (tfpar.enable, tfpar.strategy)"),
    "multi_worker_cpu_devices": ("CollectiveAllReduceExtended._initialize_local_devices",
                                 "tfpar.patches.apply (tfpar.enable, tfpar.strategy)"),
    "coordination_barrier": ("tensorflow.python.eager.context.Context.wait_at_barrier and "
                             ".coordination_service (called, not replaced)",
                             "tfpar.strategy.wait_for_workers"),
    "coordination_config": ("tensorflow.python.eager.context.Context."
                            "configure_coordination_service (called, not replaced)",
                            "tfpar.strategy (multi-worker)"),
    "strategy_workers": ("CollectiveAllReduceExtended._num_workers (read, not replaced)",
                         "tfpar.callbacks"),
    "heartbeat_error_text": ("TensorFlow's coordination service's error naming workers "
                             "whose heartbeats stopped (read from workers' output, nothing "
                             "replaced)", "tfpar.launch (a host lost as a unit)"),
    "replica_tokens": ("tensorflow.python.ops.resource_variable_ops.ResourceVariable, "
                       "values_util.get_current_replica_id_as_int (called, not replaced)",
                       "tfpar.zero.sharded.ordering_tokens, "
                       "tfpar.compression.hierarchical"),
}

# Fragments of the original source the patches replace; if they vanish, Keras changed.
_EXPECTED = {
    "TensorFlowTrainer._maybe_symbolic_build":
        'self.distribute_strategy.reduce(\n                        "MEAN",',
    "TFEpochIterator._distributed_dataset": "self._distributed_dataset = dataset",
    "reduce_per_replica": 'strategy.reduce("MEAN", v, axis=0)',
    "CollectiveAllReduceExtended._initialize_local_devices": "num_local_devices = 1",
}
# `coordination_barrier`: the eager context's barrier, called as DTensor's own
# `mesh_util.barrier` calls it (tensorflow 2.21.0).
_EXPECTED_BARRIER = {"wait_at_barrier": "pywrap_tfe.TFE_WaitAtBarrier(",
                     "coordination_service": "return self._coordination_service_config"}
# The newer entries: (what, target, fragment) as `versions.check_fragments` takes them.
FRAGMENTS = {
    "multi_worker_fit": [("PerReplicaSpec._value_specs", lambda: _values.PerReplicaSpec.__init__,
                          "self._value_specs = tuple(value_specs)")],
    "coordination_config": [(
        "Context.configure_coordination_service",
        lambda: ("signature", _eager_context.Context.configure_coordination_service),
        "(self, service_type, service_leader='', enable_health_check=True, "
        "cluster_register_timeout_in_ms=0, heartbeat_timeout_in_ms=0, "
        "shutdown_barrier_timeout_in_ms=0, coordinated_jobs=None, "
        "allow_new_incarnation_to_reconnect=False)")],
    "strategy_workers": [(
        "CollectiveAllReduceExtended._num_workers",
        lambda: _collective.CollectiveAllReduceExtended._initialize_multi_worker,
        "self._num_workers = ")],
    "replica_tokens": [
        ("values_util.get_current_replica_id_as_int",
         lambda: _values_util.get_current_replica_id_as_int,
         "replica_id = replica_context._replica_id"),
        ("ResourceVariable", lambda: _resource_variable_ops.ResourceVariable.__init__,
         "initial_value=None")],
}
_Extended = _collective.CollectiveAllReduceExtended
_original_initialize_local_devices = _Extended._initialize_local_devices
_cpu_devices_per_worker = 1

_applied = False
_original_reduce_per_replica = tf_trainer.reduce_per_replica
_original_maybe_symbolic_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    problems = []
    if {"multi_worker_fit", "multi_worker_cpu_devices"} & set(names):
        problems += _check_multi_worker()
    if "coordination_barrier" in names and not (
            callable(getattr(_eager_context, "async_wait", None)) and all(
                fragment in inspect.getsource(getattr(
                    _eager_context.Context, attr).fget if attr == "coordination_service"
                    else getattr(_eager_context.Context, attr))
                for attr, fragment in _EXPECTED_BARRIER.items())):
        problems.append(f"tensorflow {tf.__version__} changed Context.wait_at_barrier or "
                        ".coordination_service; tfpar.strategy.wait_for_workers was written "
                        f"for tensorflow {WRITTEN_FOR['tensorflow']}")
    if "heartbeat_error_text" in names:
        problems += _check_heartbeat_text()
    problems += check_entries(names, "tensorflow", FRAGMENTS, ENTRIES)
    return problems


def _check_heartbeat_text():
    """`heartbeat_error_text`: the launcher reads `tfpar.host_loss.UNHEALTHY` in the workers'
    output; TensorFlow writes it in C++, so its library must still hold the words."""
    from tfpar.host_loss import UNHEALTHY
    from tfpar.patches.dtensor_lowering import library_mentions
    if library_mentions(UNHEALTHY.encode()):
        return []
    return [f"tensorflow {tf.__version__}'s library no longer holds {UNHEALTHY!r} "
            "(registry entry heartbeat_error_text); tfpar.host_loss's lost-host rule was "
            f"written for tensorflow {WRITTEN_FOR['tensorflow']}"]


def _check_multi_worker():
    targets = {
        "TensorFlowTrainer._maybe_symbolic_build": _original_maybe_symbolic_build,
        "TFEpochIterator._distributed_dataset": tf_trainer.TFEpochIterator.__init__,
        "reduce_per_replica": _original_reduce_per_replica,
        "CollectiveAllReduceExtended._initialize_local_devices":
            _original_initialize_local_devices,
    }
    problems = []
    for name, fn in targets.items():
        if _EXPECTED[name] not in inspect.getsource(fn):
            problems.append(
                f"keras {keras.__version__}: {name} changed; tfpar's multi-worker fit patch "
                f"was written for keras {WRITTEN_FOR['keras']}")
    return problems


def wait_at_barrier(barrier_id, timeout_s):
    """Blocks until every task of this process's coordination service (multi-worker
    `tf.distribute`, DTensor across processes) reaches `barrier_id`, after this process's
    pending ops finish. Registry entry `coordination_barrier`.

    Returns:
        False at once when no coordination service runs (a single process), else True.

    Raises:
        tf.errors.OpError: the barrier timed out or a task failed.
    """
    ctx = _eager_context.context()
    if not ctx.coordination_service:
        return False
    _eager_context.async_wait()
    ctx.wait_at_barrier(barrier_id, int(timeout_s * 1000))
    return True


def configure_coordination_service(**settings):
    """The eager context's `configure_coordination_service(**settings)` (before TensorFlow
    starts). Registry entry `coordination_config`."""
    _eager_context.context().configure_coordination_service(**settings)


def strategy_workers(strategy):
    """Workers of a tf.distribute `strategy` (1 when it does not say). Registry entry
    `strategy_workers`."""
    return getattr(strategy.extended, "_num_workers", 1)


def plain_variable(initial_value):
    """A resource variable on the current device, not through any strategy's variable
    creator. Registry entry `replica_tokens`."""
    return _resource_variable_ops.ResourceVariable(initial_value)


def replica_index():
    """The local replica's index while a replica function is traced. Registry entry
    `replica_tokens`."""
    return _values_util.get_current_replica_id_as_int()


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if self._distribute_strategy is None:
        return
    if iterator is not None:
        # Shapes and dtypes are all the symbolic build needs: the first local replica's,
        # from the dataset's element spec. Reading a batch (as Keras does, then reducing it
        # across workers) would start an iterator that fit drops: it would train on the
        # next one, another order of a shuffled dataset than one device's fit sees.
        data_batch = tf.nest.map_structure(
            lambda spec: (spec._value_specs[0] if isinstance(spec, _values.PerReplicaSpec)
                          else spec),
            iterator._distributed_dataset.element_spec)
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _reduce_per_replica(values, strategy, reduction):
    if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(
            strategy) and not isinstance(strategy, tf.distribute.TPUStrategy):
        # Element-wise mean across replicas, as the single-worker path computes it, in one
        # collective for all the scalar float logs (loss, metrics): one all-reduce each cost
        # a cross-worker round trip each per step.
        leaves = tree.flatten(values)
        if len(leaves) > 1 and all(_float_scalar(v) for v in leaves):
            stacked = strategy.run(
                lambda *vs: tf.stack([tf.cast(tf.reshape(v, []), tf.float32) for v in vs]),
                args=tuple(leaves))
            means = tf.unstack(strategy.reduce("MEAN", stacked, axis=None), num=len(leaves))
            return tree.pack_sequence_as(values, [
                tf.cast(m, _local(v).dtype) for m, v in zip(means, leaves)])
        return tree.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), values)
    return _original_reduce_per_replica(values, strategy, reduction)


def _local(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def _float_scalar(value):
    v = _local(value)
    return (isinstance(v, tf.Tensor) and v.shape.rank == 0 and v.dtype.is_floating
            and v.dtype.size <= 4)


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
    """Applies `multi_worker_fit` and `multi_worker_cpu_devices` once. Raises `TfparError`
    if a target changed under an upgrade (theirs, or `optimizer_hooks`')."""
    global _applied
    if _applied:
        return
    # And the optimizer step tfpar's optimizer mixins override, as before the split.
    problems = (check(["multi_worker_fit", "multi_worker_cpu_devices"])
                + keras_optimizer.check(["optimizer_hooks"]))
    if problems:
        raise TfparError("; ".join(problems) + ". Install the pinned versions from "
                         "requirements.txt or update tfpar/patches.")
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = _reduce_per_replica
    _Extended._initialize_local_devices = _initialize_local_devices
    _applied = True


def is_applied():
    return (_applied
            and tf_trainer.TensorFlowTrainer._maybe_symbolic_build is _maybe_symbolic_build
            and tf_trainer.reduce_per_replica is _reduce_per_replica
            and _Extended._initialize_local_devices is _initialize_local_devices)
