"""Keras's `keras.distribution` on TensorFlow: the hooks of `tfpar.layout.enable` and
`tfpar.layout.variables.variable_scope`, and the reads of Keras's private distribution,
data-adapter and compile state they need (keras 3.15.1).

- `mesh_variables`: Keras's TensorFlow `Variable._initialize` creates a plain
  `tf.Variable`; inside `tfpar.layout.variables.variable_scope` (and after
  `tfpar.layout.enable()` under a Keras distribution) it is replaced
  (`variable_initialize_replaced`, `set_variable_initialize`) by
  `tfpar.layout.variables._initialize`, which creates a DTensor DVariable laid out by the
  layout map (writing the variable's `_layout` and `_value` as Keras's JAX backend does).
- `mesh_loops`: after `tfpar.layout.enable()`, `TensorFlowTrainer.fit`, `evaluate`,
  `predict`, `train_on_batch`, `test_on_batch`, `predict_on_batch` of a model whose
  weights live on a mesh run through `MeshTrainer` (the code is in
  `tfpar/layout/keras_distribution.py`; `set_trainer_loop` installs it; checked here: the
  arguments each loop takes).
- `mesh_output_layouts`: `enable()` adds `distribution_lib.distribute_tensor` to Keras's
  TensorFlow backend (it has none, `set_distribute_tensor`), which Keras calls on a
  layer's output when the layout map has a key `<layer path>/output`: tfpar's relays the
  output out on the mesh.
- `layer_tree`: not a replacement but a call. To check that every `…/output` key of a
  layout map names one of the model's layers (nested ones too), `sublayers` walks them with
  Keras's private `Layer._flatten_layers` (Keras has no public recursive accessor); the check
  compares its signature.
- `backend_mesh`: a read and a write. Keras's `DeviceMesh.backend_mesh` converts the mesh
  on first use through an accelerator system even for CPUs; tfpar gives a mesh its DTensor
  mesh beforehand (`attach_backend_mesh`) in the attribute that property caches,
  `_backend_mesh`, and reads it back (`backend_mesh`).
- `distribution_state`: reads. A distribution's layout map (`layout_map`), a variable's
  Keras layout (`variable_layout`), the metrics given to `compile` (`compiled_metrics`):
  Keras keeps them in private attributes with no public accessor.
- `symbolic_build`: a call. Keras builds what `compile` leaves unbuilt (the compiled
  metrics' and losses' variables) on the first step, inside its own loop; on a mesh they
  must exist, as DVariables, before the step is traced, so `symbolic_build` calls the
  model's private `Trainer._symbolic_build(data_batch=…)` (inside
  `tfpar.layout.variables.variable_scope`); the check looks for the builds it makes.
- `data_adapters`: calls. The mesh loops take the same inputs as Keras's (`data_adapter`,
  `train_validation_split`), through Keras's private data-adapter functions; the check
  compares their signatures.
- `mesh_initialize`: Keras's TensorFlow backend has no `distribution_lib.initialize`
  (`keras.distribution.initialize()` raises AttributeError); `enable()` adds tfpar's
  (`set_distribution_initialize`), which joins the worker processes as DTensor clients.
  Once they are joined, the backend's `list_devices` is replaced (`set_list_devices`): it
  names devices `cpu:0`, `cpu:1`, … without their process, so a job of 2 × 2 CPUs listed
  `cpu:0, cpu:1, cpu:0, cpu:1`; tfpar's lists every process's devices by full name. The
  check: Keras still has no `initialize` of its own, and `list_devices` is the code tfpar
  replaces.
- `mesh_random`: Keras's TensorFlow `random.dropout`, `uniform`, `normal` and
  `truncated_normal` draw with TensorFlow's stateless ops, which DTensor expands shard by
  shard with a seed changed per shard: on a mesh a `Dropout` drops other units than on one
  device. While a mesh step is traced, `tfpar.layout.rng` puts wrappers there
  (`set_backend_random`) that draw the whole tensor on every device, as one device does;
  the check looks for the stateless op each calls and compares `dropout`'s signature.
"""

