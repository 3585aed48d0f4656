"""dp × tp × pp in one process: pipeline stages, each a tensor-parallel model on its own mesh.

`python -m tfpar.train --model=transformer --cpu_devices=8 --data_parallel=2
--tensor_parallel=2 --pipeline_stages=2 --microbatches=4`: K meshes, each `batch` × `model`
(data_parallel × tensor_parallel) over its own group of devices (stage s on devices
s·dp·tp … (s+1)·dp·tp − 1). The model is built whole with the run's seed, cut into K stages
by `tfpar.pipeline.partition`'s rules, and every stage rebuilt as DVariables on its mesh
with the presets of `tfpar.layout.presets` (the same weight paths as the whole model), its
weights copied in. Each stage has its own stateless optimizer on its mesh.

One compiled step holds all K meshes. It runs the schedule (`tfpar.pipeline.schedule`:
any of its schedules, traced by `tfpar.pipeline.runner` as `tfpar.pipeline.executor`) with one
`GradientTape` per stage and micro-batch, as the exact mesh step does: every variable read
once, forward/backward inside a `StatelessScope`, one write per changed variable at the end.

Measured on TF 2.21 (8 logical CPUs, two 2×2 meshes): inside one `tf.function`, a
cross-mesh copy works only between fully replicated layouts (`copy_to_mesh` of a
batch-sharded value fails in SPMD expansion). DTensor's all-reduce combining
(`DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION`, on by default, read once when DTensor
starts) made the step hang with no CPU use whenever an earlier stage holds a replicated
weight and data_parallel > 1 (the transformer's embedding; a 2-mesh Dense|Dense with
replicated kernels hangs too, with dp=2 × tp=1 as well, not with dp=1); with it off
the same steps run. Presumably it merges that stage's collectives over `batch`, the
forward gather of its output with the backward sum of its weight gradients, which
waits on the next mesh, which waits on the gather. `make_meshes` turns it off. (An
explicit copy from a later mesh back to an earlier one also hung before this was found;
with combining off, the interleaved schedule's copy from the last mesh to the first,
chunk 0 to chunk 1, runs.) So an activation crosses forwards only, inside the
receiving stage's tape: gathered on its mesh, copied replicated, split again on the
`batch` axis of the next mesh; its gradient crosses back through the copy's own gradient
(`CopyToMeshGrad`), which runs.

With the interleaved schedule the model is cut into K·V stage models, model v on mesh
v % K. With ZB-H1 a B action takes the input gradient from the stage's tape and the W
action the weights' gradient from the same (persistent) tape; it differentiates the
stage again rather than reusing B's intermediate gradients, so it is exact, not cheaper.
Ops within the step run in data-dependency order: the schedule fixes the trace order,
not the execution order. With `grad_accum_steps` = k the schedule runs k times on k
groups of M micro-batches before the one update.

With `--compression` (a codec of `tfpar.layout.reduction`) each stage's gradient
reduction over its mesh's `batch` axis goes through that codec, as on one mesh: micro-batches
are shaped `[data_parallel, m, ...]`, a stage's forward runs vectorized over the replicas,
and its backward runs the forward again inside `tf.vectorized_map` with the tape there, so
each replica's weight gradient comes out `[data_parallel, *shape]` with no sum over `batch`
(the `model` axis's collectives unchanged); they are summed over the micro-batches and
averaged through each stage's `BatchAxisReduction` (error feedback sharded like the
gradient). The extra forward per stage and micro-batch is the price.

With fp16 every stage's optimizer is a `LossScaleOptimizer`: the loss is scaled by the
last stage model's scale, and one decision is taken for all: each stage's all-finite flag
is copied to every mesh, and a stage whose neighbour overflowed gets a non-finite gradient
so that its own optimizer also skips and halves its scale. With a codec the decision comes
first: each stage's reduction unscales its gradients before the codec and, on a skipped
step, leaves its residuals and `Q`s as they were. `--recompute` rematerializes
the stage models' layers (`tfpar.recompute`). Checkpoints go through `tfpar.state`, which
gathers each stage's variables to the host first: TensorFlow's own saver, given the
DVariables of several meshes in one `tf.train.Checkpoint`, fails on TF 2.21 ("All inputs
to `tf_device.Cluster` must have same mesh configuration").
"""

