"""dp × tp × pp from a user's own `model.fit`: a `keras.distribution` mesh with a stage axis.

After `tfpar.layout.enable()`, a `ModelParallel` whose `DeviceMesh` has three axes
`("stage", "batch", "model")` (or two, `("stage", "batch")`) pipelines the user's own
functional model over its stages, each stage tensor- and data-parallel on its own
`batch` × `model` sub-mesh (stage s on the devices of `mesh.devices[s]`, i.e. devices
s·dp·tp … (s+1)·dp·tp − 1 of `keras.distribution.list_devices()`):

>>> tfpar.layout.enable()
>>> mesh = keras.distribution.DeviceMesh((2, 2, 2), ["stage", "batch", "model"],
...                                      devices=keras.distribution.list_devices())
>>> layout_map = keras.distribution.LayoutMap(mesh)
>>> layout_map["up/kernel"] = (None, "model")
>>> layout_map["down/kernel"] = ("model", None)
>>> keras.distribution.set_distribution(tfpar.layout.PipelineParallel(
...     layout_map=layout_map, microbatches=4, schedule="1f1b"))
>>> model = build_my_model()     # a functional model, its own layer names
>>> model.compile(optimizer=keras.optimizers.Adam(1e-3),
...               loss="sparse_categorical_crossentropy", metrics=["accuracy"])
>>> history = model.fit(x, y, batch_size=32, epochs=2)

The model's weights stay plain (whole, on the host device) until its first `fit`,
`evaluate` or `predict`; then it is cut into stages by `tfpar.pipeline.partition`'s rules
(balanced by parameter count) and each stage is rebuilt on its sub-mesh with the layout
map's keys applied to its weights (`tfpar.layout.pipeline`'s `_cut` and `_rebuild`, as the
CLI's `--pipeline_stages` with `--tensor_parallel` does). Training runs the CLI's mesh
pipeline (`tfpar.layout.pipeline.MeshPipelineTrainer`): the schedule, one stateless
optimizer per stage made from the compiled one, with `mixed_float16` one loss-scale
decision for every stage, and a `tfpar.DistributedOptimizer`'s codec as each stage's
reduction over its `batch` axis (with Adam and top-k, PowerSGD or lowbit, Adam in front
of the codec, as on one mesh and in the CLI's 3D: `tfpar.layout.adam_front`). The compiled optimizer is built on the
model's (whole, host) weights and holds the stage optimizers' state: the stage weights
and that state (step count, slots such as Adam's m and v, the loss scale) are written
back into the user's model and its optimizer at the end of every epoch and of `fit`
(also one stopped by an exception), and after every batch when a user callback has a
batch-end hook, so `get_weights`, `save_weights`, `model.save` and a stock Keras
`load_weights` on one device see the trained values, and `keras.saving.load_model`
(under the same distribution) then `fit` goes on with the run, as does Keras's
`BackupAndRestore`. A `load_weights` (or `set_weights`) before the next
`fit`/`evaluate`/`predict`, or a callback's load in `on_train_begin`, is copied onto the
stages. Stage weights pair with the model's by object (an unnamed `add_weight` has
another auto-name in a stage's copy). The compiled optimizer's learning rate, when a
variable (`LearningRateScheduler`, `ReduceLROnPlateau` set it), is copied to every stage
optimizer before each step.

A plain `ModelParallel` on such a mesh runs the 1F1B schedule with one micro-batch per
stage; `PipelineParallel` takes `microbatches`, `schedule` ("gpipe", "1f1b", "zb_h1",
"interleaved" with `virtual_stages`).

Refused with one line: a mesh whose axes are not `("stage", "batch"[, "model"])`; layer
output layouts (`<layer>/output` keys); a model that is not functional with one input and
one output, or does not cut into the stages; a loss other than one mean-reducing loss; a
metric other than accuracy; `loss_weights`, `weighted_metrics`;
`tfpar.callbacks.BackupAndRestore` (tfpar.train's checkpoint; Keras's holds the stages'
codec state too, `tfpar.keras_codec_state`); a layer
whose non-trainable state a training step changes (BatchNormalization's statistics,
Dropout's seed, a variable a custom layer's `call` assigns:
`compat.KERAS_PIPELINE_STATEFUL_LAYER`), and what else the traced forward touches that
the stateless step would drop (each variable it reads or writes seen through
`patches.AccessScope`, before the first step runs): a layer's own `keras.metrics`
(`compat.KERAS_PIPELINE_LAYER_METRIC`), a trainable weight assigned in `call`
(`compat.KERAS_PIPELINE_ASSIGNED_WEIGHT`), a variable held by no layer of the stage
(`compat.KERAS_PIPELINE_OUTSIDE_VARIABLE`, also for a `tf.Variable`, seen as a variable
operation in the traced forward's own ops — not inside a nested function or branch —
and for the model's own variables when it is cut), a layer's own loss terms (a weight's
regularizer, an activity regularizer, `add_loss`: `compat.KERAS_PIPELINE_LAYER_LOSS`,
the stages' loss being the compiled loss alone); the rulebook's rows for the mesh
pipeline (`compat.CHIMERA_MESH`, the
interleaved schedule's) and for the mesh's codecs (`reduction.codec_of`). Each batch (the
last one too, checked before the first step) must split into `microbatches` equal
micro-batches divisible by the `batch` axis (one line naming `microbatches` otherwise). A
`tfpar.DistributedOptimizer`'s step with non-finite gradients is skipped on every stage
(in fp32 through a loss scale of 1, `_fresh`, set back to 1 after a skip, and counted in
its `nonfinite_steps`, which `tfpar.callbacks.NaNGuard` reads; an fp16 overflow halves
the loss scale, uncounted, as in the other fits). A `tfpar.DistributedOptimizer`'s codec
state (each stage's residuals, PowerSGD's Qs, Adam in front's moments and step count) is
in Keras's files of the model under the model's weight paths (`tfpar.keras_codec_state`),
so Keras's `BackupAndRestore`, `load_weights` into a model compiled with the same codec,
and `keras.saving.load_model` (the file names the codec) go on with it. Not held: a mesh
across worker processes (refused).
"""

