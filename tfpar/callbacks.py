"""Keras callbacks for a user's own `model.fit`: `BackupAndRestore` (exact resume, also
mid-epoch, of the whole state tfpar knows), `TensorBoard` (Keras's, plus tfpar's
per-step scalars) and `NaNGuard` (what `tfpar.DistributedOptimizer(on_nan=...)` asks for at
a non-finite step: stop with the step named, or log it).
"""

import dataclasses
import glob
import os
import shutil
import time

import keras
import tensorflow as tf

from tfpar import metrics, nan_guard, patches
from tfpar.checkpoint import Checkpointer, newest_intact
from tfpar.compression import aggregator_of, timing
from tfpar.errors import ConfigError, TfparError
from tfpar.preemption import PreemptionGuard


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What `Checkpointer` reads of a config, for a model tfpar did not build: the
    directory, the save period, and the facts the saved variables depend on (recorded in
    the directory's marker; a directory from a different model or optimizer is refused)."""

    checkpoint_dir: str
    checkpoint_every: int
    keep_checkpoints: int
    model: str
    optimizer: str
    compression: str
    mixed_precision: str
    model_width: int = None
    model_depth: int = None
    dataset: str = "user"
    num_classes: int = None
    grad_accum_steps: int = None
    powersgd_rank: int = None
    error_feedback: bool = None
    global_batch_size: int = None
    seed: int = None
    checkpoint_async: bool = True


@dataclasses.dataclass(frozen=True)
class _Place:
    """The `Runtime` facts `Checkpointer` reads, taken from any strategy."""

    is_chief: bool
    worker_index: int


def _place(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    task = getattr(resolver, "task_id", None) or 0
    return _Place(is_chief=bool(strategy.extended.should_checkpoint), worker_index=int(task))


def _workers(strategy):
    runtime = getattr(strategy, "tfpar_runtime", None)
    return runtime.workers if runtime is not None else patches.strategy_workers(strategy)


def _base_optimizer(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


class BackupAndRestore(keras.callbacks.Callback):
    """Drop-in for `keras.callbacks.BackupAndRestore` that resumes `model.fit` at the exact
    step, also mid-epoch, with the whole training state.

    Saved every `save_freq` steps (and when training stops early): the model's weights,
    the optimizer's slots and step counter, a `tfpar.DistributedOptimizer`'s aggregator
    state (error-feedback residuals of every replica, PowerSGD's Q), and the step. A rerun
    of the same script with this callback restores all of it on `fit`'s start and trains
    only the steps that remain. A SIGTERM (a scheduler's preemption) saves at the next
    step and stops training on every worker alike. Files are written by
    `tf.train.CheckpointManager`'s format beside training (the step waits only for the
    copy to host memory; `fit` returns once the last save is published); a run killed
    mid-save keeps the previous checkpoint, and a damaged newest one is skipped with one
    line (`tfpar.checkpoint`). A `backup_dir` holding files tfpar did not write is refused, never
    overwritten. Multi-worker: the chief writes, every worker restores from `backup_dir`
    (shared, as on one machine).

    For the resume to be exact, fit's first step after resuming must see the batch the
    interrupted run would have seen at that step. Keras runs the skipped steps of the
    resumed epoch without training and without reading data, so:

    * give `fit` an endless dataset and `steps_per_epoch`, and build the dataset to start
      at `backup.initial_step` (the step `fit` will resume at; 0 on a fresh start), e.g.
      `make_dataset().skip(backup.initial_step)` for a dataset whose order is fixed (no
      unseeded shuffle), or `tf.data.Dataset.range(backup.initial_step, total).map(batch_of_step)`;
    * with a finite dataset that `fit` re-reads every epoch (arrays, or no
      `steps_per_epoch`), resume is exact at epoch ends only, as with Keras's callback
      (use `save_freq="epoch"`).

    Callbacks see the skipped batches of the resumed epoch with empty logs, and the epoch's
    mean loss covers the steps actually trained. Randomness inside the model (dropout)
    repeats only if it is seeded per step.

    Args:
        backup_dir: where the checkpoints go (created if missing).
        save_freq: `"epoch"` or a number of steps between saves.
        keep: how many checkpoints to keep.
        delete_checkpoint: delete tfpar's files in `backup_dir` when `fit` completes all its
            epochs (as Keras does), so the next `fit` starts afresh.

    Raises:
        ConfigError: a bad argument, a `backup_dir` holding other files, or a checkpoint
            that does not match the model and optimizer.

    Examples:
        >>> import numpy as np, keras, tensorflow as tf, tfpar, tempfile
        >>> backup = tfpar.callbacks.BackupAndRestore(tempfile.mkdtemp() + "/bk", save_freq=5)
        >>> def data(start):                       # batch k depends on k only
        ...     return tf.data.Dataset.range(start, 10**6).map(
        ...         lambda k: (tf.fill((8, 2), tf.cast(k % 7, "float32")), tf.ones((8, 1))))
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> class Crash(keras.callbacks.Callback):
        ...     def on_train_batch_end(self, batch, logs=None):
        ...         if int(self.model.optimizer.iterations) == 17: raise KeyboardInterrupt
        >>> try:
        ...     model.fit(data(backup.initial_step), epochs=3, steps_per_epoch=10, verbose=0,
        ...               callbacks=[backup, Crash()])
        ... except KeyboardInterrupt:
        ...     pass
        >>> backup.initial_step                   # the last save before the crash
        15
        >>> _ = model.fit(data(backup.initial_step), epochs=3, steps_per_epoch=10, verbose=0,
        ...               callbacks=[backup])
        >>> int(model.optimizer.iterations)
        30
    """

    def __init__(self, backup_dir, save_freq="epoch", keep=2, delete_checkpoint=True):
        super().__init__()
        if not backup_dir:
            raise ConfigError("backup_dir", backup_dir, "give a directory path")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ConfigError("save_freq", save_freq, "use 'epoch' or an integer >= 1")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError("keep", keep, "must be an integer >= 1")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq, self.keep, self.delete_checkpoint = save_freq, keep, delete_checkpoint
        self._checkpointer = self._guard = None
        self._skip = 0
        self._skipping = False

    @property
    def initial_step(self):
        """The step the next `fit` with this callback resumes at (0 without a checkpoint)."""
        if self._checkpointer is not None:  # a fit that raised may have left a write
            self._checkpointer.wait()
        latest = newest_intact(self.backup_dir) if os.path.isdir(self.backup_dir) else None
        return int(latest.rsplit("-", 1)[1]) if latest else 0

    def on_train_begin(self, logs=None):
        model, strategy = self.model, self.model.distribute_strategy
        steps = self.params.get("steps")
        if not steps:
            raise TfparError(
                "tfpar.callbacks.BackupAndRestore needs the number of steps per epoch: pass "
                "steps_per_epoch= to fit (the dataset's length is unknown)")
        optimizer = model.optimizer
        if not optimizer.built:
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        aggregator = aggregator_of(optimizer)
        every = self.save_freq if self.save_freq != "epoch" else 2 ** 62
        if self._checkpointer is not None:  # a fit that raised may have left a write
            self._checkpointer.wait()
        settings = _Settings(
            checkpoint_dir=self.backup_dir, checkpoint_every=every, keep_checkpoints=self.keep,
            model=model.name, optimizer=type(_base_optimizer(optimizer)).__name__,
            compression=type(aggregator).__name__ if aggregator is not None else "none",
            mixed_precision=model.dtype_policy.name)
        self._checkpointer = Checkpointer(settings, model, _place(strategy))
        step = self._checkpointer.restore()
        self._steps_per_epoch = steps
        # Keras reads its initial epoch on every fit and never clears it: clear it when
        # there is nothing to resume, or a later fit would skip epochs.
        patches.set_initial_epoch(model, step // steps if step else None)
        self._skip = step % steps
        if self._skip:
            self._skip_in_train_function()
        if self._guard is not None:  # a fit that ended by an exception left its handler
            self._guard.restore_handler()
        self._guard = PreemptionGuard(self._checkpointer, strategy, _workers(strategy))
        self._guard.set_model(model)

    def _skip_in_train_function(self):
        """Makes the first `self._skip` steps of the resumed epoch no-ops: Keras's loop
        always starts an epoch at batch 0; fit calls `model.train_function` once a step."""
        model = self.model
        original = model.train_function

        def train_function(iterator):
            if self._skip > 0:
                self._skip -= 1
                self._skipping = True
                return {}
            model.train_function = original
            return original(iterator)

        model.train_function = train_function

    def on_train_batch_end(self, batch, logs=None):
        if self._skipping:
            self._skipping = False
            return
        self._checkpointer.on_train_batch_end(batch, logs)
        self._guard.on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._checkpointer.save()

    def on_train_end(self, logs=None):
        self._guard.restore_handler()
        self._checkpointer.wait()
        done = self._checkpointer._step >= self.params.get("epochs", 0) * self._steps_per_epoch
        if done and self.delete_checkpoint and not self._guard.preempted:
            if self._checkpointer._is_chief:
                _delete_own_files(self.backup_dir)
        else:
            self._checkpointer.save()
            self._checkpointer.wait()  # fit returns with its last save published


def _delete_own_files(directory):
    """Deletes what tfpar wrote in `directory` (and the directory, if that empties it)."""
    for path in glob.glob(os.path.join(directory, "ckpt-*")) + [
            os.path.join(directory, name) for name in ("checkpoint", "tfpar.json")]:
        if os.path.isfile(path):
            os.remove(path)
    for path in glob.glob(os.path.join(directory, ".worker_*")):
        shutil.rmtree(path, ignore_errors=True)
    if not os.listdir(directory):
        os.rmdir(directory)


class TensorBoardScalars:
    """tfpar's per-step `tfpar/` scalars, mixed into a Keras generation's `TensorBoard`:
    `TensorBoard` below (Keras 3) and `tfpar.legacy.trainer.TensorBoard` (tf_keras, the
    trainer's `keras=2`). What it reads of the model (its optimizer, aggregator and
    pipeline) is the same under both; only the base class differs."""

    def _init_scalars(self, measure_comm):
        self.measure_comm = measure_comm
        self._began = None
        self._skipped = 0
        self._last_scale = None
        self._closed = False

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._closed = False
        scale = _loss_scale(self._optimizer())
        if scale is not None:
            self._last_scale = scale

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        self._began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if not logs:  # a step BackupAndRestore skipped on resume
            return
        scalars = {"step_time_ms": 1000 * (time.perf_counter() - self._began)}
        scalars.update(self._step_scalars())
        self.write_scalars(scalars)

    def write_scalars(self, scalars, step=None):
        """Writes `{name: value}` as `tfpar/NAME` scalars of the `train` run at `step`
        (default: the optimizer's step count), also after `fit` has ended (e.g. a share
        measured after training)."""
        step = self._optimizer_step() if step is None else step
        # After fit, whose end closed the writer: a new event file in the same directory.
        writer = tf.summary.create_file_writer(self._train_dir) if self._closed else (
            self._train_writer)
        with writer.as_default():
            for name, value in scalars.items():
                tf.summary.scalar(f"tfpar/{name}", value, step=step)
        if self._closed:
            writer.close()
        else:
            writer.flush()

    def _optimizer(self):
        """The optimizer whose step count and loss scale the scalars follow."""
        return self.model.optimizer

    def _optimizer_step(self):
        return int(self._optimizer().iterations.numpy())

    def _comm(self):
        """The metrics JSON's `comm` block for this step, or None (`metrics.comm_stats`)."""
        model = self.model
        return metrics.comm_stats(model, model.distribute_strategy.num_replicas_in_sync)

    def _bubble(self):
        model = self.model
        if hasattr(model, "pipeline_metrics"):
            return model.pipeline_metrics()["bubble_theory"]
        return None

    def _step_scalars(self):
        out = {}
        comm = self._comm()
        if comm:
            out["bytes_on_wire"] = comm["bytes_on_wire_per_step"]
            out["compression_ratio"] = comm["compression_ratio"]
        optimizer = self._optimizer()
        scale = _loss_scale(optimizer)
        if scale is not None:
            if self._last_scale is not None and scale < self._last_scale:
                self._skipped += 1  # the optimizer halves the scale on a skipped step
            self._last_scale = scale
            out["loss_scale"] = scale
        counted = getattr(_base_optimizer(optimizer), "nonfinite_steps", None)
        out["skipped_steps"] = self._skipped + (float(counted.numpy()) if counted is not None
                                                else 0.0)
        bubble = self._bubble()
        if bubble is not None:
            out["pipeline_bubble"] = bubble
        return out

    def on_train_end(self, logs=None):
        if self.measure_comm is not None:
            strategy = self.model.distribute_strategy
            fraction, parts = timing.measure_comm_fraction(
                strategy, self.model, strategy.experimental_distribute_dataset(self.measure_comm))
            self.write_scalars(comm_share_scalars(fraction, parts))
        super().on_train_end(logs)
        self._closed = True


def comm_share_scalars(fraction, parts):
    """`tfpar.compression.timing.measure_comm_fraction`'s result as TensorBoard scalars:
    `comm_time_fraction` and the step's parts it came from."""
    out = {"comm_time_fraction": fraction}
    for name in ("step_ms", "compute_ms", "aggregate_ms"):
        if name in parts:
            out[f"comm_{name}"] = parts[name]
    return out


def _loss_scale(optimizer):
    """The dynamic loss scale of a Keras 3 or tf_keras `LossScaleOptimizer`, else None."""
    if optimizer is None or not hasattr(optimizer, "inner_optimizer"):
        return None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return float(optimizer.dynamic_scale.numpy()) if optimizer.built else None
    scale = getattr(optimizer, "loss_scale", None)  # tf_keras's
    return float(scale.numpy()) if scale is not None else None


class TensorBoard(TensorBoardScalars, keras.callbacks.TensorBoard):
    """Keras's `TensorBoard` callback, plus tfpar's per-step scalars in the `train` run.

    Every training step writes, at the optimizer's step number:
    `tfpar/step_time_ms` (wall time of the step as the callbacks see it),
    `tfpar/bytes_on_wire` and `tfpar/compression_ratio` (what the gradient aggregator
    handed to the collectives this step, or Keras's plain fp32 all-reduce; only with
    several replicas or a `tfpar.DistributedOptimizer`), `tfpar/skipped_steps` (updates
    skipped so far: fp16 overflows, non-finite gradients), `tfpar/loss_scale` (with a
    `keras.optimizers.LossScaleOptimizer`), and `tfpar/pipeline_bubble` (a
    `tfpar.PipelineModel`'s schedule bubble). With `measure_comm=dataset`, at the end of
    training `tfpar/comm_time_fraction` (the share of a step spent aggregating gradients,
    timed on a batch of `dataset`; see `tfpar.compression.timing`). `write_scalars` adds
    `tfpar/` scalars after `fit` (the trainer's `--tensorboard_dir` writes its measured
    communication share and pipeline bubble so).

    Args:
        log_dir: as Keras's.
        measure_comm: None, or a `tf.data.Dataset` of `(x, y)` batches to time the
            communication share on.
        **kwargs: Keras's `TensorBoard` arguments.

    Examples:
        >>> import numpy as np, keras, tfpar, tempfile
        >>> logs = tempfile.mkdtemp()
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> _ = model.fit(np.ones((16, 2)), np.ones((16, 1)), batch_size=4, verbose=0,
        ...               callbacks=[tfpar.callbacks.TensorBoard(logs)])
        >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        >>> events = EventAccumulator(logs + "/train"); _ = events.Reload()
        >>> sorted(t for t in events.Tags()["tensors"] if t.startswith("tfpar/"))
        ['tfpar/skipped_steps', 'tfpar/step_time_ms']
    """

    def __init__(self, log_dir="logs", measure_comm=None, **kwargs):
        super().__init__(log_dir=log_dir, **kwargs)
        self._init_scalars(measure_comm)


class NaNGuard(nan_guard.NaNGuard):
    """Ends `model.fit` with one line naming the step (`TfparError`) when a step's loss or
    summed gradients are not finite, or logs the step and trains on: as the optimizer's
    `on_nan` says (`tfpar.DistributedOptimizer(opt, on_nan="stop" | "skip_step")`; "stop"
    for any other optimizer). The optimizer has already left that step's update out.

    Examples:
        >>> model.fit(x, y, callbacks=[tfpar.callbacks.NaNGuard()])      # doctest: +SKIP
    """

    def __init__(self):
        super().__init__(hint="lower the learning rate, check the data, or pass "
                              "on_nan='skip_step' to tfpar.DistributedOptimizer")
