"""Which settings each backend of the trainer honours: one table, checked before TensorFlow.

`ParallelConfig` calls `check(config)` on construction. A setting a backend cannot honour
is refused with one `ConfigError` line naming the setting, the value and why, never
silently ignored. Imports no TensorFlow.

Backends (what `tfpar.train.train` runs a config on, see `tfpar.backends`):

- `data_parallel`: Keras 3 on a `tf.distribute` strategy (one device, mirrored, multi-worker),
- `pipeline`: the same backend with `pipeline_stages > 1` (a `PipelineModel`); under a
  `TF_CONFIG` of several workers, one stage per worker process, each running that stage
  of every replica (`tfpar.pipeline.remote`; its rows are in `ACROSS_WORKERS`),
- `dtensor`: Keras 3 on a DTensor mesh, for `tensor_parallel > 1` and for `zero_stage=3`
  (under a `TF_CONFIG` of several workers the mesh, and with `pipeline_stages > 1` each
  stage's mesh, spans them),
- `tf_keras`: `keras=2`, legacy Keras on the `tf.distribute` strategies.

`COMBINATIONS` lists what one setting's value excludes on every backend (ZeRO-3 with a
sparse or low-rank codec, ZeRO 1/2 with `auto`; on a mesh, compression with one replica
on `batch`; the
zero-bubble schedule with recomputation; Chimera with an odd micro-batch count or on the
mesh pipeline; tfmot's settings), `ACROSS_WORKERS` what a
`TF_CONFIG` cluster excludes (`check_cluster`, from `tfpar.train.check_inputs`). This is
the one rulebook: nothing else in tfpar raises a `ConfigError` for a combination (a test
walks the source). Code a Python caller reaches without a `ParallelConfig` (the pipeline
executor, `MeshTrainer`, ...) applies the same row through `enforce`.

>>> from tfpar import ParallelConfig
>>> backend_of(ParallelConfig(tensor_parallel=2))
'dtensor'
"""

import dataclasses

from tfpar.errors import ConfigError

# Codecs that take Adam in front of compression by default (`--compress_adam_step`, every
# backend; `tfpar.config.ADAM_FRONT_CODECS` is this tuple).
ADAM_FRONT_CODECS = ("topk", "powersgd", "lowbit")

BACKENDS = ("data_parallel", "pipeline", "dtensor", "tf_keras")

# setting -> {backend: (the values that backend honours, why it honours no other)}.
# A setting or backend not listed is honoured with every valid value.
TABLE = {
    "sequence_parallel": {
        backend: ((False,), "sequence parallelism splits activations over the model axis "
                            "of --tensor_parallel>1")
        for backend in ("data_parallel", "pipeline", "tf_keras")},
    "grad_accum_steps": {
        "tf_keras": ((1,), "tf_keras optimizers do not accumulate gradients"),
    },
    "pipeline_stages": {
        "tf_keras": ((1,), "pipeline parallelism is Keras 3 only"),
    },
    "tensor_parallel": {
        "tf_keras": ((1,), "tensor parallelism is Keras 3 only"),
    },
    "model": {
        "tf_keras": (("mlp", "convnet"), "--keras=2 builds mlp or convnet (the transformer's "
                                         "layers are Keras 3 only)"),
    },
    "on_nan": {
        "dtensor": (("stop",), "the DTensor step cannot skip a non-finite update; use "
                               "--on_nan=stop"),
        "tf_keras": (("stop",), "skipping non-finite steps is Keras 3 only"),
    },
    "recompute": {
        "tf_keras": (("none",), "recomputation wraps Keras 3 layers"),
    },
    "zero_stage": {
        "pipeline": ((0,), "ZeRO shards one optimizer over data-parallel replicas; a "
                           "pipeline's per-stage optimizers are not sharded"),
        "dtensor": ((0, 3), "a DTensor mesh shards parameters (3, tfpar.zero.fsdp); "
                            "stages 1 and 2 run on tf.distribute (--tensor_parallel=1)"),
        "tf_keras": ((0,), "ZeRO is built on Keras 3's optimizer"),
    },
    "offload": {
        "pipeline": (("none",), "a pipeline's stage optimizers update on their stages' "
                                "devices; the host update is built for one data-parallel "
                                "optimizer"),
        "dtensor": (("none",), "a DTensor mesh updates its sharded weights in the mesh's "
                               "step, which cannot call the host's Python (TF 2.21; ZeRO-3's "
                               "parameters on the host: not built, see the memory guide); the "
                               "host update runs on tf.distribute (data parallelism, "
                               "--zero_stage=1|2)"),
        "tf_keras": (("none",), "offload is built on Keras 3's optimizer"),
    },
    "adam_warmup_steps": {
        "tf_keras": ((50,), "tf_keras optimizers keep Adam behind the aggregator (no "
                            "Adam in front of it)"),
    },
    "allreduce": {
        "pipeline": (("auto", "flat"), "a pipeline's stages run their own collectives; the "
                                       "hierarchical sum is data parallelism's"),
        "dtensor": (("auto", "flat"), "a DTensor mesh reduces through DTensor's collectives, "
                                      "not tf.distribute's groups"),
        "tf_keras": (("auto", "flat"), "the hierarchical sum is wired into Keras 3's "
                                       "optimizer hook"),
    },
    "measure_comm": {
        "pipeline": ((False,), "the communication share is measured on a data-parallel step "
                               "only; a pipeline reports its bubble instead"),
        "dtensor": ((False,), "the communication share is measured on tf.distribute "
                              "collectives only"),
        "tf_keras": ((False,), "the communication share is measured on Keras 3's train "
                               "step (--keras=3)"),
    },
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row: `setting`'s value is refused when `refuses(config)` (a cluster row:
    `refuses(config, cluster)`, `cluster` a parsed `TF_CONFIG`) holds; `why` (text, or a
    function of the same arguments) says why and what would work; `value` (a function of
    the same arguments) is the value named, by default the setting's."""

    setting: str
    refuses: object
    why: object
    value: object = None
    cluster: bool = False

    def error(self, config, cluster=None):
        """The `ConfigError` of this row for `config`, or None if it does not refuse."""
        args = (config, cluster) if self.cluster else (config,)
        if not self.refuses(*args):
            return None
        why = self.why(*args) if callable(self.why) else self.why
        value = self.value(*args) if self.value else getattr(config, self.setting)
        return ConfigError(self.setting, value, why)