import json
import re

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import compat, keras_codec_state, patches
from tfpar.errors import ConfigError, TfparError
from tfpar.layout import pipeline as pipeline_lib
from tfpar.layout import presets, reduction, values, variables
from tfpar.layout.mesh import BATCH, MODEL
from tfpar.layout.optimizer import stateless_optimizer
from tfpar.layout.step import _read, refusals_raised, walk_layers
from tfpar.metrics import STEP_LOSS
from tfpar.pipeline.schedule import make_schedule

STAGE = "stage"
_ACCURACY = ("accuracy", "acc", "sparse_categorical_accuracy")


class PipelineParallel(keras.distribution.ModelParallel):
    """Keras's `ModelParallel` on a mesh `("stage", "batch", "model")`, with the pipeline's
    settings (see the module docstring).

    Args:
        layout_map: a `keras.distribution.LayoutMap` on the 3-axis (or `("stage",
            "batch")`) mesh; its keys are full-match regexes of the weights' paths, its
            axes "batch" and "model", applied on every stage's sub-mesh.
        microbatches: M, micro-batches per batch (default: one per stage).
        schedule: "gpipe", "1f1b", "zb_h1" or "interleaved".
        virtual_stages: model chunks per stage (the interleaved schedule only).
        batch_dim_name: the batch axis; "batch".

    Examples:
        >>> keras.distribution.set_distribution(tfpar.layout.PipelineParallel(
        ...     layout_map=layout_map, microbatches=4))
    """

    def __init__(self, *, layout_map, microbatches=None, schedule="1f1b", virtual_stages=1,
                 batch_dim_name=BATCH, **kwargs):
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name, **kwargs)
        self.microbatches, self.schedule = microbatches, schedule
        self.virtual_stages = virtual_stages


def is_pipeline(distribution):
    """Whether `distribution` is a Keras distribution on a mesh with a "stage" axis."""
    return (distribution is not None and hasattr(distribution, "device_mesh")
            and STAGE in tuple(distribution.device_mesh.axis_names))


def settings(distribution):
    """`(stages, data_parallel, tensor_parallel, microbatches, schedule, virtual_stages)`
    of a pipeline distribution, checked.

    Raises:
        ConfigError: the mesh's axes, a bad micro-batch count, or a schedule the mesh
            pipeline does not run (`compat`'s rows).
    """
    mesh = distribution.device_mesh
    names, shape = tuple(mesh.axis_names), tuple(mesh.shape)
    if names not in ((STAGE, BATCH, MODEL), (STAGE, BATCH)) or (
            distribution.batch_dim_name != BATCH):
        raise ConfigError("DeviceMesh.axis_names", names,
                          "a pipeline mesh is ('stage', 'batch', 'model') or ('stage', "
                          "'batch'), stage first, with batch_dim_name='batch'")
    K, dp = shape[0], shape[1]
    tp = shape[2] if len(shape) == 3 else 1
    M = getattr(distribution, "microbatches", None) or K
    schedule = getattr(distribution, "schedule", "1f1b")
    V = getattr(distribution, "virtual_stages", 1)
    if not isinstance(M, int) or M < 1:
        raise ConfigError("microbatches", M, "must be an integer >= 1")
    view = compat.view(backend="dtensor", pipeline_stages=K, data_parallel=dp,
                       tensor_parallel=tp, microbatches=M, schedule=schedule,
                       virtual_stages=V)
    for rule in (compat.CHIMERA_MESH, compat.INTERLEAVED_VIRTUAL_STAGES,
                 compat.INTERLEAVED_MICROBATCHES):
        compat.enforce(rule, view)
    return K, dp, tp, M, schedule, V if schedule == "interleaved" else 1