import contextlib
import inspect

import keras
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import distribution_lib as tf_distribution_lib
from keras.src.backend.tensorflow import random as tf_random
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.trainers import compile_utils as _compile_utils
from keras.src.trainers import data_adapters as _data_adapters
from keras.src.trainers.data_adapters import array_slicing as _array_slicing

from tfpar.patches.versions import WRITTEN_FOR, check_entries

ENTRIES = {
    "mesh_variables": ("keras.src.backend.tensorflow.core.Variable._initialize",
                       "tfpar.layout.variables.variable_scope, tfpar.layout.enable"),
    "mesh_loops": ("TensorFlowTrainer." + "/".join(_name for _name in (
        "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")),
        "tfpar.layout.enable"),
    "mesh_output_layouts": ("keras.src.backend.tensorflow.distribution_lib.distribute_tensor",
                            "tfpar.layout.enable"),
    "layer_tree": ("keras.src.layers.layer.Layer._flatten_layers (called, not replaced)",
                   "tfpar.layout.keras_distribution.check_layout_map, "
                   "tfpar.layout.keras_step (a codec's convolution check)"),
    "backend_mesh": ("keras.distribution.DeviceMesh._backend_mesh (read and written, the "
                     "cache of its backend_mesh property)",
                     "tfpar.layout.mesh, tfpar.layout.multi_client"),
    "distribution_state": ("ModelParallel._layout_map, Variable._layout, "
                           "CompileMetrics._user_metrics/_user_weighted_metrics (read)",
                           "tfpar.layout.variables, tfpar.layout.keras_distribution"),
    "symbolic_build": ("keras.src.trainers.trainer.Trainer._symbolic_build (called, not "
                       "replaced)", "tfpar.layout.keras_distribution"),
    "data_adapters": ("keras.src.trainers.data_adapters.get_data_adapter, array_slicing."
                      "train_validation_split (called, not replaced)",
                      "tfpar.layout.keras_distribution"),
    "mesh_initialize": ("keras.src.backend.tensorflow.distribution_lib.initialize (added), "
                        "list_devices (replaced once processes are joined)",
                        "tfpar.layout.enable, tfpar.layout.multi_client"),
    "mesh_random": ("keras.src.backend.tensorflow.random.dropout/uniform/normal/"
                    "truncated_normal (replaced while a mesh step is traced)",
                    "tfpar.layout.rng"),
}
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
LIST_DEVICES = tf_distribution_lib.list_devices  # `mesh_initialize`: Keras's own
# `mesh_random`: Keras's own, before any patch, and the stateless op each draws with.
BACKEND_RANDOM = {name: getattr(tf_random, name)
                  for name in ("dropout", "uniform", "normal", "truncated_normal")}
_RANDOM_OPS = {"dropout": "tf.nn.experimental.stateless_dropout(",
               "uniform": "tf.random.stateless_uniform(",
               "normal": "tf.random.stateless_normal(",
               "truncated_normal": "tf.random.stateless_truncated_normal("}
