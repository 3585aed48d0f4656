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
- `mesh_variables`: Keras's TensorFlow `Variable._initialize` creates a plain
  `tf.Variable`; inside `tfpar.layout.variables.variable_scope` (and after
  `tfpar.layout.enable()` under a Keras distribution) it creates a DTensor DVariable laid
  out by the layout map.
- `mesh_loops`: after `tfpar.layout.enable()`, `TensorFlowTrainer.fit`, `evaluate`,
  `predict`, `train_on_batch`, `test_on_batch`, `predict_on_batch` of a model whose
  weights live on a mesh run through `MeshTrainer` (the code is in
  `tfpar/layout/keras_distribution.py`; checked here: the arguments each loop takes).
- `mesh_output_layouts`: `enable()` adds `distribution_lib.distribute_tensor` to Keras's
  TensorFlow backend (it has none), which Keras calls on a layer's output when the layout
  map has a key `<layer path>/output`: tfpar's relays the output out on the mesh.
- `layer_tree`: not a replacement but a call. To check that every `…/output` key of a
  layout map names one of the model's layers (nested ones too), `sublayers` walks them with
  Keras's private `Layer._flatten_layers` (Keras has no public recursive accessor); the check
  compares its signature.
- `graph_control_input`: not a replacement but a call of a private method.
  `PipelineExecutor(one_op_at_a_time=True)` adds a control edge between two ops that already
  exist (each op of a stage waits for the one created before it) with TensorFlow's
  `Operation._add_control_input`, the call `tf.function`'s automatic control dependencies
  make; the public `tf.control_dependencies` works only on ops not yet created.
  `add_control_input` is the one caller; the check looks at the C++ binding's signature and
  at TensorFlow's own use of it in `auto_control_deps`, and adds one edge in a scratch graph.
- `function_nodes`: not a replacement but a read. `tfpar.pipeline.partition` walks a
  functional model's graph through `Function._nodes_by_depth` (Keras has no public
  accessor for its nodes); `nodes_by_depth` is the one reader, and the check looks for the
  attribute being built in `keras.src.ops.function.Function`.
- `function_loss`: not a replacement but a call. `PipelineModel.compile` wraps a loss
  given as a function in Keras's own `LossFunctionWrapper` (private; it matches the ranks
  of labels and predictions as `compile` does for Keras's models); `function_loss` is the
  one caller, and the check compares the wrapper's signature.
- `dtensor_started`: not a replacement but a read. A mesh pipeline and ZeRO-3 must turn
  DTensor's all-reduce combining off before DTensor starts
  (`tfpar.layout.mesh.no_all_reduce_combining`); whether it has started is DTensor's
  private `api._dtensor_singleton`. `dtensor_started` is the one reader; the check looks
  for the singleton in DTensor's source.
- `function_constant_folding`: not a replacement but a setting TensorFlow has no public
  call for. ZeRO-3 turns off the constant folding TensorFlow's function runtime does when
  a function first runs on a device (`OptimizerOptions.opt_level=L0` in the eager
  context's config, before TensorFlow starts; Grappler still folds constants when the
  function is built). On a DTensor mesh each device's thread builds its part of the step
  while the other devices already run theirs; when they have filled the CPU allocator's
  cap, the folding's copy gets no memory and TensorFlow 2.21 copies into the null buffer
  (`tensor::DeepCopy` from `GraphRunner::Run` in `ConstantFold`): a SIGSEGV instead of the
  out-of-memory error. `no_function_constant_folding` is the one writer; the check looks
  for the eager context's `config` starting from its private `_config`.

- `fused_momentum`: not a replacement but a re-implementation behind a public override.
  `tfpar.optimizers.FusedMomentumMixin.update_step` computes `keras.optimizers.SGD`'s
  momentum update (nesterov=False) with TensorFlow's `ResourceApplyKerasMomentum`
  (`m = m*momentum - lr*g; w += m`) on the slot Keras finds with its private
  `_get_variable_index`; the check looks for that formula and that lookup in
  `SGD.update_step`, and for the kernel in `tf.raw_ops`.
- `loss_tracker`: not a replacement but a read. `tfpar.metrics.report_step_loss` hooks the
  `Mean` a compiled model's train step updates with each batch's loss (Keras 3's
  `Trainer._loss_tracker`, tf_keras's `LossesContainer._total_loss_mean`; neither library
  has a public accessor) to report the step's own loss beside the running mean.
  `loss_tracker` is the one reader; the check looks for the tracker being made in
  `Trainer.compile` and updated in the train steps.