def _mesh(c):
    return backend_of(c) == "dtensor"


# ZeRO-3's reduce-scatter travels in these codecs (`tfpar.zero.reduce_scatter`), and so
# does ZeRO 1/2's with CPU offload.
ZERO_CODECS = ("fp16", "bf16", "int8")
# ZeRO 1/2's (`tfpar.zero.sharded`): the reduce-scatter in fp16/bf16/int8, lowbit or top-k
# (`sharded.CODECS`), or the aggregator's whole sum of which each replica keeps its piece
# (`sharded.AGGREGATED`: threshold, PowerSGD, auto).
ZERO12_CODECS = ZERO_CODECS + ("lowbit", "topk", "threshold", "powersgd")
# Those whose reduce-scatter leaves the update to the piece's owner alone, which offload
# moves to the host (`tfpar.offload.OffloadZeroMixin`); threshold's and PowerSGD's
# aggregator with offload is not tested.
ZERO_OFFLOAD_CODECS = ZERO_CODECS + ("lowbit", "topk")
ZERO_COMPRESSION = Rule(
    "compression", lambda c: c.zero_stage in (1, 2)
    and c.compression not in ("none",) + ZERO12_CODECS,
    "not supported: --zero_stage=1|2 compresses gradients with " + ", ".join(ZERO12_CODECS)
    + "; use one of those, or --zero_stage=0")
# Top-k on ZeRO 1/2 with Adam behind it (`--nocompress_adam_step`, `--offload=optimizer`, or
# another optimizer) sends each piece to its owner alone: no warm-up table is built there,
# and `--topk_union` does nothing either (one warning line at start:
# `tfpar.zero.sharded.TOPK_UNION_LINE`; refusing it would refuse the default). With Adam in
# front (`tfpar.zero.sharded.adam_in_front`'s condition, here without TensorFlow) data
# parallelism's aggregator runs the codec: its warm-up and union work.
ZERO_TOPK_WARMUP = Rule(
    "topk_warmup_steps", lambda c: c.zero_stage in (1, 2) and c.compression == "topk"
    and c.topk_warmup_steps > 0
    and not (c.optimizer == "adam" and c.compress_adam_step and c.offload == "none"),
    "not supported with --zero_stage=1|2 and Adam behind the codec: ZeRO's top-k sends "
    "--topk_ratio of each piece from the first step; use --topk_warmup_steps=0, Adam in "
    "front (--optimizer=adam --compress_adam_step, no --offload), or --zero_stage=0")
# ZeRO-3's reduce-scatter on the mesh travels in the same (`tfpar.zero.reduce_scatter`).
ZERO3_COMPRESSION = Rule(
    "compression", lambda c: c.zero_stage == 3
    and c.compression not in ("none",) + ZERO_CODECS,
    "not supported: --zero_stage=3 reduce-scatters gradients in fp16, bf16 or int8; "
    "no other codec's reduce-scatter is built (use one of those, or --compression=none)")
ZERO3_COMPRESSION_MODEL = Rule(
    "model", lambda c: c.zero_stage == 3 and c.compression != "none"
    and c.model not in TENSOR_PARALLEL_MODELS,
    "not supported: ZeRO-3's compressed reduce-scatter maps the step over replicas, where "
    "TensorFlow vectorizes a convolution's filter gradient as a loop a DTensor mesh cannot "
    "run (TF 2.21); use --model=mlp or transformer, or --compression=none")
ZERO3_COMPRESSION_RECOMPUTE = Rule(
    "recompute", lambda c: c.zero_stage == 3 and c.compression != "none"
    and c.recompute != "none",
    "not supported: ZeRO-3's compressed reduce-scatter forms each replica's gradient in a "
    "step mapped over replicas, where layers are not recomputed; use --recompute=none, or "
    "--compression=none")

# Without resharding each layer keeps its gathered weights and its activations for the
# backward pass: the layers are wrapped to gather once, and `--recompute` would not apply.
ZERO3_KEEP_RECOMPUTE = Rule(
    "recompute", lambda c: c.zero_stage == 3 and not c.zero_reshard_after_forward
    and c.recompute != "none",
    "not supported with --nozero_reshard_after_forward: ZeRO-3 then keeps each layer's "
    "whole weights and activations for the backward pass, nothing recomputed; use "
    "--recompute=none, or --zero_reshard_after_forward (recomputed, the default)")

# Without resharding every layer is kept whole already: a count of layers kept says nothing.
ZERO3_KEEP_LAST = Rule(
    "zero_keep_last_layers", lambda c: c.zero_stage == 3 and not c.zero_reshard_after_forward
    and c.zero_keep_last_layers > 0,
    "not supported with --nozero_reshard_after_forward, which keeps every layer's whole "
    "weights already; use --zero_keep_last_layers=0, or --zero_reshard_after_forward")


def _mesh_dp_is_one(c):
    """The mesh's `batch` axis has one replica: `--data_parallel=1`, or left to the
    devices (0) with `--cpu_devices` all taken by the tensor and pipeline degrees."""
    if c.data_parallel:
        return c.data_parallel == 1
    return c.cpu_devices > 1 and c.cpu_devices == c.tensor_parallel * c.pipeline_stages


