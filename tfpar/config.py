"""`ParallelConfig`: the one validated object every part of tfpar reads its settings from.

Flags (`tfpar.flags`) and Python callers both produce a `ParallelConfig`; the strategy
factory, the aggregators, the pipeline and the layout layer take it and never parse flags
or re-derive degrees themselves.
"""

import dataclasses
import re

from tfpar import compat
from tfpar.cpu_kernels import CHOICES as CPU_KERNELS
from tfpar.dims import ParallelDims
from tfpar.errors import ConfigError
from tfpar.replica_split import split_examples

MODELS = ("mlp", "convnet", "transformer")
OPTIMIZERS = ("sgd", "momentum", "adam")
STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker")
COLLECTIVES = ("auto", "ring", "nccl")
# How gradient sums cross hosts (`tfpar.compression.hierarchical`).
ALLREDUCE = ("auto", "flat", "hierarchical")
PRECISIONS = ("none", "bf16", "fp16")
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "lowbit", "topk", "threshold", "powersgd",
                "auto")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "chimera")
ON_NAN = ("stop", "skip_step")
RECOMPUTE = ("none", "blocks", "full")
ZERO_STAGES = (0, 1, 2, 3)
ZERO_GATHERS = ("fp32", "int8")
# Top-k's and threshold's defaults, here only: the trainer's `--topk_*` / `--threshold`, and
# `TopKAggregator()` / `ThresholdAggregator()` (so `tfpar.DistributedOptimizer(compression=
# "topk")`) read them. Why 25 % with the union: docs/benchmarks/compression.md.
TOPK_RATIO = 0.25
TOPK_DENSE_BELOW = 1024
TOPK_UNION = True
TOPK_MOMENTUM_CARRY = 0.5
THRESHOLD = 1e-4
# `--compression=lowbit`'s bits per entry (`LowBitAggregator`'s default too).
LOWBIT_BITS = 3
# Codecs that take Adam in front of compression by default (`--compress_adam_step`, every
# backend: `tfpar.compression.adam_front`): exact Adam for `--adam_warmup_steps`, then each
# replica's compressed Adam step (docs/guides/compression.md).
ADAM_FRONT_CODECS = compat.ADAM_FRONT_CODECS
OFFLOADS = ("none", "optimizer", "optimizer+params")
_DATASET_RE = re.compile(r"^(auto|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Every setting of a tfpar run, validated on construction.

    Args:
        model: model from `tfpar.models` to train: one of `MODELS`; `model_width` and
            `model_depth` override its default size (0 keeps the default).
        dataset: `"auto"` for the model's built-in generated task, or `"module:function"`
            naming a function `(input_context, config) -> tf.data.Dataset` of `(x, y)`
            batches of `per_replica_batch` examples; `num_classes` must then be given.
        global_batch_size: examples per optimizer step over all replicas (before
            gradient accumulation multiplies it).
        steps: optimizer steps to train in total; `steps_per_epoch`: steps between
            epoch ends (progress bar, validation, TensorBoard epoch scalars).
        validation_steps: batches of held-out data evaluated at every epoch end (0 = off):
            examples of the same generated task that the training stream never reaches,
            or, with `dataset="module:function"`, what `module.function_validation(
            input_context, config)` yields. Results: `validation` in the metrics JSON,
            `val_loss` / `val_accuracy` in Keras callbacks' logs.
        optimizer, learning_rate: the optimizer and its learning rate for
            `base_batch_size` examples; with `scale_lr` the rate is multiplied by
            effective batch / `base_batch_size` (the linear scaling rule) and ramped up
            linearly over `warmup_steps`.
        fused_update: momentum SGD's update through TensorFlow's fused kernel where it
            applies (`tfpar.optimizers.FusedMomentumMixin`); off (Keras's own ops) by
            default until a benchmark shows it no slower in every round.
        cpu_kernels: TensorFlow's CPU kernels, chosen before it starts (`tfpar.cpu_kernels`):
            `"auto"` = oneDNN unless `TF_ENABLE_ONEDNN_OPTS` is already set, `"onednn"`,
            `"eigen"`; TensorFlow's own default depends on the processor.
        grad_accum_steps: micro-steps whose gradients are averaged into one update;
            the effective batch is `global_batch_size * grad_accum_steps`.
        mixed_precision: `"none"`, `"bf16"` or `"fp16"` (fp16 adds dynamic loss scaling).
        seed: seeds weights, data and dropout so that runs repeat exactly.
        strategy, collective, cpu_devices: see `tfpar.strategy`; `cpu_devices=N>0`
            splits the CPU into N logical devices before TensorFlow initialises.
        collective_timeout_s, heartbeat_timeout_s, startup_timeout_s: bounds after which
            a stalled collective, a dead peer, or a peer that never starts becomes an error.
        data_parallel: the parallel degrees, with `tensor_parallel`, `pipeline_stages`,
            `microbatches`, `schedule`, `virtual_stages`; 0 here means "all replicas".
        sequence_parallel: with `tensor_parallel > 1` on the transformer, also split the
            activations outside attention and MLP (norms, residual adds) along the
            sequence over the `model` axis (`tfpar.layout.presets.sequence_parallel`).
        recompute: activation recomputation, one of `RECOMPUTE` (`tfpar.recompute`).
        zero_stage: ZeRO over the data-parallel replicas: 0 = none, 1 = optimizer state,
            2 = also gradients (`tfpar.zero`), 3 = also parameters (on a DTensor mesh,
            `tfpar.zero.fsdp`). See `tfpar.compat` for where it is honoured.
        zero_gather: `"fp32"`, or `"int8"`: ZeRO-3 gathers each weight as int8 codes
            with an fp32 scale per row (ZeRO++'s qwZ); the sharded weights stay fp32.
        zero_prefetch: ZeRO-3 issues each layer's gather one layer early, forward and
            backward (`tfpar.zero.fsdp`); False gathers each just before its layer.
        zero_reshard_after_forward: ZeRO-3 frees each layer's whole weights after its
            forward and gathers and recomputes the layer in the backward pass; False
            (FSDP's `reshard_after_forward=False`) gathers once a step and keeps every
            layer's whole weights and activations for the backward pass.
        zero_keep_last_layers: with resharding, the last N layers the forward pass runs
            keep their whole weights and activations for the backward pass, which starts
            with them (FSDP's `reshard_after_forward=False` on them); -1: the last layer at
            least as large as the median one and those after it (the transformer's last
            block, `ln_f` and `lm_head`; `tfpar.zero.fsdp.kept_layers`); 0 (the default
            until its step time is measured side by side): none.
        offload: `"none"`, or `"optimizer"`: the optimizer's slots in host memory and its
            update run there (`tfpar.offload`, ZeRO-Offload's design), on data
            parallelism and ZeRO 1/2. `"optimizer+params"` (ZeRO-3's parameters held on
            the host between gathers) is named so the rulebook can say it is not built.
        compression and its parameters: the gradient aggregator (`tfpar.compression`).
        checkpoint_dir, checkpoint_every, keep_checkpoints: periodic checkpoints of the
            whole training state; a run with an existing checkpoint resumes from it.
        checkpoint_async: write checkpoints beside training, the step blocking only while
            the state is copied to host memory (`tfpar.checkpoint`); False writes them
            within the step.
        tensorboard_dir, metrics_json: where to write TensorBoard logs and the metrics JSON.
        measure_comm: after training, time compute-only against full steps and report the
            communication share of a step (`comm.comm_time_fraction`).
        keras: 3 (keras) or 2 (tf_keras, trained by `tfpar.legacy`); prune_* and qat:
            tfmot pruning / quantization-aware training (Keras 2 only); export_dir: where
            the final (stripped / TFLite int8) model goes. See `tfpar.legacy.options`.

    Raises:
        ConfigError: a value out of range, or a setting the backend that will run this
            config cannot honour or a combination it refuses (the table in
            `tfpar.compat`), in one line naming it.

    Examples:
        >>> cfg = ParallelConfig(model="mlp", global_batch_size=64, grad_accum_steps=2)
        >>> cfg.effective_batch_size
        128
    """

    # What to train.
    model: str = "mlp"
    model_width: int = 0
    model_depth: int = 0
    dataset: str = "auto"
    num_classes: int = 0
    global_batch_size: int = 64
    steps: int = 200
    steps_per_epoch: int = 50
    validation_steps: int = 0
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    scale_lr: bool = False
    base_batch_size: int = 64
    warmup_steps: int = 0
    grad_accum_steps: int = 1
    mixed_precision: str = "none"
    seed: int = 0
    on_nan: str = "stop"
    fused_update: bool = False
    cpu_kernels: str = "auto"
    # Where it runs.
    strategy: str = "auto"
    collective: str = "auto"
    allreduce: str = "auto"
    cpu_devices: int = 0
    collective_timeout_s: float = 120.0
    heartbeat_timeout_s: float = 30.0
    startup_timeout_s: float = 120.0
    # Parallel degrees.
    data_parallel: int = 0
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    # Memory.
    recompute: str = "none"
    zero_stage: int = 0
    zero_gather: str = "fp32"
    zero_prefetch: bool = True
    zero_reshard_after_forward: bool = True
    zero_keep_last_layers: int = 0
    offload: str = "none"
    # Gradient aggregation.
    compression: str = "none"
    topk_ratio: float = TOPK_RATIO
    topk_warmup_steps: int = 0
    topk_dense_below: int = TOPK_DENSE_BELOW
    topk_union: bool = TOPK_UNION
    topk_momentum_carry: float = TOPK_MOMENTUM_CARRY
    threshold: float = THRESHOLD
    lowbit_bits: int = LOWBIT_BITS
    powersgd_rank: int = 16
    powersgd_start_step: int = 0
    # Pairs of P/Q all-reduces a step; 1 until `fit` shows 2 faster (docs/benchmarks/
    # compression_link.md, 2026-12-05: faster in the profile, `fit`'s rounds inconclusive).
    powersgd_groups: int = 1
    compress_adam_step: bool = True
    adam_warmup_steps: int = 50
    auto_budget_ms: float = 20.0
    auto_link_mbps: float = 0.0
    auto_link_latency_ms: float = 1.0
    error_feedback: bool = True
    # MB a gradient bucket holds before it closes; 0: no buckets (`--compression=none`
    # keeps Keras's one all-reduce across workers too, a codec sends each tensor alone).
    bucket_mb: float = 4.0
    # Outputs.
    checkpoint_dir: str = ""
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    checkpoint_async: bool = True
    tensorboard_dir: str = ""
    metrics_json: str = ""
    measure_comm: bool = False
    verbose: int = 1
    # Legacy Keras and tfmot (tfpar.legacy; validated by tfpar.legacy.options.check).
    keras: int = 3
    prune_sparsity: float = 0.0
    prune_initial_sparsity: float = 0.0
    prune_begin_step: int = 0
    prune_end_step: int = 0
    prune_frequency: int = 10
    qat: bool = False
    export_dir: str = ""

    def __post_init__(self):
        _one_of("model", self.model, MODELS)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("strategy", self.strategy, STRATEGIES)
        _one_of("collective", self.collective, COLLECTIVES)
        _one_of("allreduce", self.allreduce, ALLREDUCE)
        _one_of("mixed_precision", self.mixed_precision, PRECISIONS)
        _one_of("compression", self.compression, COMPRESSIONS)
        _one_of("schedule", self.schedule, SCHEDULES)
        _one_of("on_nan", self.on_nan, ON_NAN)
        _one_of("cpu_kernels", self.cpu_kernels, CPU_KERNELS)
        _one_of("recompute", self.recompute, RECOMPUTE)
        _one_of("zero_gather", self.zero_gather, ZERO_GATHERS)
        _one_of("offload", self.offload, OFFLOADS)
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError("zero_stage", self.zero_stage, "choose one of 0, 1, 2, 3")
        if (isinstance(self.zero_keep_last_layers, bool)
                or not isinstance(self.zero_keep_last_layers, int)
                or self.zero_keep_last_layers < -1):
            raise ConfigError("zero_keep_last_layers", self.zero_keep_last_layers,
                              "use a count of layers >= 0, or -1 (the last block and "
                              "the layers after it)")
        if not _DATASET_RE.match(self.dataset):
            raise ConfigError("dataset", self.dataset, "use 'auto' or 'package.module:function'")
        for name in ("global_batch_size", "steps", "steps_per_epoch", "base_batch_size",
                     "grad_accum_steps", "tensor_parallel", "pipeline_stages",
                     "microbatches", "virtual_stages", "powersgd_rank", "powersgd_groups",
                     "checkpoint_every", "keep_checkpoints"):
            _at_least(name, getattr(self, name), 1)
        for name in ("model_width", "model_depth", "num_classes", "warmup_steps",
                     "cpu_devices", "data_parallel", "powersgd_start_step", "seed", "verbose",
                     "validation_steps"):
            _at_least(name, getattr(self, name), 0)
        for name in ("learning_rate", "collective_timeout_s", "heartbeat_timeout_s",
                     "startup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(name, value, "must be a number > 0")
        if not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb >= 0:
            raise ConfigError("bucket_mb", self.bucket_mb,
                              "must be a number >= 0 (0: no buckets, Keras's all-reduce)")
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError("topk_ratio", self.topk_ratio, "must be in (0, 1], e.g. 0.01 for 1 %")
        _at_least("topk_warmup_steps", self.topk_warmup_steps, 0)
        _at_least("topk_dense_below", self.topk_dense_below, 0)
        if not 0 <= self.topk_momentum_carry <= 1:
            raise ConfigError("topk_momentum_carry", self.topk_momentum_carry,
                              "must be in [0, 1], e.g. 0.5")
        _at_least("adam_warmup_steps", self.adam_warmup_steps, 0)
        if not self.threshold > 0:
            raise ConfigError("threshold", self.threshold, "must be > 0")
        if self.lowbit_bits not in (1, 2, 3, 4):
            raise ConfigError("lowbit_bits", self.lowbit_bits, "choose 1, 2, 3 or 4 "
                              "(8 bits: --compression=int8)")
        if not self.auto_budget_ms > 0:
            raise ConfigError("auto_budget_ms", self.auto_budget_ms, "must be > 0, e.g. 20")
        for name in ("auto_link_mbps", "auto_link_latency_ms"):
            if not getattr(self, name) >= 0:
                raise ConfigError(name, getattr(self, name), "must be >= 0 (0 = measure)")
        if self.global_batch_size % self.microbatches:
            raise ConfigError("microbatches", self.microbatches,
                              f"must divide global_batch_size={self.global_batch_size}")
        from tfpar.legacy import options as legacy_options  # imports no TensorFlow
        legacy_options.check(self)
        compat.check(self)  # what the backend that will run this config honours

    @property
    def dims(self):
        """The parallel degrees as a `tfpar.dims.ParallelDims` (devices not known yet)."""
        return ParallelDims.from_config(self)

    @property
    def effective_batch_size(self):
        """Examples behind one optimizer update: global batch × accumulation steps."""
        return self.global_batch_size * self.grad_accum_steps

    @property
    def scaled_learning_rate(self):
        """The peak learning rate after the linear scaling rule (if `scale_lr`)."""
        if not self.scale_lr:
            return self.learning_rate
        return self.learning_rate * self.effective_batch_size / self.base_batch_size

    def replica_split(self, replicas, accumulated=True):
        """How one step's examples (global batch × accumulation steps; without
        `accumulated` one global batch, as held-out data) go over `replicas` replicas: a
        `tfpar.replica_split.ReplicaSplit`, as even as possible (22/21/21 for 64 over 3),
        with padding of weight zero where the replicas do not divide the batch. A
        pipelined step cuts each replica's batch into `microbatches` (× accumulation
        steps) equal micro-batches: its `microsteps`, which the padded batch is a
        multiple of (held-out batches too: the mesh pipeline evaluates by micro-batch)."""
        micro = self.microbatches if self.dims.pp_enabled else 1
        if not accumulated:
            return split_examples(self.global_batch_size, replicas, micro)
        return split_examples(self.effective_batch_size, replicas,
                              self.grad_accum_steps * micro)

    def per_replica_batch(self, replicas, why=""):
        """The batch each replica computes on where every replica must take the same number
        of real examples (`why` says where, for the message); raises `ConfigError` if the
        replicas do not divide the global batch. The generated data needs no such split
        on any backend: it splits any batch (`replica_split`); a `--dataset` function's
        equal per-replica batches do."""
        if self.global_batch_size % replicas:
            low = self.global_batch_size // replicas * replicas
            fits = " or ".join(str(n) for n in (low, low + replicas) if n >= replicas)
            raise ConfigError(
                "global_batch_size", self.global_batch_size,
                f"must be divisible by the {replicas} replicas"
                f"{f' ({why})' if why else ''}; try {fits}")
        return self.global_batch_size // replicas

    def replace(self, **changes):
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self):
        return dataclasses.asdict(self)


def _one_of(name, value, allowed):
    if value not in allowed:
        raise ConfigError(name, value, f"choose one of {', '.join(allowed)}")


def _at_least(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(name, value, f"must be an integer >= {low}")
