"""Keras 3 on a `tf.distribute` strategy: data parallelism, pipelines, aggregators.

One device, `MirroredStrategy` or `MultiWorkerMirroredStrategy` (`tfpar.strategy`); with
`pipeline_stages > 1` the model becomes a `PipelineModel` (`tfpar.pipeline.for_training`);
`compression` wraps the optimizer with a gradient aggregator. Training is Keras's own
`model.fit`, in segments of whole epochs so a resumed run continues at its step
(`tfpar.checkpoint.fit_segments`).
"""

import os

import keras
from absl import logging

from tfpar import (accumulation, checkpoint, data, devices, faults, memory, metrics,
                   nan_guard, optimizers, pipeline, preemption, recompute, strategy,
                   tf_config)
from tfpar import models, patches
from tfpar.backends import Backend, tensorboard_dir
from tfpar.pipeline import remote


class DistributeBackend(Backend):
    """Keras 3 on a `tf.distribute` strategy (see the module docstring)."""

    board = None  # the run's `tfpar.callbacks.TensorBoard` with `tensorboard_dir`

    def build_runtime(self, config, environ=None, runtime=None):
        if config.offload != "none":
            # Before TensorFlow starts: a capped offloaded run near the cap ended in SIGSEGV
            # instead of the out-of-memory line (docs/benchmarks/memory.md), as ZeRO-3 did.
            patches.no_function_constant_folding()
        devices.split_cpu(config.cpu_devices)
        keras.utils.set_random_seed(config.seed)
        optimizers.set_policy(config.mixed_precision)
        cluster = tf_config.load(os.environ if environ is None else environ)
        if runtime is None and remote.spans_workers(config, cluster):
            # One stage per worker process, worker 0 the client; the others serve and exit.
            runtime = remote.make_runtime(config, cluster, strategy.Runtime)
        if runtime is None:
            runtime = strategy.make_runtime(config, environ)
        logging.info(devices.topology(runtime.strategy, runtime.workers))
        return runtime

    def build_model(self, config, runtime, task):
        """Builds and compiles the model under the strategy's scope, optimizer built, so a
        checkpoint can restore every variable before the first step. Any global batch
        splits over the replicas (`tfpar.replica_split`); raises `ConfigError` first if a
        `--dataset` function's equal per-replica batches cannot hold it."""
        if task.user_fn is not None:
            config.per_replica_batch(runtime.replicas, "a --dataset function yields equal "
                                                       "per-replica batches")
        with runtime.strategy.scope():
            model = models.build(config.model, task.input_shape, task.num_classes,
                                 width=config.model_width, depth=config.model_depth)
            recompute.apply(model, config)
            if config.dims.pp_enabled:
                model = pipeline.for_training(model, config, runtime)
            # Across workers `--compression=none` sums in `--bucket_mb` buckets, last
            # layers first, so the first buckets can cross the link while backward still
            # runs; in one process (no link to hide) it stays on Keras's one all-reduce
            # (docs/benchmarks/compression_link.md, "Uncompressed buckets across
            # workers"). Not under `--offload`, whose host update `tfpar.compat` keeps
            # apart from every aggregator.
            across = runtime.kind == "multi_worker" and runtime.workers > 1
            optimizer = optimizers.make_optimizer(
                config, bucketed=True if across and config.offload == "none" else None)
            # Before compile: a PipelineModel copies the optimizer, guard included, per stage.
            nan_guard.skip_nonfinite_updates(optimizer, skip=config.on_nan == "skip_step")
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                jit_compile=False)
            model.optimizer.build(model.trainable_variables)
            if not config.dims.pp_enabled:  # a PipelineModel accumulates in its schedule
                accumulation.install(model, config.grad_accum_steps)
            metrics.report_step_loss(model)  # the metrics JSON's per-step loss
        return model

    def fit(self, config, runtime, model, task, recorder, callbacks):
        guard_nan = nan_guard.NaNGuard(config.on_nan)
        callbacks = [recorder, guard_nan, *callbacks]
        start, checkpointer, guard = 0, None, None
        if config.checkpoint_dir:
            checkpointer = checkpoint.Checkpointer(config, model, runtime)
            start = checkpointer.restore()
            guard = preemption.PreemptionGuard(checkpointer, runtime.strategy,
                                               runtime.workers)
            callbacks += [checkpointer, guard]  # in this order: the guard saves the step done
            if start:
                logging.info("resuming from %s at step %d", config.checkpoint_dir, start)
        guard_nan.step = start
        if config.tensorboard_dir:
            from tfpar.callbacks import TensorBoard
            self.board = TensorBoard(tensorboard_dir(config, runtime), update_freq="epoch")
            callbacks.append(self.board)
        fault = faults.injector(start)
        if fault is not None:
            callbacks.append(fault)
        from tfpar import compression
        aggregator = compression.aggregator_of(model.optimizer)
        if isinstance(aggregator, compression.AutoAggregator):
            callbacks.append(compression.LossGuard(aggregator))  # sends more when loss drifts
        self._memory_start = memory.reset_peaks()  # the peak of training, not of building
        fit_segments(config, runtime, model, task, callbacks, start)
        if checkpointer is not None:
            guard.restore_handler()
            checkpointer.save()
            checkpointer.wait()  # the process ends only with its last save published
        out = {"resumed_from_step": start}
        if guard_nan.skipped:
            out["skipped_steps"] = guard_nan.skipped
        if checkpointer is not None and checkpointer.elastic:
            out["elastic"] = checkpointer.elastic  # the world-size changes
        if guard is not None and guard.preempted:
            out["preempted"] = True
        return out

    def stats(self, config, runtime, model, task, recorder):
        comm = metrics.comm_stats(model, runtime.replicas)
        from tfpar import compression
        decisions = getattr(compression.aggregator_of(model.optimizer), "decisions", None)
        if comm is not None and decisions is not None:
            comm["auto"] = decisions()  # --compression=auto: the link and ranks it chose
        if config.measure_comm and comm is not None and not model.stop_training:
            # Compute-only vs full steps on a scratch copy of the aggregator (the run's
            # state is untouched); every worker takes part. (Not for pipelines: refused by
            # tfpar.compat.)
            from tfpar.compression.timing import measure_comm_fraction
            comm["comm_time_fraction"], timing = measure_comm_fraction(
                runtime.strategy, model,
                data.distributed_dataset(runtime.strategy, config, task))
            # Beyond the original keys: the overlap, and both shares before clamping to
            # [0, 1] (timing noise can push a small share below 0).
            for key in ("overlap_fraction", "comm_fraction_unclamped",
                        "overlap_fraction_unclamped", "hidden_fraction", "comm_busy_ms",
                        "backward_end_ms"):
                if key in timing:
                    comm[key] = timing[key]
            if self.board is not None:
                from tfpar.callbacks import comm_share_scalars
                self.board.write_scalars(comm_share_scalars(comm["comm_time_fraction"],
                                                            timing))
        local_replicas = runtime.replicas // (runtime.workers if runtime.kind == "multi_worker"
                                              else 1)
        if hasattr(model, "pipeline_metrics"):
            params = model.params_per_stage() * local_replicas
            pipeline_block = model.pipeline_metrics()
        else:
            params, pipeline_block = [model.count_params()] * local_replicas, None
        if self.board is not None and pipeline_block and "bubble_measured" in pipeline_block:
            # The profiled step's bubble (`tfpar.pipeline.probe`) beside the schedule's.
            self.board.write_scalars(
                {"pipeline_bubble_measured": pipeline_block["bubble_measured"]})
        result = metrics.summarize(config, runtime, recorder, params, comm=comm,
                                   pipeline=pipeline_block)
        result["memory"].update(memory.memory_block(model, getattr(self, "_memory_start", None)))
        from tfpar import offload
        offloaded = offload.stats(model.optimizer)
        if offloaded is not None:
            result["offload"] = offloaded
        return result


