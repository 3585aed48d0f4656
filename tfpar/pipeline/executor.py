"""Runs a pipeline schedule: micro-batch forwards and backwards per stage, one update.

Everything is traced into the caller's `tf.function` (jit_compile off: XLA cannot span
devices), so the runtime overlaps stages that are ready at the same time. Per stage and
micro-batch a `GradientTape` records the forward; the backward is `tape.gradient` with the
next stage's input gradient as `output_gradients`. Both run under the stage's device: ops
go where their `tf.device` scope says, not where their variables are. Control
dependencies chain each stage's actions in schedule order; nothing else orders them.

With `grad_accum_steps` = k the schedule runs k times in the step (`ScheduleRunner.run`'s
groups), on k consecutive groups of M micro-batches, before the one update: the same
gradient as one run of k·M micro-batches. With fp16 (stage optimizers that are
`keras.optimizers.LossScaleOptimizer`s) the last stage's loss is multiplied by its
optimizer's scale, and every stage takes one decision: a stage whose gradients are finite
while another's are not gets a non-finite gradient, so that every stage's optimizer skips
its update and halves its scale (all scales start equal and stay equal). Stage optimizers
guarded by `--on_nan` (`tfpar.nan_guard`) take the same one decision.

No stateful op that touches no variable (`tf.print`, `tf.timestamp`, `py_function`) may go
in here: automatic control dependencies would chain them all in program order and
serialise the pipeline. Measure from outside the step or with the profiler.

Examples:
    >>> ex = PipelineExecutor(stages, devices, make_schedule("1f1b", 2, 4), loss_fn)
    >>> ex.build_optimizers(keras.optimizers.Adam(1e-3))
    >>> step = tf.function(ex.train_step, jit_compile=False)
    >>> loss, y_pred = step(x, y)
"""

import contextlib
import functools

import keras
import tensorflow as tf

from tfpar import compat, patches
from tfpar.devices import check_device_count, compute_devices
from tfpar.errors import ConfigError, TfparError
from tfpar.pipeline.placement import current_device, variables_on
from tfpar.pipeline.runner import ScheduleRunner
from tfpar.pipeline.schedule import chunks_of, has_weight_passes