import contextlib
import types

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import models, recompute
from tfpar.dims import ParallelDims
from tfpar.errors import ConfigError
from tfpar.layout import mesh as mesh_lib
from tfpar.layout import presets, reduction, values, variables
from tfpar.layout.mesh import BATCH, axis_size, make_mesh
from tfpar.layout.newaxis import traced_with_expand_dims
from tfpar.layout.optimizer import stateless_optimizer
from tfpar.layout.step import _layouts, _read, _write
from tfpar.layout.trainer import MeshTrainer, _refuse_keras_loops
from tfpar.pipeline import partition as partition_lib
from tfpar.pipeline.runner import ScheduleRunner
from tfpar.pipeline.schedule import chunks_of, make_schedule


def make_meshes(data_parallel, tensor_parallel, stages, devices):
    """`stages` meshes of `data_parallel` × `tensor_parallel`, over consecutive groups of
    `devices`. Call it before any other DTensor use in the process: it turns off DTensor's
    all-reduce combining, which DTensor reads once (see the module docstring).

    Raises:
        ConfigError: the three degrees do not multiply to the number of devices, or
            DTensor already started with all-reduce combining on.
    """
    mesh_lib.no_all_reduce_combining("pipeline_stages", stages,
                                      "a mesh pipeline's step could hang")
    dims = ParallelDims(dp=data_parallel, tp=tensor_parallel, pp=stages).on_devices(
        len(devices))
    return [make_mesh(dims.dp, dims.tp, group) for group in dims.stage_groups(devices)]


class StagedModel(keras.Model):
    """The stage models of a mesh pipeline, in order; `weights` lists them stage by stage,
    in the whole model's order. Stage model v (virtual stage v = chunk·K + s) lives on
    mesh v % K: with the interleaved schedule a mesh holds V of them. Not callable:
    `MeshPipelineTrainer` runs it."""

    def __init__(self, stages, num_meshes=None, **kwargs):
        super().__init__(**kwargs)
        self.stages = list(stages)
        self.num_meshes = num_meshes or len(self.stages)
        self.built = True
        self.optimizer = None  # each stage model has its own (MeshPipelineTrainer's);
        # callbacks that look for a compiled model's optimizer (Keras's TensorBoard) find none

    def on_mesh(self, index):
        """The stage models on mesh `index`."""
        return self.stages[index::self.num_meshes]

    def call(self, x, training=False):
        raise TypeError("a mesh pipeline runs through its MeshPipelineTrainer")


def build(config, task, meshes, build_optimizer):
    """Builds `(StagedModel, MeshPipelineTrainer)` for `config` over `meshes` (one per
    stage).

    Args:
        config: the `ParallelConfig` (model, seed, pipeline_stages, microbatches,
            schedule, virtual_stages).
        task: the `tfpar.data` task (input shape, classes).
        meshes: K `keras.distribution.DeviceMesh`es of equal shape (`make_meshes`).
        build_optimizer: a function returning a new Keras optimizer (one per stage).

    Raises:
        ConfigError: a setting this composition does not run (named), or the model does
            not cut into K stages.
    """
    rules = presets.preset_rules(presets.model_presets(config.model))
    keras.utils.set_random_seed(config.seed)
    whole = models.build(config.model, task.input_shape, task.num_classes,
                         width=config.model_width, depth=config.model_depth)
    K, V = len(meshes), config.dims.virtual
    # As on one mesh (`trainer.build_on_mesh`): with one replica on `batch` there is no
    # data-parallel reduction to compress.
    codec = (config.compression if config.compression != "none"
             and axis_size(meshes[0], BATCH) > 1 else None)
    stages, optimizers, reductions = [], [], []
    # Piece v (virtual stage v = chunk·K + s) lives on mesh v % K.
    for v, (nodes, src, out) in enumerate(_cut(whole, K * V)):
        distribution = keras.distribution.ModelParallel(
            layout_map=presets.layout_map(meshes[v % K], rules), batch_dim_name=BATCH)
        with variables.variable_scope(distribution):
            stage = _rebuild(nodes, src, out, v)
            # `blocks`: the zoo's block names among the stage's layers; `full`: every
            # layer of the stage with weights (not one input per stage, as on
            # `tfpar.pipeline`: here each layer keeps its own input).
            for layer in recompute.recomputed_layers(stage, config.recompute,
                                                     recompute.block_names(
                                                         config.model, config.model_depth)):
                recompute.rematerialize(layer)
            optimizer = stateless_optimizer(build_optimizer())
            optimizer.build(stage.trainable_variables)
        _refuse_keras_loops(stage)
        stages.append(stage)
        optimizers.append(optimizer)
        reductions.append(None if codec is None else reduction.for_codec(
            meshes[v % K], stage.trainable_variables, codec, config.error_feedback, optimizer,
            **reduction.codec_options(config)))
    model = StagedModel(stages, K, name=f"{whole.name}_mesh_pipeline")
    model.stage_optimizers = optimizers  # whose state `tfpar.state` saves
    object.__setattr__(model, "tfpar_reductions", tuple(r for r in reductions if r))
    schedule = make_schedule(config.schedule, K, config.microbatches, V)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, MeshPipelineTrainer(meshes, model, optimizers, schedule, loss,
                                      grad_accum_steps=config.grad_accum_steps,
                                      reductions=reductions if codec else None)


