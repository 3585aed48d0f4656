"""The public entry points for a user's own Keras script: `make_strategy`,
`DistributedOptimizer` and `enable` (exported at the top of `tfpar`).

They build on what `python -m tfpar.train` uses — `tfpar.strategy.make_runtime` and the
gradient aggregators of `tfpar.compression` — so a script that calls `model.fit` itself gets
the same fixes and the same compressed all-reduce.
"""

import inspect

import keras
import tensorflow as tf
from absl import logging

from tfpar import compression as compression_lib
from tfpar import compat, devices, keras_codec_state, nan_guard, patches
from tfpar import offload as offload_lib
from tfpar.config import COMPRESSIONS, OFFLOADS, ON_NAN, STRATEGIES, ParallelConfig
from tfpar.errors import ConfigError
from tfpar.compression.keras_hook import AggregatingOptimizerMixin
from tfpar.strategy import make_runtime

# The ParallelConfig fields that shape a strategy (the others describe a training run).
STRATEGY_OPTIONS = ("collective", "collective_timeout_s", "heartbeat_timeout_s",
                    "startup_timeout_s", "data_parallel")


def make_strategy(kind="auto", cpu_devices=None, **options):
    """A `tf.distribute.Strategy` with tfpar's fixes applied, for `model.fit` in your script.

    `auto` picks `MultiWorkerMirroredStrategy` when `TF_CONFIG` names several workers (as
    `tfpar-launch --workers=N` / `python -m tfpar.launch` sets it), `MirroredStrategy` when
    this process has several devices, `OneDeviceStrategy` otherwise. Applied on top: Keras 3
    `fit` works across workers (`tfpar.patches`), each worker can run several logical-CPU
    replicas, collectives time out after `collective_timeout_s` and peers that never start
    or die end the job after `startup_timeout_s` / `heartbeat_timeout_s` instead of hanging.

    Call it once per process, first (TensorFlow allows one strategy per process, and the CPU
    split must precede any TensorFlow op).

    Args:
        kind: "auto", "one_device", "mirrored" or "multi_worker".
        cpu_devices: split the CPU into this many logical devices, one replica each (per
            worker); None or 1 keeps one.
        **options: `collective` ("auto", "ring", "nccl"), `collective_timeout_s`,
            `heartbeat_timeout_s`, `startup_timeout_s`, `data_parallel` (replicas to use,
            0 = all): the `tfpar.ParallelConfig` fields of the same names.

    Returns:
        the strategy; use it as `with strategy.scope(): model = ...; model.compile(...)`,
        then `model.fit(...)`.

    Raises:
        ConfigError: an unknown option, a bad value, or a `TF_CONFIG` that does not fit.

    Examples:
        >>> import numpy as np, keras, tfpar
        >>> strategy = tfpar.make_strategy(cpu_devices=2)
        >>> strategy.num_replicas_in_sync
        2
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> x = np.ones((32, 4), "float32")
        >>> model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0).history["loss"][0] > 0
        True
    """
    for name, value in options.items():
        if name not in STRATEGY_OPTIONS:
            raise ConfigError(name, value,
                              f"not an option of make_strategy; use {', '.join(STRATEGY_OPTIONS)}")
    if kind not in STRATEGIES:
        raise ConfigError("kind", kind, f"choose one of {', '.join(STRATEGIES)}")
    if cpu_devices is not None and (isinstance(cpu_devices, bool)
                                    or not isinstance(cpu_devices, int) or cpu_devices < 1):
        raise ConfigError("cpu_devices", cpu_devices, "must be None or an integer >= 1")
    config = ParallelConfig(strategy=kind, cpu_devices=cpu_devices or 0, **options)
    devices.split_cpu(config.cpu_devices)
    runtime = make_runtime(config)
    runtime.strategy.tfpar_runtime = runtime  # what the callbacks and optimizer read
    runtime.strategy.tfpar_config = config
    return runtime.strategy