MESH_COMPRESSION_ONE_REPLICA = Rule(
    "compression", lambda c: _mesh(c) and c.compression != "none" and _mesh_dp_is_one(c),
    "a DTensor mesh with one replica on its batch axis has no data-parallel reduction to "
    "compress (the model axis's collectives are exact); use --data_parallel>1 or "
    "--compression=none")
# The mesh's codecs (`tfpar.layout.reduction`) compress from the first step at one density.
MESH_POWERSGD_START = Rule(
    "powersgd_start_step", lambda c: _mesh(c) and c.compression == "powersgd"
    and c.powersgd_start_step > 0,
    "not supported: PowerSGD on a DTensor mesh compresses from step 0; use "
    "--powersgd_start_step=0, or --tensor_parallel=1 (tf.distribute)")
# DGC's momentum (`TopKAggregator(momentum=...)`) is tf.distribute's top-k's.
MESH_TOPK_MOMENTUM = Rule(
    "momentum", lambda c: _mesh(c) and c.compression == "topk"
    and getattr(c, "topk_momentum", 0.0) > 0,
    "not supported: top-k on a DTensor mesh has no DGC momentum; use momentum=0.0 (the "
    "optimizer's own momentum runs after the sum), or tf.distribute (tfpar.make_strategy)",
    value=lambda c: c.topk_momentum)  # the aggregator's argument (no ParallelConfig field)
MESH_TOPK_WARMUP = Rule(
    "topk_warmup_steps", lambda c: _mesh(c) and c.compression == "topk"
    and c.topk_warmup_steps > 0,
    "not supported: top-k on a DTensor mesh sends --topk_ratio from step 0; use "
    "--topk_warmup_steps=0, or --tensor_parallel=1 (tf.distribute)")
# Adam in front of the mesh's codecs (`tfpar.layout.adam_front`) starts from its exact
# warm-up; tf.distribute's `--adam_warmup_steps=0` (each replica its own Adam from step 0)
# is not built there.
MESH_ADAM_WARMUP = Rule(
    "adam_warmup_steps", lambda c: _mesh(c) and c.compress_adam_step
    and c.optimizer == "adam" and c.compression in ADAM_FRONT_CODECS
    and c.adam_warmup_steps == 0,
    "not supported on a DTensor mesh: Adam in front of its codec starts from exact steps; "
    "use --adam_warmup_steps>=1, or --compress_adam_step=false (Adam behind the codec)")
ZB_H1_RECOMPUTE = Rule(
    "recompute", lambda c: backend_of(c) == "pipeline" and c.schedule == "zb_h1"
    and c.recompute in ("full", True),  # True: `PipelineModel(recompute=True)`
    "a zero-bubble schedule keeps the activations its weight passes need; use 1f1b to "
    "recompute")
INTERLEAVED_VIRTUAL_STAGES = Rule(
    "virtual_stages", lambda c: c.schedule == "interleaved" and c.dims.pp_enabled
    and c.virtual_stages < 2,
    "the interleaved schedule needs --virtual_stages >= 2")

# The zoo's models with tensor-parallel layout presets (`tfpar.layout.presets`), and
# with sequence-parallel ones.
TENSOR_PARALLEL_MODELS = ("mlp", "transformer")
SEQUENCE_PARALLEL_MODELS = ("transformer",)
MESH_MODEL = Rule(
    "model", lambda c: _mesh(c) and (c.zero_stage != 3 or c.dims.tp_enabled)
    and c.model not in TENSOR_PARALLEL_MODELS,
    f"tensor parallelism has presets for {', '.join(TENSOR_PARALLEL_MODELS)}; use "
    "--tensor_parallel=1 or give your own layout rules")
SEQUENCE_MODEL = Rule(
    "sequence_parallel",
    lambda c: c.sequence_parallel and c.model not in SEQUENCE_PARALLEL_MODELS,
    "not supported: sequence parallelism splits the transformer's sequence; --model=mlp and "
    "convnet have none")
INTERLEAVED_MICROBATCHES = Rule(
    "microbatches", lambda c: c.schedule == "interleaved" and c.dims.pp_enabled
    and c.microbatches % c.pipeline_stages != 0,
    lambda c: f"the interleaved schedule needs a multiple of pipeline_stages="
              f"{c.pipeline_stages}, e.g. "
              f"{c.pipeline_stages * max(1, round(c.microbatches / c.pipeline_stages))}")
CHIMERA_MICROBATCHES = Rule(
    "microbatches", lambda c: c.schedule == "chimera" and c.dims.pp_enabled
    and c.microbatches % 2,
    lambda c: f"the chimera schedule sends half the micro-batches down the pipeline and "
              f"half up; use an even number, e.g. {c.microbatches + 1}")
# The mesh pipeline (`tfpar.layout.pipeline`) builds one copy of each stage on its mesh;
# Chimera's second pipeline needs a second copy on the mirrored mesh and the sum of both
# copies' gradients across meshes, which it does not build.
CHIMERA_MESH = Rule(
    "schedule", lambda c: c.schedule == "chimera" and _mesh(c) and c.dims.pp_enabled,
    "not supported on the mesh pipeline (--tensor_parallel>1 or --zero_stage=3 with "
    "--pipeline_stages>1): it holds one copy of each stage, and chimera's second pipeline "
    "needs a second; use 1f1b, interleaved or zb_h1 there, or chimera with "
    "--tensor_parallel=1")
ONE_DEVICE_REPLICAS = Rule(
    "data_parallel", lambda c: c.strategy == "one_device" and c.data_parallel > 1,
    "the one_device strategy has 1 replica; use --data_parallel=1 (or 0), or "
    "--strategy=mirrored")

def _mesh_pipeline_cuts(c):
    """Equal pieces a mesh pipeline cuts a step's batch into (micro-batches × accumulation
    steps × `batch`-axis replicas), when the replicas are known before TensorFlow
    (`--data_parallel`, or what `--cpu_devices` leaves); else 0."""
    parts = c.data_parallel or (c.cpu_devices // (c.tensor_parallel * c.pipeline_stages)
                                if c.cpu_devices > 1 else 0)
    return c.microbatches * c.grad_accum_steps * parts