def _cut(model, num_stages):
    """`(nodes, input tensor, output tensor)` per stage: `tfpar.pipeline.partition`'s
    balanced split by parameter count."""
    functional, nodes = partition_lib._graph(model)
    if num_stages > len(nodes):
        raise ConfigError("pipeline_stages", num_stages,
                          f"model {model.name!r} has {len(nodes)} layers")
    cuts, blocker = partition_lib._valid_cuts(functional, nodes)
    cuts[len(nodes) - 1] = functional.outputs[0]
    cuts[-1] = functional.inputs[0]
    if len(cuts) - 1 < num_stages:
        raise ConfigError("pipeline_stages", num_stages,
                          f"model {model.name!r} cuts into at most {len(cuts) - 1} "
                          f"stages: {blocker}")
    costs = [partition_lib._cost(n.operation) for n in nodes]
    return [(nodes[b:e], cuts[b - 1], cuts[e - 1]) for b, e in
            partition_lib.balanced_bounds(costs, sorted(cuts)[1:-1], num_stages)]


def _rebuild(nodes, src, out, index):
    """`partition._rebuild` for a mesh: fresh layers (DVariables, inside the caller's
    variable scope) with the original weights put on their layouts."""
    inp = keras.Input(shape=src.shape[1:], dtype=src.dtype, name=f"stage_{index}_input")
    tensors, copies = {id(src): inp}, {}
    for n in nodes:
        op = n.operation
        if isinstance(op, keras.layers.Layer):
            if id(op) not in copies:
                copies[id(op)] = (op.__class__.from_config(op.get_config()), op)
            op = copies[id(op)][0]
        args, kwargs = n.arguments.fill_in(tensors)
        for t, v in zip(n.outputs, keras.tree.flatten(op(*args, **kwargs))):
            tensors[id(t)] = v
    sources = []
    for copy, original in copies.values():
        for variable, weight in zip(copy.weights, original.weights):
            values.assign(variable, np.asarray(weight))
            sources.append((variable, weight))
    stage = keras.Model(inp, tensors[id(out)], name=f"stage_{index}")
    # Each copy's weight with the original it came from, by object: an unnamed
    # `add_weight` gets a new auto-name (`variable_7`) in the copy, so paths can differ.
    object.__setattr__(stage, "tfpar_sources", sources)
    return stage


def _move(h, source, mesh):
    """`h` (split on the `batch` axis of mesh `source`) onto `mesh`, split there the same
    way: the one cross-mesh copy that works inside a step (see the module docstring)."""
    rank = h.shape.rank
    whole = dtensor.relayout(h, dtensor.Layout.replicated(source.backend_mesh, rank))
    whole = dtensor.copy_to_mesh(whole, dtensor.Layout.replicated(mesh.backend_mesh, rank))
    return dtensor.relayout(whole, dtensor.Layout.batch_sharded(mesh.backend_mesh, BATCH,
                                                                rank))


