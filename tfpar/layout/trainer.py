"""`MeshTrainer`: `fit` / `evaluate` / `predict` for a model whose variables live on a mesh.

Keras's own `fit` cannot drive a DTensor model on TensorFlow (measured: the iterator op
inside the compiled step has no layout, `tf._element_layouts`), and `run_eagerly` cannot
work at all (an eager tape meets regular tensors where DTensors are expected). So batches
are put on the mesh on the host, split on the `batch` axis, and the compiled steps of
`tfpar.layout.step` run on them. Keras callbacks receive the same calls and logs as under
`model.fit` (running means over the epoch).

Examples:
    >>> mesh = make_mesh(2, 2)
    >>> model, trainer = build_on_mesh(mesh, preset_rules(["megatron_mlp"]),
    ...     lambda: models.mlp((32,), 10), lambda: keras.optimizers.Adam(1e-3),
    ...     keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> trainer.fit(batches, epochs=1)
"""

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfpar import patches
from tfpar.errors import ConfigError, TfparError
from tfpar.metrics import STEP_LOSS
from tfpar.layout import (activations, keras_step, presets, reduction, step, values,
                          variables)
from tfpar.layout.mesh import BATCH, batch_parts
from tfpar.layout.optimizer import stateless_optimizer


def build_on_mesh(mesh, rules, build_model, build_optimizer, loss,
                  shard_optimizer_state=False, grad_accum_steps=1, compression=None,
                  error_feedback=True, codec_options=None):
    """Builds a model and its optimizer as DVariables on `mesh` and a trainer for them.

    Args:
        mesh: a `keras.distribution.DeviceMesh` from `make_mesh`.
        rules: `(regex, axes)` layout rules (see `tfpar.layout.presets`); rules about
            layer outputs or inputs (`…/output`, `…/input`, e.g. the `sequence_parallel`
            preset) lay out activations (`tfpar.layout.activations`).
        build_model: a function returning the built, uncompiled Keras model; called
            inside the variable scope so every weight is created on the mesh.
        build_optimizer: a function returning a new Keras optimizer; called inside the
            scope, since an optimizer creates `iterations` and its learning rate when
            constructed.
        loss: a `keras.losses.Loss`.
        shard_optimizer_state: also split optimizer slots over the `batch` axis (ZeRO
            stage 1, see `variables.optimizer_state_over_batch`).
        grad_accum_steps: micro-batches per step (see `MeshTrainer`).
        compression: None (DTensor's own fp32 sum over `batch`), or a codec of
            `tfpar.layout.reduction.CODECS` for the data-parallel gradient reduction
            (`none` forms each replica's gradient and averages in fp32); for a model
            whose weights are split over `batch` (ZeRO-3) one of
            `tfpar.zero.reduce_scatter.CODECS`, reduce-scattered onto the pieces. With one
            replica on `batch` there is nothing to reduce and the exact step runs.
        error_feedback: with a lossy `compression`, carry what it dropped to the next step.
        codec_options: the codec's parameters (`reduction.codec_options(config)`), or None
            for `BatchAxisReduction`'s defaults.

    Returns:
        `(model, MeshTrainer)`; the model is compiled with `optimizer` and `loss` so that
        `model.optimizer` is set (checkpoints, callbacks).
    """
    distribution = keras.distribution.ModelParallel(
        layout_map=presets.layout_map(mesh, rules), batch_dim_name=BATCH)
    with variables.variable_scope(distribution):
        model = build_model()
        optimizer = stateless_optimizer(build_optimizer())
        with variables.optimizer_state_over_batch(shard_optimizer_state):
            optimizer.build(model.trainable_variables)
        model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    laid_out = activations.apply(model, mesh, rules)
    if laid_out:
        logging.info("activation layouts on %d layers (%s)", len(laid_out),
                     ", ".join(list(laid_out)[:3]) + (" …" if len(laid_out) > 3 else ""))
    _refuse_keras_loops(model)
    reducer = None
    if compression is not None:
        reducer = reduction.for_variables(mesh, model.trainable_variables, compression,
                                          error_feedback, codec_options, optimizer)
    # Where `tfpar.state` finds the codec's state (not an attribute Keras tracks).
    object.__setattr__(model, "tfpar_reductions", (reducer,) if reducer else ())
    return model, MeshTrainer(mesh, model, optimizer, loss, grad_accum_steps,
                              reduction=reducer)


