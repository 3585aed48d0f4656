"""Keras's own `keras.distribution` API, honoured on TensorFlow.

On the TensorFlow backend Keras 3.15 accepts `set_distribution(ModelParallel(...))` and
ignores it: every variable stays a plain `tf.Variable`, `fit` trains on one device, no
warning (measured on 4 logical CPUs: every weight a `ResourceVariable` without a layout,
`fit` returns as usual; `DataParallel` the same). After `tfpar.layout.enable()` the same
user code trains on the mesh through tfpar's exact step (`MeshTrainer`):

>>> tfpar.layout.enable()
>>> mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
...                                      devices=keras.distribution.list_devices())
>>> layout_map = keras.distribution.LayoutMap(mesh)
>>> layout_map["up/kernel"] = (None, "model")
>>> layout_map["down/kernel"] = ("model", None)
>>> keras.distribution.set_distribution(
...     keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
>>> model = build_my_model()      # any built Keras model, its own layer names
>>> model.compile(optimizer=keras.optimizers.Adam(1e-3),
...               loss="sparse_categorical_crossentropy", metrics=["accuracy"])
>>> history = model.fit(x, y, batch_size=32, epochs=2)

Honoured: `set_distribution(ModelParallel(layout_map, batch_dim_name=...))` (the batch axis
is the mesh axis named "batch", else the first: keras.io's guide names it "data") and
`distribution.scope()` (the layout map's keys are full-match regexes of `variable.path`,
as Keras defines them; every key must match a weight or name a layer), KerasHub's
`Backbone.get_layout_map(mesh)` presets (weights split over `batch` too are gathered where
used), layouts of layer outputs (keys `<layer path>/output`, e.g. `user_mlp/up/output`:
inside the mesh step the layer's output is relaid out to that layout, through
`tfpar.layout.activations.relayout_value`, by the `distribute_tensor` Keras's TensorFlow
backend lacks; values unchanged, so the step stays exact), `DataParallel` (every weight
whole on every device, the batch split: data parallelism on DTensor),
`tfpar.layout.FullyShardedDataParallel` (ZeRO-3: every trainable weight split over `batch`
too, gathered layer by layer, `tfpar.layout.keras_fsdp`), a `DeviceMesh` of
up to two axes over `keras.distribution.list_devices()`, or of three,
`("stage", "batch", "model")`: the model cut into pipeline stages at its first `fit`, each
stage tensor- and data-parallel on its own sub-mesh, trained by the trainer's mesh pipeline
with `mixed_float16` and a `DistributedOptimizer`'s codec per stage
(`tfpar.layout.keras_pipeline`, `tfpar.layout.PipelineParallel` for its micro-batches and
schedule); any model Keras builds, through
its own compiled code (`tfpar.layout.keras_step`): several inputs and outputs (dicts,
lists), `compile(optimizer, loss, loss_weights, metrics, weighted_metrics)` with a loss
per output, any Keras metric (built-in or a custom `keras.metrics.Metric`), `add_loss`
and regularizers, masking, embeddings, RNN layers built with `unroll=True`, a subclassed
model built by its first `fit`, a model's own `train_step` (run inside the mesh step, its
writes kept until the step's end), `test_step`, `predict_step` and `compute_metrics`;
`mixed_bfloat16` and `mixed_float16` (the `LossScaleOptimizer` compile adds) policies;
`fit(x, y, batch_size, epochs, verbose, callbacks, validation_split, validation_data,
shuffle, class_weight, sample_weight, initial_epoch, steps_per_epoch, validation_steps,
validation_batch_size, validation_freq)` with the data Keras's own adapters accept
(arrays and structures of them, `tf.data`, generators), logs as Keras's (the model's
metrics, running over the epoch), returning a `History`; `evaluate`, `predict`,
`train_on_batch`, `test_on_batch`, `predict_on_batch`; callbacks in `evaluate`/`predict`;
Keras's state API (`tfpar.layout.keras_state`): `get_weights`, `set_weights`,
`variable.assign`, `numpy()`, `save_weights`/`load_weights`, `save`/
`keras.models.load_model` (loaded under a distribution: laid out by its map; without
one: a plain model), `summary`, and Keras's `ModelCheckpoint` and `BackupAndRestore` in
`fit`; a `tfpar.DistributedOptimizer`'s compression of the batch axis
(`tfpar.layout.keras_step`, through the mesh trainer's `tfpar.layout.reduction`);
`keras.distribution.initialize()` and `list_devices()` across worker processes
(`tfpar.layout.multi_client.keras_initialize`); dropout drawn as on one device
(`tfpar.layout.rng`). A layout-map key for a weight its layer lacks is logged and unused,
as in Keras.

Refused with one line: a layout-map key matching no weight, no layer and no layer output;
an output layout whose rank or split does not fit the output; a batch axis other than
"batch" (or the first axis when none is so named); a model whose weights were created before `enable()` and `set_distribution`; a
Keras RNN layer without `unroll=True` (DTensor has no layout for the TensorList ops of
its `tf.while_loop`); a model's own `train_step` with the `mixed_float16` loss scale
(`compat.CUSTOM_TRAIN_STEP_LOSS_SCALE`); Keras's
`gradient_accumulation_steps` (use `MeshTrainer`'s `grad_accum_steps`).
`steps_per_execution` and `jit_compile` are not used (one compiled step per batch), which
is logged. A `Concatenate` (any `tf.concat`) feeding a kernel split on its rows
(`("model", None)`) is exact: DTensor alone computes it shard by shard (8e-2 off after 4
steps on TF 2.21), so the mesh step lays every concat out with its axis whole
(`tfpar.layout.concat_axis`).
"""