class MeshPipelineTrainer(MeshTrainer):
    """`MeshTrainer` for K·V stage models on K meshes, trained by a pipeline schedule.

    Args:
        meshes: one `keras.distribution.DeviceMesh` per stage.
        model: the `StagedModel` (K·V stage models, model v on mesh v % K).
        optimizers: one built stateless optimizer per stage model, on its mesh. If they
            are `keras.optimizers.LossScaleOptimizer`s (fp16), the loss is scaled by the
            last stage model's scale and every stage takes one decision: when any stage's
            gradient is not finite, every stage skips its update and halves its scale.
        schedule: K action lists (`tfpar.pipeline.schedule`: any schedule; with V model
            chunks per stage for the interleaved one; with W passes for zero-bubble).
        loss: a mean-reducing `keras.losses.Loss`.
        grad_accum_steps: k > 1 runs the schedule k times in the step, on k consecutive
            groups of M micro-batches, and applies the mean gradient of all k·M in one
            update (the batch must split into k·M micro-batches divisible by
            data_parallel).
        reductions: None (DTensor's own sum over `batch`), or one
            `tfpar.layout.reduction.BatchAxisReduction` per stage model, on its mesh: each
            data-parallel replica's gradient is then formed on its own (micro-batches
            shaped `[data_parallel, m, ...]`, the stage's backward vectorized over the
            replicas and recomputing its forward) and averaged over `batch` through the
            codec; the `model` axis's collectives stay exact.
    """

    def __init__(self, meshes, model, optimizers, schedule, loss, accuracy="accuracy",
                 grad_accum_steps=1, reductions=None):
        self.meshes, self.mesh, self.model, self.loss = meshes, meshes[0], model, loss
        self.stage_optimizers = optimizers
        self.reductions = reductions
        self.optimizer = types.SimpleNamespace(
            variables=[v for o in optimizers for v in o.variables])
        # grad_accum_steps >= 1 is checked by ParallelConfig, which `build` reads it from.
        self.grad_accum_steps, self.accuracy, self.reduction = grad_accum_steps, accuracy, None
        self.K, self.V = len(schedule), chunks_of(schedule)
        self.M = 1 + max(a.microbatch for a in schedule[0])
        if len(model.stages) != self.K * self.V or len(meshes) != self.K:
            raise ConfigError("pipeline_stages", len(meshes),
                              f"the schedule has {self.K} stages × {self.V} chunks for "
                              f"{len(model.stages)} stage models on {len(meshes)} meshes")
        # fp16: where each stage optimizer keeps its scale among its variables.
        self.scale_index = None
        if all(hasattr(o, "inner_optimizer") for o in optimizers):
            self.scale_index = [[id(v) for v in o.variables].index(id(o.dynamic_scale))
                                for o in optimizers]
        # Zero-bubble schedules split each backward: B the input gradient, W the weights'.
        self._runner = ScheduleRunner(schedule)
        self.split = self._runner.split
        for stage, optimizer in zip(model.stages, optimizers):
            variables.check_dvariables(list(stage.variables) + list(optimizer.variables),
                                       "the mesh pipeline")
        self._train = self._compiled(self._train_step)
        self._eval = self._compiled(self._eval_step)

    def _compiled(self, step):
        fn = tf.function(traced_with_expand_dims(step))

        def call(*args):
            with dtensor.default_mesh(self.mesh.backend_mesh):
                return fn(*args)
        return call

    def _on_mesh(self, batch, training=False):
        batch = tuple(b for b in batch if b is not None)
        if len(batch) not in (2, 3):
            raise ConfigError("batch", f"{len(batch)} arrays",
                              "a mesh pipeline takes (x, y) or (x, y, sample_weight) batches")
        x = np.asarray(batch[0])
        parts = axis_size(self.mesh, BATCH)
        count = self.M * (self.grad_accum_steps if training else 1)
        if len(x) % (count * parts):
            raise ConfigError("microbatches", self.M,
                              f"the batch of {len(x)} must split into {count} micro-batches "
                              f"(microbatches × grad_accum_steps) divisible by "
                              f"data_parallel={parts} (the mesh pipeline's stages hand "
                              "equal micro-batches on; tfpar.train's generated data pads "
                              "each replica's share to fit)")
        if training and self.reductions:  # each micro-batch as [data_parallel, m, ...]
            micro = [np.split(np.asarray(b), count) for b in batch]
            xs = tuple(values.replica_batches_to_mesh((p,), self.meshes[0])[0]
                       for p in micro[0])
            ys = tuple(tuple(values.replica_batches_to_mesh((p,), self.meshes[-1])[0]
                             for p in parts_) for parts_ in micro[1:])
            return xs, ys
        xs = values.micro_batches_to_mesh((x,), self.meshes[0], count)[0]
        # Labels and weights go where the loss is: the last stage model's mesh.
        ys = values.micro_batches_to_mesh(batch[1:], self.meshes[-1], count)
        return xs, ys

    def mesh_of(self, v):
        return self.meshes[v % self.K]

    def stage_forward(self, v, tv, ntv, h, training=True):
        stage = self.model.stages[v]
        mapping = (list(zip(stage.trainable_variables, tv))
                   + list(zip(stage.non_trainable_variables, ntv)))
        with keras.StatelessScope(state_mapping=mapping):
            return stage(h, training=training)

    def replica_forward(self, v, tv, ntv, h):
        """Stage model v on `h` `[data_parallel, m, ...]`, one replica at a time (the
        layouts of the replica gradients' backward, `replica_grads`)."""
        return tf.vectorized_map(lambda x: self.stage_forward(v, tv, ntv, x), h)

    def replica_grads(self, v, tv, ntv, h, upstream, target, weights, inputs):
        """Each replica's gradients of stage model v: `[data_parallel, *shape]` per
        weight (if `weights`), then the input's (if `inputs`). The forward runs again
        inside the replica map: a gradient formed there has no sum over `batch` in it.
        `target(out, replica_args)` gives the last stage model's scaled loss."""
        elems = (h,) + (tuple(target[1]) if upstream is None else (upstream,))

        def one(args):
            h_r = args[0]
            with tf.GradientTape() as tape:
                tape.watch(tv)
                tape.watch(h_r)
                out = self.stage_forward(v, tv, ntv, h_r)
                if upstream is None:
                    out = target[0](out, args[1:])
            sources = (list(tv) if weights else []) + ([h_r] if inputs else [])
            return [tf.convert_to_tensor(g) for g in tape.gradient(
                out, sources, output_gradients=None if upstream is None else args[1],
                unconnected_gradients="zero")]
        return tf.vectorized_map(one, elems)

    def _train_step(self, xs, ys):
        stages = self.model.stages
        tv = [_read(st.trainable_variables) for st in stages]
        ntv = [_read(st.non_trainable_variables) for st in stages]
        ov = [_read(o.variables) for o in self.stage_optimizers]
        residuals = [r.read() for r in self.reductions] if self.reductions else []
        # fp16: one scale for the whole pipeline, the last stage model's (on its mesh).
        scale = None if self.scale_index is None else ov[-1][self.scale_index[-1]]
        step = _MeshStepActions(self, tv, ntv, ys, scale)
        # The schedule once per group of M micro-batches (gradient accumulation).
        self._runner.run(step, lambda m: xs[m], groups=self.grad_accum_steps)
        acc = step.acc
        # fp16: one decision for every stage, taken before the codecs so that a skipped
        # step leaves their residuals as they were.
        finite = None if scale is None else self._finite_everywhere(acc)
        if self.reductions is not None:
            for v, reducer in enumerate(self.reductions):
                acc[v], kept = reducer.mean(
                    acc[v], residuals[v],
                    scale=None if scale is None else ov[v][self.scale_index[v]],
                    finite=None if scale is None else finite[v])
                for residual, value in zip(reducer.step_variables, kept):
                    residual.assign(dtensor.relayout(value, residual.layout))
        if scale is not None:
            for gs, ok in zip(acc, finite):
                # Divided by 1 (all finite): unchanged; by 0: not finite, so each stage's
                # optimizer skips its update and halves its scale.
                gs[0] = gs[0] / tf.cast(ok, gs[0].dtype)
        for v, (stage, optimizer) in enumerate(zip(stages, self.stage_optimizers)):
            new_tv, new_ov = optimizer.stateless_apply(ov[v], acc[v], tv[v])
            _write(stage.trainable_variables, _layouts(stage.trainable_variables), tv[v],
                   new_tv)
            _write(optimizer.variables, _layouts(optimizer.variables), ov[v], new_ov)
        return {"loss": tf.add_n(step.losses),
                "correct": tf.add_n([c for c, _ in step.metrics]),
                "weight": tf.add_n([w for _, w in step.metrics])}

    def _finite_everywhere(self, grads):
        """fp16: every stage's `LossScaleOptimizer` takes one decision. Each stage model's
        all-finite flag is copied (a replicated scalar) to every mesh; returns, per stage
        model, on its mesh, whether every stage's gradient is finite (the same scale on
        every stage, as all start equal and take the same decisions)."""
        flags = [tf.cast(reduction.all_finite(gs), tf.float32) for gs in grads]
        out = []
        for v in range(len(grads)):
            mesh = self.mesh_of(v).backend_mesh
            here = [f if u % self.K == v % self.K else dtensor.copy_to_mesh(
                f, dtensor.Layout.replicated(mesh, 0)) for u, f in enumerate(flags)]
            out.append(tf.reduce_min(tf.stack(here)) > 0)
        return out

    def _eval_step(self, xs, ys):
        losses, metrics = [], []
        stages = self.model.stages
        tv = [_read(st.trainable_variables) for st in stages]
        ntv = [_read(st.non_trainable_variables) for st in stages]
        for m in range(self.M):
            h = xs[m]
            for v in range(len(stages)):
                # inference mode, as Keras's `evaluate` runs a model (dropout off)
                h = self.stage_forward(v, tv[v], ntv[v], h if v == 0 else
                                        _move(h, self.mesh_of(v - 1), self.mesh_of(v)),
                                        training=False)
            losses.append(self.micro_loss(h, ys, m, 1))
            metrics.append(_correct(h, ys, m))
        return {"loss": tf.add_n(losses), "correct": tf.add_n([c for c, _ in metrics]),
                "weight": tf.add_n([w for _, w in metrics])}

    def micro_loss(self, logits, ys, m, groups=None):
        """Micro-batch m's share of the batch's mean loss (equal micro-batches: the mean of
        their means), over `groups` groups of M (default: grad_accum_steps)."""
        weight = ys[1][m] if len(ys) > 1 else None
        groups = self.grad_accum_steps if groups is None else groups
        return self.loss(ys[0][m], logits, weight) / (self.M * groups)

    def predict(self, x, batch_size=None):
        raise ConfigError("predict", "mesh pipeline", "not built for a mesh pipeline yet")