def _refuse_keras_loops(model):
    """Keras's own loops fail on a mesh deep inside TensorFlow (`tf._element_layouts`);
    say what to use instead."""
    for name in ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                 "predict_on_batch"):
        def refuse(*args, _name=name, **kwargs):
            raise TfparError(
                f"model.{_name} cannot run a model whose variables live on a DTensor mesh "
                "(Keras's TensorFlow loops have no layouts for their input pipeline); use "
                f"the MeshTrainer's {_name} instead")
        object.__setattr__(model, name, refuse)


class MeshTrainer:
    """Trains, evaluates and predicts with a model whose variables are DVariables.

    Args:
        mesh: the `keras.distribution.DeviceMesh` the variables live on.
        model: a built Keras model created inside `variable_scope`.
        optimizer: its optimizer, passed through `stateless_optimizer` and built.
        loss: a `keras.losses.Loss` called as `loss(y, logits, sample_weight)`; or None:
            the model's own compiled loss, metrics and steps (`keras_step.KerasSteps`:
            any input and output structure, `train_step`, `test_step`, `predict_step`;
            logs are the model's metrics; `grad_accum_steps` and `reduction` unused: a
            `tfpar.DistributedOptimizer`'s codec makes the Keras steps' own reduction).
        grad_accum_steps: k > 1 cuts every training batch into k micro-batches that run
            one after the other in the step, their mean gradient applied in one update:
            the same update as one step on the whole batch, with the activations of one
            micro-batch at a time (the batch must divide by k × data_parallel).
        reduction: a `tfpar.layout.reduction.BatchAxisReduction` (or ZeRO-3's
            `ShardedReduction`) that averages each replica's own gradient over the `batch`
            axis (compression), or None.
        accuracy: the name under which logs report the (sample-weighted) accuracy of the
            argmax of the logits against integer labels; None leaves it out.

    Raises:
        TfparError: a variable of the model or the optimizer is not a DVariable, or
            functions are set to run eagerly (DTensor cannot differentiate eagerly).
    """

    keras_steps = None  # the model's own Keras steps, when `loss` is None

    def __init__(self, mesh, model, optimizer, loss, grad_accum_steps=1,
                 accuracy="accuracy", reduction=None):
        if tf.config.functions_run_eagerly() or getattr(model, "run_eagerly", False):
            raise TfparError(
                "run_eagerly cannot work on a DTensor mesh: an eager GradientTape meets "
                "regular tensors where DTensors are expected. Turn it off "
                "(tf.config.run_functions_eagerly(False), model.run_eagerly=False)")
        variables.check_dvariables(list(model.variables) + list(optimizer.variables),
                                   "MeshTrainer")
        if int(grad_accum_steps) < 1:
            raise ConfigError("grad_accum_steps", grad_accum_steps, "must be an integer >= 1")
        self.mesh, self.model, self.optimizer, self.loss = mesh, model, optimizer, loss
        self.grad_accum_steps, self.accuracy = int(grad_accum_steps), accuracy
        self.reduction = reduction
        self.keras_steps = None
        if loss is None:
            self.keras_steps = keras_step.KerasSteps(mesh, model, optimizer)
            self._train, self._eval = self.keras_steps.train, self.keras_steps.test
            self._predict = self.keras_steps.predict
            return
        self._train = step.train_step(mesh, model, optimizer, loss, self.grad_accum_steps,
                                      reduction, accuracy=bool(accuracy))
        self._eval = step.eval_step(mesh, model, loss, accuracy=bool(accuracy))
        self._predict = step.predict_step(mesh, model)

    def _on_mesh(self, batch, training=False):
        batch = tuple(b for b in batch if b is not None)
        if self.keras_steps is not None:  # (x,), (x, y) or (x, y, w), each any structure
            if training and self.keras_steps.reduction is not None:
                return values.replica_batches_to_mesh(batch, self.mesh)
            return values.batch_to_mesh(batch, self.mesh)
        if len(batch) not in (2, 3):
            raise TfparError(f"a batch must be (x, y) or (x, y, sample_weight), got "
                             f"{len(batch)} arrays")
        if any(isinstance(b, (dict, list, tuple)) for b in batch):
            raise TfparError("with a loss given, a batch holds one array each for x, y and "
                             "sample_weight; for several inputs or outputs pass loss=None "
                             "(the model's own compiled loss, as keras.distribution runs it)")
        if training and self.reduction is not None and self.grad_accum_steps > 1:
            return values.micro_replica_batches_to_mesh(batch, self.mesh,
                                                        self.grad_accum_steps)
        if training and self.reduction is not None:
            return values.replica_batches_to_mesh(batch, self.mesh)
        if training and self.grad_accum_steps > 1:
            return values.micro_batches_to_mesh(batch, self.mesh, self.grad_accum_steps)
        return values.batch_to_mesh(batch, self.mesh)

    def _step(self, batch):
        out = self._train(*self._on_mesh(batch, training=True))
        return keras_step.logs_to_host(out) if self.keras_steps else _host(out)

    def _sums(self):
        """The epoch's running logs: the model's metrics (reset here) in Keras mode."""
        if self.keras_steps is None:
            return _Sums(self.accuracy)
        keras_step.reset_metrics(self.model)
        return _Latest()

    def train_on_batch(self, x, y, sample_weight=None):
        """One exact optimizer step; returns `{"loss", "accuracy"}` of the batch (in Keras
        mode the model's metrics, running since they were last reset, as Keras's
        `train_on_batch` reports them)."""
        if self.keras_steps is not None:
            return self._step((x, y, sample_weight))
        return _logs(self._step((x, y, sample_weight)), self.accuracy)

    def fit(self, batches, epochs=1, steps_per_epoch=None, initial_epoch=0,
            callbacks=None, verbose=0, validation_data=None, validation_steps=None,
            validation_freq=1):
        """Trains on `batches` like `keras.Model.fit`.

        Args:
            batches: an iterable (e.g. a `tf.data.Dataset` or list) of global batches
                `(x, y)` or `(x, y, sample_weight)`, numpy arrays or tensors.
            epochs, initial_epoch: epochs `initial_epoch … epochs-1` are run.
            steps_per_epoch: batches per epoch; default: one pass over `batches`.
            callbacks: Keras callbacks (they get `on_train_batch_end` logs with the
                epoch's running mean loss and accuracy, as under `model.fit`, and the
                step's own loss as `step_loss`, as `tfpar.metrics.report_step_loss` adds).
            verbose: 0 silent, 1 progress bar.
            validation_data, validation_steps: held-out batches (iterated afresh; a list,
                or a function returning a new iterable each time) that `evaluate` runs on
                for up to `validation_steps` batches at the end of every
                `validation_freq`-th epoch; callbacks get `val_loss` and `val_accuracy` in
                the epoch's logs, as under `model.fit`.

        Returns:
            A dict `{"loss": [per epoch], "accuracy": [per epoch], …}`, one list per key of
            the epoch logs.
        """
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_progbar=bool(verbose), model=self.model, verbose=verbose,
            epochs=epochs, steps=steps_per_epoch)
        history = {}
        iterator = iter(batches)
        self.model.stop_training = False
        # Keras's BackupAndRestore (and tfpar's) set the epoch to resume from in
        # on_train_begin; one left from an earlier fit is not this fit's
        patches.set_initial_epoch(self.model, None)
        callbacks.on_train_begin()
        initial_epoch = patches.initial_epoch(self.model) or initial_epoch
        for epoch in range(initial_epoch, epochs):
            callbacks.on_epoch_begin(epoch)
            sums = self._sums()
            index = 0
            while steps_per_epoch is None or index < steps_per_epoch:
                batch = next(iterator, None)
                if batch is None:
                    break
                callbacks.on_train_batch_begin(index)
                out = self._step(batch)
                sums.add(out)
                step_loss = {} if self.keras_steps else {STEP_LOSS: out["loss"]}
                callbacks.on_train_batch_end(index, {**sums.logs(), **step_loss})
                index += 1
                if self.model.stop_training:
                    break
            logs = sums.logs()
            if validation_data is not None and (epoch + 1) % validation_freq == 0:
                held_out = validation_data() if callable(validation_data) else validation_data
                logs.update({f"val_{k}": v for k, v in
                             self.evaluate(held_out, validation_steps).items()})
            callbacks.on_epoch_end(epoch, logs)
            for key, value in logs.items():
                history.setdefault(key, []).append(value)
            if self.model.stop_training or (steps_per_epoch and index < steps_per_epoch):
                break
        callbacks.on_train_end(logs if epochs > initial_epoch else None)
        return history

    def evaluate(self, batches, steps=None, callbacks=None):
        """Mean loss and weighted accuracy over `batches` (no variable is written).

        Args:
            callbacks: a `keras.callbacks.CallbackList` that gets `on_test_batch_begin`
                and `on_test_batch_end` (the running means) per batch, as under
                `model.evaluate`; its caller calls `on_test_begin` and `on_test_end`.

        Returns:
            `{"loss": float, "accuracy": float}`, loss averaged over batches as Keras does.
        """
        sums = self._sums()
        for index, batch in enumerate(batches):
            if steps is not None and index >= steps:
                break
            if callbacks is not None:
                callbacks.on_test_batch_begin(index)
            out = self._eval(*self._on_mesh(batch))
            sums.add(keras_step.logs_to_host(out) if self.keras_steps else _host(out))
            if callbacks is not None:
                callbacks.on_test_batch_end(index, sums.logs())
        return sums.logs()

    def predict(self, x, batch_size=None):
        """Logits for `x` (numpy), computed in batches split over the `batch` axis.

        Args:
            x: inputs; its length must divide into `batch_size` batches.
            batch_size: examples per call, default all of `x`; must be divisible by
                the `batch` axis size.
        """
        x = np.asarray(x)
        batch_size = batch_size or len(x)
        parts = batch_parts(self.mesh)
        if batch_size % parts or len(x) % batch_size:
            raise TfparError(f"predict: batch_size={batch_size} must divide len(x)={len(x)} "
                             f"and be divisible by data_parallel={parts}")
        outs = [values.to_host(self._predict(values.batch_to_mesh(
            (x[i:i + batch_size],), self.mesh)[0])) for i in range(0, len(x), batch_size)]
        return np.concatenate(outs)

    def save_weights(self, path):
        """Writes the model's weights (not the optimizer) as a TF checkpoint at `path`;
        returns the path written. `load_weights` reads it onto any mesh, and
        `tf.train.Checkpoint(model=plain_model).read(path)` onto a single device."""
        return tf.train.Checkpoint(model=self.model).write(path)

    def load_weights(self, path):
        """Reads weights written by `save_weights` (from any mesh or a plain model).

        Raises:
            AssertionError: a weight of this model is not in the file.
        """
        tf.train.Checkpoint(model=self.model).read(path).assert_existing_objects_matched()

    def checkpoint(self, **extra):
        """A `tf.train.Checkpoint` of the model and optimizer (and `extra` trackables);
        it restores onto any mesh, or onto a model built without one."""
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, **extra)


class _Sums:
    """Epoch running means: loss averaged over batches, accuracy over sample weights."""

    def __init__(self, accuracy="accuracy"):
        self.accuracy = accuracy
        self.batches, self.loss, self.correct, self.weight = 0, 0.0, 0.0, 0.0

    def add(self, out):
        self.batches += 1
        self.loss += out["loss"]
        self.correct += out["correct"]
        self.weight += out["weight"]

    def logs(self):
        if not self.batches:
            return {}
        return _logs({"loss": self.loss / self.batches, "correct": self.correct,
                      "weight": self.weight}, self.accuracy)


class _Latest:
    """Keras mode: the model's metrics keep the epoch's running values; the logs are the
    last step's."""

    def __init__(self):
        self.latest = {}

    def add(self, out):
        self.latest = out

    def logs(self):
        return dict(self.latest)


def _host(out):
    return {k: float(values.to_host(v)) for k, v in out.items()}


def _logs(out, accuracy="accuracy"):
    logs = {"loss": out["loss"]}
    if accuracy:
        logs[accuracy] = out["correct"] / out["weight"] if out["weight"] else 0.0
    return logs
