"""`python -m tfpar.train`: config → strategy → data → model → `fit` → metrics.

With no flags it trains a small MLP on a generated teacher task over every local device
and prints a summary. `--flagfile=configs/NAME.cfg` runs a recipe; under `TF_CONFIG` (or
`python -m tfpar.launch`) the same command is one worker of a multi-worker job.

Python callers use `train(ParallelConfig(...))`, which returns the metrics dict.
"""

import os
import sys

import keras
import tensorflow as tf
from absl import app, flags, logging

from tfpar import models
from tfpar import (accumulation, checkpoint, data, devices, faults, metrics, nan_guard,
                   pipeline, preemption, strategy)
from tfpar import flags as tfpar_flags
from tfpar.errors import TfparError

tfpar_flags.define_flags()
FLAGS = flags.FLAGS


@keras.saving.register_keras_serializable(package="tfpar")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """`peak * min(1, (step + 1) / warmup_steps)`."""

    def __init__(self, peak, warmup_steps):
        self.peak, self.warmup_steps = peak, warmup_steps

    def __call__(self, step):
        ramp = keras.ops.cast(step + 1, "float32") / float(self.warmup_steps)
        return self.peak * keras.ops.minimum(1.0, ramp)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps}


def learning_rate(config):
    """The peak rate after the linear scaling rule, with linear warm-up if asked for."""
    peak = config.scaled_learning_rate
    if not config.warmup_steps:
        return peak
    return LinearWarmup(peak, config.warmup_steps)


def make_optimizer(config):
    """The Keras optimizer for `config`: learning-rate rule, aggregator, fp16 loss scaling."""
    kwargs = {"learning_rate": learning_rate(config)}
    if config.optimizer == "adam":
        optimizer = keras.optimizers.Adam(**kwargs)
    else:
        optimizer = keras.optimizers.SGD(
            momentum=0.9 if config.optimizer == "momentum" else 0.0, **kwargs)
    if config.compression != "none":
        from tfpar import compression
        optimizer = compression.wrap_optimizer(optimizer, compression.make_aggregator(config))
    if config.mixed_precision == "fp16":
        optimizer = nan_guard.ConsistentLossScaleOptimizer(optimizer)
    return optimizer


def build_model(config, runtime, task):
    """Builds and compiles the model under the strategy's scope, optimizer built, so a
    checkpoint can restore every variable before the first step."""
    with runtime.strategy.scope():
        model = models.build(config.model, task.input_shape, task.num_classes,
                             width=config.model_width, depth=config.model_depth)
        if config.pipeline_stages > 1:
            model = pipeline.for_training(model, config, runtime)
        model.compile(
            optimizer=make_optimizer(config),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            jit_compile=False)
        nan_guard.skip_nonfinite_updates(model.optimizer, skip=config.on_nan == "skip_step")
        model.optimizer.build(model.trainable_variables)
    accumulation.install(model, config.grad_accum_steps)
    return model


def fit_segments(start, total, per_epoch):
    """Splits batches `start … total-1` into `fit` calls of whole epochs.

    Returns a list of `(initial_epoch, epochs, steps_per_epoch, first_batch)`; a resumed
    run first finishes its partial epoch, and a last partial epoch gets a call of its own.

    >>> fit_segments(0, 10, 4)
    [(0, 2, 4, 0), (2, 3, 2, 8)]
    >>> fit_segments(5, 12, 4)
    [(1, 2, 3, 5), (2, 3, 4, 8)]
    """
    segments = []
    batch = start
    while batch < total:
        epoch = batch // per_epoch
        length = min(per_epoch - batch % per_epoch, total - batch)
        if (segments and length == per_epoch and segments[-1][2] == per_epoch
                and segments[-1][3] + (segments[-1][1] - segments[-1][0]) * per_epoch == batch):
            initial, epochs, steps, first = segments[-1]
            segments[-1] = (initial, epochs + 1, steps, first)
        else:
            segments.append((epoch, epoch + 1, length, batch))
        batch += length
    return segments