import functools
import inspect
import itertools
import re

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tfpar import keras_codec_state, nan_guard, patches
from tfpar.errors import ConfigError, TfparError
from tfpar.layout import mesh as mesh_lib
from tfpar.layout import (activations, keras_fsdp, keras_pipeline, keras_state,
                          multi_client, values, variables)
from tfpar.layout.optimizer import stateless_optimizer
from tfpar.layout.trainer import MeshTrainer
from tfpar.zero import fsdp

_LOOPS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
          "predict_on_batch")
_ORIGINAL = {name: patches.MESH_LOOPS[name] for name in _LOOPS}  # Keras's own
_SIGNATURE = {name: inspect.signature(fn) for name, fn in _ORIGINAL.items()}
# The loops that build an unbuilt model from their first batch, as Keras's do.
_BUILDING_LOOPS = ("fit", "evaluate", "train_on_batch", "test_on_batch")
_enabled = False


def check_targets():
    """Problems with the Keras code `enable` hooks (empty when it is keras 3.15.1's): the
    `mesh_*` entries of `tfpar.patches.REGISTRY`."""
    return patches.check_targets(["mesh_variables", "mesh_loops", "mesh_output_layouts",
                                  "mesh_initialize", "mesh_variable_values"])


def enable():
    """Makes Keras's `keras.distribution` API work on TensorFlow, for this process.

    From now on, while a `ModelParallel` or `DataParallel` distribution is set (or its
    `scope()` is entered), Keras variables are created as DTensor DVariables laid out by
    it, and `fit` / `evaluate` / `predict` (and the `*_on_batch` calls) of a model whose
    weights live on a mesh run through tfpar's exact mesh step. Models built without a
    distribution are untouched. Calling it twice is harmless.

    Raises:
        TfparError: Keras is not the version the hooks were written for.
    """
    global _enabled
    problems = check_targets()
    if problems:
        raise TfparError(problems[0])
    if _enabled:
        return
    patches.set_variable_initialize(_initialize)
    for name in _LOOPS:
        patches.set_trainer_loop(name, _routed(name))
    patches.set_distribute_tensor(distribute_tensor)
    patches.set_distribution_initialize(multi_client.keras_initialize)
    keras_state.enable()
    _enabled = True