def stage_meshes(distribution):
    """The K `batch` × `model` sub-meshes of a pipeline distribution's mesh (made once):
    stage s on `mesh.devices[s]`."""
    meshes = getattr(distribution, "tfpar_stage_meshes", None)
    if meshes is None:
        if dtensor.num_clients() > 1:
            raise TfparError("a keras.distribution mesh with a 'stage' axis runs in one "
                             "process; across workers use python -m tfpar.train "
                             "--pipeline_stages with --tensor_parallel")
        K, dp, tp, *_ = settings(distribution)
        devices = []  # "cpu:0" (keras.distribution.list_devices()) as DTensor names it
        for device in np.asarray(distribution.device_mesh.devices).ravel():
            spec = tf.DeviceSpec.from_string(str(device) if "/" in str(device)
                                             else "/device:" + str(device))
            devices.append(f"/device:{spec.device_type.upper()}:{spec.device_index}")
        meshes = pipeline_lib.make_meshes(dp, tp, K, devices)
        distribution.tfpar_stage_meshes = meshes
    return meshes


def trainer_for(model, distribution):
    """The `KerasPipelineTrainer` of `model` (made on first use, again when `compile`
    changed), its stages holding the model's current weights."""
    if model.optimizer is None:
        raise TfparError("compile the model before fit/evaluate/predict")
    key = _key(model, distribution)
    trainer = getattr(model, "_tfpar_pipeline_trainer", None)
    if trainer is None or trainer.compiled_key != key:
        trainer = _build(model, distribution)
        trainer.compiled_key = key
        object.__setattr__(model, "_tfpar_pipeline_trainer", trainer)
    trainer.from_model()
    return trainer


def _key(model, distribution):
    """What a trainer is built from: the pipeline's settings, the mesh's devices, and
    `compile`'s optimizer, loss and config (a new distribution or a recompile with other
    settings builds a new trainer)."""
    mesh = distribution.device_mesh
    devices = tuple(str(d) for d in np.asarray(mesh.devices).ravel())
    # without the optimizer's config: it holds the current learning rate, which callbacks
    # change (the stage optimizers' state must outlive that)
    config = json.dumps({k: v for k, v in (model.get_compile_config() or {}).items()
                         if k != "optimizer"}, sort_keys=True, default=repr)
    # the optimizer and loss themselves (held, so a new one never takes a freed one's id);
    # which weights train (a layer frozen or unfrozen since builds anew: its stages'
    # trainable weights and optimizers change)
    trainable = tuple(id(v) for v in model.trainable_variables)
    return (settings(distribution), tuple(mesh.shape), devices, model.optimizer,
            model.loss, config, trainable)


def _build(model, distribution):
    K, dp, tp, M, schedule_name, V = settings(distribution)
    _check_model(model)
    rules = _rules(distribution, model)
    loss, accuracy = _loss(model), _accuracy(model)
    meshes = stage_meshes(distribution)
    codec, error_feedback, options = _codec(model.optimizer)
    if not model.optimizer.built:
        # On the whole model's (host) weights, as Keras's first step or `load_model` builds
        # it: it holds the stage optimizers' state between fits and in Keras's files.
        model.optimizer.build(model.trainable_variables)
    if dp == 1:
        codec = None  # one replica on `batch`: nothing to reduce, the exact step runs
    stages, optimizers, reductions = [], [], []
    for v, (nodes, src, out) in enumerate(pipeline_lib._cut(model, K * V)):
        mesh = meshes[v % K]
        scope = keras.distribution.ModelParallel(
            layout_map=presets.layout_map(mesh, rules), batch_dim_name=BATCH)
        with variables.variable_scope(scope):
            stage = pipeline_lib._rebuild(nodes, src, out, v)
            optimizer = stateless_optimizer(_fresh(model.optimizer))
            optimizer.build(stage.trainable_variables)
        pipeline_lib._refuse_keras_loops(stage)
        stages.append(stage)
        optimizers.append(optimizer)
        if codec is not None:
            # with the stage's optimizer: Adam in front of the codec where `codec_of` asks
            # for it (a `DistributedOptimizer` over Adam), as the CLI's 3D and one mesh
            reductions.append(reduction.for_variables(
                mesh, stage.trainable_variables, codec, error_feedback, dict(options),
                optimizer))
    staged = pipeline_lib.StagedModel(stages, K, name=f"{model.name}_mesh_pipeline")
    staged.stage_optimizers = optimizers
    object.__setattr__(staged, "tfpar_reductions", tuple(reductions))
    trainer = KerasPipelineTrainer(
        meshes, staged, optimizers, make_schedule(schedule_name, K, M, V), loss,
        accuracy=accuracy, reductions=reductions or None, user_model=model)
    trainer.codec = codec  # the stages' codec (None: DTensor's exact sum over `batch`)
    # Keras's files of the model hold the stages' codec state under the model's weight
    # paths (`tfpar.keras_codec_state`), repeated ones told apart in the model's order as
    # on one mesh; a file loaded before now is written in here
    names = dict(zip(map(id, model.trainable_variables),
                     reduction.distinct_paths(model.trainable_variables)))
    whole = {id(s): names.get(id(w), w.path) for s, w in trainer.pairs}
    keras_codec_state.attach(model, model.optimizer, reductions, [
        dict(zip(reduction.distinct_paths(stage.trainable_variables),
                 [whole[id(v)] for v in stage.trainable_variables])) for stage in stages])
    return trainer