class _MeshStepActions:
    """The actions of one traced mesh-pipeline step (`tfpar.pipeline.runner`'s methods):
    a `GradientTape` per stage model and micro-batch over the step's variable values `tv`
    (read once); the weights' gradients summed per stage model in `acc`, each replica's
    own (`[data_parallel, *shape]`) when the stages' reductions run a codec."""

    def __init__(self, trainer, tv, ntv, ys, scale):
        self.t, self.tv, self.ntv, self.ys, self.scale = trainer, tv, ntv, ys, scale
        self.per_replica = trainer.reductions is not None
        self.last = len(trainer.model.stages) - 1
        self.acc = [None] * len(trainer.model.stages)
        self.losses, self.metrics, self.tapes = [], [], {}

    def scope(self, s, action, m):
        return contextlib.nullcontext()

    def add(self, v, grads):
        grads = [tf.convert_to_tensor(g) for g in grads]
        self.acc[v] = grads if self.acc[v] is None else [
            a + b for a, b in zip(self.acc[v], grads)]

    def scaled(self, loss):
        return loss if self.scale is None else loss * tf.cast(self.scale, loss.dtype)

    def replica_loss(self, m):
        """(target, its per-replica arguments) of micro-batch m."""
        t = self.t

        def target(logits, args):
            weight = args[1] if len(args) > 1 else None
            return self.scaled(t.loss(args[0], logits, weight) / (t.M * t.grad_accum_steps))
        return target, tuple(y[m] for y in self.ys)

    def _arrived(self, v, h):
        """The input `h` moved onto stage model v's mesh (v > 0)."""
        return _move(h, self.t.mesh_of(v - 1), self.t.mesh_of(v))

    def forward(self, s, v, m, h):
        t, last = self.t, self.last
        if self.per_replica:
            # The tape holds the copy from the previous mesh only: the weights' gradients
            # come from `replica_grads`.
            tape, h_in = None, h
            if v > 0:
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    h_in = self._arrived(v, h)
            out = t.replica_forward(v, self.tv[v], self.ntv[v], h_in)
            if v == last:
                self.losses.append(t.micro_loss(out, self.ys, m))
                self.metrics.append(_correct(out, self.ys, m))
            self.tapes[(v, m)] = (tape, h, None, h_in)
            return out
        with tf.GradientTape(persistent=t.split) as tape:
            tape.watch(self.tv[v])
            h_in = h
            if v > 0:
                tape.watch(h)
                h_in = self._arrived(v, h)
            out = t.stage_forward(v, self.tv[v], self.ntv[v], h_in)
            if v == last:
                loss = t.micro_loss(out, self.ys, m)
                self.losses.append(loss)
                self.metrics.append(_correct(out, self.ys, m))
                out = self.scaled(loss)
        self.tapes[(v, m)] = (tape, h, out, h_in)
        return out

    def backward(self, s, v, m, upstream):
        if self.per_replica:
            return self._replica_backward("BW", v, m, upstream)
        tape, h, out, _ = self.tapes.pop((v, m))
        sources = list(self.tv[v]) + ([h] if v > 0 else [])
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(
            out, sources, output_gradients=upstream, unconnected_gradients="zero")]
        grad_in = grads.pop() if v > 0 else None
        self.add(v, grads)
        return grad_in

    def backward_input(self, s, v, m, upstream):
        """ZB-H1's B: the input gradient only; W gets `upstream` again."""
        if self.per_replica:
            return self._replica_backward("B", v, m, upstream), upstream
        tape, h, out, _ = self.tapes[(v, m)]
        grad_in = None
        if v > 0:
            grad_in = tf.convert_to_tensor(tape.gradient(out, h, output_gradients=upstream))
        return grad_in, upstream

    def backward_weight(self, s, v, m, upstream):
        """ZB-H1's W: the weights' gradient, from the forward's (persistent) tape."""
        if self.per_replica:
            self._replica_backward("W", v, m, upstream)
            return
        tape, _, out, _ = self.tapes.pop((v, m))
        self.add(v, tape.gradient(out, self.tv[v], output_gradients=upstream,
                                  unconnected_gradients="zero"))

    def _replica_backward(self, kind, v, m, upstream):
        """A B, W or whole ("BW") backward of stage model v on micro-batch m with each
        replica's weight gradients (`replica_grads`); returns the input's gradient (or
        None), which goes back to the previous mesh through the forward's own copy
        (`_move` on its tape)."""
        inputs = v > 0 and kind != "W"
        weights = kind != "B"
        tape, h, _, h_in = (self.tapes[(v, m)] if kind == "B"
                            else self.tapes.pop((v, m)))
        if not (inputs or weights):  # ZB-H1's B on the first stage: nothing to send
            return None
        grads = self.t.replica_grads(v, self.tv[v], self.ntv[v], h_in, upstream,
                                      self.replica_loss(m), weights, inputs)
        grad_in = None
        if inputs:
            grad_in = tf.convert_to_tensor(tape.gradient(h_in, h,
                                                         output_gradients=grads.pop()))
        if weights:
            self.add(v, grads)
        return grad_in


def _correct(logits, ys, m):
    """(weighted correct predictions, weight sum) of micro-batch m."""
    y = ys[0][m]
    match = tf.cast(tf.equal(tf.cast(tf.argmax(logits, axis=-1), y.dtype), y), tf.float32)
    weight = tf.cast(ys[1][m], tf.float32) if len(ys) > 1 else tf.ones_like(match)
    return tf.reduce_sum(match * weight), tf.reduce_sum(weight)