def disable():
    """Undoes `enable` (models already on a mesh keep their DVariables)."""
    global _enabled
    patches.set_variable_initialize(patches.VARIABLE_INITIALIZE)
    for name, fn in _ORIGINAL.items():
        patches.set_trainer_loop(name, fn)
    patches.set_distribute_tensor(None)
    patches.set_distribution_initialize(None)
    patches.set_list_devices(patches.LIST_DEVICES)
    keras_state.disable()
    _enabled = False


def is_enabled():
    return _enabled


def _initialize(self, value):
    distribution = keras.distribution.distribution()
    if distribution is not None and not isinstance(value, tf.Variable):
        if keras_pipeline.is_pipeline(distribution):  # whole on the host, cut at fit
            keras_pipeline.settings(distribution)
            return patches.VARIABLE_INITIALIZE(self, value)
        check_distribution(distribution)
    return variables._initialize(self, value)


def check_distribution(distribution):
    """Raises `ConfigError` for a distribution tfpar cannot honour; gives its mesh a DTensor
    mesh (`mesh.attach_backend_mesh`)."""
    kinds = (keras.distribution.ModelParallel, keras.distribution.DataParallel)
    if not isinstance(distribution, kinds):
        raise ConfigError("distribution", type(distribution).__name__,
                          "tfpar honours keras.distribution.ModelParallel and DataParallel")
    mesh = distribution.device_mesh
    batch = mesh_lib.batch_axis(mesh)
    if distribution.batch_dim_name != batch or len(mesh.shape) > 2:
        raise ConfigError("batch_dim_name", distribution.batch_dim_name,
                          "tfpar splits batches over the mesh axis named 'batch', else the "
                          "first axis, on a mesh of at most 2 axes (got axes "
                          f"{tuple(mesh.axis_names)}); use batch_dim_name={batch!r} on a "
                          "mesh of 1 or 2 axes, or a mesh ('stage', 'batch', 'model') to "
                          "pipeline")
    if any(size > 1 for axis, size in zip(mesh.axis_names, mesh.shape) if axis != batch):
        # A ZeRO-3 model made earlier in this process may have set all-gathers, which a
        # mesh with a second split axis gets wrong (measured, TF 2.21: a 2x2 ZeRO-3 fit
        # after a 4-device one, 0.66 off one device after 4 steps; 3e-8 with DTensor's
        # own lowering): that one, before any of this mesh's variables is made.
        fsdp.dtensor_gathers()
    mesh_lib.attach_backend_mesh(mesh)


def distribute_tensor(tensor, layout):
    """Keras's `distribute_tensor` for its TensorFlow backend (Keras calls it on a layer's
    output when the distribution has a layout for `<layer path>/output`): inside tfpar's
    mesh step, the output relaid out to `layout` (`activations.relayout_value`); a tensor
    not on a mesh (a plain eager tensor) is returned as it is.

    Raises:
        ConfigError: the layer has several outputs, or the layout does not fit the output
            (rank, or a dimension that does not split over its mesh axis).
    """
    if not isinstance(tensor, (tf.Tensor, tf.Variable)):
        raise ConfigError("layout_map", f"an output layout {tuple(layout.axes)}",
                          "tfpar relays out layers with one output tensor; give the "
                          f"layout to a layer with one output (got {type(tensor).__name__})")
    if tf.executing_eagerly() and not dtensor.is_dtensor(tensor):
        return tensor
    shape = tensor.shape
    if shape.rank != len(layout.axes):
        raise ConfigError("layout_map", f"an output layout {tuple(layout.axes)}",
                          f"the layer's output has shape {tuple(shape)}; give one axis "
                          "entry per dimension")
    mesh = layout.device_mesh
    for dim, axis in zip(shape, layout.axes):
        if axis is not None and dim is not None and dim % mesh_lib.axis_size(mesh, axis):
            raise ConfigError("layout_map", f"an output layout {tuple(layout.axes)}",
                              f"dimension {dim} of the output {tuple(shape)} does not split "
                              f"over {axis}={mesh_lib.axis_size(mesh, axis)}")
    axes = [dtensor.UNSHARDED if axis is None else axis for axis in layout.axes]
    return activations.relayout_value(
        tensor, dtensor.Layout(axes, mesh_lib.attach_backend_mesh(mesh)))