def enable():
    """Makes Keras 3's `fit` work under a tf.distribute strategy you build yourself.

    For a script that builds its own `tf.distribute.MultiWorkerMirroredStrategy()` (or
    `MirroredStrategy`) as tensorflow.org's tutorials do, instead of `make_strategy`. Stock
    Keras 3 fails there (keras-team/keras#20585): `fit` reduces its input batch across
    workers and each scalar log along an axis it has not; and under any strategy it builds
    the model from a batch it then drops, so a shuffled dataset trains in its second
    order, not the one a single device sees. After `enable()` neither happens. Call it
    once, before the strategy is built; calling it again does nothing. `make_strategy`
    calls it for you.

    Raises:
        TfparError: the installed Keras or TensorFlow is not the version tfpar's fixes
            were written for (requirements.txt pins it).

    Examples:
        >>> import numpy as np, keras, tensorflow as tf, tfpar
        >>> tfpar.enable()
        >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> x = np.ones((32, 4), "float32")
        >>> data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8)
        >>> model.fit(data, epochs=1, verbose=0).history["loss"][0] > 0
        True
    """
    patches.apply()


def _aggregator(compression_arg, options):
    """The aggregator `compression_arg` names, built with `options` (its constructor's
    arguments); an `Aggregator` instance is taken as it is."""
    if isinstance(compression_arg, compression_lib.Aggregator):
        if options:
            name = next(iter(options))
            raise ConfigError(name, options[name], "options go to the aggregator's "
                              "constructor; pass them there when compression is an instance")
        return compression_arg
    if compression_arg not in COMPRESSIONS:
        raise ConfigError("compression", compression_arg,
                          f"choose one of {', '.join(COMPRESSIONS)} or pass a "
                          "tfpar.compression_lib.Aggregator")
    factories = {"none": compression_lib.NoneAggregator, "int8": compression_lib.Int8Aggregator,
                 "lowbit": compression_lib.LowBitAggregator,
                 "topk": compression_lib.TopKAggregator, "threshold": compression_lib.ThresholdAggregator,
                 "powersgd": compression_lib.PowerSGDAggregator,
                 "auto": compression_lib.AutoAggregator}
    if compression_arg in ("fp16", "bf16"):
        cls, args = compression_lib.CastAggregator, (compression_arg,)
    else:
        cls, args = factories[compression_arg], ()
    allowed = [p for p in (list(inspect.signature(cls.__init__).parameters)[1 + len(args):]
                           + list(inspect.signature(compression_lib.Aggregator.__init__).parameters)[1:])
               if p not in ("kwargs", "name")]
    for name, value in options.items():
        if name not in allowed:
            raise ConfigError(name, value, f"not an option of compression={compression_arg!r}; "
                              f"use {', '.join(dict.fromkeys(allowed))}")
    # Safe without a ParallelConfig: a collective that never completes becomes an error.
    strategy_config = getattr(tf.distribute.get_strategy(), "tfpar_config", None)
    options.setdefault("timeout_s", (strategy_config or ParallelConfig()).collective_timeout_s)
    try:
        return cls(*args, **options)
    except ValueError as err:  # the constructors name argument and value already
        raise ConfigError("compression", compression_arg, str(err)) from None