- `onednn_enabled`: not a replacement but a read. Whether TensorFlow runs oneDNN's CPU
  kernels (`tfpar.cpu_kernels.active`, the metrics JSON's `cpu_kernels`) has no public
  accessor; TensorFlow's own tests ask the private binding
  `_pywrap_util_port.IsMklEnabled`. `onednn_enabled` is the one reader; the check calls
  the binding and expects a bool.

`REGISTRY` lists them all, with the target and who applies it; `check_targets()` checks
every one (`tests/test_patches.py`).
"""

import inspect

import keras
from keras.src import tree
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import distribution_lib as tf_distribution_lib
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.ops import function as _keras_function

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _collective
from tensorflow.python.framework import auto_control_deps as _auto_control_deps
from tensorflow.dtensor.python import api as _dtensor_api
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.core.protobuf import config_pb2 as _config_pb2
from tensorflow.python.eager import context as _eager_context
from tensorflow.python.util import _pywrap_util_port

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
# patch -> (what it replaces, what applies it).
REGISTRY = {
    "multi_worker_fit": ("TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica",
                         "tfpar.patches.apply"),
    "multi_worker_cpu_devices": ("CollectiveAllReduceExtended._initialize_local_devices",
                                 "tfpar.patches.apply"),
    "mesh_variables": ("keras.src.backend.tensorflow.core.Variable._initialize",
                       "tfpar.layout.variables.variable_scope, tfpar.layout.enable"),
    "mesh_loops": ("TensorFlowTrainer." + "/".join(_name for _name in (
        "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")),
        "tfpar.layout.enable"),
    "mesh_output_layouts": ("keras.src.backend.tensorflow.distribution_lib.distribute_tensor",
                            "tfpar.layout.enable"),
    "layer_tree": ("keras.src.layers.layer.Layer._flatten_layers (called, not replaced)",
                   "tfpar.layout.keras_distribution.check_layout_map"),
    "graph_control_input": ("tensorflow.python.framework.ops.Operation._add_control_input "
                            "(called, not replaced)",
                            "tfpar.pipeline.executor (one_op_at_a_time)"),
    "function_nodes": ("keras.src.ops.function.Function._nodes_by_depth (read, not replaced)",
                       "tfpar.pipeline.partition"),
    "function_loss": ("keras.src.losses.losses.LossFunctionWrapper (called, not replaced)",
                      "tfpar.pipeline.model.PipelineModel.compile"),
    "dtensor_started": ("tensorflow.dtensor.python.api._dtensor_singleton (read, not replaced)",
                        "tfpar.layout.mesh.no_all_reduce_combining"),
    "fused_momentum": ("keras.optimizers.SGD.update_step (overridden, its formula "
                       "re-implemented by ResourceApplyKerasMomentum)",
                       "tfpar.optimizers.fuse_momentum"),
    "function_constant_folding": ("tensorflow.python.eager.context.Context._config "
                                  "(written before TensorFlow starts, not replaced)",
                                  "tfpar.backends.dtensor (zero_stage=3)"),
    "loss_tracker": ("keras.src.trainers.trainer.Trainer._loss_tracker, tf_keras's "
                     "LossesContainer._total_loss_mean (read, not replaced)",
                     "tfpar.metrics.report_step_loss"),
    "onednn_enabled": ("tensorflow.python.util._pywrap_util_port.IsMklEnabled (called, not "
                       "replaced)", "tfpar.cpu_kernels.active"),
    "coordination_barrier": ("tensorflow.python.eager.context.Context.wait_at_barrier and "
                             ".coordination_service (called, not replaced)",
                             "tfpar.strategy.wait_for_workers"),
}
# `fused_momentum`: Keras 3.15.1's SGD.update_step, the lines the fused kernel computes.
_EXPECTED_SGD_UPDATE = (
    "m = self.momentums[self._get_variable_index(variable)]",
    "ops.multiply(m, momentum),\n                    ops.multiply(gradient, learning_rate),",
    "ops.subtract(",
    "self.assign_add(variable, m)",
)
# `function_constant_folding`: the eager context builds its ConfigProto from `_config`.
_EXPECTED_CONTEXT_CONFIG = "config.CopyFrom(self._config)"
_EXPECTED_DTENSOR_SINGLETON = "_dtensor_singleton = None"
# `coordination_barrier`: the eager context's barrier, called as DTensor's own
# `mesh_util.barrier` calls it (tensorflow 2.21.0).
_EXPECTED_BARRIER = {"wait_at_barrier": "pywrap_tfe.TFE_WaitAtBarrier(",
                     "coordination_service": "return self._coordination_service_config"}
# `loss_tracker`: where keras 3.15.1 makes and updates the tracker, where tf_keras updates its.
_EXPECTED_LOSS_TRACKER = {
    "Trainer.compile": 'self._loss_tracker = metrics_module.Mean(name="loss")',
    "TensorFlowTrainer.train_step": "self._loss_tracker.update_state(",
    "tf_keras LossesContainer.__call__": "self._total_loss_mean.update_state(",
}
_ONEDNN_READER = "IsMklEnabled"  # `onednn_enabled`: the binding TensorFlow's tests ask
_EXPECTED_FLATTEN_LAYERS = "(self, include_self=True, recursive=True)"  # `layer_tree`
# `function_nodes`: where Keras 3.15.1 builds the attribute; `function_loss`: its signature.
_EXPECTED_FUNCTION_NODES = "self._nodes_by_depth = nodes_by_depth"
_EXPECTED_FUNCTION_LOSS = "(self, fn, reduction='sum_over_batch_size', name=None, dtype=None, **kwargs)"
# The arguments each Keras loop `mesh_loops` routes is written against (keras 3.15.1); a
# new argument would be ignored on the mesh.
MESH_LOOP_ARGS = {
    "fit": ["self", "x", "y", "batch_size", "epochs", "verbose", "callbacks",
            "validation_split", "validation_data", "shuffle", "class_weight",
            "sample_weight", "initial_epoch", "steps_per_epoch", "validation_steps",
            "validation_batch_size", "validation_freq"],
    "evaluate": ["self", "x", "y", "batch_size", "verbose", "sample_weight", "steps",
                 "callbacks", "return_dict", "kwargs"],
    "predict": ["self", "x", "batch_size", "verbose", "steps", "callbacks"],
    "train_on_batch": ["self", "x", "y", "sample_weight", "class_weight", "return_dict"],
    "test_on_batch": ["self", "x", "y", "sample_weight", "return_dict"],
    "predict_on_batch": ["self", "x"],
}
MESH_LOOPS = {name: tf_trainer.TensorFlowTrainer.__dict__[name] for name in MESH_LOOP_ARGS}
VARIABLE_INITIALIZE = tf_core.Variable._initialize  # Keras's own, before any patch
# `graph_control_input`: the binding's signature (tensorflow 2.21.0) and TensorFlow's own call.
_EXPECTED_CONTROL_INPUT = {
    "signature": "(self: object, arg0: object) -> None",
    "auto_control_deps": "op._add_control_input(o)",
}
_EXPECTED_INITIALIZE = "self._value = tf.Variable("
_Extended = _collective.CollectiveAllReduceExtended
_original_initialize_local_devices = _Extended._initialize_local_devices
_cpu_devices_per_worker = 1

_applied = False
_original_reduce_per_replica = tf_trainer.reduce_per_replica
_original_maybe_symbolic_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build


def check_targets(names=None):
    """Returns a list of problems: patch targets whose source no longer matches.

    Args:
        names: the `REGISTRY` patches to check (default all).
    """
    names = list(REGISTRY) if names is None else list(names)
    problems = []
    if {"multi_worker_fit", "multi_worker_cpu_devices"} & set(names):
        problems += _check_multi_worker()
    if "mesh_variables" in names and _EXPECTED_INITIALIZE not in inspect.getsource(
            VARIABLE_INITIALIZE):
        problems.append(f"keras {keras.__version__} changed keras.src.backend.tensorflow."
                        "core.Variable._initialize; tfpar.layout was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    if "mesh_loops" in names:
        for name, expected in MESH_LOOP_ARGS.items():
            args = list(inspect.signature(MESH_LOOPS[name]).parameters)
            if args != expected:
                problems.append(f"keras {keras.__version__}: TensorFlowTrainer.{name} takes "
                                f"{args}; tfpar.layout.enable was written for keras "
                                f"{WRITTEN_FOR['keras']}")
    if "graph_control_input" in names:
        problems += _check_control_input()
    if "function_nodes" in names and _EXPECTED_FUNCTION_NODES not in inspect.getsource(
            _keras_function.Function.__init__):
        problems.append(f"keras {keras.__version__} changed Function._nodes_by_depth; "
                        "tfpar.pipeline.partition was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    if "function_loss" in names and str(inspect.signature(
            LossFunctionWrapper.__init__)) != _EXPECTED_FUNCTION_LOSS:
        problems.append(f"keras {keras.__version__} changed LossFunctionWrapper; "
                        "PipelineModel.compile was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    if "dtensor_started" in names and _EXPECTED_DTENSOR_SINGLETON not in inspect.getsource(
            _dtensor_api):
        problems.append(f"tensorflow {tf.__version__} changed dtensor's api._dtensor_singleton; "
                        "tfpar.layout.mesh was written for tensorflow "
                        f"{WRITTEN_FOR['tensorflow']}")
    if "layer_tree" in names and str(inspect.signature(
            keras.layers.Layer._flatten_layers)) != _EXPECTED_FLATTEN_LAYERS:
        problems.append(f"keras {keras.__version__} changed Layer._flatten_layers; "
                        "tfpar.layout's layout-map check was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    if "function_constant_folding" in names and (
            _EXPECTED_CONTEXT_CONFIG not in inspect.getsource(_eager_context.Context.config.fget)
            or "self._initialized = False" not in inspect.getsource(
                _eager_context.Context.__init__)):
        problems.append(f"tensorflow {tf.__version__} changed the eager Context's _config; "
                        "tfpar.patches.no_function_constant_folding was written for "
                        f"tensorflow {WRITTEN_FOR['tensorflow']}")
    if "fused_momentum" in names:
        source = inspect.getsource(keras.optimizers.SGD.update_step)
        if (not all(f in source for f in _EXPECTED_SGD_UPDATE)
                or not hasattr(tf.raw_ops, "ResourceApplyKerasMomentum")):
            problems.append(f"keras {keras.__version__} changed SGD.update_step (or "
                            f"tensorflow {tf.__version__} lost ResourceApplyKerasMomentum); "
                            "tfpar.optimizers.FusedMomentumMixin was written for keras "
                            f"{WRITTEN_FOR['keras']}")
    if "loss_tracker" in names:
        problems += _check_loss_tracker()
    if "onednn_enabled" in names and not isinstance(
            getattr(_pywrap_util_port, _ONEDNN_READER, lambda: None)(), bool):
        problems.append(f"tensorflow {tf.__version__} changed _pywrap_util_port."
                        f"{_ONEDNN_READER}; tfpar.cpu_kernels was written for tensorflow "
                        f"{WRITTEN_FOR['tensorflow']}")
    if "coordination_barrier" in names and not (
            callable(getattr(_eager_context, "async_wait", None)) and all(
                fragment in inspect.getsource(getattr(
                    _eager_context.Context, attr).fget if attr == "coordination_service"
                    else getattr(_eager_context.Context, attr))
                for attr, fragment in _EXPECTED_BARRIER.items())):
        problems.append(f"tensorflow {tf.__version__} changed Context.wait_at_barrier or "
                        ".coordination_service; tfpar.strategy.wait_for_workers was written "
                        f"for tensorflow {WRITTEN_FOR['tensorflow']}")
    if "mesh_output_layouts" in names and _keras_distribute_tensor() is not None:
        problems.append(f"keras {keras.__version__} has its own TensorFlow "
                        "distribution_lib.distribute_tensor; tfpar.layout.enable's "
                        "would replace it")
    return problems


def _check_control_input():
    method = getattr(_tf_ops.Operation, "_add_control_input", None)
    found = [
        method is not None and _EXPECTED_CONTROL_INPUT["signature"] in (method.__doc__ or ""),
        _EXPECTED_CONTROL_INPUT["auto_control_deps"] in inspect.getsource(
            _auto_control_deps.AutomaticControlDependencies.__exit__),
    ]
    if all(found):
        graph = tf.Graph()
        with graph.as_default():
            a, b = tf.constant(1.0), tf.constant(2.0)
            add_control_input(b.op, a.op)
            found.append(list(b.op.control_inputs) == [a.op])
    if all(found):
        return []
    return [f"tensorflow {tf.__version__} changed Operation._add_control_input; "
            "PipelineExecutor(one_op_at_a_time=True) was written for tensorflow "
            f"{WRITTEN_FOR['tensorflow']}"]


def add_control_input(op, before):
    """Makes graph op `op` wait for op `before` (both already created; graph building
    only). Registry entry `graph_control_input`."""
    op._add_control_input(before)


def nodes_by_depth(functional):
    """{depth: [nodes]} of a functional model's graph, or None if it has none. Registry
    entry `function_nodes`."""
    return getattr(functional, "_nodes_by_depth", None)


def function_loss(fn):
    """A `keras.losses.Loss` computing `fn(y_true, y_pred)` as Keras's `compile` wraps a
    function. Registry entry `function_loss`."""
    return LossFunctionWrapper(fn)


def sublayers(model):
    """Every layer inside `model`, nested ones too (not `model` itself). Registry entry
    `layer_tree`."""
    return model._flatten_layers(include_self=False, recursive=True)


def _check_loss_tracker():
    from keras.src.trainers import trainer as _trainer
    sources = {"Trainer.compile": inspect.getsource(_trainer.Trainer.compile),
               "TensorFlowTrainer.train_step": inspect.getsource(
                   tf_trainer.TensorFlowTrainer.train_step)}
    try:
        from tf_keras.src.engine import compile_utils
    except ImportError:  # tf_keras (`keras=2`) is optional
        compile_utils = None
    if compile_utils is not None:
        sources["tf_keras LossesContainer.__call__"] = inspect.getsource(
            compile_utils.LossesContainer.__call__)
    return [f"{where} no longer has `{_EXPECTED_LOSS_TRACKER[where]}`; "
            "tfpar.metrics.report_step_loss was written for keras "
            f"{WRITTEN_FOR['keras']} and its tf_keras"
            for where, source in sources.items() if _EXPECTED_LOSS_TRACKER[where] not in source]


def loss_tracker(model):
    """The `Mean` a compiled model's train step updates with each batch's loss (Keras 3's
    `_loss_tracker`; a tf_keras model's `compiled_loss._total_loss_mean`). Registry entry
    `loss_tracker`."""
    if isinstance(model, keras.Model):
        return model._loss_tracker
    return model.compiled_loss._total_loss_mean


def dtensor_started():
    """Whether DTensor has started in this process. Registry entry `dtensor_started`."""
    return getattr(_dtensor_api, "_dtensor_singleton", None) is not None


def onednn_enabled():
    """Whether this process's TensorFlow runs oneDNN's CPU kernels. Registry entry
    `onednn_enabled`."""
    return bool(getattr(_pywrap_util_port, _ONEDNN_READER)())


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


def no_function_constant_folding():
    """Turns off the constant folding of TensorFlow's function runtime for this process
    (see the module docstring). Registry entry `function_constant_folding`.

    Returns:
        Whether it is off: False when TensorFlow already started in this process (its
        config is read once), which changes nothing but the out-of-memory path.
    """
    ctx = _eager_context.context()
    if ctx._initialized:
        return ctx._config is not None and (ctx._config.graph_options.optimizer_options
                                            .opt_level == _config_pb2.OptimizerOptions.L0)
    config = _config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    config.graph_options.optimizer_options.opt_level = _config_pb2.OptimizerOptions.L0
    ctx._config = config
    return True


def _keras_distribute_tensor():
    """Keras's own `distribute_tensor` on TensorFlow (None in keras 3.15.1), not the one
    `tfpar.layout.enable` puts there."""
    fn = getattr(tf_distribution_lib, "distribute_tensor", None)
    if fn is None or getattr(fn, "__module__", "").startswith("tfpar."):
        return None
    return fn


def _check_multi_worker():
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
        # Element-wise mean across replicas, as the single-worker path computes it, in one
        # collective for all the scalar float logs (loss, metrics): one all-reduce each cost
        # a cross-worker round trip each per step (~5 ms on a 100 Mbit/s link).
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
    """Applies every patch once. Raises `TfparError` if a target changed under an upgrade."""
    global _applied
    if _applied:
        return
    problems = check_targets(["multi_worker_fit", "multi_worker_cpu_devices"])
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
