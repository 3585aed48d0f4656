"""The compiled steps on a mesh: train (exact), evaluate, predict.

Measured on TF 2.21: inside one `tf.function`, DTensor's rewrite can let a read of a
variable that was assigned earlier in the function see the stale value, even with
explicit control dependencies; Keras's stock `apply_gradients` after the backward pass
gave Adam weights off by 3.4e-2 after 5 steps. The train step here therefore never reads
a variable after writing it, as Keras's JAX trainer: it reads every variable once, runs
forward, loss, backward and the optimizer on those values inside a `StatelessScope`, and
writes each changed variable once at the end. Every write depends on the reads through
data, not through control edges the rewrite could drop.

Before the first call, the traced graph is inspected: every variable it touches must be a
DVariable (a plain one would be updated once per device).
"""

import contextlib

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar.errors import TfparError
from tfpar.zero import fsdp
from tfpar.layout import activations, rng
from tfpar.layout.concat_axis import traced_with_concat_axis_whole
from tfpar.layout.newaxis import traced_with_expand_dims
from tfpar.layout.variables import check_dvariables


def _read(variables):
    return [v.value.read_value() for v in variables]


def _layouts(variables):
    return [v.value.layout for v in variables]


def _write(variables, layouts, old, new):
    for variable, layout, before, after in zip(variables, layouts, old, new):
        if after is before:
            continue  # unchanged: no write at all
        variable.value.assign(dtensor.relayout(tf.cast(after, before.dtype), layout))


def _metrics(loss, logits, y, sample_weight, accuracy=True):
    """Loss and the weighted-accuracy sums (Keras's SparseCategoricalAccuracy); without
    `accuracy` (labels need not be class ids, e.g. `loss="mse"`), `correct` is 0."""
    if not accuracy:
        return {"loss": loss, "correct": tf.zeros([], tf.float32),
                "weight": tf.ones([], tf.float32)}
    match = tf.cast(tf.equal(tf.cast(tf.argmax(logits, axis=-1), y.dtype), y), tf.float32)
    weight = (tf.ones_like(match) if sample_weight is None
              else tf.cast(sample_weight, tf.float32))
    return {"loss": loss, "correct": tf.reduce_sum(match * weight),
            "weight": tf.reduce_sum(weight)}


def _forward_loss(model, loss_fn, mapping, x, y, sample_weight, training):
    mapping = fsdp.gathered(mapping)  # ZeRO-3's weights split over `batch`, whole here
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        logits = model(x, training=training)
        loss = loss_fn(y, logits, sample_weight)
        extra = list(scope.losses) + list(model.losses)
        if extra:
            loss = loss + tf.add_n([tf.cast(e, loss.dtype) for e in extra])
    return logits, loss, scope


def train_step(mesh, model, optimizer, loss_fn, grad_accum_steps=1, reduction=None,
               accuracy=True):
    """A compiled `step(x, y, sample_weight) -> {"loss", "correct", "weight"}`.

    Args:
        mesh: the `keras.distribution.DeviceMesh` the variables live on.
        model: a built Keras model whose variables are DVariables.
        optimizer: a built optimizer passed through `stateless_optimizer`; a
            `LossScaleOptimizer` scales the loss before the backward pass and skips the
            update when a gradient is not finite (one decision for the whole mesh: the
            check reduces over every shard).
        loss_fn: a `keras.losses.Loss` (called as `loss_fn(y, logits, sample_weight)`).
        grad_accum_steps: k > 1 runs k micro-batches one after the other and applies
            their mean gradient in one update; the step is then called with tuples of k
            micro-batches (`values.micro_batches_to_mesh`).
        reduction: a `tfpar.layout.reduction.BatchAxisReduction` (or ZeRO-3's
            `tfpar.zero.reduce_scatter.ShardedReduction`): each data-parallel replica's
            gradient is formed on its own and averaged over the `batch` axis through it
            (compression) once per step; the step is then called with batches shaped
            `[data_parallel, m, ...]` (`values.replica_batches_to_mesh`; with
            `grad_accum_steps > 1` a tuple of them). With a `LossScaleOptimizer` the
            reduction unscales before its codec and a skipped step leaves its state.
        accuracy: count correct argmax predictions of integer labels (else `correct` is 0).

    Returns:
        A callable compiled with `tf.function`; call it with batches already on the
        mesh (`batch_to_mesh`), `sample_weight` may be None. It refuses (TfparError) to
        run if its graph touches a variable that is not a DVariable.
    """
    step = _TrainStep(model, optimizer, loss_fn, grad_accum_steps, reduction, accuracy)
    return _checked(mesh, step.step, "the training step")