def check_layout_map(distribution, model):
    """Raises `ConfigError` naming a `LayoutMap` key that matches none of `model`'s weight
    paths nor any of its layers' `<path>/output` (a typo there would leave the weight whole,
    or the output as it is, without a word). A key for a weight its layer does not have
    (keras.io's guide lays out `d1/bias` of a `Dense(..., use_bias=False, name="d1")`) is
    logged and left unused, as Keras does."""
    layout_map = patches.layout_map(distribution)
    paths = [v.path for v in model.weights]
    layers = [activations.layer_path(layer) for layer in patches.sublayers(model)]
    outputs = [path + "/output" for path in layers]
    for key in layout_map or ():
        if any(key == p or re.fullmatch(key, p) for p in paths + outputs):
            continue
        owner = key.rsplit("/", 1)[0]
        if "/" in key and any(owner == p or re.fullmatch(owner, p) for p in layers):
            logging.warning("layout_map key %r: layer %r has no such weight (its weights: "
                            "%s); the key is not used", key, owner,
                            ", ".join(p for p in paths if p.startswith(owner + "/")) or "none")
            continue
        raise ConfigError("layout_map", key,
                          "matches none of the model's weight paths (full match of "
                          f"variable.path, e.g. {', '.join(paths[:3])}) nor a layer output "
                          f"(<layer path>/output, e.g. {', '.join(outputs[:2])})")


def _on_mesh(model):
    return any(variables.is_dvariable(v) for v in model.weights)


def _routed(name):
    original = _ORIGINAL[name]

    @functools.wraps(original)
    def loop(self, *args, **kwargs):
        distribution = keras.distribution.distribution()
        if keras_pipeline.is_pipeline(distribution) and not _on_mesh(self):
            arguments = _SIGNATURE[name].bind(self, *args, **kwargs)
            arguments.apply_defaults()
            arguments = dict(arguments.arguments)
            del arguments["self"]
            trainer = keras_pipeline.trainer_for(self, distribution)
            return globals()["_" + name](self, trainer, **arguments)
        if not _on_mesh(self):
            if distribution is not None and self.weights:
                raise TfparError(
                    f"model.{name}: a keras.distribution {type(distribution).__name__} is "
                    "set but the model's weights are plain variables on one device; call "
                    "tfpar.layout.enable() and set_distribution before building the model")
            if distribution is None or name not in _BUILDING_LOOPS:
                return original(self, *args, **kwargs)
            check_distribution(distribution)  # unbuilt: built on its mesh from a batch
        arguments = _SIGNATURE[name].bind(self, *args, **kwargs)
        arguments.apply_defaults()
        arguments = dict(arguments.arguments)
        del arguments["self"]
        trainer = _mesh_trainer(self) if _on_mesh(self) else None
        return globals()["_" + name](self, trainer, **arguments)

    return loop