def train(config, environ=None, callbacks=(), runtime=None):
    """Trains `config`; returns `(metrics, model)` (metrics: see `tfpar.metrics.summarize`).

    Args:
        config: the `ParallelConfig` to run.
        environ: where to read `TF_CONFIG` from (default `os.environ`).
        callbacks: extra Keras callbacks for every `fit` call.
        runtime: a `tfpar.strategy.Runtime` from an earlier `make_runtime` to train on
            instead of building a new one: how one process trains several models (or the
            same one several times) on its one strategy. Tensor-parallel and tf_keras runs
            build their own and ignore it.

    Call in a fresh process (or pass the `runtime` of the earlier call): `config.cpu_devices`
    must be applied before TensorFlow initialises, and TensorFlow allows one distribution
    strategy per process.

    Raises:
        ConfigError: a setting, `TF_CONFIG` or the checkpoint directory is unusable.
        TfparError: the run cannot proceed (peers missing, loss not finite, ...).
    """
    if config.tensor_parallel > 1:
        from tfpar import layout  # a DTensor mesh instead of a tf.distribute strategy
        return layout.train(config)
    if config.keras == 2:
        from tfpar import legacy  # tf_keras models, tfmot pruning and QAT
        return legacy.train(config, environ=environ, callbacks=callbacks)
    devices.split_cpu(config.cpu_devices)
    keras.utils.set_random_seed(config.seed)
    if config.mixed_precision != "none":
        keras.mixed_precision.set_global_policy(
            {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}[config.mixed_precision])
    if runtime is None:
        runtime = strategy.make_runtime(config, environ)
    config.per_replica_batch(runtime.replicas)
    logging.info(devices.topology(runtime.strategy, runtime.workers))
    task = data.make_task(config)
    model = build_model(config, runtime, task)

    recorder = metrics.StepRecorder()
    guard_nan = nan_guard.NaNGuard(config.on_nan, recorder)
    callbacks = [recorder, guard_nan, *callbacks]
    start, checkpointer, guard = 0, None, None
    if config.checkpoint_dir:
        checkpointer = checkpoint.Checkpointer(config, model, runtime)
        start = checkpointer.restore()
        guard = preemption.PreemptionGuard(checkpointer, runtime.strategy, runtime.workers)
        callbacks += [checkpointer, guard]  # in this order: the guard saves the step just done
        if start:
            logging.info("resuming from %s at step %d", config.checkpoint_dir, start)
    guard_nan.step = start
    if config.tensorboard_dir:
        log_dir = config.tensorboard_dir if runtime.is_chief else os.path.join(
            config.tensorboard_dir, f"worker_{runtime.worker_index}")
        callbacks.append(keras.callbacks.TensorBoard(log_dir, update_freq="epoch"))

    fault = faults.injector(start)
    if fault is not None:
        callbacks.append(fault)
    verbose = config.verbose if runtime.is_chief else 0
    for initial, epochs, steps, first in fit_segments(start, config.steps,
                                                      config.steps_per_epoch):
        dataset = data.distributed_dataset(runtime.strategy, config, task, first)
        model.fit(dataset, initial_epoch=initial, epochs=epochs, steps_per_epoch=steps,
                  callbacks=callbacks, verbose=verbose, shuffle=False)
        if model.stop_training:
            break
    if checkpointer is not None:
        guard.restore_handler()
        checkpointer.save()

    comm = metrics.comm_stats(model, runtime.replicas)
    if config.measure_comm and comm is not None and config.pipeline_stages == 1 \
            and not model.stop_training:
        # Compute-only vs full steps on a scratch copy of the aggregator (the run's state is
        # untouched); every worker takes part.
        from tfpar.compression.timing import measure_comm_fraction
        comm["comm_time_fraction"], timing = measure_comm_fraction(
            runtime.strategy, model, data.distributed_dataset(runtime.strategy, config, task))
        if "overlap_fraction" in timing:  # beyond DESIGN.md's keys: hidden behind backward
            comm["overlap_fraction"] = timing["overlap_fraction"]
    local_replicas = runtime.replicas // runtime.workers
    if hasattr(model, "pipeline_metrics"):
        params = model.params_per_stage() * local_replicas
        pipeline_block = model.pipeline_metrics()
    else:
        params, pipeline_block = [model.count_params()] * local_replicas, None
    result = metrics.summarize(config, runtime, recorder, params, comm=comm,
                               pipeline=pipeline_block)
    result["resumed_from_step"] = start
    if guard_nan.skipped:
        result["skipped_steps"] = guard_nan.skipped
    if guard is not None and guard.preempted:
        result["preempted"] = True
    if config.metrics_json and runtime.is_chief:
        metrics.write_json(config.metrics_json, result)
    return result, model


def _cause(err):
    """The informative line of a TensorFlow runtime error (its first line is often just
    'Graph execution error:')."""
    lines = [line.strip() for line in (err.message or str(err)).splitlines() if line.strip()]
    for key in ("unhealthy", "timed out", "Deadline", "Error reported from", "aborted"):
        for i, line in enumerate(lines):
            if key in line:
                detail = lines[i + 1] if line.endswith(":") and i + 1 < len(lines) else ""
                return f"{line} {detail}".strip()[:300]
    return lines[0][:300] if lines else type(err).__name__


def summary_line(result):
    parts = [f"strategy={result['strategy']}", f"replicas={result['replicas']}",
             f"workers={result['workers']}", f"steps={result['steps']}",
             f"loss {result['loss_history'][0]:.4f} -> {result['final_loss']:.4f}"
             if result["loss_history"] else "no steps run"]
    if "examples_per_sec" in result:
        parts.append(f"{result['examples_per_sec']:.0f} examples/s")
        parts.append(f"step {result['step_time_ms']['median']:.1f} ms")
    if "comm" in result:
        parts.append(f"{result['comm']['bytes_on_wire_per_step'] / 1e6:.3f} MB/step on the "
                     f"wire (x{result['comm']['compression_ratio']:.1f} smaller)")
    return "tfpar: " + ", ".join(parts)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    tf.get_logger().setLevel("WARNING")
    try:
        config = tfpar_flags.config_from_flags()
        result, _ = train(config)
    except TfparError as err:
        print(f"tfpar: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.CancelledError, tf.errors.AbortedError) as err:
        # A dead, stalled or missing peer: say so in one line instead of a C++ stack.
        print(f"tfpar: error: a collective with the other workers failed "
              f"({type(err).__name__}: {_cause(err)}); a peer died, stalled past "
              f"--collective_timeout_s or --heartbeat_timeout_s, or never started",
              file=sys.stderr, flush=True)
        sys.exit(1)
    print(summary_line(result), flush=True)
    if result.get("preempted"):
        print(f"tfpar: preempted (SIGTERM): checkpoint saved at step "
              f"{result['resumed_from_step'] + result['steps']}; run the same command to resume",
              file=sys.stderr, flush=True)
        sys.exit(143)


if __name__ == "__main__":
    app.run(main)