class PipelineExecutor:
    """One training step of a pipeline schedule over stage models.

    With Chimera's schedule (`tfpar.pipeline.schedule.chimera_schedule`) each stage holds
    two stage models, one per direction: stage s's chunk 0 (model s) is virtual stage s,
    its chunk 1 (model K + s) a copy of virtual stage K - 1 - s, which must start with the
    same weights (`PipelineModel.split` builds them so). The copy's gradients are summed
    into its virtual stage's home (chunk 0, on stage s for virtual stage s), whose
    optimizer alone updates it, aggregating over replicas as 1F1B's stage s does (one
    codec state per virtual stage); the copy then takes the home's new weights. The two
    copies stay equal bit for bit, as one model's would, whatever the codec.

    Args:
        stages: K*V callables (keras models); stage model v = c*K + s runs on stage s
            (Chimera: V = 2, the second pipeline's copies in chunk 1).
        devices: K placements, one per stage: a device name, or one device per replica
            of the current strategy (`tfpar.pipeline.placement`); under a
            MirroredStrategy each replica runs its micro-batches through its own devices.
        schedule: list of K action lists (`tfpar.pipeline.schedule`).
        loss_fn: `loss_fn(y_true, y_pred[, sample_weight])`, mean-reduced or per example
            (it is averaged); the step's loss is its mean over the full batch. A Keras
            `Loss` also divides by the number of replicas (Keras's convention, so that
            the all-reduced sum of gradients is their mean).
        recompute: keep only each stage's input and recompute its forward in the backward
            (`tf.recompute_grad`): less activation memory, one more forward per stage.
            Not with a zero-bubble schedule (its W pass needs the kept activations).
        grad_accum_steps: k, the schedule's runs per step, each on M micro-batches of the
            batch (which must split into k·M), before one update.
        serialize: chain all actions of all stages into one sequence (no overlap). For
            benchmarks: its step time is the pipeline's total busy time.
        one_op_at_a_time: chain every op of a stage after the one created before it, so
            a stage runs one op at a time, as a device with one stream does. Without it
            the runtime may run independent ops of one stage side by side (a backward's
            input- and weight-gradient matmuls), and on logical CPUs sharing a thread
            pool that stage then takes the threads the next stage waits for.
    Raises:
        ConfigError: stages, devices and schedule disagree in size.
        TfparError: `one_op_at_a_time` on a TensorFlow whose `Operation._add_control_input`
            changed (`tfpar.patches.REGISTRY["graph_control_input"]`).
    """

    def __init__(self, stages, devices, schedule, loss_fn, recompute=False, serialize=False,
                 one_op_at_a_time=False, grad_accum_steps=1):
        self.K, self.V = len(schedule), chunks_of(schedule)
        self.M = 1 + max(a.microbatch for a in schedule[0])
        self.groups = grad_accum_steps  # >= 1: checked by ParallelConfig / PipelineModel
        if len(stages) != self.K * self.V:
            raise ConfigError("stages", len(stages), f"the schedule runs {self.K} stages x "
                              f"{self.V} chunks = {self.K * self.V} stage models")
        if len(devices) != self.K:
            raise ConfigError("devices", devices, f"give one device per stage ({self.K})")
        self.stages, self.devices, self.schedule = list(stages), list(devices), schedule
        self.loss_fn, self.serialize = loss_fn, serialize
        self.one_op_at_a_time = one_op_at_a_time
        if one_op_at_a_time:
            problems = patches.check_targets(["graph_control_input"])
            if problems:
                raise TfparError(problems[0])
        self.optimizers = None
        self.split = has_weight_passes(schedule)
        if self.split and recompute:
            compat.enforce(compat.ZB_H1_RECOMPUTE, compat.view(
                backend="pipeline", pipeline_stages=self.K, schedule="zb_h1",
                recompute=recompute))
        self.calls = [tf.recompute_grad(_training_call(s)) if recompute else _training_call(s)
                       for s in self.stages]
        # Zero-bubble: each stage runs layer by layer, so that B can stop at the input
        # gradients and W compute each layer's weight gradients from its output gradient.
        self.units = [_chain_units(s) for s in self.stages] if self.split else None
        # Trace order and the messages between virtual stages: `tfpar.pipeline.runner`.
        self.runner = ScheduleRunner(schedule)
        # The stage models a micro-batch passes, input end first (Chimera: the first
        # pipeline's), and the copies of each virtual stage (Chimera: two).
        by_position = {}
        for v in range(self.K * self.V):
            by_position.setdefault(self.runner.position(v), []).append(v)
        self.path = [by_position[p][0] for p in sorted(by_position)]
        self.copies = [by_position[self.runner.position(v)] for v in range(self.K * self.V)]
        # The stage model each virtual stage's optimizer updates (its first copy); the
        # other copies take its weights after the update.
        self.home = [copies[0] for copies in self.copies]

    def stage_variables(self, s):
        """Trainable variables stage s's optimizer updates: of its chunks that are their
        virtual stage's home (all chunks but Chimera's copies of the second pipeline)."""
        return [v for c in range(self.V) if self.home[c * self.K + s] == c * self.K + s
                for v in self.stages[c * self.K + s].trainable_variables]

    def build_optimizers(self, optimizer):
        """One copy of `optimizer` per stage, created and built under the stage's device so
        its slots sit next to the variables (the stock optimizer puts them all on the
        first device), for `stage_variables(s)` (Chimera: one set of slots per virtual
        stage, for its home copy). A tfpar gradient aggregator on `optimizer` is copied too: each stage
        aggregates its own gradients across the replicas, with its residuals (and
        PowerSGD's Q) on the stage's devices. A `LossScaleOptimizer` (fp16) is copied
        around a copy of its inner optimizer, each stage with its own scale."""
        self.optimizers = []
        for s, placement in enumerate(self.devices):
            with variables_on(placement):
                opt = _copy_optimizer(optimizer)
                opt.build(self.stage_variables(s))
            self.optimizers.append(opt)
        return self.optimizers

    def loss_scaled(self):
        """True when the stage optimizers scale the loss (fp16)."""
        return self.optimizers is not None and all(
            isinstance(o, keras.optimizers.LossScaleOptimizer) for o in self.optimizers)

    def skips_nonfinite(self):
        """True when the stage optimizers skip (or count) non-finite steps: fp16's
        `LossScaleOptimizer`, or `tfpar.nan_guard.skip_nonfinite_updates`."""
        return self.loss_scaled() or (self.optimizers is not None and all(
            hasattr(o, "tfpar_skip_nonfinite") for o in self.optimizers))

    def check_batch(self, x):
        """Raises ConfigError if a statically known batch does not split into k·M."""
        n, count = x.shape[0], self.M * self.groups
        if n is not None and n % count:
            raise ConfigError("microbatches", self.M, f"must divide the batch size {n}"
                              f"{' into grad_accum_steps groups' if self.groups > 1 else ''}"
                              f"; use a batch that is a multiple of {count}")

    def gradients(self, x, y, sample_weight=None):
        """Forward and backward of the (replica's) batch by the schedule.

        Args:
            x, y: the batch; `sample_weight` optional weights passed to the loss.
        Returns:
            (loss, y_pred, grads): mean loss over the batch, the last stage's outputs
            concatenated in batch order, and per stage the summed gradients for
            `stage_variables(s)` (the gradient of the full-batch mean loss).
        """
        K, V, last = self.K, self.V, self.path[-1]
        count = self.M * self.groups  # micro-batches in the step
        self.check_batch(x)
        devices = [current_device(p) for p in self.devices]
        with tf.device(devices[0]):
            # Batches of unknown size are checked at run time, before tf.split's own error.
            ok = tf.debugging.assert_equal(
                tf.shape(x)[0] % count, 0,
                message=f"microbatches={self.M}"
                        f"{f' x grad_accum_steps={self.groups}' if self.groups > 1 else ''}"
                        " must divide the batch size")
        with tf.device(devices[0]), tf.control_dependencies([ok]):
            xs = tf.split(x, count)
        with tf.device(devices[last % K]), tf.control_dependencies([ok]):
            labels = tf.split(y, count)
            ws = [None] * count if sample_weight is None else tf.split(sample_weight, count)
            # fp16: one scale for the whole pipeline, the last stage's optimizer's.
            scale = (tf.convert_to_tensor(self.optimizers[last % K].dynamic_scale)
                     if self.loss_scaled() else None)
        step = _StepActions(self, devices, labels, ws, scale)
        self.runner.run(step, lambda m: xs[m], groups=self.groups)
        with tf.device(devices[last % K]):
            loss = tf.add_n(step.losses)
            y_pred = tf.concat(step.preds, axis=0)
        acc = self._sum_copies(step.acc, devices)
        grads = [[g for c in range(V) if self.home[c * K + s] == c * K + s
                  for g in acc[c * K + s]] for s in range(K)]
        return loss, y_pred, grads

    def _sum_copies(self, acc, devices):
        """Each home stage model's gradients summed with those of the other copies of
        its virtual stage (Chimera), in model order, on the home's stage device."""
        if all(len(c) == 1 for c in self.copies):
            return acc
        summed = list(acc)
        for v, copies in enumerate(self.copies):
            if self.home[v] == v:
                with tf.device(devices[v % self.K]):
                    summed[v] = [functools.reduce(_add, gs) for gs in
                                 zip(*(acc[c] for c in copies))]
        return summed

    def weight_grads(self, v, tape, ys, out_grads):
        """W pass: each unit's weight gradients from its output gradient, in the order of
        `stages[v].trainable_variables` (zeros for a variable no unit uses)."""
        by_id = {}
        for unit, x_out, g in zip(self.units[v], ys[1:], out_grads):
            variables = unit.trainable_variables
            if variables:
                for var, grad in zip(variables, tape.gradient(
                        x_out, variables, output_gradients=g, unconnected_gradients="zero")):
                    by_id[id(var)] = grad
        return [by_id[id(var)] if id(var) in by_id else tf.zeros_like(var)
                for var in self.stages[v].trainable_variables]

    def apply(self, grads):
        """One optimizer step per stage, on the stage's device (with fp16 or a
        non-finite guard: after every stage agreed on whether the step's gradients are
        finite)."""
        if self.optimizers is None:
            raise RuntimeError("call build_optimizers(optimizer) before training")
        if self.skips_nonfinite():
            grads = self._agree_on_finite(grads)
        for s, (opt, placement) in enumerate(zip(self.optimizers, self.devices)):
            with tf.device(current_device(placement)):
                opt.apply(grads[s], self.stage_variables(s))
        self._copy_homes()

    def _copy_homes(self):
        """Chimera: each copy of the second pipeline takes its home's updated weights, on
        every replica (the home's value on that replica, copied to the copy's device)."""
        pairs = [(dst.value, src.value) for v, home in enumerate(self.home) if home != v
                 for dst, src in zip(self.stages[v].trainable_variables,
                                     self.stages[home].trainable_variables)]
        if not pairs:
            return

        def copy(strategy):
            for dst, src in pairs:
                strategy.extended.update(dst, lambda d, value: d.assign(value),
                                         args=(src,), group=False)
        tf.__internal__.distribute.interim.maybe_merge_call(copy, tf.distribute.get_strategy())

    def _agree_on_finite(self, grads):
        """Where any stage's gradients are not finite, every stage's first gradient is
        divided by 0, so that every stage's optimizer skips its update (fp16: and halves
        its scale; a guarded one counts the step); finite steps pass unchanged (divided
        by 1)."""
        flags = []
        for s, gs in enumerate(grads):
            with tf.device(current_device(self.devices[s])):
                flags.append(tf.reduce_min([tf.cast(tf.reduce_all(tf.math.is_finite(
                    _dense_part(g))), tf.float32) for g in gs] or [1.0]))
        agreed = []
        for s, gs in enumerate(grads):
            with tf.device(current_device(self.devices[s])):
                finite = tf.reduce_min(tf.stack([tf.identity(f) for f in flags]))
                agreed.append([_divide(gs[0], finite)] + list(gs[1:]) if gs else gs)
        return agreed

    def train_step(self, x, y, sample_weight=None):
        """gradients + apply. Returns (loss, y_pred)."""
        loss, y_pred, grads = self.gradients(x, y, sample_weight)
        self.apply(grads)
        return loss, y_pred

    def predict(self, x, training=False):
        """The stages in sequence on the whole batch, each on its device."""
        for v in self.path:
            with tf.device(current_device(self.devices[v % self.K])):
                x = self.stages[v](x, training=training)
        return x