def _mesh_trainer(model, batch=None):
    """The `MeshTrainer` of `model` (made on first use, again when `compile` changed);
    `batch` (host arrays), when given, builds what is unbuilt (a subclassed model's
    weights, by the distribution's layout map; the compiled metrics and losses, whole) on
    the mesh from its shapes, as Keras's first step would."""
    if model.optimizer is None:
        raise TfparError("compile the model before fit/evaluate/predict")
    distribution = keras.distribution.distribution()
    mesh = _mesh_of(model) if _on_mesh(model) else distribution.device_mesh
    keras_fsdp.set_lowering(model)  # this model's, whatever another model set before
    optimizer = _stateless_on_mesh(model, mesh)
    if batch is not None:  # Keras's build: nothing to do when all is built
        scope = distribution if not _on_mesh(model) else _replicated(mesh)
        with variables.variable_scope(scope):
            patches.symbolic_build(model, batch)
    if not optimizer.built:
        with variables.variable_scope(_replicated(mesh)):
            optimizer.build(model.trainable_variables)
            if getattr(optimizer, "tfpar_skip_nonfinite", False):  # not behind fp16's
                nan_guard.add_counter(optimizer)
    key = (optimizer, model.loss, tuple(id(m) for m in model.metrics),
           len(model.metrics_variables))
    cached = getattr(model, "_tfpar_mesh_trainer", None)
    if cached is not None and cached.compiled_key == key:
        return cached
    if distribution is not None and distribution.device_mesh is mesh:
        check_layout_map(distribution, model)
    for setting in ("steps_per_execution",):
        if getattr(model, setting, 1) not in (1, None):
            logging.warning("%s=%s is not used on a mesh (one compiled step per batch)",
                            setting, getattr(model, setting))
    _metrics_to_mesh(model, mesh)
    _check_layers(model)
    keras_fsdp.prepare(model, distribution)  # ZeRO-3's per-layer gathers, once a model
    trainer = MeshTrainer(mesh, model, optimizer, None)
    trainer.compiled_key = key
    model._tfpar_mesh_trainer = trainer
    return trainer


def _stateless_on_mesh(model, mesh):
    """The model's optimizer, switched to stateless updates before it is built (made again
    on the mesh if it was made before the distribution: unbuilt, nothing is lost)."""
    optimizer = model.optimizer
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ConfigError("gradient_accumulation_steps", optimizer.gradient_accumulation_steps,
                          "is not supported on a mesh; use "
                          "MeshTrainer(..., grad_accum_steps=k) (k micro-batches per step)")
    if optimizer.built:
        if patches.is_stateless_class(type(optimizer)):
            return optimizer
        # built off the mesh step's path (keras.models.load_model): its state moved over,
        # a `DistributedOptimizer`'s hooks too (its class without tfpar's mixins)
        hooks = _tfpar_hooks(optimizer)
        plain = (None if hasattr(optimizer, "inner_optimizer")
                 else keras_pipeline._plain_class(optimizer))
        optimizer = model.optimizer = keras_state.rebuilt_optimizer(
            optimizer, model, _replicated(mesh), plain,
            lambda fresh: _to_mesh_hooks(fresh, hooks))
        return optimizer
    hooks = _tfpar_hooks(optimizer)
    if not all(variables.is_dvariable(v) for v in optimizer.variables):
        with variables.variable_scope(_replicated(mesh)):
            optimizer = optimizer.__class__.from_config(optimizer.get_config())
        model.optimizer = optimizer
    _to_mesh_hooks(optimizer, hooks)
    return stateless_optimizer(optimizer)


_HOOKS = ("tfpar_aggregator", "tfpar_skip_nonfinite", "tfpar_on_nan",
          keras_codec_state.ATTRIBUTE)