# The generated data pads each replica's share to whole micro-batches
# (`tfpar.data.mesh_dataset`); a --dataset function's batches reach the mesh pipeline whole.
USER_DATA_MESH_PIPELINE = Rule(
    "global_batch_size", lambda c: c.dataset != "auto" and _mesh(c) and c.dims.pp_enabled
    and _mesh_pipeline_cuts(c) and c.global_batch_size % _mesh_pipeline_cuts(c),
    lambda c: f"a --dataset function's batches reach the mesh pipeline whole, cut into "
              f"microbatches × grad_accum_steps × data parallel = {_mesh_pipeline_cuts(c)} "
              f"equal pieces; use a multiple of {_mesh_pipeline_cuts(c)}, or the generated "
              f"data (--dataset=auto), which pads each replica's share")

# A Keras model whose class overrides `train_step` runs it on a mesh with its writes kept
# until the end of the step (`tfpar.layout.keras_step`); Keras's LossScaleOptimizer
# writes inside a `tf.cond`, whose branch values cannot leave it.
CUSTOM_TRAIN_STEP_LOSS_SCALE = Rule(
    "mixed_precision", lambda c: c.mixed_precision == "fp16"
    and getattr(c, "custom_train_step", False),
    "not supported with a model's own train_step on a mesh (the LossScaleOptimizer "
    "updates inside a tf.cond); use mixed_bfloat16, or Keras's train_step")

# Under `keras.distribution` a `tfpar.DistributedOptimizer`'s codec compresses the mesh's
# batch axis (`tfpar.layout.keras_step` forms each replica's gradient); a model's own
# `train_step` takes its gradients itself, already summed over `batch` by DTensor.
KERAS_MESH_AGGREGATOR_TRAIN_STEP = Rule(
    "compression", lambda c: c.compression != "none"
    and getattr(c, "keras_distribution", False) and getattr(c, "custom_train_step", False),
    "not supported with a model's own train_step under keras.distribution (its "
    "tape.gradient is summed over the mesh's batch axis by DTensor before any codec could "
    "see a replica's gradient); pass the plain Keras optimizer, or use Keras's train_step")
# ZeRO-3's per-layer gathering (`tfpar.zero.fsdp`) runs each gathering layer's `call` in a
# scope of its own, recomputed in the backward pass: a loss term added there (`add_loss`,
# an inner layer's activity regularizer) would be dropped (measured: 2.806 against one
# device's 3.822, weights 0.022 apart), its gradient with it.
KERAS_ZERO3_LAYER_LOSS = Rule(
    "layer", lambda c: bool(getattr(c, "zero3_layer_loss", None)),
    "adds a loss term in call (add_loss, an activity regularizer of a layer inside it), "
    "which ZeRO-3's per-layer gather would drop; use FullyShardedDataParallel("
    "gather_per_layer=False) (the weights gathered at the step's start), or leave the term "
    "out",
    value=lambda c: c.zero3_layer_loss)
# The same codec step maps each replica's forward and backward over the replicas, where
# TensorFlow forms a convolution's filter gradient as a TensorList loop that DTensor cannot
# lay out (TF 2.21: 'tf.TensorListSetItem' op ComputeLayoutForward error, in 14 lines), as
# `ZERO3_COMPRESSION_MODEL` refuses for the CLI's convnet.
KERAS_MESH_CODEC_CONV = Rule(
    "layer", lambda c: bool(getattr(c, "codec_conv_layer", None)),
    "is a convolution, whose filter gradient a tfpar.DistributedOptimizer's codec on a "
    "Keras mesh cannot form per replica (TensorFlow builds it as a loop DTensor cannot lay "
    "out, TF 2.21); pass the plain Keras optimizer (DTensor's own fp32 sum), or train this "
    "model with tfpar.make_strategy() and the codec on tf.distribute",
    value=lambda c: c.codec_conv_layer)
# A `tfpar.DistributedOptimizer` under keras.distribution runs through the mesh's reduction
# (`tfpar.layout.reduction.codec_of`): these codecs; `auto` (whose ranks the mesh trainer
# plans from `--auto_*` flags) and an aggregator class of the user's own are not mapped.
KERAS_MESH_CODECS = ("none", "fp16", "bf16", "int8", "lowbit", "topk", "threshold",
                     "powersgd")
KERAS_MESH_AGGREGATOR_CODEC = Rule(
    "compression", lambda c: getattr(c, "keras_distribution", False)
    and c.compression not in KERAS_MESH_CODECS,
    "not supported in a user's model.fit under keras.distribution: the mesh's reduction "
    "takes " + ", ".join(KERAS_MESH_CODECS) + "; use one of those, or --compression=auto "
    "with python -m tfpar.train --tensor_parallel>1")

# The same under keras.distribution: the mesh's step updates DVariables itself, where the
# host update of `tfpar.DistributedOptimizer(offload=...)` (tf.distribute's merge) is not.
KERAS_MESH_OFFLOAD = Rule(
    "offload", lambda c: c.offload != "none" and getattr(c, "keras_distribution", False),
    "not supported under keras.distribution (ModelParallel, DataParallel): the host update "
    "runs on tf.distribute replicas (tfpar.make_strategy); pass offload='none' there")
# Adam in front of the mesh's codec (`tfpar.layout.adam_front`), as a DistributedOptimizer
# over Adam puts it under keras.distribution: tf.distribute's `v` moved by the compressed
# sum and its exact refresh steps are not built there (aggregator arguments, no flags).
KERAS_MESH_ADAM_VARIANCE = Rule(
    "adam_variance", lambda c: getattr(c, "keras_distribution", False)
    and getattr(c, "adam_variance", "frozen") == "live",
    "not supported under keras.distribution: Adam in front of the mesh's codec keeps `v` "
    "frozen after its warm-up or moves each replica's own; use 'frozen', 'local' or "
    "'local_debiased', or tf.distribute (tfpar.make_strategy)")