class _StepActions:
    """The actions of one traced executor step (`tfpar.pipeline.runner`'s methods): a
    `GradientTape` per virtual stage and micro-batch under the stage's device; the
    weights' gradients summed per virtual stage in `acc`; with `one_op_at_a_time`, every
    op of an action chained after the one created before it."""

    def __init__(self, executor, devices, labels, weights, scale=None):
        self.ex, self.devices, self.labels, self.weights = executor, devices, labels, weights
        self.scale = scale                         # fp16: the loss scale, else None
        n = executor.K * executor.V
        self.position = executor.runner.position  # stage model -> virtual stage
        self.last = executor.runner.last
        self.count = executor.M * executor.groups  # micro-batches in the step
        self.acc = [None] * n                      # summed grads per virtual stage
        self.losses, self.preds = [None] * self.count, [None] * self.count
        self.tapes = {}                            # stashed forwards
        self.done = [None] * executor.K            # last action's op, per stage
        self.marks = []                            # what the action's done-op groups
        self.graph = tf.compat.v1.get_default_graph()
        self.chained = executor.one_op_at_a_time and not tf.executing_eagerly()

    @contextlib.contextmanager
    def scope(self, s, a, m):
        """The action runs on stage s's device after the stage's previous action (after
        every action when `serialize`); the name scope lets a profiler trace (or a graph
        check) find each action."""
        first_op = len(self.graph.get_operations()) if self.chained else 0
        chain = 0 if self.ex.serialize else s
        after = [self.done[chain]] if self.done[chain] is not None else []
        with tf.device(self.devices[s]), tf.control_dependencies(after), \
                tf.name_scope(f"s{s}_{a.kind}{m}_c{a.chunk}"):
            yield
            self.done[chain] = tf.group(*self.marks)
        if self.chained:
            _chain_in_order(self.graph.get_operations()[first_op:])

    def _accumulate(self, v, grads):
        self.acc[v] = grads if self.acc[v] is None else list(map(_add, self.acc[v], grads))

    def forward(self, s, v, m, x):
        ex, split = self.ex, self.ex.split
        with tf.GradientTape(persistent=split) as tape:
            h = tf.identity(x)  # the copy onto this device
            first = self.position(v) == 0
            if not first or split:
                tape.watch(h)
            if split:
                ys = [h]  # each unit's output, from the stage input on
                for unit in ex.units[v]:
                    ys.append(unit(ys[-1], training=True))
                out = ys[-1]
            else:
                out = ex.calls[v](h)
            if self.position(v) == self.last:
                self.preds[m] = out
                # Mean of per-micro-batch means / (k·M) = mean over the full batch.
                args = (self.labels[m], out) + (
                    () if self.weights[m] is None else (self.weights[m],))
                out = self.losses[m] = tf.reduce_mean(ex.loss_fn(*args)) / self.count
                if self.scale is not None:  # fp16: the gradients come out scaled
                    out = out * tf.cast(self.scale, out.dtype)
        self.tapes[(v, m)] = (tape, ys if split else h, out)
        self.marks = [out]
        return out

    def backward(self, s, v, m, upstream):
        tape, h, out = self.tapes.pop((v, m))
        variables = self.ex.stages[v].trainable_variables
        first = self.position(v) == 0
        sources = variables + ([] if first else [h])
        grads = tape.gradient(out, sources, output_gradients=upstream,
                              unconnected_gradients="zero")
        grad_in = None if first else grads.pop()
        self._accumulate(v, grads)
        self.marks = [_dense_part(g) for g in self.acc[v]] + ([] if first else [grad_in])
        return grad_in

    def backward_input(self, s, v, m, upstream):
        """Zero-bubble B: each unit's output gradient, last first; only input gradients.
        Returns the stage input's gradient and what W needs (the units' output
        gradients)."""
        tape, ys, out = self.tapes[(v, m)]
        first = self.position(v) == 0
        g = tape.gradient(out, ys[-1], output_gradients=upstream)
        out_grads = [g]
        for i in range(len(ys) - 1, 1 if first else 0, -1):
            g = tape.gradient(ys[i], ys[i - 1], output_gradients=g)
            out_grads.append(g)
        out_grads.reverse()  # out_grads[i]: gradient of units[i]'s output
        self.marks = [out_grads[0]]
        return (None if first else out_grads[0]), out_grads[-len(self.ex.units[v]):]

    def backward_weight(self, s, v, m, out_grads):
        """Zero-bubble W: the weights' gradients from the units' output gradients."""
        tape, ys, _ = self.tapes.pop((v, m))
        self._accumulate(v, self.ex.weight_grads(v, tape, ys, out_grads))
        self.marks = [_dense_part(g) for g in self.acc[v]]