def _check_model(model):
    """Refuses what `compile` set that the pipeline's one loss and accuracy cannot honour
    (the model's graph is checked by `tfpar.pipeline.partition` when it is cut)."""
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    if getattr(inner, "gradient_accumulation_steps", None):
        raise ConfigError("gradient_accumulation_steps", inner.gradient_accumulation_steps,
                          "is not supported on a pipeline mesh (Keras accumulates over "
                          "batches); the pipeline's microbatches already split each batch")
    config = model.get_compile_config() or {}
    for setting in ("loss_weights", "weighted_metrics"):
        if config.get(setting):
            raise ConfigError(setting, config[setting],
                              "the pipeline mesh takes one loss and accuracy; compile "
                              "without it")


def _rules(distribution, model):
    """The layout map's `(key, axes)` pairs, for each stage's sub-mesh; refuses layer
    output keys and keys that match no weight (`keras_distribution.check_layout_map`)."""
    from tfpar.layout.keras_distribution import check_layout_map
    layout_map = patches.layout_map(distribution)
    keys = list(layout_map or ())
    for key in keys:
        if key.endswith("/output"):
            raise ConfigError("layout_map", key,
                              "a pipeline mesh lays out weights only; remove the layer "
                              "output key (or use a mesh without a 'stage' axis)")
    check_layout_map(distribution, model)
    return [(key, tuple(layout_map[key].axes)) for key in keys]


def _loss(model):
    """The compiled loss as a mean-reducing `keras.losses.Loss`."""
    loss = model.loss
    if isinstance(loss, str) or (callable(loss) and not isinstance(loss, keras.losses.Loss)):
        fn = keras.losses.get(loss)
        loss = fn if isinstance(fn, keras.losses.Loss) else patches.function_loss(fn)
    if not isinstance(loss, keras.losses.Loss) or loss.reduction != "sum_over_batch_size":
        raise ConfigError("loss", getattr(loss, "name", loss),
                          "the pipeline mesh takes one loss averaged over the batch (a name, "
                          "a function, or a keras.losses.Loss with "
                          "reduction='sum_over_batch_size')")
    return loss


def _accuracy(model):
    """The name the compiled accuracy metric is logged under, or None."""
    metrics = (model.get_compile_config() or {}).get("metrics") or []
    names = [m for m in keras.tree.flatten(metrics)]
    if any(not isinstance(m, str) or m not in _ACCURACY for m in names) or len(names) > 1:
        raise ConfigError("metrics", names,
                          "the pipeline mesh reports the loss and, with metrics=['accuracy'], "
                          "the accuracy of integer labels; compile with those")
    return names[0] if names else None


def _codec(optimizer):
    """`(codec, error_feedback, options)` of a `tfpar.DistributedOptimizer`'s aggregator
    (`reduction.codec_of`), or `(None, True, {})`."""
    from tfpar.compression import keras_hook
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    offloaded = getattr(inner, "tfpar_offload", "none")
    if offloaded != "none":
        compat.enforce(compat.KERAS_MESH_OFFLOAD, compat.view(
            backend="dtensor", offload=offloaded, keras_distribution=True))
    aggregator = keras_hook.aggregator_of(optimizer)
    if aggregator is None:
        return None, True, {}
    return reduction.codec_of(aggregator)


def _plain_class(optimizer):
    """The Keras optimizer class under tfpar's tf.distribute mixins (a
    `DistributedOptimizer`'s aggregation and non-finite guard run on tf.distribute
    replicas; on the mesh the stages' reductions and the loss scale do that)."""
    from tfpar.compression.keras_hook import AggregatingOptimizerMixin
    from tfpar.nan_guard import SkipNonFiniteMixin
    return patches.unmixed_class(type(optimizer), (AggregatingOptimizerMixin,
                                                   SkipNonFiniteMixin))