KERAS_MESH_ADAM_REFRESH = Rule(
    "adam_refresh_every", lambda c: getattr(c, "keras_distribution", False)
    and getattr(c, "adam_refresh_every", 0) > 0,
    "not supported under keras.distribution: Adam in front of the mesh's codec runs exact "
    "steps in its warm-up only; use 0, or tf.distribute (tfpar.make_strategy)")

# ZeRO-3 from a user's `model.fit` (`tfpar.layout.FullyShardedDataParallel`): a
# `DistributedOptimizer`'s codec goes through ZeRO-3's reduce-scatter, built for these.
KERAS_ZERO3_CODEC = Rule(
    "compression", lambda c: getattr(c, "keras_distribution", False) and c.zero_stage == 3
    and c.compression not in ("none",) + ZERO_CODECS,
    "not supported under tfpar.layout.FullyShardedDataParallel: ZeRO-3 reduce-scatters "
    "gradients in fp16, bf16 or int8 only; use one of those or 'none', or "
    "keras.distribution.ModelParallel/DataParallel (weights whole over 'batch') for this "
    "codec")
# ... and its per-layer gathers run inside one mesh's step: a pipeline mesh's stages are
# meshes of their own (the CLI's `--zero_stage=3 --pipeline_stages>1` row).
KERAS_ZERO3_PIPELINE = Rule(
    "device_mesh", lambda c: getattr(c, "keras_distribution", False) and c.zero_stage == 3
    and "stage" in getattr(c, "mesh_axes", ()),
    "not supported by tfpar.layout.FullyShardedDataParallel: ZeRO-3 gathers each layer "
    "inside one mesh's step, and a 'stage' axis cuts the model into meshes of their own; "
    "use a mesh ('batch',) or ('batch', 'model'), or tfpar.layout.PipelineParallel "
    "without ZeRO-3",
    value=lambda c: tuple(c.mesh_axes))

# A user's model on a pipeline mesh (`tfpar.layout.keras_pipeline`): the mesh pipeline's
# step writes back the trainable weights and the optimizers' state only, so a layer whose
# non-trainable state training changes (BatchNormalization's moving statistics, Dropout's
# seed, a variable a custom layer's `call` assigns) would keep its first values.
KERAS_PIPELINE_STATEFUL_LAYER = Rule(
    "layer", lambda c: bool(getattr(c, "stateful_layer", None)),
    "its non-trainable state (moving statistics, a random seed, a variable its call "
    "assigns) is not updated by a fit on a pipeline mesh; fit without such layers there "
    "(a frozen BatchNormalization is fine), or on a mesh without a 'stage' axis",
    value=lambda c: c.stateful_layer)
# The same step applies each stage's optimizer to the weights' values it read at the step's
# start: a trainable weight a layer's `call` assigns (a clip) would lose that write.
KERAS_PIPELINE_ASSIGNED_WEIGHT = Rule(
    "layer", lambda c: bool(getattr(c, "assigned_weight", None)),
    "assigns its trainable weight in call (a clip, a decay, keras.layers."
    "SpectralNormalization), a write a fit on a Keras mesh would drop every step; for a "
    "clip give the layer a keras.constraints.Constraint of your own (kernel_constraint=; "
    "Keras applies it after each update), else fit this model without a mesh",
    value=lambda c: c.assigned_weight)
# Each stage runs copies of the model's layers: a layer's own `keras.metrics` updated in
# its `call` would be the copy's, never kept or reported.
KERAS_PIPELINE_LAYER_METRIC = Rule(
    "layer", lambda c: bool(getattr(c, "layer_metric", None)),
    "updates its own keras.metrics in call, which a fit on a pipeline mesh neither keeps "
    "nor reports (its stages train copies of the layers); fit it on a mesh without a "
    "'stage' axis",
    value=lambda c: c.layer_metric)
# A variable held by no layer of the stage whose forward reads or writes it (a
# `keras.Variable` the model holds directly or none holds, a weight of another stage's
# layer, a `tf.Variable`): the stages' step trains, writes and reads only their own
# layers' weights (a host variable read in a stage fails in DTensor's mesh propagation; a
# Keras variable's write is dropped, a tf.Variable's does not count as on one device).
KERAS_PIPELINE_OUTSIDE_VARIABLE = Rule(
    "variable", lambda c: bool(getattr(c, "outside_variable", None)),
    "is held by no layer of the pipeline stage that would use it (a keras.Variable or "
    "tf.Variable outside its layers, the model's own, another stage's weight): a fit on a "
    "pipeline mesh trains, writes and reads only each stage's own layers' weights; hold it "
    "in a layer of the stage that uses it, or fit on a mesh without a 'stage' axis",
    value=lambda c: c.outside_variable)
# The stages' loss is the compiled loss of the last stage's output: a layer's own loss
# terms (a kernel, bias or activity regularizer, `add_loss`) are not in it, so the run
# would train without them (measured: an L2(0.5) kernel regularizer's 2x2x2 fit ended
# 0.076 from one device's weights with the plain model's loss).
KERAS_PIPELINE_LAYER_LOSS = Rule(
    "layer", lambda c: bool(getattr(c, "layer_loss", None)),
    "adds its own loss terms (a kernel, bias or activity regularizer, add_loss), which a "
    "fit on a pipeline mesh leaves out of the stages' loss; fit it on a mesh without a "
    "'stage' axis (its step adds them), or without them",
    value=lambda c: c.layer_loss)