_EXPECTED_INITIALIZE = "self._value = tf.Variable("
_EXPECTED_FLATTEN_LAYERS = "(self, include_self=True, recursive=True)"  # `layer_tree`
FRAGMENTS = {
    "backend_mesh": [("DeviceMesh.backend_mesh",
                      lambda: keras.distribution.DeviceMesh.backend_mesh.fget,
                      'if not hasattr(self, "_backend_mesh"):')],
    "distribution_state": [
        ("ModelParallel._layout_map", lambda: keras.distribution.ModelParallel.__init__,
         "self._layout_map = layout_map"),
        ("Variable._layout", lambda: keras.Variable.__init__, "self._layout = layout"),
        ("CompileMetrics._user_metrics", lambda: _compile_utils.CompileMetrics.__init__,
         "self._user_metrics = metrics"),
        ("CompileMetrics._user_weighted_metrics",
         lambda: _compile_utils.CompileMetrics.__init__,
         "self._user_weighted_metrics = weighted_metrics"),
        ("Trainer._compile_metrics", lambda: keras.Model.compile,
         "self._compile_metrics = CompileMetrics(")],
    "symbolic_build": [
        ("Trainer._symbolic_build", lambda: ("signature", keras.Model._symbolic_build),
         "(self, iterator=None, data_batch=None)"),
        ("Trainer._symbolic_build", lambda: keras.Model._symbolic_build,
         "self.compute_metrics,"),
        ("Trainer._symbolic_build", lambda: keras.Model._symbolic_build,
         "self._compute_loss,")],
    "data_adapters": [
        ("data_adapters.get_data_adapter",
         lambda: ("signature", _data_adapters.get_data_adapter),
         "(x, y=None, sample_weight=None, batch_size=None, steps_per_epoch=None, "
         "shuffle=False, class_weight=None)"),
        ("array_slicing.train_validation_split",
         lambda: ("signature", _array_slicing.train_validation_split),
         "(arrays, validation_split)")],
    "mesh_initialize": [
        ("tensorflow distribution_lib.list_devices", lambda: ("signature", LIST_DEVICES),
         "(device_type=None)"),
        ("tensorflow distribution_lib.list_devices", lambda: LIST_DEVICES,
         "tf_devices = tf.config.list_logical_devices(device_type=device_type)")],
    "mesh_random": [(f"tensorflow random.{_name}", lambda _name=_name: BACKEND_RANDOM[_name],
                     _op) for _name, _op in _RANDOM_OPS.items()] + [
        ("tensorflow random.dropout", lambda: ("signature", BACKEND_RANDOM["dropout"]),
         "(inputs, rate, noise_shape=None, seed=None)")],
}


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    problems = []
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
    if "layer_tree" in names and str(inspect.signature(
            keras.layers.Layer._flatten_layers)) != _EXPECTED_FLATTEN_LAYERS:
        problems.append(f"keras {keras.__version__} changed Layer._flatten_layers; "
                        "tfpar.layout's layout-map check was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    if "mesh_output_layouts" in names and keras_distribute_tensor() is not None:
        problems.append(f"keras {keras.__version__} has its own TensorFlow "
                        "distribution_lib.distribute_tensor; tfpar.layout.enable's "
                        "would replace it")
    if "mesh_initialize" in names and _keras_own(
            getattr(tf_distribution_lib, "initialize", None)) is not None:
        problems.append(f"keras {keras.__version__} has its own TensorFlow "
                        "distribution_lib.initialize; tfpar.layout.enable's would replace it")
    problems += check_entries(names, "keras", FRAGMENTS, ENTRIES)
    return problems


def keras_distribute_tensor():
    """Keras's own `distribute_tensor` on TensorFlow (None in keras 3.15.1), not the one
    `tfpar.layout.enable` puts there."""
    return _keras_own(getattr(tf_distribution_lib, "distribute_tensor", None))


def _keras_own(fn):
    if fn is None or getattr(fn, "__module__", "").startswith("tfpar."):
        return None
    return fn


def set_distribution_initialize(fn):
    """Gives Keras's TensorFlow backend `distribution_lib.initialize = fn` (what
    `keras.distribution.initialize` calls); None takes tfpar's away again. Registry entry
    `mesh_initialize`."""
    if fn is not None:
        tf_distribution_lib.initialize = fn
    elif _keras_own(getattr(tf_distribution_lib, "initialize", None)) is None and hasattr(
            tf_distribution_lib, "initialize"):
        del tf_distribution_lib.initialize


def set_list_devices(fn):
    """Makes Keras's TensorFlow backend `distribution_lib.list_devices` (what
    `keras.distribution.list_devices` calls) `fn`; `LIST_DEVICES` puts Keras's own back.
    Registry entry `mesh_initialize`."""
    tf_distribution_lib.list_devices = fn


def set_variable_initialize(fn):
    """Makes Keras's TensorFlow `Variable._initialize` `fn` (`VARIABLE_INITIALIZE` puts
    Keras's own back). Registry entry `mesh_variables`.

    Returns:
        The one it replaced.
    """
    previous = tf_core.Variable._initialize
    tf_core.Variable._initialize = fn
    return previous


@contextlib.contextmanager
def variable_initialize_replaced(fn):
    """Within, Keras's TensorFlow `Variable._initialize` is `fn`; the previous one after.
    Registry entry `mesh_variables`."""
    previous = set_variable_initialize(fn)
    try:
        yield
    finally:
        set_variable_initialize(previous)


def set_trainer_loop(name, fn):
    """Makes `TensorFlowTrainer.<name>` (a `MESH_LOOPS` name) `fn`. Registry entry
    `mesh_loops`."""
    if name not in MESH_LOOPS:
        raise KeyError(name)
    setattr(tf_trainer.TensorFlowTrainer, name, fn)


def set_distribute_tensor(fn):
    """Gives Keras's TensorFlow backend `distribution_lib.distribute_tensor = fn`; None
    takes it away again if it is tfpar's. Registry entry `mesh_output_layouts`."""
    if fn is not None:
        tf_distribution_lib.distribute_tensor = fn
    elif getattr(getattr(tf_distribution_lib, "distribute_tensor", None), "__module__",
                 "").startswith("tfpar."):
        del tf_distribution_lib.distribute_tensor


def set_backend_random(name, fn):
    """Makes Keras's TensorFlow `random.<name>` (a `BACKEND_RANDOM` name) `fn`
    (`BACKEND_RANDOM[name]` puts Keras's own back). Registry entry `mesh_random`."""
    if name not in BACKEND_RANDOM:
        raise KeyError(name)
    setattr(tf_random, name, fn)


def sublayers(model):
    """Every layer inside `model`, nested ones too (not `model` itself). Registry entry
    `layer_tree`."""
    return model._flatten_layers(include_self=False, recursive=True)


def backend_mesh(device_mesh):
    """The DTensor mesh attached to a `keras.distribution.DeviceMesh`, or None (never
    converts). Registry entry `backend_mesh`."""
    return getattr(device_mesh, "_backend_mesh", None)


def attach_backend_mesh(device_mesh, mesh):
    """Makes DTensor `mesh` what `device_mesh.backend_mesh` returns. Registry entry
    `backend_mesh`."""
    device_mesh._backend_mesh = mesh
    return mesh


def layout_map(distribution):
    """The `keras.distribution.LayoutMap` of `distribution`, or None. Registry entry
    `distribution_state`."""
    return getattr(distribution, "_layout_map", None)


def variable_layout(variable):
    """The `keras.distribution.TensorLayout` a Keras variable was created with (None if
    none). Registry entry `distribution_state`."""
    return variable._layout


def compiled_metrics(model):
    """The metrics and weighted metrics given to `model.compile` (as given). Registry entry
    `distribution_state`."""
    compiled = getattr(model, "_compile_metrics", None)
    return (list(getattr(compiled, "_user_metrics", None) or [])
            + list(getattr(compiled, "_user_weighted_metrics", None) or []))


def data_adapter(**kwargs):
    """Keras's data adapter for `fit`-style inputs (`x`, `y`, `sample_weight`,
    `batch_size`, `steps_per_epoch`, `shuffle`, `class_weight`). Registry entry
    `data_adapters`."""
    return _data_adapters.get_data_adapter(**kwargs)


def train_validation_split(arrays, validation_split):
    """Keras's `validation_split` of `fit` inputs. Registry entry `data_adapters`."""
    return _array_slicing.train_validation_split(arrays, validation_split=validation_split)


def symbolic_build(model, data_batch):
    """Builds `model`'s unbuilt compiled metrics and losses (and the model, the optimizer)
    from the shapes of `data_batch` (`(x, y[, sample_weight])`, host arrays), as Keras's
    first step does. Registry entry `symbolic_build`."""
    model._symbolic_build(data_batch=data_batch)
