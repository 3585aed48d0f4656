"""The model's own Keras steps on a mesh: any loss, metric, input and output structure.

Under `keras.distribution` (`tfpar.layout.enable`) a model trains through Keras's own code
for everything but the update: the compiled loss (`compile(loss=…)`: several outputs,
dicts, `loss_weights`, `add_loss` and regularizers), the loss tracker, and every metric
(`compute_metrics`: built-in or custom `keras.metrics.Metric`), on batches of any
structure (dicts and lists of inputs, outputs and sample weights). The metrics' variables
are DVariables like the weights, so their sums over the batch are DTensor's, over every
shard.

Like `tfpar.layout.step` (whose docstring says why), every step reads each variable once,
computes on those values inside a `keras.StatelessScope`, and writes each changed variable
once at the end: the default training step does what Keras's JAX trainer does (the
gradient with respect to the values read, `optimizer.stateless_apply`, the metrics after
the update).

A model with its own `train_step` (its class's or set on it) gets it run inside the
mesh step: non-trainable, optimizer and metric variables are read once into the scope,
trainable ones are read where the user's code reads them (so that its
`tape.gradient(loss, self.trainable_variables)` works), and every write the code makes
(`optimizer.apply`, `metric.update_state`, `variable.assign`) is kept by the scope (later
reads in the step see it) and written once at the end. `test_step` and `predict_step`,
the user's or Keras's, run inside the scope with every variable read once.
"""

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import compat, keras_codec_state, patches
from tfpar.errors import ConfigError
from tfpar.layout import reduction as reduction_lib
from tfpar.layout import mesh as mesh_lib
from tfpar.layout import values
from tfpar.layout.step import (_checked, first_replica, reduce_over_batch,
                               refusals_raised, replica_gradients)
from tfpar.layout.variables import check_dvariables
from tfpar.zero import fsdp


def overrides_train_step(model):
    """Whether `model` has its own `train_step` (its class's, or one set on the model,
    as `tfpar.metrics.report_step_loss` sets), not Keras's."""
    return getattr(model.train_step, "__func__", None) is not keras.Model.train_step


# Keras's convolution layers (`KERAS_MESH_CODEC_CONV`)
_CONVOLUTIONS = tuple(getattr(keras.layers, name) for name in (
    "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
    "SeparableConv1D", "SeparableConv2D", "DepthwiseConv1D", "DepthwiseConv2D"))


def _read(variables):
    return [v.value.read_value() for v in variables]


def _current(scope, variables, old):
    """Each variable's value at the end of `scope` (its `old` value if not written)."""
    out = []
    for variable, before in zip(variables, old):
        after = scope.get_current_value(variable)
        out.append(before if after is None else after)
    return out


def _write(variables, old, new):
    """Writes each changed variable once, in its own layout."""
    for variable, before, after in zip(variables, old, new):
        if after is None or after is before:
            continue
        layout = variable.value.layout
        variable.value.assign(dtensor.relayout(tf.cast(after, variable.dtype), layout))


def _batch_size(x):
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return tf.shape(first)[0]