# `--offload` (`tfpar.offload`): what its host update does not run with. The same rows
# check `tfpar.DistributedOptimizer(offload=...)` (a `view` with `api=True`), each saying
# what works in the API's words there.
def _say(c, flag, argument):
    """`flag` (the trainer's) or, for a `view(api=True)`, `argument` (the API's)."""
    return argument if getattr(c, "api", False) else flag


OFFLOAD_RULES = (
    # ZeRO-3's step is one DTensor function; what it can read from the host per layer
    # was probed (tools/probe_param_offload.py, docs/guides/memory.md): no Python (TF 2.21);
    # per-device tf.data readers of host files in (patches.per_device_iterator), the
    # pieces' gradients out, the update on the host after the step: bit-equal to the
    # device-resident update in the probe's chain, not wired into the mesh trainer.
    Rule("offload", lambda c: c.offload == "optimizer+params",
         lambda c: "not built: ZeRO-3's DTensor step cannot call the host's Python (TF 2.21: "
                   "tf.numpy_function has no layout propagation, and crashes or hangs in "
                   "DTensor's replicated expansion), and the file-based route that runs is not "
                   "wired into the mesh trainer; use "
                   + _say(c, "--offload=optimizer (data parallelism, --zero_stage=1|2)",
                          "offload='optimizer' (data parallelism)")),
    Rule("offload", lambda c: c.offload != "none" and c.optimizer == "sgd",
         lambda c: _say(c, "plain SGD keeps no optimizer state to offload; use "
                           "--optimizer=momentum or adam, or --offload=none",
                        "SGD without momentum keeps no optimizer state to offload; use "
                        "keras.optimizers.SGD(momentum=0.9) or Adam, or offload='none'")),
    Rule("compression", lambda c: c.offload != "none" and c.compression != "none"
         and not (c.zero_stage in (1, 2) and c.compression in ZERO_OFFLOAD_CODECS),
         lambda c: "not supported with " + _say(c, "--offload", f"offload={c.offload!r}")
                   + ": the gradient aggregators update through Keras's device-side step; "
                   + _say(c, "use --compression=none, or with --zero_stage=1|2 "
                             + ", ".join(ZERO_OFFLOAD_CODECS),
                          "use compression='none' (the default with offload)")),
    Rule("fused_update", lambda c: c.offload != "none" and c.fused_update,
         "the fused kernel updates on the device; --offload updates on the host: use "
         "--nofused_update"),
)

# Codecs whose messages travel by all-gather only: nothing of theirs is summed by a
# collective, so `--allreduce=hierarchical` would change nothing (`auto` keeps them flat).
GATHER_CODECS = ("int8", "lowbit", "threshold")


def _hierarchical(c):
    return getattr(c, "allreduce", "auto") == "hierarchical"


def _gathers(c):
    """`c`'s codec sends by all-gather only: `GATHER_CODECS`, and top-k without the union
    of the replicas' indices (each replica's own entries gathered)."""
    return c.compression in GATHER_CODECS or (c.compression == "topk"
                                              and not getattr(c, "topk_union", True))


def _keras_allreduce(c):
    """`--compression=none --bucket_mb=0`: Keras's own all-reduce, no aggregator."""
    return c.compression == "none" and getattr(c, "bucket_mb", 4.0) == 0


ALLREDUCE_RULES = (
    Rule("allreduce", lambda c: _hierarchical(c) and _gathers(c),
         lambda c: f"--compression={c.compression}"
                   + ("" if c.compression in GATHER_CODECS else " --notopk_union")
                   + " all-gathers its codes (no sum to split by host); use --allreduce=auto "
                   "or flat, or --compression=none, fp16, bf16, topk (with its union), "
                   "powersgd or auto"),
    Rule("allreduce", lambda c: _hierarchical(c) and _keras_allreduce(c),
         "--compression=none --bucket_mb=0 keeps Keras's one all-reduce (no aggregator to "
         "route by host); use --bucket_mb>0 with --allreduce=hierarchical, or "
         "--allreduce=auto or flat"),
    Rule("allreduce", lambda c: _hierarchical(c) and c.zero_stage in (1, 2),
         "--zero_stage=1|2 reduce-scatters over one group of all replicas "
         "(tfpar.zero.sharded); use --allreduce=auto or flat"),
    Rule("allreduce", lambda c: _hierarchical(c) and c.offload != "none",
         "--offload keeps Keras's one all-reduce (no aggregator to route by host); use "
         "--allreduce=auto or flat"),
)