def fit_segments(config, runtime, model, task, callbacks, start):
    """`model.fit` from step `start` to `config.steps` in whole-epoch segments (Keras 3 and
    tf_keras alike), with the held-out data at every epoch end if
    `config.validation_steps`; stops early if a callback set `model.stop_training`."""
    validation = {}
    if config.validation_steps:
        validation = {"validation_data": data.distributed_validation(runtime.strategy,
                                                                     config, task),
                      "validation_steps": config.validation_steps}
    verbose = config.verbose if runtime.is_chief else 0
    segments = checkpoint.fit_segments(start, config.steps, config.steps_per_epoch)
    if validation:
        # One `fit` per epoch: Keras keeps its evaluation iterator between the epochs of one
        # `fit`, and a distributed iterator may have read ahead of the last evaluation, so a
        # later epoch could start the held-out data at another batch. A new `fit` starts a
        # new iterator: every evaluation sees the same held-out batches.
        segments = [(epoch, epoch + 1, steps, first + (epoch - initial) * steps)
                    for initial, epochs, steps, first in segments
                    for epoch in range(initial, epochs)]
    for initial, epochs, steps, first in segments:
        dataset = data.distributed_dataset(runtime.strategy, config, task, first)
        model.fit(dataset, initial_epoch=initial, epochs=epochs, steps_per_epoch=steps,
                  callbacks=callbacks, verbose=verbose, shuffle=False, **validation)
        if model.stop_training:
            break