def _tfpar_hooks(optimizer):
    """What `tfpar.DistributedOptimizer` set on `optimizer` (or its inner optimizer)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return {name: getattr(inner, name) for name in _HOOKS if hasattr(inner, name)}


def _to_mesh_hooks(optimizer, hooks):
    """A `tfpar.DistributedOptimizer` on the mesh: its class without tfpar's tf.distribute
    mixins (the aggregator's all-reduce and the guarded update run on tf.distribute
    replicas; the mesh step reduces through `tfpar.layout.reduction` and skips
    non-finite updates itself, `keras_step`), its `hooks` kept."""
    from tfpar.compression.keras_hook import AggregatingOptimizerMixin
    from tfpar.nan_guard import SkipNonFiniteMixin
    inner = patches.mix_out(getattr(optimizer, "inner_optimizer", optimizer),
                            (AggregatingOptimizerMixin, SkipNonFiniteMixin))
    for name, value in hooks.items():
        if name == keras_codec_state.ATTRIBUTE:  # untracked by TensorFlow, as it was made
            object.__setattr__(inner, name, value)
        else:
            setattr(inner, name, value)


def _check_layers(model):
    """Refuses, in one line, a layer DTensor cannot run: a Keras RNN layer looping with
    `tf.while_loop` (its TensorList ops have no DTensor layout, `tf.EmptyTensorList`)."""
    for layer in patches.sublayers(model):
        if isinstance(layer, keras.layers.RNN) and not layer.unroll:
            raise ConfigError(f"{layer.name}.unroll", False,
                              "DTensor has no layout for the TensorList ops of an RNN "
                              "layer's tf.while_loop; build it with unroll=True (the same "
                              "values, one step per time step in the graph)")


def _mesh_of(model):
    return next(patches.variable_layout(v).device_mesh for v in model.weights
                if variables.is_dvariable(v))


def _replicated(mesh):
    """A distribution whose variables are whole on every device of `mesh`."""
    return keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name=mesh_lib.batch_axis(mesh))


def _metrics_to_mesh(model, mesh):
    """Metric variables made without a distribution (`compile` outside it) are made again,
    whole on the mesh, with their current values."""
    plain = [v for v in model.metrics_variables if not variables.is_dvariable(v)]
    if plain:
        variables.move_to_mesh(plain, _replicated(mesh))


def _adapter(x, y=None, sample_weight=None, batch_size=None, steps=None, shuffle=False,
             class_weight=None):
    return patches.data_adapter(
        x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
        steps_per_epoch=steps, shuffle=shuffle, class_weight=class_weight)


def _verbose(verbose):
    return 1 if verbose == "auto" else verbose


def _fit(model, trainer, x, y, batch_size, epochs, verbose, callbacks, validation_split,
         validation_data, shuffle, class_weight, sample_weight, initial_epoch,
         steps_per_epoch, validation_steps, validation_batch_size, validation_freq):
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = patches.train_validation_split(
            (x, y, sample_weight), validation_split=validation_split)
    adapter = _adapter(x, y, sample_weight, batch_size, steps_per_epoch, shuffle,
                       class_weight)
    if steps_per_epoch is None:
        steps_per_epoch = adapter.num_batches
        if steps_per_epoch is None:
            raise ConfigError("steps_per_epoch", None, "the data's length is unknown; pass "
                              "steps_per_epoch")
        # one fresh pass (reshuffled) per epoch, as Keras does
        batches = itertools.chain.from_iterable(
            adapter.get_numpy_iterator() for _ in range(initial_epoch, epochs))
    else:  # one iterator across epochs, as Keras does with steps_per_epoch
        batches = adapter.get_numpy_iterator()
    trainer, batches = _ready(model, trainer, batches)
    validation = None
    if validation_data is not None:
        held_out = _adapter(*_unpack(validation_data),
                            batch_size=validation_batch_size or batch_size,
                            steps=validation_steps)
        validation = lambda: itertools.islice(held_out.get_numpy_iterator(),  # noqa: E731
                                              validation_steps)
    history = keras.callbacks.History()
    callbacks = list(callbacks or []) + [history]
    pipelined = isinstance(trainer, keras_pipeline.KerasPipelineTrainer)
    if pipelined:  # called with `model`
        trainer.check_batches([_size(adapter, "batch_size"),
                               _size(adapter, "partial_batch_size")])
        callbacks = [keras_pipeline.UserCallbacks(trainer, callbacks, _verbose(verbose),
                                                  epochs, steps_per_epoch)]
        verbose = 0  # the progress bar is the user's callbacks', with the model's logs
    try:
        trainer.fit(batches, epochs=epochs, steps_per_epoch=steps_per_epoch,
                    initial_epoch=initial_epoch, callbacks=callbacks,
                    verbose=_verbose(verbose), validation_data=validation,
                    validation_freq=validation_freq)
    except BaseException:
        # An error or Ctrl-C mid-fit: the steps taken stay in the model. (On success the
        # callbacks' `on_train_end` wrote them before the user's own ran: writing them
        # again here would undo a callback's `set_weights`, EarlyStopping's best weights.)
        if pipelined:
            trainer.to_model()
        raise
    model.history = history
    return history


def _size(adapter, name):
    """A Keras data adapter's batch size `name`, or None where it has none (a generator's
    or `PyDataset`'s adapter raises `NotImplementedError` for it)."""
    try:
        return getattr(adapter, name, None)
    except NotImplementedError:
        return None