# Settings that a value of another setting excludes, on every backend.
COMBINATIONS = (
    CUSTOM_TRAIN_STEP_LOSS_SCALE,
    KERAS_MESH_AGGREGATOR_TRAIN_STEP,
    KERAS_MESH_AGGREGATOR_CODEC,
    KERAS_MESH_OFFLOAD,
    KERAS_MESH_ADAM_VARIANCE,
    KERAS_MESH_ADAM_REFRESH,
    KERAS_ZERO3_CODEC,
    KERAS_ZERO3_PIPELINE,
    ZERO_COMPRESSION,
    ZERO_TOPK_WARMUP,
    ZERO3_COMPRESSION,
    ZERO3_COMPRESSION_RECOMPUTE,
    ZERO3_KEEP_RECOMPUTE,
    ZERO3_KEEP_LAST,
    ZERO3_COMPRESSION_MODEL,
    Rule("zero_gather", lambda c: c.zero_gather != "fp32" and c.zero_stage != 3,
         "the int8 weight gather is ZeRO-3's (stages 1-2 gather fp32 pieces); add "
         "--zero_stage=3 or use --zero_gather=fp32"),
    MESH_COMPRESSION_ONE_REPLICA,
    MESH_POWERSGD_START,
    MESH_TOPK_WARMUP,
    MESH_TOPK_MOMENTUM,
    MESH_ADAM_WARMUP,
    MESH_MODEL,
    SEQUENCE_MODEL,
    Rule("sequence_parallel", lambda c: c.sequence_parallel and not c.dims.tp_enabled,
         "not supported: sequence parallelism splits activations over the model axis of "
         "--tensor_parallel>1 (with --zero_stage=3 and --tensor_parallel=1 there is none)"),
    Rule("sequence_parallel", lambda c: c.sequence_parallel and c.dims.pp_enabled,
         "not supported: sequence layouts are built for the unpipelined mesh step; use "
         "--pipeline_stages=1"),
    # ZeRO-3 x tensor parallelism runs on one mesh; the mesh pipeline's stages (3D) each
    # build their own, where ZeRO-3's per-layer gathers are not wired.
    Rule("zero_stage", lambda c: c.zero_stage == 3 and c.dims.pp_enabled,
         "not supported with --pipeline_stages>1: ZeRO-3 gathers each layer inside one "
         "mesh's step, and the mesh pipeline's stages are meshes of their own; use "
         "--zero_stage=0 in 3D, or ZeRO-3 with --tensor_parallel and no pipeline"),
    Rule("sequence_parallel", lambda c: c.sequence_parallel and c.zero_stage == 3,
         "not supported: --zero_stage=3 gathers each layer's weights in a wrapper the "
         "sequence layouts are not built for; use --zero_stage=0"),
    ZB_H1_RECOMPUTE,
    INTERLEAVED_VIRTUAL_STAGES,
    INTERLEAVED_MICROBATCHES,
    CHIMERA_MICROBATCHES,
    CHIMERA_MESH,
    ONE_DEVICE_REPLICAS,
    USER_DATA_MESH_PIPELINE,
    *OFFLOAD_RULES,
    *ALLREDUCE_RULES,
    # tfmot 0.8 wraps only tf_keras layers (prune_low_magnitude refuses a Keras 3 model).
    Rule("prune_sparsity", lambda c: c.keras == 3 and c.prune_sparsity > 0,
         "tensorflow-model-optimization prunes only tf_keras models; add --keras=2"),
    Rule("qat", lambda c: c.keras == 3 and c.qat,
         "tensorflow-model-optimization quantizes only tf_keras models; add --keras=2"),
    Rule("mixed_precision", lambda c: c.qat and c.mixed_precision != "none",
         "tfmot's fake-quant layers fail under a mixed-precision policy (float16/bfloat16 "
         "inputs to float32 ranges); use --mixed_precision=none with --qat"),
    Rule("qat", lambda c: c.qat and c.prune_sparsity > 0,
         "--prune_sparsity with --qat in one run is not supported (tfmot's "
         "prune-preserving QAT is not wired in); choose one"),
)


def spans_workers(config, cluster):
    """True when `config` is a tf.distribute pipeline across the workers of `cluster` (a
    parsed `TF_CONFIG`, or None): one stage per worker process (`tfpar.pipeline.remote`)."""
    return (backend_of(config) == "pipeline" and cluster is not None
            and cluster.num_workers > 1)


def several_on_some_host(cluster):
    """Several hosts in `cluster` (a parsed `TF_CONFIG`, or None), one with several workers:
    where `--allreduce=auto` picks the hierarchical sum (`tfpar.compression.hierarchical`)."""
    hosts = cluster.hosts if cluster is not None else []
    return len(hosts) > 1 and any(len(h) > 1 for h in hosts)


def resolve_allreduce(config, cluster):
    """"flat" or "hierarchical": `config.allreduce` with "auto" resolved for `cluster` (a
    parsed `TF_CONFIG`, or None): hierarchical on several hosts, one with several workers,
    for data parallelism through an aggregator whose messages are summed (not ZeRO 1/2, not
    `--offload`, not the all-gather codecs)."""
    if config.allreduce != "auto":
        return config.allreduce
    summed = (backend_of(config) == "data_parallel" and not config.zero_stage
              and config.offload == "none" and not _gathers(config)
              and not _keras_allreduce(config))
    return "hierarchical" if summed and several_on_some_host(cluster) else "flat"


def pipeline_replicas(config):
    """The replicas of a pipeline across workers (`spans_workers`): `--data_parallel`,
    else `--cpu_devices` (each worker runs its stage of every replica on its logical
    CPUs)."""
    return config.data_parallel or max(1, config.cpu_devices)


DTENSOR_EVALUATOR = Rule(
    "TF_CONFIG", lambda c, k: _mesh(c) and k is not None and k.worker_index is None,
    "a DTensor mesh spans training processes only (chief, worker)",
    value=lambda c, k: f"task type {k.task_type!r}", cluster=True)

STRATEGY_WITHOUT_CLUSTER = Rule(
    "strategy", lambda c, k: c.strategy == "multi_worker" and k is None,
    "TF_CONFIG is not set; start the workers with `python -m tfpar.launch --workers=N -- "
    "python -m tfpar.train ...` or set TF_CONFIG for each worker", cluster=True)
STRATEGY_ON_WORKERS = Rule(
    "strategy", lambda c, k: c.strategy in ("one_device", "mirrored") and k is not None
    and k.num_workers > 1,
    lambda c, k: f"TF_CONFIG names {k.num_workers} workers; use --strategy=multi_worker or "
                 f"auto, or unset TF_CONFIG", cluster=True)