def _fresh(optimizer):
    """A new, unbuilt optimizer like the compiled one, for one stage (a
    `LossScaleOptimizer` around a new inner optimizer under `mixed_float16`). A
    `tfpar.DistributedOptimizer` never applies a non-finite step: in fp32 its stages get a
    `LossScaleOptimizer` at scale 1 that never grows, so the mesh pipeline's one decision
    for every stage skips such a step everywhere (a scale that is a power of two leaves
    every finite step's values exact)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is None:
        fresh = _plain_class(optimizer).from_config(optimizer.get_config())
        if getattr(optimizer, "tfpar_skip_nonfinite", False):
            return keras.optimizers.LossScaleOptimizer(fresh, initial_scale=1.0,
                                                       dynamic_growth_steps=2**31 - 1)
        return fresh
    return type(optimizer)(_plain_class(inner).from_config(inner.get_config()),
                           initial_scale=optimizer.initial_scale,
                           dynamic_growth_steps=optimizer.dynamic_growth_steps)


class KerasPipelineTrainer(pipeline_lib.MeshPipelineTrainer):
    """The mesh pipeline's trainer for a user's model (`MeshPipelineTrainer`'s arguments,
    and `user_model`: the whole model whose weights the stages copy and write back)."""

    def __init__(self, meshes, model, optimizers, schedule, loss, accuracy, reductions,
                 user_model):
        super().__init__(meshes, model, optimizers, schedule, loss, accuracy=accuracy,
                         reductions=reductions)
        self.user_model = user_model
        # Each stage weight with the model's weight it was copied from (by object, not by
        # path: an unnamed `add_weight` is auto-named anew in the stage's copy).
        whole = {id(v): v for v in user_model.weights}
        self.pairs = []
        for stage in model.stages:
            for variable, source in stage.tfpar_sources:
                if id(source) not in whole:  # already a weight of an earlier stage
                    raise ConfigError(
                        "layer", _owner_name(user_model, source),
                        "a layer called in two pipeline stages would be copied into "
                        "each and trained apart; call it within one stage, or give each "
                        "call its own layer")
                self.pairs.append((variable, whole.pop(id(source))))
        if whole:  # the model's own variables, outside its layers (`model.v = ...`)
            compat.enforce(compat.KERAS_PIPELINE_OUTSIDE_VARIABLE, compat.view(
                backend="dtensor", outside_variable=", ".join(
                    v.path for v in whole.values())))
        self.state_pairs = _state_pairs(self.pairs, model.stages, optimizers,
                                        user_model.optimizer)
        self._forward = self._compiled(self._predict_step)
        self.stateful_layer = _stateful_layer(model.stages)
        user = getattr(user_model.optimizer, "inner_optimizer", user_model.optimizer)
        # A schedule is in each stage optimizer's copied config; a variable learning rate
        # (which LearningRateScheduler, ReduceLROnPlateau set) is pushed before each step.
        self.scheduled = isinstance(user.get_config().get("learning_rate"), dict)
        self.rates = [v for o in optimizers
                      for v in getattr(o, "inner_optimizer", o).variables
                      if v.path.endswith("/learning_rate")]
        self.rate = None
        # fp32 `tfpar.DistributedOptimizer`: the skip's scale is held at 1 (`_fresh`).
        compiled = user_model.optimizer
        self.scale_one = (getattr(compiled, "tfpar_skip_nonfinite", False)
                          and getattr(compiled, "inner_optimizer", None) is None)
        # where such a skipped step is counted, as the other fits count it
        # (`keras_step`, `tfpar.nan_guard`): `NaNGuard` reads it
        self.counter = getattr(compiled, "nonfinite_steps", None) if self.scale_one else None
        self.refused = None  # `stage_forward`'s refusal, raised inside the traced step

    def _step(self, batch):
        if self.stateful_layer:
            compat.enforce(compat.KERAS_PIPELINE_STATEFUL_LAYER, compat.view(
                backend="dtensor", stateful_layer=self.stateful_layer))
        if not self.scheduled:
            rate = float(np.asarray(self.user_model.optimizer.learning_rate))
            if rate != self.rate:
                for variable in self.rates:
                    values.assign(variable, rate)
                self.rate = rate
        with refusals_raised(self):  # a refusal made while this step was traced
            out = super()._step(batch)
        if self.scale_one:  # a skipped step halved it: back to 1, so it never reaches 0
            scales = [o.dynamic_scale for o in self.stage_optimizers]
            if float(values.to_host(scales[0].value)) != 1.0:
                for scale in scales:
                    values.assign(scale, 1.0)
                if self.counter is not None:
                    self.counter.assign_add(1.0)
        return out

    def from_model(self):
        """The user's model's current weights onto the stages, and its optimizer's state
        (`iterations`, slots, loss scale) into the stage optimizers' (a rebuilt trainer,
        a loaded model, goes on from there)."""
        for stage_variable, variable in self.pairs + self.state_pairs:
            values.assign(stage_variable, np.asarray(variable))

    def to_model(self):
        """The stages' weights into the user's model (whole, host values), and the stage
        optimizers' state into its optimizer (`model.save`, `save_weights` and Keras's
        `BackupAndRestore` hold it). The codecs' state needs no copy: Keras's files read
        it from the stages' reductions (`tfpar.keras_codec_state`)."""
        written = set()
        for stage_variable, variable in self.pairs + self.state_pairs:
            if id(variable) not in written:  # `iterations`, the scale: equal on every stage
                written.add(id(variable))
                variable.assign(values.to_host(stage_variable.value))

    def check_batches(self, sizes):
        """Refuses, before any step, a batch size of `fit`'s data (the last batch's too)
        that does not split into the micro-batches (`_on_mesh`'s line)."""
        parts = self.mesh.shape[0]
        for size in sizes:
            if size and size % (self.M * parts):
                raise ConfigError("microbatches", self.M,
                                  f"the batch of {size} must split into {self.M} "
                                  f"micro-batches divisible by data_parallel={parts}; pick "
                                  "a batch_size (and data length) that do")

    def stage_forward(self, v, tv, ntv, h, training=True):
        """Stage model v on `h` (`MeshPipelineTrainer`'s); in training, refuses (while the
        step is traced, before it runs) a forward that touches state the stateless step
        would not carry: a variable of the stage written in `call` (non-trainable state,
        a trainable weight), a layer's own metric, or a variable of no layer of the stage
        read or written (`_refuse_accesses`); or a loss term of a layer's own, which the
        stages' loss leaves out (`_refuse_layer_losses`)."""
        stage = self.model.stages[v]
        mapping = (list(zip(stage.trainable_variables, tv))
                   + list(zip(stage.non_trainable_variables, ntv)))
        graph = tf.compat.v1.get_default_graph()  # the step being traced
        first = len(graph.get_operations())
        with patches.AccessScope(state_mapping=mapping, collect_losses=training) as scope:
            out = stage(h, training=training)
        if training:
            try:
                _refuse_accesses(stage, scope, graph.get_operations()[first:])
                _refuse_layer_losses(stage, scope)
            except ConfigError as error:
                self.refused = error
                raise
        return out

    def train_on_batch(self, x, y, sample_weight=None):
        logs = super().train_on_batch(x, y, sample_weight)
        self.to_model()
        return logs

    def _predict_step(self, x):
        h = x
        for v, stage in enumerate(self.model.stages):
            if v:
                h = pipeline_lib._move(h, self.mesh_of(v - 1), self.mesh_of(v))
            mapping = list(zip(stage.weights, _read(stage.weights)))
            with keras.StatelessScope(state_mapping=mapping):
                h = stage(h, training=False)
        return h

    def predict_batch(self, x):
        """The model's output for a host batch `x`, padded to a multiple of the `batch`
        axis (rows are independent in inference) and cut back."""
        x = np.asarray(x)
        parts = self.mesh.shape[0]
        pad = -len(x) % parts
        if pad:
            x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
        out = values.to_host(self._forward(values.batch_to_mesh((x,), self.mesh)[0]))
        return out[:len(out) - pad]