class _TrainStep:
    """`train_step`'s pieces: the variables read once, the gradient by micro-batches,
    per replica (through `reduction`) or whole, and the one write at the end."""

    def __init__(self, model, optimizer, loss_fn, grad_accum_steps, reduction, accuracy):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.accuracy = accuracy
        self.grad_accum_steps, self.reduction = grad_accum_steps, reduction
        self.trainable = list(model.trainable_variables)
        self.non_trainable = list(model.non_trainable_variables)
        self.opt_vars = list(optimizer.variables)
        check_dvariables(self.trainable + self.non_trainable + self.opt_vars,
                         "the training step")
        self.layouts = [_layouts(self.trainable), _layouts(self.non_trainable),
                        _layouts(self.opt_vars)]
        self.scales_loss = hasattr(optimizer, "inner_optimizer")  # a LossScaleOptimizer

    def _mapping(self, tv, ntv):
        return list(zip(self.trainable, tv)) + list(zip(self.non_trainable, ntv))

    def micro_step(self, tv, ntv, ov, x, y, sample_weight):
        """One forward/backward pass: the gradients, new non-trainable values, metrics."""
        with tf.GradientTape() as tape:
            tape.watch(tv)
            logits, loss, scope = _forward_loss(self.model, self.loss_fn,
                                                self._mapping(tv, ntv), x, y,
                                                sample_weight, True)
            scaled = loss
            if self.scales_loss:  # reads the scale from this step's optimizer values
                with keras.StatelessScope(state_mapping=list(zip(self.opt_vars, ov))):
                    scaled = self.optimizer.scale_loss(loss)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(scaled, tv)]
        new_ntv = [scope.get_current_value(v) for v in self.non_trainable]
        return grads, new_ntv, _metrics(loss, logits, y, sample_weight, self.accuracy)

    def replica_step(self, tv, ntv, ov, x, y, sample_weight):
        """One gradient per data-parallel replica: vectorized over the leading `batch`
        axis, so DTensor never sums over it; `reduction` does, through its codec, once per
        step: with `grad_accum_steps` = k, `x`, `y` and `sample_weight` are tuples of k
        micro-batches, each replica's k gradients averaged first. With fp16 the loss is
        scaled by the optimizer's scale and the reduction unscales before its codec."""
        scale = self._scale(ov)
        if self.grad_accum_steps == 1:
            x, y = (x,), (y,)
            sample_weight = None if sample_weight is None else (sample_weight,)
        k = len(x)
        grads, new_ntv, outs = None, ntv, []
        for i in range(k):
            part, new_ntv, out = self._replica_grads(
                tv, new_ntv, x[i], y[i], None if sample_weight is None else sample_weight[i],
                scale)
            grads = part if grads is None else [a + b for a, b in zip(grads, part)]
            outs.append(out)
        if k > 1:
            grads = [g / k for g in grads]
        grads = reduce_over_batch(self.reduction, grads, scale)
        out = {"loss": tf.add_n([o["loss"] for o in outs]) / k,
               "correct": tf.add_n([o["correct"] for o in outs]),
               "weight": tf.add_n([o["weight"] for o in outs])}
        return grads, new_ntv, out

    def _scale(self, ov):
        """The loss scale among this step's optimizer values (fp16), else None."""
        if not self.scales_loss:
            return None
        index = [id(v) for v in self.opt_vars].index(id(self.optimizer.dynamic_scale))
        return ov[index]

    def _replica_grads(self, tv, ntv, x, y, sample_weight, scale):
        """Each replica's gradients `[replicas, *shape]` of one batch `[replicas, m, ...]`
        (of the loss times `scale`, if given), the new non-trainable values (replica 0's)
        and the batch's metrics."""
        def forward(xr, yr, wr):
            weight = None if sample_weight is None else wr
            logits, loss, scope = _forward_loss(self.model, self.loss_fn,
                                                self._mapping(tv, ntv), xr, yr, weight, True)
            scaled = loss if scale is None else loss * tf.cast(scale, loss.dtype)
            new = [scope.get_current_value(v) for v in self.non_trainable]
            return scaled, (new, _metrics(loss, logits, yr, weight, self.accuracy))

        weights = y if sample_weight is None else sample_weight
        grads, (new_ntv, out) = replica_gradients(forward, tv, (x, y, weights))
        new_ntv = first_replica(new_ntv, self.non_trainable)
        out = {"loss": tf.reduce_mean(out["loss"]), "correct": tf.reduce_sum(out["correct"]),
               "weight": tf.reduce_sum(out["weight"])}
        return grads, new_ntv, out

    def accumulated_step(self, tv, ntv, ov, x, y, sample_weight):
        """Unrolled: k forward/backward passes in one graph, the gradients summed as they
        come; non-trainable state (seeds, statistics) flows from one micro-batch to the
        next, as over k plain steps. The mean gradient, as one step on a k× batch."""
        k = self.grad_accum_steps
        grads, new_ntv, outs = None, ntv, []
        for i in range(k):
            part, new_ntv, out = self.micro_step(
                tv, new_ntv, ov, x[i], y[i],
                None if sample_weight is None else sample_weight[i])
            grads = part if grads is None else [a + b for a, b in zip(grads, part)]
            outs.append(out)
        grads = [g / k for g in grads]
        out = {"loss": tf.add_n([o["loss"] for o in outs]) / k,
               "correct": tf.add_n([o["correct"] for o in outs]),
               "weight": tf.add_n([o["weight"] for o in outs])}
        return grads, new_ntv, out

    def step(self, x, y, sample_weight=None):
        tv, ntv, ov = _read(self.trainable), _read(self.non_trainable), _read(self.opt_vars)
        if self.reduction is not None:
            grads, new_ntv, out = self.replica_step(tv, ntv, ov, x, y, sample_weight)
        elif self.grad_accum_steps == 1:
            grads, new_ntv, out = self.micro_step(tv, ntv, ov, x, y, sample_weight)
        else:
            grads, new_ntv, out = self.accumulated_step(tv, ntv, ov, x, y, sample_weight)
        new_tv, new_ov = self.optimizer.stateless_apply(ov, grads, tv)
        _write(self.trainable, self.layouts[0], tv, new_tv)
        _write(self.non_trainable, self.layouts[1], ntv, new_ntv)
        _write(self.opt_vars, self.layouts[2], ov, new_ov)
        return out