def DistributedOptimizer(optimizer, compression=None, on_nan="stop",  # noqa: N802
                         offload="none", **aggregator_options):
    """A new Keras optimizer like `optimizer` that sums gradients over replicas through a
    tfpar aggregator (compressed all-reduce), as Horovod's `DistributedOptimizer` does.

    The returned optimizer is a copy built from `optimizer.get_config()`; `optimizer` itself
    is left unchanged and usable. Under a strategy with one replica, or none, it behaves
    exactly like the plain optimizer (nothing is communicated, nothing compressed).
    Checkpoints of it (`tf.train.Checkpoint(optimizer=...)`, `tfpar.callbacks.
    BackupAndRestore`) include the aggregator's state: error-feedback residuals per replica,
    PowerSGD's Q. Create it inside `strategy.scope()`, like any optimizer used there.
    It serialises as the optimizer it copies: `model.save` writes a plain
    `keras.optimizers.Adam` (etc.: its class, config, step count and slots), so stock
    `keras.models.load_model` loads the file in a process that never imports tfpar, with
    the plain optimizer and its state (once its codec ran on a `keras.distribution` mesh,
    the file names `tfpar>DistributedAdam` with the codec instead: below). The compression is not in the file: wrap the loaded
    model's optimizer again to train on with it (`tfpar.DistributedOptimizer(
    model.optimizer, ...)`, a fresh copy). Under `mixed_float16` Keras's
    `LossScaleOptimizer` around it writes what Keras's class around the plain optimizer
    holds (without tfpar's counter of skipped steps), so stock `load_model` goes on with
    the loss scale too (`tfpar.keras_codec_state.write_plain`). With Adam in front of
    compression (Adam with "powersgd", "lowbit", "topk", "threshold" or "auto" over
    several replicas) Adam's moments are kept per replica by the aggregator, not in Adam's
    slots: the file holds Adam's step count with its moments at zero.

    Under `keras.distribution` (`ModelParallel`, `DataParallel` after
    `tfpar.layout.enable()`) the codec compresses the mesh's batch axis instead
    (`tfpar.layout.reduction`: each replica's gradient, error feedback sharded like it,
    with a `LossScaleOptimizer` too): the options it takes are PowerSGD's `rank` and `seed`,
    top-k's `ratio`, `union` and `dense_below`, threshold's, lowbit's `bits` and
    `error_feedback`; `auto`, PowerSGD's `start_step`, top-k's `warmup_steps` and
    `momentum`, and a model's own `train_step` are refused. With Adam and "topk", "powersgd"
    or "lowbit", Adam goes in front of the codec there too, as the trainer's mesh runs it
    (`tfpar.layout.adam_front`): `adam_warmup_steps` exact steps, then each replica's Adam
    step or scaled gradient through the codec, `adam_variance` "frozen", "local" or
    "local_debiased" ("live" and `adam_refresh_every` are refused); `adam=None` keeps Adam
    behind it. Other optimizers run after the compressed sum. The codec's state (Adam's
    moments too) is in `tfpar.callbacks.BackupAndRestore`'s checkpoint and, under
    `keras.distribution`, in Keras's files (`model.save`, `save_weights`, Keras's
    `BackupAndRestore`: `tfpar.keras_codec_state`), which `load_weights` and Keras's
    `BackupAndRestore` read back into a model compiled with the same codec.

    Args:
        optimizer: a Keras 3 optimizer (or its name, e.g. "adam"), also a
            `keras.optimizers.LossScaleOptimizer` (its inner optimizer aggregates).
        compression: "none", "fp16", "bf16", "int8", "lowbit", "topk", "threshold",
            "powersgd", "auto", or a `tfpar.compression_lib.Aggregator` instance; None (the
            default): "powersgd", or "none" with `offload` (the only one it runs with). With Adam,
            "lowbit" (3 bits per entry) sends ~10x fewer bytes than fp32 at fp32's quality
            on the quality suite; "topk" at its default (ratio 0.25 with the replicas'
            union, as the trainer's `--topk_ratio`) ~0.76x at 2 replicas, and logs so.
        on_nan: a step whose summed gradients hold a NaN or Inf is never applied: weights,
            optimizer slots and the aggregator's state (error feedback) stay as they were
            and `optimizer.nonfinite_steps` counts it. With the callback
            `tfpar.callbacks.NaNGuard()` in `model.fit`, "stop" (the default) then ends
            `fit` with one line naming the step, "skip_step" logs the step and trains on.
            (Without the callback both skip such steps silently; none trains on NaN.)
        offload: "none", or "optimizer": the optimizer's slots (Adam's m and v, SGD's
            momentum) live in host memory (NumPy) and its update runs there, as
            `--offload=optimizer` (`tfpar.offload`): the devices keep the weights only,
            which equal the device-resident run's. For `keras.optimizers.Adam` or `SGD`
            with momentum (no amsgrad, EMA or Keras accumulation) under data parallelism
            (`tfpar.make_strategy`), with `compression="none"`. `model.save` writes the host
            slots as the plain optimizer's, so stock Keras loads them; a checkpoint
            (`tfpar.callbacks.BackupAndRestore`) keeps them too.
        **aggregator_options: arguments of that aggregator's constructor, e.g. `rank=2`
            and `start_step=10` for PowerSGD, `ratio=0.01` for top-k, `bucket_mb`,
            `error_feedback`, `timeout_s` (default: the strategy's `collective_timeout_s`
            from `tfpar.make_strategy`, else 120 s).

    Returns:
        the new optimizer; `tfpar.compression.aggregator_of(it)` is its aggregator (with
        `comm_stats()`: bytes on the wire per step).

    Raises:
        ConfigError: an unknown compression or option, a bad option value, `on_nan`
            not "stop" or "skip_step", or an `offload` the optimizer or compression does
            not run with (`tfpar.compat`'s offload rows).
        TypeError: `optimizer` is not a Keras 3 optimizer on the TensorFlow backend.

    Examples:
        >>> import numpy as np, keras, tfpar
        >>> strategy = tfpar.make_strategy(cpu_devices=2)
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
        ...     opt = tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="powersgd",
        ...                                      rank=1)
        ...     model.compile(optimizer=opt, loss="mse")
        >>> x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
        >>> history = model.fit(x, x, batch_size=16, epochs=3, verbose=0).history["loss"]
        >>> history[-1] < history[0]
        True
        >>> stats = tfpar.compression.aggregator_of(opt).comm_stats()
        >>> stats["bytes_on_wire_per_step"] < stats["bytes_uncompressed_per_step"]
        True
    """
    if on_nan not in ON_NAN:
        raise ConfigError("on_nan", on_nan, f"choose one of {', '.join(ON_NAN)}")
    if offload not in OFFLOADS:
        raise ConfigError("offload", offload, f"choose one of {', '.join(OFFLOADS)}")
    if compression is None:
        compression = "powersgd" if offload == "none" else "none"
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if offload != "none" and isinstance(optimizer, keras.optimizers.Optimizer) \
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        _check_offload(optimizer, compression, offload)
    aggregator = _aggregator(compression, dict(aggregator_options))
    # Keras's `LossScaleOptimizer` around it (fp16: `compile` wraps it) writes the file
    # stock Keras reads, and reads it back (`tfpar.keras_codec_state.write_plain`)
    patches.loss_scale_files(keras_codec_state.write_plain, keras_codec_state.read_either)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        config = optimizer.get_config()
        config.pop("inner_optimizer")
        inner = DistributedOptimizer(optimizer.inner_optimizer, aggregator, on_nan=on_nan,
                                     offload=offload)
        return type(optimizer)(inner, **config)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer={optimizer!r} is not a Keras optimizer; pass e.g. "
                        "keras.optimizers.Adam(1e-3) or 'adam'")
    if offload != "none":
        # No aggregator: the offloaded step all-reduces as Keras does, then updates on the
        # host (`tfpar.offload.OffloadMixin`), which also counts and skips non-finite steps.
        copy = _plain_class(optimizer).from_config(optimizer.get_config())
        wrapped = offload_lib.wrap_optimizer(copy, offload)
        nan_guard.skip_nonfinite_updates(wrapped)
        wrapped.tfpar_on_nan = on_nan
        return wrapped
    if (isinstance(compression, str) and "adam" not in aggregator_options
            and compression in compression_lib.ADAM_STEP_AGGREGATORS
            and _plain_class(optimizer) is keras.optimizers.Adam
            and not optimizer.amsgrad):
        # As the trainer does (`--compress_adam_step`): compress Adam's step, not the
        # gradient Adam would normalise; PowerSGD with each replica's own `v`
        # (`make_aggregator`, docs/benchmarks/compression.md). The optimizer's own betas
        # before `v`'s rule is picked: top-k's synced momentum depends on beta_1.
        aggregator.adam = (float(optimizer.beta_1), float(optimizer.beta_2),
                           float(optimizer.epsilon))
        if compression == "topk":
            logging.warning(compression_lib.topk_with_adam_line(aggregator.ratio,
                                                                aggregator.union))
        # Each replica's own `v` where the trainer takes it (`make_aggregator`): PowerSGD,
        # low-bit, and top-k with its momentum synced (at its default ratio).
        if (compression in ("powersgd", "lowbit") or aggregator.adam_sync_momentum) and not {
                "adam_variance", "adam_refresh_every"} & set(aggregator_options):
            aggregator.set_adam_variance("local_debiased")
    # The copy's class is the mixin over `optimizer`'s own class with that class's name and
    # module (`wrap_optimizer`), so Keras saves it as the plain optimizer, as Horovod does.
    copy = _plain_class(optimizer).from_config(optimizer.get_config())
    wrapped = compression_lib.wrap_optimizer(copy, aggregator)
    # Keras's files of a model on a `keras.distribution` mesh hold the codec's state in it
    # (`optimizer/tfpar_codec_state`, which stock Keras does not read)
    keras_codec_state.add_to(wrapped, aggregator, on_nan)
    # Non-finite steps counted and never applied (`tfpar.nan_guard`); the mixin keeps the
    # class's name and module, so the file still holds the plain optimizer.
    nan_guard.skip_nonfinite_updates(wrapped)
    wrapped.tfpar_on_nan = on_nan
    return wrapped


