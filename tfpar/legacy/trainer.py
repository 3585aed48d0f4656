"""The tf_keras pieces of a `keras=2` run (`tfpar.backends.tf_keras` drives them).

The same run as any other of `tfpar.train.train` — strategy from `tfpar.strategy`, data
from `tfpar.data`, the aggregator from `tfpar.compression`, the metrics JSON from
`tfpar.metrics` — with a `tf_keras` model from `tfpar.models.legacy`, optionally pruned
(`prune_sparsity`) or quantization-aware (`qat`) with tfmot, and the final model exported
(`finish`).

`tf_keras.Model.fit` runs under `MirroredStrategy` and `MultiWorkerMirroredStrategy` with
its own distribution code (Keras 3's multi-worker patch is not needed; tfpar's patch that
gives each worker several logical CPUs is TensorFlow's and applies). One repair: under
`MultiWorkerMirroredStrategy`, tf_keras's default `distribute_reduction_method="auto"`
sums the per-batch logs over workers (a loss of 2.25 is logged as 4.50 by 2 workers); the
logged metrics are already synchronised over all replicas, so "first" is what is wanted.
"""

import math
import os

import tf_keras

from tfpar import callbacks, data, metrics
from tfpar.errors import TfparError
from tfpar.legacy import options, optimizer as optimizer_lib


class Recorder(tf_keras.callbacks.Callback):
    """Feeds `tf_keras` callback events to a `tfpar.metrics.StepRecorder` (a Keras 3
    callback, which tf_keras's callback list would not accept)."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def on_epoch_begin(self, epoch, logs=None):
        self.recorder.on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.recorder.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.recorder.on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.recorder.on_epoch_end(epoch, logs)


class Saver(tf_keras.callbacks.Callback):
    """Feeds `tf_keras` step ends to a `tfpar.checkpoint.Checkpointer` (a Keras 3 callback,
    which tf_keras's callback list would not accept): a save every `checkpoint_every`
    steps."""

    def __init__(self, checkpointer):
        super().__init__()
        self.checkpointer = checkpointer

    def on_train_batch_end(self, batch, logs=None):
        self.checkpointer.on_train_batch_end(batch, logs)


class Preemption(tf_keras.callbacks.Callback):
    """Feeds `tf_keras` step ends to a `tfpar.preemption.PreemptionGuard` (a Keras 3
    callback): after SIGTERM the workers agree on a step, save and stop, as a Keras 3 run
    does. The guard stops the tf_keras model it is given (`stop_training`)."""

    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def set_model(self, model):
        super().set_model(model)
        self.guard.set_model(model)

    def on_train_batch_end(self, batch, logs=None):
        self.guard.on_train_batch_end(batch, logs)


class StopOnNaN(tf_keras.callbacks.Callback):
    """`on_nan=stop` for tf_keras: a non-finite loss ends the run, naming the step."""

    def __init__(self):
        super().__init__()
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        loss = float((logs or {}).get("loss", 0.0))
        if not math.isfinite(loss):
            raise TfparError(f"loss became {loss} at step {self.step} (on_nan=stop); lower "
                             "--learning_rate or check the data")
        self.step += 1


class TensorBoard(callbacks.TensorBoardScalars, tf_keras.callbacks.TensorBoard):
    """`tfpar.callbacks.TensorBoard` for tf_keras: tf_keras's callback (its callback list
    takes no Keras 3 callback) with the same per-step `tfpar/` scalars. tf_keras's own
    callback asks for batch calls only while profiling; its `fit` then calls every
    callback's batch hooks because another in the list asks for them (`Recorder`, which
    the trainer always adds)."""

    def __init__(self, log_dir="logs", measure_comm=None, **kwargs):
        super().__init__(log_dir=log_dir, **kwargs)
        self._init_scalars(measure_comm)


def build_model(config, runtime, task):
    """The compiled `tf_keras` model for `config` (pruning or QAT wrappers applied), built
    under the strategy scope with its optimizer built."""
    from tfpar.models import legacy as legacy_models
    from tfpar.legacy import pruning, quantization
    with runtime.strategy.scope():
        model = legacy_models.build(config.model, task.input_shape, task.num_classes,
                                    width=config.model_width, depth=config.model_depth,
                                    seed=config.seed)
        if options.option(config, "prune_sparsity"):
            model = pruning.prune(model, config)
        elif options.option(config, "qat"):
            model = quantization.quantize(model)
        model.compile(
            optimizer=optimizer_lib.make_optimizer(config),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[tf_keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
        model.optimizer.build(model.trainable_variables)
        # The metrics JSON's per-step loss; tf_keras's Mean sums the replicas' state.
        metrics.report_step_loss(model, tf_keras.metrics.Mean)
    model.distribute_reduction_method = "first"  # see the module docstring
    return model


def finish(config, runtime, task, model):
    """Sparsity / QAT checks and the export; returns the extra metrics blocks."""
    from tfpar.legacy import pruning, quantization
    out = {}
    export_dir = options.option(config, "export_dir")
    final = model
    if options.option(config, "prune_sparsity"):
        final = pruning.strip(model, runtime.strategy)
        out["pruning"] = {"target_sparsity": options.option(config, "prune_sparsity"),
                          "end_step": options.prune_end_step(config),
                          **pruning.sparsity_report(model)}
    if options.option(config, "qat") and runtime.is_chief:
        from tfpar.models import legacy as legacy_models
        # A fresh float model outside the strategy scope: running it is local (a model of
        # the strategy would run collectives that only the chief joins).
        float_model = quantization.copy_to_float(model, legacy_models.build(
            config.model, task.input_shape, task.num_classes, width=config.model_width,
            depth=config.model_depth, seed=config.seed))
        flatbuffer = quantization.to_tflite(model)
        held_out = data.global_batches(config, task, config.steps, 1)[0][0]
        out["qat"] = quantization.compare(float_model, flatbuffer, held_out)
        if export_dir:
            _write_atomically(os.path.join(export_dir, "model_int8.tflite"),
                              lambda path: _write_bytes(path, flatbuffer))
            _write_atomically(os.path.join(export_dir, "model_float.keras"), float_model.save)
    if export_dir and runtime.is_chief and not options.option(config, "qat"):
        _write_atomically(os.path.join(export_dir, "model.keras"), final.save)
    if export_dir:
        out["export_dir"] = export_dir
    return out


def _write_atomically(path, write):
    """`write(tmp)` then renames tmp to `path`: a reader (or a run that fails mid-write) sees
    the old file or the whole new one, never a partial file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    base, ext = os.path.splitext(path)
    tmp = f"{base}.tmp-{os.getpid()}{ext}"  # Keras wants the .keras extension
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_bytes(path, payload):
    with open(path, "wb") as f:
        f.write(payload)