def _ready(model, trainer, batches):
    """The trainer once what is unbuilt (the model, `compile`'s metrics and losses) is
    built from the first batch (as Keras's first step would), and `batches` with that
    batch still first."""
    batches = iter(batches)
    if isinstance(trainer, keras_pipeline.KerasPipelineTrainer):  # built: a functional model
        return trainer, batches
    first = next(batches, None)
    if first is None:
        return trainer, iter(())
    return _mesh_trainer(model, first), itertools.chain([first], batches)


def _unpack(data):
    if isinstance(data, (tuple, list)):
        if len(data) not in (2, 3):
            raise ConfigError("validation_data", f"a tuple of {len(data)}",
                              "give (x, y) or (x, y, sample_weight)")
        return tuple(data)
    return (data,)


def _results(logs, return_dict):
    if return_dict:
        return logs
    return logs["loss"] if len(logs) == 1 else list(logs.values())


def _callbacks(model, callbacks, verbose, steps):
    """A `CallbackList` as Keras's `evaluate`/`predict` make one (a progress bar unless
    `verbose=0`)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    verbose = _verbose(verbose)
    return keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose,
                                        epochs=1, steps=steps, model=model)


def _evaluate(model, trainer, x, y, batch_size, verbose, sample_weight, steps, callbacks,
              return_dict, kwargs):
    adapter = _adapter(x, y, sample_weight, batch_size, steps)
    trainer, batches = _ready(model, trainer, adapter.get_numpy_iterator())
    callbacks = _callbacks(model, callbacks, verbose, steps or adapter.num_batches)
    callbacks.on_test_begin()
    logs = trainer.evaluate(batches, steps=steps, callbacks=callbacks)
    callbacks.on_test_end(logs)
    return _results(logs, return_dict)


def _predict(model, trainer, x, batch_size, verbose, steps, callbacks):
    adapter = _adapter(x, batch_size=batch_size, steps=steps)
    callbacks = _callbacks(model, callbacks, verbose, steps or adapter.num_batches)
    unpack = keras.utils.unpack_x_y_sample_weight
    callbacks.on_predict_begin()
    outs = []
    for index, batch in enumerate(itertools.islice(adapter.get_numpy_iterator(), steps)):
        callbacks.on_predict_batch_begin(index)
        outs.append(_predict_batch(trainer, unpack(batch)[0]))
        callbacks.on_predict_batch_end(index, {"outputs": outs[-1]})
    callbacks.on_predict_end()
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *outs)


def _predict_batch(trainer, x):
    if isinstance(trainer, keras_pipeline.KerasPipelineTrainer):
        return trainer.predict_batch(x)
    out = trainer._predict(*values.batch_to_mesh((x,), trainer.mesh))
    return keras.tree.map_structure(values.to_host, out)


def _train_on_batch(model, trainer, x, y, sample_weight, class_weight, return_dict):
    batch = next(iter(_adapter(x, y, sample_weight, batch_size=_length(x),
                               class_weight=class_weight).get_numpy_iterator()))
    trainer, _ = _ready(model, trainer, [batch])
    return _results(trainer.train_on_batch(*batch), return_dict)


def _test_on_batch(model, trainer, x, y, sample_weight, return_dict):
    trainer, _ = _ready(model, trainer, [(x, y, sample_weight)])
    return _results(trainer.evaluate([(x, y, sample_weight)]), return_dict)


def _predict_on_batch(model, trainer, x):
    return _predict_batch(trainer, keras.tree.map_structure(np.asarray, x))


def _length(x):
    return len(next(iter(keras.tree.flatten(x))))