def _check_offload(optimizer, compression, offload):
    """`tfpar.compat`'s offload rows for the API's arguments (a `view(api=True)`, whose
    lines name the API's arguments): `optimizer` as the trainer's `--optimizer`, an
    `Aggregator` instance by its class."""
    plain = _plain_class(optimizer)
    kind = ("adam" if issubclass(plain, keras.optimizers.Adam) else
            "momentum" if getattr(optimizer, "momentum", 0) else
            "sgd" if issubclass(plain, keras.optimizers.SGD) else "adam")  # others: wrap's line
    if isinstance(compression, compression_lib.NoneAggregator):
        compression = "none"
    elif not isinstance(compression, str):
        compression = type(compression).__name__
    config = compat.view(api=True, offload=offload, compression=compression, optimizer=kind)
    for rule in compat.OFFLOAD_RULES:
        compat.enforce(rule, config)


def _plain_class(optimizer):
    """The Keras optimizer class under tfpar's aggregating or offloading mixin (`optimizer`'s
    own if none)."""
    return patches.unmixed_class(type(optimizer),
                                 (AggregatingOptimizerMixin, offload_lib.OffloadMixin))


_DISTRIBUTED = {}


def distributed_class(base):
    """The class registered as `tfpar>Distributed<Base>`, for files whose config holds the
    aggregator (`"compression"`, and `"on_nan"`): saved by tfpar before
    `DistributedOptimizer` saved the plain optimizer, and by a model whose codec ran on a
    `keras.distribution` mesh (`tfpar.keras_codec_state`). `from_config` gives a
    `DistributedOptimizer` with it."""
    if base not in _DISTRIBUTED:
        class Distributed(AggregatingOptimizerMixin, base):
            @classmethod
            def from_config(cls, config, custom_objects=None):
                config = dict(config)
                spec = config.pop("compression", None)
                on_nan = config.pop("on_nan", "stop")
                optimizer = base.from_config(config, custom_objects=custom_objects)
                if spec is None:
                    return optimizer
                aggregator = getattr(compression_lib, spec["class_name"])(**spec["config"])
                return DistributedOptimizer(optimizer, compression=aggregator, on_nan=on_nan)

        Distributed.__name__ = Distributed.__qualname__ = f"Distributed{base.__name__}"
        _DISTRIBUTED[base] = keras.saving.register_keras_serializable(package="tfpar")(
            Distributed)
    return _DISTRIBUTED[base]


# Files name these classes (saved by earlier versions, or of a codec on a mesh);
# registered at import.
REGISTERED_BASES = tuple(name for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "Adafactor", "Nadam", "RMSprop",
    "Ftrl", "Lion", "Lamb", "Muon") if hasattr(keras.optimizers, name))
for _name in REGISTERED_BASES:
    distributed_class(getattr(keras.optimizers, _name))
