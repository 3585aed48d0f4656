"""The backends of the one trainer, `tfpar.train.train`.

`train` runs every config through the same four calls of a `Backend`:
`build_runtime` → `build_model` → `fit` → `stats`. Which backend runs a config, and which
settings each honours, is the table in `tfpar.compat` (checked when the `ParallelConfig` is
built, before TensorFlow starts):

- `distribute.DistributeBackend`: Keras 3 on a `tf.distribute` strategy (one device,
  mirrored, multi-worker); data parallelism, pipelines (`pipeline_stages > 1`), gradient
  aggregators, accumulation, mixed precision, checkpoints and preemption.
- `tf_keras.TfKerasBackend`: `keras=2`, the same strategies with `tf_keras` models, tfmot
  pruning and QAT; it rides on `DistributeBackend` and swaps the Keras pieces.
- `dtensor.DTensorBackend`: `tensor_parallel > 1`, Keras 3 on a DTensor mesh.

Modules below `tfpar.train` (these included) never import it.
"""

import os

from tfpar import compat


class Backend:
    """How `tfpar.train.train` runs a config on devices. One instance per `train` call.

    Subclasses implement:
        build_runtime(config, environ, runtime): the runtime to train on (`runtime`, if
            given, is an earlier call's, reused: one strategy per process); applies
            `config.cpu_devices` and seeds first.
        build_model(config, runtime, task): the compiled model, every variable built (so
            a checkpoint can restore before the first step).
        fit(config, runtime, model, task, recorder, callbacks): trains `config.steps`
            steps (resuming from a checkpoint if there is one) with `recorder` (a
            `tfpar.metrics.StepRecorder`) and the user's `callbacks` watching, evaluating
            on held-out data when `config.validation_steps`; returns the metrics keys
            the run adds (`resumed_from_step`, ...).
        stats(config, runtime, model, task, recorder): the metrics dict of
            `tfpar.metrics.summarize` for the finished run.
    """

    def build_runtime(self, config, environ=None, runtime=None):
        raise NotImplementedError

    def build_model(self, config, runtime, task):
        raise NotImplementedError

    def fit(self, config, runtime, model, task, recorder, callbacks):
        raise NotImplementedError

    def stats(self, config, runtime, model, task, recorder):
        raise NotImplementedError


def for_config(config):
    """The backend that runs `config` (see `tfpar.compat.backend_of`)."""
    kind = compat.backend_of(config)
    if kind == "dtensor":
        from tfpar.backends.dtensor import DTensorBackend
        return DTensorBackend()
    if kind == "tf_keras":
        from tfpar.backends.tf_keras import TfKerasBackend
        return TfKerasBackend()
    from tfpar.backends.distribute import DistributeBackend
    return DistributeBackend()


def tensorboard_dir(config, runtime):
    """Where this worker writes TensorBoard logs: the chief in `config.tensorboard_dir`,
    worker i in its `worker_i` subdirectory (two writers of one file would corrupt it)."""
    if runtime.is_chief:
        return config.tensorboard_dir
    return os.path.join(config.tensorboard_dir, f"worker_{runtime.worker_index}")