def _chain_in_order(ops):
    """Each op waits for the op created before it. Creation order is a topological order
    (an op's inputs exist before it), so the extra edges add no cycle."""
    for prev, op in zip(ops, ops[1:]):
        if prev not in op.control_inputs:
            patches.add_control_input(op, prev)  # no public equivalent for existing ops


def _add(a, b):
    """a + b for gradients; sparse ones (embeddings) stay sparse, as Keras's optimizer
    treats them (rows a batch does not touch are not updated)."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                                tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _divide(g, d):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(d, g.values.dtype), g.indices, g.dense_shape)
    return g / tf.cast(d, g.dtype)


def _copy_optimizer(optimizer):
    """A fresh copy of `optimizer` (unbuilt), with a copy of its tfpar aggregator; a
    `LossScaleOptimizer` around a copy of its inner optimizer."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        config = optimizer.get_config()
        config.pop("inner_optimizer")
        return type(optimizer)(_copy_optimizer(optimizer.inner_optimizer), **config)
    copy = optimizer.__class__.from_config(optimizer.get_config())
    if hasattr(optimizer, "tfpar_skip_nonfinite"):  # the class has the guard's mixin
        copy.tfpar_skip_nonfinite = optimizer.tfpar_skip_nonfinite
    aggregator = getattr(optimizer, "tfpar_aggregator", None)
    if aggregator is not None:  # the class already has the aggregating mixin
        copy.tfpar_aggregator = type(aggregator)(**aggregator.get_config())
    return copy


def _dense_part(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _training_call(stage):
    return lambda h: stage(h, training=True)


def _chain_units(stage):
    """The stage's layers in order when it is a chain (each layer takes the previous one's
    single output), else the whole stage as one unit: its W pass then repeats the input
    gradients through the stage, which is exact but slower."""
    from tfpar.pipeline.partition import _graph
    try:
        _, nodes = _graph(stage)
    except Exception:  # not a functional graph: one unit
        return [stage]
    previous = stage.inputs[0]
    for node in nodes:
        if len(node.input_tensors) != 1 or node.input_tensors[0] is not previous \
                or len(node.outputs) != 1:
            return [stage]
        previous = node.outputs[0]
    return [node.operation for node in nodes]


def default_devices(num_stages):
    """The first `num_stages` local compute devices.

    Raises:
        ConfigError: fewer devices exist (on CPU, split it with --cpu_devices).
    """
    check_device_count("pipeline_stages", num_stages)
    return compute_devices()[:num_stages]