def _owner_name(model, weight):
    """`"name (Class)"` of the layer of `model` that holds `weight` (its path if none)."""
    return next((f"{layer.name} ({type(layer).__name__})"
                 for layer in walk_layers(model)
                 if any(w is weight for w in layer.weights)), weight.path)


def _refuse_layer_losses(stage, scope):
    """`compat.KERAS_PIPELINE_LAYER_LOSS` for the first layer of `stage` with a loss term
    of its own: a weight with a regularizer (Keras adds it from `model.losses`, never in
    `call`), or a loss `call` added (`scope`, collecting: an activity regularizer,
    `add_loss`). The stages' loss is the compiled loss of the last stage's output alone."""
    layers = list(walk_layers(stage))
    for layer in layers:
        # Keras adds a regularizer's term for trainable weights only (a frozen,
        # regularized pretrained block adds none on one device either)
        if any(getattr(w, "regularizer", None) is not None for w in layer.trainable_weights):
            compat.enforce(compat.KERAS_PIPELINE_LAYER_LOSS, compat.view(
                backend="dtensor", layer_loss=f"{layer.name} ({type(layer).__name__})"))
    if scope.losses:
        active = [layer for layer in layers
                  if getattr(layer, "activity_regularizer", None) is not None]
        name = (f"{active[0].name} ({type(active[0]).__name__})" if active else
                f"a layer of {stage.name} (add_loss in call)")
        compat.enforce(compat.KERAS_PIPELINE_LAYER_LOSS, compat.view(
            backend="dtensor", layer_loss=name))


def _refuse_accesses(stage, scope, ops):
    """The rulebook's row for the first variable the forward of `stage` in `scope` (a
    `patches.AccessScope`; `ops`: the operations it traced) touched that the stateless
    step would not carry, or nothing:

    - a trainable weight of the stage written (a clip in `call`): the step applies the
      optimizer to the values it read, the write is dropped
      (`compat.KERAS_PIPELINE_ASSIGNED_WEIGHT`);
    - a non-trainable variable of the stage written (a running mean):
      `compat.KERAS_PIPELINE_STATEFUL_LAYER`;
    - a variable of a layer's own `keras.metrics` read or written (`update_state` in
      `call`): the stage's copy of the layer holds its own metric, which the step neither
      keeps nor reports (`compat.KERAS_PIPELINE_LAYER_METRIC`);
    - any other variable (a `keras.Variable` held outside the stage's layers, a weight of
      another stage's layer): the step neither trains nor writes it
      (`compat.KERAS_PIPELINE_OUTSIDE_VARIABLE`); so too a `tf.Variable` that is not a
      Keras variable, seen as a variable operation among `ops` (the stage's own
      variables come in as the step's values: its forward has none), named by it.
    """
    trainable = {id(w) for w in stage.trainable_variables}
    own = trainable | {id(w) for w in stage.non_trainable_variables}
    metrics = {id(v): layer for layer in walk_layers(stage)
               for v in layer.metrics_variables}
    touched = dict(scope.written)
    touched.update((key, v) for key, v in scope.read.items() if key not in touched)
    for key, variable in touched.items():
        written = key in scope.written
        if key in own and not written:
            continue
        if key in own:
            rule, field = ((compat.KERAS_PIPELINE_ASSIGNED_WEIGHT, "assigned_weight")
                           if key in trainable else
                           (compat.KERAS_PIPELINE_STATEFUL_LAYER, "stateful_layer"))
            name = _owner_name(stage, variable)
        elif key in metrics:
            layer = metrics[key]
            rule, field = compat.KERAS_PIPELINE_LAYER_METRIC, "layer_metric"
            name = f"{layer.name} ({type(layer).__name__})"
        else:
            rule, field = compat.KERAS_PIPELINE_OUTSIDE_VARIABLE, "outside_variable"
            name = variable.path
        compat.enforce(rule, compat.view(backend="dtensor", **{field: name}))
    for op in ops:
        if (op.type.endswith("VariableOp") or op.type.startswith("Resource")) and any(
                t.dtype == tf.resource for t in op.inputs):
            compat.enforce(compat.KERAS_PIPELINE_OUTSIDE_VARIABLE, compat.view(
                backend="dtensor", outside_variable=f"a tf.Variable ({op.type} {op.name})"))