def replica_gradients(forward, tv, batch):
    """Each data-parallel replica's own gradient with respect to `tv`, without DTensor's sum
    over the batch axis: `forward(*replica_batch) -> (scaled_loss, aux)` runs once per
    replica, vectorized (`tf.vectorized_map`) over the leading axis of every tensor of
    `batch` (a tuple of structures of `[replicas, m, ...]` DTensors split on the batch axis).

    Returns:
        `(grads, aux)`: `grads[i]` is `[replicas, *tv[i].shape]` laid out
        `(batch, *its layout)`, or None where the loss does not depend on `tv[i]`; `aux`
        with a leading `[replicas]` axis on every tensor.
    """
    unconnected = set()

    def one(args):
        with tf.GradientTape() as tape:
            tape.watch(tv)
            scaled, aux = forward(*args)
        grads = tape.gradient(scaled, tv)
        unconnected.update(i for i, g in enumerate(grads) if g is None)
        # pfor returns tensors only: an unconnected weight's gradient as zeros, None after.
        return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                for g, v in zip(grads, tv)], aux

    # ZeRO-3's gathers: gradients left whole; activation layouts: vectorized relayouts.
    with fsdp.per_replica_gradients(), activations.per_replica():
        grads, aux = tf.vectorized_map(one, batch)
    return [None if i in unconnected else g for i, g in enumerate(grads)], aux


def first_replica(new_values, variables):
    """Non-trainable state (seeds, statistics) formed per replica advances alike on every
    replica: replica 0's value of each (a value without the replicas' axis as it is)."""
    return [n[0] if n.shape.rank == v.value.shape.rank + 1 else n
            for n, v in zip(new_values, variables)]