# What a cluster of several workers excludes: the one-client pipeline across workers
# (`tfpar.pipeline.remote`) and DTensor's clients (`tfpar.layout.multi_client`).
ACROSS_WORKERS = (
    STRATEGY_WITHOUT_CLUSTER,
    STRATEGY_ON_WORKERS,
    Rule("pipeline_stages", lambda c, k: spans_workers(c, k) and c.dims.pp != k.num_workers,
         lambda c, k: f"across worker processes each of the {k.num_workers} workers holds "
                      f"one stage; use --pipeline_stages={k.num_workers} or "
                      f"--workers={c.dims.pp}", cluster=True),
    Rule("TF_CONFIG", lambda c, k: spans_workers(c, k) and k.worker_index is None,
         "a pipeline across workers has no evaluator task; give chief/worker tasks only",
         value=lambda c, k: k.task_type, cluster=True),
    DTENSOR_EVALUATOR,
    # Each worker holds its stage of every replica, one logical CPU a replica.
    Rule("data_parallel", lambda c, k: spans_workers(c, k)
         and c.data_parallel > max(1, c.cpu_devices),
         lambda c, k: f"across worker processes each worker runs its stage of every "
                      f"replica on its own logical CPUs; use --cpu_devices="
                      f"{c.data_parallel} (or --data_parallel<={max(1, c.cpu_devices)})",
         cluster=True),
    Rule("allreduce", lambda c, k: _hierarchical(c) and not several_on_some_host(k),
         lambda c, k: ("TF_CONFIG is not set" if k is None else
                       f"TF_CONFIG puts its {k.num_workers} workers on {len(k.hosts)} "
                       f"host(s) of {', '.join(str(len(h)) for h in k.hosts)} worker(s)")
         + ": the hierarchical sum needs several hosts (addresses' host part), one with "
           "several workers; use --allreduce=auto or flat", cluster=True),
    Rule("offload", lambda c, k: c.offload != "none" and c.zero_stage in (1, 2)
         and k is not None and k.num_workers > 1,
         "not supported across worker processes with --zero_stage=1|2: each worker's host "
         "holds its own replicas' pieces and a checkpoint reads them in one process; use "
         "--zero_stage=0 with --offload (every worker's host keeps the whole state), or one "
         "worker", cluster=True),
)

_NAMES = {"data_parallel": "data parallelism", "pipeline": "--pipeline_stages>1",
          "dtensor": "--tensor_parallel>1 (DTensor; also --zero_stage=3)",
          "tf_keras": "--keras=2"}


def backend_of(config):
    """The backend that runs `config`: one of `BACKENDS` (a `view`'s forced backend
    first)."""
    forced = getattr(config, "_tfpar_backend", None)
    if forced:
        return forced
    if getattr(config, "keras", 3) == 2:
        return "tf_keras"
    dims = config.dims
    if dims.tp_enabled or (getattr(config, "zero_stage", 0) == 3 and not dims.pp_enabled):
        return "dtensor"  # ZeRO-3: tfpar.zero.fsdp
    if dims.pp_enabled:
        return "pipeline"
    return "data_parallel"


def check(config):
    """Raises `ConfigError` for the first setting `config`'s backend cannot honour, then
    for the first row of `COMBINATIONS` that refuses it."""
    backend = backend_of(config)
    for setting in TABLE:
        enforce_honoured(setting, config, backend)
    for rule in COMBINATIONS:
        enforce(rule, config)


def check_cluster(config, cluster):
    """Raises `ConfigError` for the first row of `ACROSS_WORKERS` that refuses `config` on
    `cluster` (a parsed `TF_CONFIG`, or None)."""
    for rule in ACROSS_WORKERS:
        enforce(rule, config, cluster)


def check_inputs(config, cluster):
    """What the trainer refuses of `config` on `cluster` (a parsed `TF_CONFIG`, or None)
    before TensorFlow, beyond `check`: `check_cluster`, then a mesh's degrees against
    `--cpu_devices` (`check_devices`). `tfpar.train.check_inputs` reads `TF_CONFIG` and
    calls this; the planner and the doctor too."""
    check_cluster(config, cluster)
    if not spans_workers(config, cluster):  # else one stage per worker: no mesh to check
        check_devices(config, cluster.num_workers if cluster is not None else 1)


def enforce(rule, config, cluster=None):
    """Raises `rule`'s `ConfigError` if it refuses `config` (a `ParallelConfig` or a
    `view`); how code reached without a `ParallelConfig` applies a row of the table."""
    error = rule.error(config, cluster)
    if error is not None:
        raise error


def enforce_honoured(setting, config, backend=None):
    """Raises `ConfigError` if `backend` (default `config`'s) cannot honour `config`'s
    value of `setting` (a row of `TABLE`)."""
    backend = backend or backend_of(config)
    rules = TABLE.get(setting, {})
    if backend not in rules or not hasattr(config, setting):
        return
    honoured, why = rules[backend]
    value = getattr(config, setting)
    if value not in honoured:
        raise ConfigError(setting, value, f"not supported with {_NAMES[backend]}: {why}")


def view(base=None, backend=None, **settings):
    """An unchecked `ParallelConfig`: `base`'s settings (default: the defaults) with
    `settings` applied, for `enforce` where code holds some settings but no config;
    `backend` forces `backend_of`'s answer (e.g. "dtensor" for any mesh)."""
    from tfpar.config import ParallelConfig  # config imports this module

    values = {f.name: getattr(base, f.name) if base is not None else f.default
              for f in dataclasses.fields(ParallelConfig)}
    values.update(settings)
    config = object.__new__(ParallelConfig)
    for name, value in values.items():
        object.__setattr__(config, name, value)
    object.__setattr__(config, "_tfpar_backend", backend)
    return config


def check_devices(config, processes=1):
    """Before TensorFlow: a DTensor mesh's degrees against the logical CPUs of one process
    (`cpu_devices > 1`), by `ParallelDims.on_devices`. Across several processes
    (`processes > 1`) or on real devices (`cpu_devices` 0 or 1) the count is known only
    once TensorFlow lists the devices: `tfpar.layout` checks it then. (GPUs, when present,
    are the mesh's devices: `--cpu_devices` is for CPU-only hosts.)

    Raises:
        ConfigError: naming the degree that does not fit, and the settings that would.
    """
    if backend_of(config) != "dtensor" or processes > 1 or config.cpu_devices < 2:
        return
    config.dims.on_devices(config.cpu_devices,
                           f"logical CPUs of --cpu_devices={config.cpu_devices}")