def _owners(optimizer, weights):
    """`(variable, index)` for each of `optimizer`'s variables that a plain Keras
    optimizer of its class has (built on `weights`; tfpar's mixins' own are left out):
    the index in `weights` of the weight it is a slot of (None: its own, `iterations`,
    the rate).

    Found by building a twin (same class and config) on stand-ins of `weights` named
    `tfpar<i>x`: Keras builds the same variables in the same order for the same shapes,
    and names a slot after its weight, here a name no other weight's is a prefix of (a
    model's own names collide: two nested models' "proj", a weight "y_kernel" of a layer
    "x" and one "kernel" of "x_y", Adafactor's factors named by the weight's bare name).

    Raises:
        TfparError: the twin's variables do not line up with `optimizer`'s."""
    twin = _plain_class(optimizer).from_config(optimizer.get_config())
    # Each stand-in of its weight's rank, every dimension 1 (Keras's optimizers branch on
    # a weight's rank and `overwrite_with_gradient`, not its size): a full-size twin held
    # (1 + slots) x the model in host memory for a moment.
    stand_ins = []
    for i, w in enumerate(weights):
        stand_in = keras.Variable(np.zeros((1,) * len(w.shape), w.dtype), dtype=w.dtype,
                                  name=f"tfpar{i}x")
        stand_in.overwrite_with_gradient = getattr(w, "overwrite_with_gradient", False)
        stand_ins.append(stand_in)
    twin.build(stand_ins)
    # the twin's variables, in order, among `optimizer`'s (which may hold more: tfpar's
    # mixins' own), each with the names it may have there
    expected = []
    for variable in twin.variables:
        match = re.match(r"tfpar(\d+)x(?=_|$)", variable.name)
        if match is None:
            expected.append((None, {variable.name}, variable))
            continue
        index, tag = int(match.group(1)), match.group(0)
        names = {variable.name.replace(tag, weights[index].path.replace("/", "_"), 1),
                 variable.name.replace(tag, weights[index].name, 1)}
        expected.append((index, names, variable))
    out, j = [], 0
    for variable in optimizer.variables:
        if j < len(expected) and variable.name in expected[j][1] and (
                len(variable.shape) == len(expected[j][2].shape)):
            out.append((variable, expected[j][0]))
            j += 1
    if j != len(expected):
        raise TfparError(
            f"the {type(optimizer).__name__} optimizer's variables do not line up with a "
            "fresh one's built on the same weights; a pipeline mesh runs Keras's own "
            "optimizers (SGD, Adam, ...) built on the model's trainable weights")
    return out


def _state_pairs(pairs, stages, optimizers, compiled):
    """`(stage optimizer variable, the compiled optimizer's variable that holds it)` for
    every variable of the stage optimizers with a counterpart in the compiled (built)
    optimizer: its step count and learning rate, each slot (paired by the weight it
    belongs to, `_owners`, and its rank among that weight's slots; never by name), and,
    when both are `LossScaleOptimizer`s, the loss scale and its counter. (An fp32
    `tfpar.DistributedOptimizer`'s stages hold a scale of 1 that the compiled one has
    not: `_fresh`.)

    Raises:
        TfparError: a stage optimizer's variable the compiled one has no counterpart of.
    """
    def levels(optimizer):
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is None:
            return [], optimizer
        ids = {id(v) for v in inner.variables}
        return [v for v in optimizer.variables if id(v) not in ids], inner

    def by_owner(optimizer, weights):
        """{(id(weight), rank): slot} and {name: [own variables]} of `optimizer`, and
        the ids of every variable of it either holds."""
        slots, own, found = {}, {}, set()
        for variable, index in _owners(optimizer, weights):
            found.add(id(variable))
            if index is None:
                own.setdefault(variable.name, []).append(variable)
            else:
                ranked = slots.setdefault(id(weights[index]), [])
                slots[(id(weights[index]), len(ranked))] = variable
                ranked.append(variable)
        return slots, own, found

    def missing(variable):
        return TfparError(
            f"the pipeline stage optimizer's variable {variable.name!r} has no "
            f"counterpart in the compiled {type(compiled_inner).__name__}; a "
            "pipeline mesh runs Keras's own optimizers (SGD, Adam, ...)")

    whole_of = {id(s): w for s, w in pairs}
    compiled_own, compiled_inner = levels(compiled)
    # On the weights the compiled optimizer was built on (the model's trainable weights
    # then, `_build` or Keras's own build): a layer frozen since keeps its slots there,
    # untouched, and no other weight's slot is taken for them.
    built = list(patches.built_variables(compiled_inner))
    theirs, theirs_own, _ = by_owner(compiled_inner, built)
    built_ids = {id(w) for w in built}
    for stage in stages:
        for variable in stage.trainable_variables:
            source = whole_of.get(id(variable))
            if source is not None and id(source) not in built_ids:
                raise TfparError(
                    f"weight {source.path!r} is trainable but the model's optimizer was "
                    "built without it (a layer unfrozen after the optimizer was built); "
                    "compile with a new optimizer")
    out, idle = [], []
    for stage, optimizer in zip(stages, optimizers):
        own, inner = levels(optimizer)
        weights = list(stage.trainable_variables)
        pairs = []
        mine, mine_own, paired = by_owner(inner, weights)
        for variable in inner.variables:
            if id(variable) not in paired:
                raise missing(variable)
        for (key, rank), variable in ((k, v) for k, v in mine.items()
                                      if isinstance(k, tuple)):
            target = theirs.get((id(whole_of[key]), rank))
            if target is None or tuple(target.shape) != tuple(variable.shape):
                raise missing(variable)
            pairs.append((variable, target))
        for name, variables in mine_own.items():
            targets = theirs_own.get(name, [])
            if len(variables) != 1 or len(targets) != 1:
                raise missing(variables[0])
            pairs.append((variables[0], targets[0]))
        own_by_name = {v.name: v for v in compiled_own}
        pairs += [(v, own_by_name[v.name]) for v in own if v.name in own_by_name]
        # A stage with nothing to train (its layers frozen) never steps: its step count
        # and loss scale go after the training stages', whose `to_model` writes.
        (out if weights else idle).extend(pairs)
    return out + idle