def reduce_over_batch(reduction, grads, scale=None, finite=None):
    """The mean over the batch axis of each replica's gradients (`replica_gradients`,
    None kept None) through `reduction`'s codec; its new state (residuals, PowerSGD's
    `Q`s) is written to its variables here (read once, written once). `scale` and
    `finite` as in `BatchAxisReduction.mean` (fp16's loss scale; a skipped step)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if len(present) < len(grads):  # the codec takes every variable's: zeros for the rest
        grads = [tf.zeros((reduction.replicas,) + tuple(shape), tf.float32) if g is None
                 else g for g, shape in zip(grads, reduction.shapes)]
    means, kept = reduction.mean(grads, reduction.read(), scale=scale, finite=finite)
    for variable, value in zip(reduction.step_variables, kept):
        variable.assign(dtensor.relayout(value, variable.layout))
    return [means[i] if i in present else None for i in range(len(means))]


def eval_step(mesh, model, loss_fn, accuracy=True):
    """A compiled `step(x, y, sample_weight) -> {"loss", "correct", "weight"}` that writes
    nothing (`accuracy` as in `train_step`)."""
    variables = list(model.trainable_variables) + list(model.non_trainable_variables)

    def step(x, y, sample_weight=None):
        mapping = list(zip(variables, _read(variables)))
        logits, loss, _ = _forward_loss(model, loss_fn, mapping, x, y, sample_weight, False)
        return _metrics(loss, logits, y, sample_weight, accuracy)

    return _checked(mesh, step, "the evaluation step")


def predict_step(mesh, model):
    """A compiled `step(x) -> logits` (batch-sharded like `x`)."""
    def step(x):
        return model(x, training=False)

    return _checked(mesh, step, "the predict step")


def _trace(fn, args):
    """`fn.get_concrete_function(*args)`; a `TfparError` raised while tracing (a layout
    that does not fit, found when the shapes are known) is re-raised as itself, not as
    the RuntimeError autograph makes of exceptions it cannot rebuild from a message."""
    try:
        return fn.get_concrete_function(*args)
    except RuntimeError as err:
        cause = err.__context__
        while cause is not None and not isinstance(cause, TfparError):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause.with_traceback(None) from None


def wraps_refusal(error, refusal):
    """Whether `error` is `refusal`, or has it as a cause or context, or carries its line
    (AutoGraph re-raises an error traced in a step with its own text around it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if error is refusal or str(refusal) in str(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def refusals_raised(owner):
    """Runs a step that may be traced inside: a refusal the trace recorded in
    `owner.refused` (cleared first) is raised as the rulebook's one line, not inside
    AutoGraph's wrapping of it; any other error as it came."""
    owner.refused = None
    try:
        yield
    except Exception as error:
        if owner.refused is not None and wraps_refusal(error, owner.refused):
            raise owner.refused from None
        raise


def walk_layers(model):
    """The layers of `model` depth first, those of nested models in their place (not the
    nested models themselves; a user's layer's own sublayers are not walked: for every
    layer Keras tracks, `tfpar.patches.sublayers`)."""
    for layer in getattr(model, "layers", []):
        if hasattr(layer, "layers"):
            yield from walk_layers(layer)
        else:
            yield layer


def _checked(mesh, step, what):
    """Compiles `step`; each new trace is checked for plain variables before it runs.

    Ops without DTensor inputs (`tf.range`, constants) are placed on `mesh` replicated
    (without a default mesh DTensor crashes on them); Keras's random draws (dropout) are
    one device's (`tfpar.layout.rng`); every `tf.concat` is traced with its concat axis
    whole (`tfpar.layout.concat_axis`: DTensor's is wrong otherwise).
    """
    fn = tf.function(traced_with_concat_axis_whole(traced_with_expand_dims(step),
                                                   mesh.backend_mesh))
    checked = set()

    def call(*args):
        with dtensor.default_mesh(mesh.backend_mesh), rng.drawing_whole(mesh.backend_mesh):
            concrete = _trace(fn, args)
            if id(concrete) not in checked:
                check_dvariables(concrete.graph.variables, what)
                checked.add(id(concrete))
            return fn(*args)

    call.python_function = fn
    return call
