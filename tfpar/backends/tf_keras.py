"""`keras=2`: `tf_keras` models on the `tf.distribute` strategies, tfmot pruning and QAT.

Rides on `DistributeBackend`: the same runtime, data, segments of `fit` and metrics, with
the tf_keras model, optimizer hook and callbacks of `tfpar.legacy`.

`tf_keras.Model.fit` runs under `MirroredStrategy` and `MultiWorkerMirroredStrategy` with
its own distribution code (Keras 3's multi-worker patch is not needed; tfpar's patch that
gives each worker several logical CPUs is TensorFlow's and applies).
"""

import tf_keras
from absl import logging

from tfpar import checkpoint, devices, memory, metrics, optimizers, preemption, strategy
from tfpar.backends import tensorboard_dir
from tfpar.backends.distribute import DistributeBackend, fit_segments
from tfpar.legacy import options, trainer


class TfKerasBackend(DistributeBackend):
    """`tf_keras` on `tfpar.strategy`'s strategies (see the module docstring)."""

    def build_runtime(self, config, environ=None, runtime=None):
        if runtime is None:
            devices.split_cpu(config.cpu_devices)
            runtime = strategy.make_runtime(config, environ)
        optimizers.set_policy(config.mixed_precision, tf_keras)
        tf_keras.utils.set_random_seed(config.seed)
        logging.info(devices.topology(runtime.strategy, runtime.workers))
        return runtime

    def build_model(self, config, runtime, task):
        return trainer.build_model(config, runtime, task)

    def fit(self, config, runtime, model, task, recorder, callbacks):
        """`callbacks` are tf_keras callbacks. Checkpoints are `tfpar.checkpoint`'s, the
        state under the same layout-independent names (`tfpar.state`); skipping non-finite
        steps is refused for `keras=2` (`tfpar.compat`); the model is exported at the end."""
        stop_on_nan = trainer.StopOnNaN()
        callbacks = [trainer.Recorder(recorder), stop_on_nan, *callbacks]
        start, checkpointer, guard = 0, None, None
        if config.checkpoint_dir:
            checkpointer = checkpoint.Checkpointer(config, model, runtime)
            start = checkpointer.restore()
            guard = preemption.PreemptionGuard(checkpointer, runtime.strategy,
                                               runtime.workers)
            # In this order: the guard saves the step the saver has counted.
            callbacks += [trainer.Saver(checkpointer), trainer.Preemption(guard)]
            if start:
                logging.info("resuming from %s at step %d", config.checkpoint_dir, start)
        stop_on_nan.step = start
        if options.option(config, "prune_sparsity"):
            from tfpar.legacy import pruning
            callbacks += pruning.pruning_callbacks()
        if config.tensorboard_dir:
            self.board = trainer.TensorBoard(tensorboard_dir(config, runtime),
                                             update_freq="epoch")
            callbacks.append(self.board)
        self._memory_start = memory.reset_peaks()
        fit_segments(config, runtime, model, task, callbacks, start)
        if checkpointer is not None:
            guard.restore_handler()
            checkpointer.save()
            checkpointer.wait()  # the process ends only with its last save published
        if guard is not None and guard.preempted:
            # Stopped early: no export or pruning/QAT report of an unfinished model.
            return {"keras": 2, "resumed_from_step": start, "preempted": True}
        return {"keras": 2, "resumed_from_step": start,
                **trainer.finish(config, runtime, task, model)}

    def stats(self, config, runtime, model, task, recorder):
        # tf_keras wraps the optimizer in a LossScaleOptimizer at compile under mixed_float16.
        comm = metrics.comm_stats(model, runtime.replicas)
        local_replicas = runtime.replicas // runtime.workers
        result = metrics.summarize(config, runtime, recorder,
                                   [model.count_params()] * local_replicas, comm=comm)
        result["memory"].update(memory.memory_block(model, getattr(self, "_memory_start",
                                                                   None)))
        return result