def _stateful_layer(stages):
    """`"name (Class)"` of the first layer of `stages` whose non-trainable state a
    training step changes (moving statistics of a layer not frozen, a seed generator's
    state), or None."""
    for stage in stages:
        for layer in walk_layers(stage):
            own = layer.non_trainable_variables
            seeded = any(v.path.endswith("seed_generator_state") for v in own)
            moving = isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            if seeded or moving:  # (constants, an adapted Normalization: never written)
                return f"{layer.name} ({type(layer).__name__})"
    return None


def _overrides(callback, *methods):
    """Whether `callback` has its own hook among `methods` (its class's, or one set on the
    instance, as `LambdaCallback` does)."""
    def own(m):
        hook = getattr(callback, m)
        return getattr(hook, "__func__", hook) is not getattr(keras.callbacks.Callback, m)
    return any(own(m) for m in methods)


class UserCallbacks(keras.callbacks.Callback):
    """The user's callbacks in a pipeline `fit` (and, with `verbose`, Keras's progress
    bar), called with the user's model and the model's logs (not tfpar's `step_loss`):
    the stage weights are written into it before each epoch end and training's end (and
    each batch end when a callback has a batch-end hook), and its
    `stop_training` is passed on to the trainer."""

    def __init__(self, trainer, callbacks, verbose=0, epochs=1, steps=None):
        super().__init__()
        from tfpar.callbacks import BackupAndRestore
        for callback in callbacks:
            if isinstance(callback, BackupAndRestore):
                raise ConfigError("callbacks", "tfpar.callbacks.BackupAndRestore",
                                  "its checkpoint is tfpar.train's, not a pipeline mesh's; "
                                  "use keras.callbacks.BackupAndRestore (the model's "
                                  "optimizer holds the stages' state)")
        self.trainer = trainer
        self.verbose = verbose
        self.inner = keras.callbacks.CallbackList(
            callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=epochs, steps=steps,
            model=trainer.user_model)
        # (Keras's BackupAndRestore saving once an epoch reads nothing at a batch's end:
        # no per-batch copy of the weights and optimizer state for it.)
        self.every_batch = any(
            _overrides(c, "on_train_batch_end", "on_batch_end") and not (
                isinstance(c, keras.callbacks.BackupAndRestore) and c.save_freq == "epoch")
            for c in callbacks)

    def set_params(self, params):
        self.inner.set_params({**params, "verbose": self.verbose})

    def set_model(self, model):
        self.staged = model

    def _stop(self):
        if getattr(self.trainer.user_model, "stop_training", False):
            self.staged.stop_training = True

    def on_train_begin(self, logs=None):
        model = self.trainer.user_model
        model.stop_training = False
        patches.set_initial_epoch(model, None)  # one left from an earlier fit is not this one's
        self.inner.on_train_begin(logs)
        # Keras's BackupAndRestore loads its file into the model here, and the epoch to
        # resume from: onto the stages, and into the trainer's loop.
        self.trainer.from_model()
        patches.set_initial_epoch(self.staged, patches.initial_epoch(model))

    def on_epoch_begin(self, epoch, logs=None):
        self.inner.on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.inner.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self.every_batch:
            self.trainer.to_model()
        self.inner.on_train_batch_end(
            batch, {k: v for k, v in (logs or {}).items() if k != STEP_LOSS})
        self._stop()

    def on_epoch_end(self, epoch, logs=None):
        self.trainer.to_model()
        self.inner.on_epoch_end(epoch, logs)
        self._stop()

    def on_train_end(self, logs=None):
        self.trainer.to_model()
        self.inner.on_train_end(logs)