class KerasSteps:
    """The compiled train, test and predict steps of a compiled Keras model on a mesh.

    Args:
        mesh: the `keras.distribution.DeviceMesh` the variables live on.
        model: a compiled Keras model whose variables, metrics' variables included, are
            DVariables (`tfpar.layout.keras_distribution` builds them so).
        optimizer: its optimizer, passed through `stateless_optimizer` and built.

    Each step is called with one batch already on the mesh, `(x,)`, `(x, y)` or
    `(x, y, sample_weight)`, each a tensor or a structure of tensors, and returns the
    step's logs (`model.compute_metrics`'s dict: running values since the last
    `reset_metrics`); `predict` returns the model's output structure.

    With a `tfpar.DistributedOptimizer` (its aggregator's codec, `reduction.codec_of`)
    and more than one replica on the batch axis, the training step forms each replica's
    gradient (`step.replica_gradients`) and averages them through the mesh trainer's
    `tfpar.layout.reduction` (`reduction`, its state in `model.tfpar_reductions` and in
    Keras's files of the model, `tfpar.keras_codec_state`); it is
    then called with batches `[data_parallel, m, ...]` (`values.replica_batches_to_mesh`).
    A non-finite mean gradient is never applied: the `LossScaleOptimizer` skips it (fp16),
    else the weights, slots and codec state stay and `optimizer.nonfinite_steps` counts
    it, as `tfpar.nan_guard` does on tf.distribute.

    Raises:
        TfparError: a variable is not a DVariable.
        ConfigError: the model overrides `train_step` and its optimizer is a
            `LossScaleOptimizer` (`compat.CUSTOM_TRAIN_STEP_LOSS_SCALE`) or compresses
            (`compat.KERAS_MESH_AGGREGATOR_TRAIN_STEP`); the aggregator is not one the mesh
            runs (`reduction.codec_of`), or with weights split over `batch` (ZeRO-3,
            `tfpar.layout.keras_fsdp`) not one ZeRO-3 reduce-scatters
            (`compat.KERAS_ZERO3_CODEC`); or the optimizer keeps its state on the host
            (`compat.KERAS_MESH_OFFLOAD`).
    """

    def __init__(self, mesh, model, optimizer):
        offloaded = getattr(getattr(optimizer, "inner_optimizer", optimizer),
                            "tfpar_offload", "none")
        if offloaded != "none":
            compat.enforce(compat.KERAS_MESH_OFFLOAD, compat.view(
                backend="dtensor", offload=offloaded, keras_distribution=True))
        self.mesh, self.model, self.optimizer = mesh, model, optimizer
        self.trainable = list(model.trainable_variables)
        self.non_trainable = list(model.non_trainable_variables)
        self.metric_vars = list(model.metrics_variables)
        self.opt_vars = list(optimizer.variables)
        check_dvariables(self.trainable + self.non_trainable + self.metric_vars
                         + self.opt_vars, "the training step")
        self.custom = overrides_train_step(model)
        if self.custom and hasattr(optimizer, "inner_optimizer"):
            compat.enforce(compat.CUSTOM_TRAIN_STEP_LOSS_SCALE, compat.view(
                backend="dtensor", mixed_precision="fp16", custom_train_step=True))
        self.reduction = self._reduction(mesh)
        object.__setattr__(model, "tfpar_reductions",
                           (self.reduction,) if self.reduction else ())
        # Keras's files of the model hold the codec's state (`tfpar.keras_codec_state`)
        keras_codec_state.attach(model, optimizer, list(model.tfpar_reductions))
        train = (self._custom_train if self.custom else
                 self._replica_train if self.reduction else self._train)
        self.refused = None  # `_refuse_trainable_writes`'s, raised inside the traced step
        self.train = self._raising_refusals(_checked(mesh, train, "the training step"))
        self.test = _checked(mesh, self._test, "the evaluation step")
        self.predict = _checked(mesh, self._predict, "the predict step")

    def _raising_refusals(self, step):
        """`step` (a `_checked` step) raising a refusal made while it was traced as the
        rulebook's one line, not inside AutoGraph's wrapping of it."""
        def call(*args):
            with refusals_raised(self):
                return step(*args)
        call.python_function = step.python_function
        return call

    def _refuse_dropped(self):
        """The rulebook's line for what a ZeRO-3 gathering layer's own scope dropped in
        this trace (`fsdp.take_dropped`): a write of its weight
        (`compat.KERAS_PIPELINE_ASSIGNED_WEIGHT`), a loss term
        (`compat.KERAS_ZERO3_LAYER_LOSS`)."""
        for layer, written, losses in fsdp.take_dropped(self.model):
            name = f"{layer.name} ({type(layer).__name__})"
            rule, view = ((compat.KERAS_PIPELINE_ASSIGNED_WEIGHT,
                           compat.view(backend="dtensor", assigned_weight=name)) if written
                          else (compat.KERAS_ZERO3_LAYER_LOSS,
                                compat.view(backend="dtensor", zero3_layer_loss=name)))
            try:
                compat.enforce(rule, view)
            except ConfigError as error:
                self.refused = error
                raise

    def _refuse_trainable_writes(self, scope, mapping):
        """`compat.KERAS_PIPELINE_ASSIGNED_WEIGHT` (while the step is traced, before it
        runs) for a trainable weight the forward in `scope` assigned (a clip in a layer's
        `call`): the step applies the optimizer to the values it read, so the write would
        be dropped every step, silently (measured: a clip on a 4 x 2 mesh ended 0.25 from
        one device's weights). `mapping`: the scope's `(variable, value)` pairs."""
        mapped = {id(variable): value for variable, value in mapping}
        for variable in self.trainable:
            current = scope.get_current_value(variable)
            if current is not None and current is not mapped.get(id(variable)):
                layer = variable.path.rsplit("/", 1)[0]
                try:
                    compat.enforce(compat.KERAS_PIPELINE_ASSIGNED_WEIGHT, compat.view(
                        backend="dtensor",
                        assigned_weight=f"{layer} (its weight {variable.path})"))
                except ConfigError as error:
                    self.refused = error
                    raise

    def _reduction(self, mesh):
        """The mesh's batch-axis reduction for the optimizer's aggregator, or None."""
        from tfpar.compression import keras_hook
        aggregator = keras_hook.aggregator_of(self.optimizer)
        if aggregator is None:
            return None
        codec, error_feedback, options = reduction_lib.codec_of(aggregator)
        if fsdp.split_over_batch(self.trainable):  # ZeRO-3 (`layout.keras_fsdp`)
            compat.enforce(compat.KERAS_ZERO3_CODEC, compat.view(
                backend="dtensor", compression=codec, keras_distribution=True, zero_stage=3))
            if codec == "none":  # DTensor's own fp32 reduce-scatter: nothing to map
                return None
        if self.custom:
            compat.enforce(compat.KERAS_MESH_AGGREGATOR_TRAIN_STEP, compat.view(
                backend="dtensor", compression=codec, keras_distribution=True,
                custom_train_step=True))
        # every layer Keras tracks, those a user's layer holds as attributes too
        conv = next((layer for layer in patches.sublayers(self.model)
                     if isinstance(layer, _CONVOLUTIONS)), None)
        if conv is not None and reduction_lib.batch_parts(mesh) > 1:
            compat.enforce(compat.KERAS_MESH_CODEC_CONV, compat.view(
                backend="dtensor", compression=codec, keras_distribution=True,
                codec_conv_layer=f"{conv.name} ({type(conv).__name__})"))
        # Adam in front of the codec (its `adam_front` option) switches the optimizer to
        # apply the reduction's steps (`tfpar.layout.adam_front`).
        return reduction_lib.for_variables(mesh, self.trainable, codec, error_feedback,
                                           options, self.optimizer)

    def _train(self, *data):
        """Keras's `train_step` with a stateless update (what Keras's JAX trainer does)."""
        model, optimizer = self.model, self.optimizer
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        tv, ntv = _read(self.trainable), _read(self.non_trainable)
        mv, ov = _read(self.metric_vars), _read(self.opt_vars)
        state = self.non_trainable + self.metric_vars + self.opt_vars
        with tf.GradientTape() as tape:
            tape.watch(tv)
            mapping = self._mapping(tv, ntv, mv, ov, gathered=True)
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                y_pred, _, scaled = patches.forward_loss(model, x, y, sample_weight,
                                                         _batch_size(x))
            self._refuse_trainable_writes(scope, mapping)
            self._refuse_dropped()
            new_ntv, new_mv = (_current(scope, self.non_trainable, ntv),
                               _current(scope, self.metric_vars, mv))
        grads = [None if g is None else tf.convert_to_tensor(g)
                 for g in tape.gradient(scaled, tv)]
        # A `DistributedOptimizer` whose gradients need no codec here (ZeRO-3's 'none',
        # one replica on `batch`) still never applies a non-finite step (as
        # `_replica_train`; fp16's `LossScaleOptimizer` skips its own)
        finite = None
        if (getattr(optimizer, "dynamic_scale", None) is None
                and getattr(optimizer, "tfpar_skip_nonfinite", False)):
            finite = reduction_lib.all_finite([g for g in grads if g is not None])
        new_tv, new_ov = optimizer.stateless_apply(ov, grads, tv)
        if finite is not None:
            new_tv, new_ov = self._skipped_unless(finite, tv, ov, new_tv, new_ov)
        # the metrics after the update, as in Keras's train_step
        mapping = self._mapping(new_tv, new_ntv, new_mv, new_ov)
        with keras.StatelessScope(state_mapping=mapping) as scope:
            logs = model.compute_metrics(x, y, y_pred, sample_weight)
        new_state = _current(scope, state, new_ntv + new_mv + new_ov)
        _write(self.trainable, tv, new_tv)
        _write(state, ntv + mv + ov, new_state)
        return logs

    def _replica_train(self, *data):
        """`_train` with each replica's gradient averaged through `self.reduction`; `data`
        is `[data_parallel, m, ...]` (each structure's tensors)."""
        model, optimizer = self.model, self.optimizer
        tv, ntv = _read(self.trainable), _read(self.non_trainable)
        mv, ov = _read(self.metric_vars), _read(self.opt_vars)
        scale = self._value(ov, getattr(optimizer, "dynamic_scale", None))

        def forward(*replica_data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(replica_data)
            mapping = self._mapping(tv, ntv, mv, ov, gathered=True)
            # The loss tracker's update here is this replica's: dropped, made once below.
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                # `scaled`: the optimizer's `scale_loss` (a LossScaleOptimizer's dynamic
                # scale, any `loss_scale_factor`), which its `apply` divides out again.
                y_pred, loss, scaled = patches.forward_loss(model, x, y, sample_weight,
                                                            _batch_size(x))
            self._refuse_trainable_writes(scope, mapping)
            self._refuse_dropped()
            return scaled, (y_pred, loss, _current(scope, self.non_trainable, ntv))

        grads, (y_pred, losses, new_ntv) = replica_gradients(forward, tv, data)
        new_ntv = first_replica(new_ntv, self.non_trainable)
        finite = None
        if scale is None and getattr(optimizer, "tfpar_skip_nonfinite", False):
            finite = reduction_lib.all_finite([g for g in grads if g is not None])
        grads = reduce_over_batch(self.reduction, grads, scale, finite)
        if finite is not None:  # a mean the codec's sum overflowed (fp16) is not applied
            finite = tf.logical_and(finite, reduction_lib.all_finite(
                [g for g in grads if g is not None]))
        new_tv, new_ov = optimizer.stateless_apply(ov, grads, tv)
        if finite is not None:
            new_tv, new_ov = self._skipped_unless(finite, tv, ov, new_tv, new_ov)
        # The loss tracker and the metrics after the update, on the whole batch.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
            tuple(self._whole_batch(d) for d in data))
        mapping = self._mapping(new_tv, new_ntv, mv, new_ov)
        with keras.StatelessScope(state_mapping=mapping) as scope:
            patches.loss_tracker(model).update_state(tf.reduce_mean(losses),
                                                     sample_weight=_batch_size(x))
            logs = model.compute_metrics(x, y, self._whole_batch(y_pred), sample_weight)
        state = self.non_trainable + self.metric_vars + self.opt_vars
        new_state = _current(scope, state, new_ntv + mv + new_ov)
        _write(self.trainable, tv, new_tv)
        _write(state, ntv + mv + ov, new_state)
        return logs

    def _whole_batch(self, structure):
        """Each tensor of `structure` `[data_parallel, m, ...]` as the whole batch
        `[data_parallel * m, ...]`, split on the batch axis as a batch is."""
        def merge(t):
            merged = tf.reshape(t, [-1] + t.shape[2:].as_list())
            return dtensor.relayout(merged, mesh_lib.batch_sharded(self.mesh,
                                                                   merged.shape.rank))
        return keras.tree.map_structure(merge, structure)

    def _mapping(self, tv, ntv, mv, ov, gathered=False):
        """A `StatelessScope`'s state mapping: the model's trainable and non-trainable
        variables, the metrics' and the optimizer's, to these values; `gathered`: the
        model's ZeRO-3 pieces whole, for a forward pass (`fsdp.gathered`)."""
        weights = list(zip(self.trainable, tv)) + list(zip(self.non_trainable, ntv))
        return ((fsdp.gathered(weights) if gathered else weights)
                + list(zip(self.metric_vars, mv)) + list(zip(self.opt_vars, ov)))

    def _value(self, values_, variable):
        """`variable`'s value among `values_` (this step's reads of `self.opt_vars`), or
        None when it is None."""
        if variable is None:
            return None
        return values_[[id(v) for v in self.opt_vars].index(id(variable))]

    def _skipped_unless(self, finite, tv, ov, new_tv, new_ov):
        """The update when `finite`, else the old values with `nonfinite_steps` counted."""
        keep = lambda new, old: reduction_lib.where_scalar(finite, new, old)  # noqa: E731
        new_tv = [keep(n, o) for n, o in zip(new_tv, tv)]
        new_ov = [keep(n, o) for n, o in zip(new_ov, ov)]
        counter = getattr(self.optimizer, "nonfinite_steps", None)
        if counter is not None:
            index = [id(v) for v in self.opt_vars].index(id(counter))
            new_ov[index] = ov[index] + 1.0 - tf.cast(finite, ov[index].dtype)
        return new_tv, new_ov

    def _custom_train(self, *data):
        """The model's own `train_step(data)`, its writes kept until the end."""
        ntv, mv, ov = _read(self.non_trainable), _read(self.metric_vars), _read(self.opt_vars)
        state = self.non_trainable + self.metric_vars + self.opt_vars
        mapping = (fsdp.gathered(list(zip(self.non_trainable, ntv)))
                   + list(zip(self.metric_vars, mv)) + list(zip(self.opt_vars, ov)))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            logs = self.model.train_step(_data(data))
        new_tv = [scope.get_current_value(v) for v in self.trainable]
        new_state = _current(scope, state, ntv + mv + ov)
        optimizer = self.optimizer
        if (getattr(optimizer, "dynamic_scale", None) is None
                and getattr(optimizer, "tfpar_skip_nonfinite", False)):
            # A `DistributedOptimizer` never applies a non-finite step (`_train`'s rule):
            # the gradients are the user's step's own, so the check is on what its update
            # wrote (a non-finite gradient makes non-finite weights); weights, slots and
            # the codec state stay, `nonfinite_steps` counts it (a review's probe: a NaN
            # reached every weight, the count stayed 0).
            tv = _read(self.trainable)
            new_tv = [o if n is None else n for n, o in zip(new_tv, tv)]
            finite = reduction_lib.all_finite(new_tv)
            count = len(ntv) + len(mv)
            new_tv, new_ov = self._skipped_unless(finite, tv, ov, new_tv, new_state[count:])
            new_state = new_state[:count] + new_ov
            _write(self.trainable, tv, new_tv)
        else:
            _write(self.trainable, [None] * len(self.trainable), new_tv)
        _write(state, ntv + mv + ov, new_state)
        return logs

    def _test(self, *data):
        variables = self.trainable + self.non_trainable
        old, mv = _read(variables), _read(self.metric_vars)
        mapping = fsdp.gathered(list(zip(variables, old))) + list(zip(self.metric_vars, mv))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            logs = self.model.test_step(_data(data))
        _write(self.metric_vars, mv, _current(scope, self.metric_vars, mv))
        return logs

    def _predict(self, *data):
        variables = self.trainable + self.non_trainable
        mapping = fsdp.gathered(list(zip(variables, _read(variables))))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
            return self.model.predict_step(_data(data))


def _data(data):
    """A step's positional batch as Keras's steps take it: the tuple `(x,)`, `(x, y)` or
    `(x, y, sample_weight)` its data adapters yield."""
    return tuple(data)


def reset_metrics(model):
    """`model.reset_metrics()` for metrics whose variables live on a mesh: the values
    Keras's own `reset_state` writes, assigned in each variable's layout."""
    with keras.StatelessScope() as scope:
        model.reset_metrics()
    for variable in model.metrics_variables:
        value = scope.get_current_value(variable)
        if value is not None:
            values.assign(variable, np.asarray(value))


def logs_to_host(logs):
    """A step's logs as Python floats (arrays for metrics that are not scalars), nested
    dicts flattened as Keras's `fit` does."""
    out = {}
    for name, value in logs.items():
        if isinstance(value, dict):  # a metric returning several (Keras flattens them)
            out.update(logs_to_host(value))
            continue
        array = values.to_host(value)
        out[name] = float(array) if np.ndim(array) == 0 else array
    return out
