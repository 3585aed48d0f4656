"""Child process for tests/test_keras_3d.py, on 8 logical CPUs: a user's own functional
Keras model trained by `model.fit` under `keras.distribution` on a mesh
`("stage", "batch", "model")` of 2 × 2 × 2 (`tfpar.layout.keras_pipeline`); prints one
JSON line mapping each case to its result.

Usage: python tests/keras_3d_child.py CASE[,CASE...] [CONFIGS_JSON OUT]
- `exact`: SGD and Adam, 3 steps of 1F1B with 4 micro-batches, against the same model
  fitted on one device (no distribution) from the same weights and batches: weights,
  losses, `evaluate`, `predict`; `save_weights` read by a plain model, and a reference
  file of the initial weights read by `load_weights` into the trained pipelined model
  then evaluated, against the one-device evaluate at those weights.
- `powersgd`: `tfpar.DistributedOptimizer(..., compression="powersgd")` exact at its
  limit (Adam at full rank, SGD at rank 16 on kernels whose gradients have rank <= 16)
  against the uncompressed run on one device, then a step with infinite inputs (fp32); at
  rank 1 under
  `mixed_float16` (Adam in front, 2 exact steps): losses, the codec's bytes and state; then
  a batch that overflows fp16:
  every stage's weights and loss scale before and after.
- `state`: what the step must keep besides the weights: a Dropout model refused in one
  line; a LearningRateScheduler at 0 from the second epoch (that epoch's weights stay),
  the model optimizer's `iterations`; an fp32 DistributedOptimizer after 3 infinite
  batches (its stages' scale, then a finite step against that step alone); a last batch
  that does not split refused before any step; an error at the third batch of a fit
  (the model holds the two steps taken).
- `refusals`: the one-line errors of a mesh with the stage axis not first, Chimera on the
  mesh pipeline, tfpar's `BackupAndRestore`.
- `resume`: Adam's state across files: one epoch, `model.save`, `load_model` (under the
  same distribution), one more epoch; and Keras's `BackupAndRestore` stopped inside the
  second epoch, then a fresh model resumed by it: each against two epochs on one device.
- `codec_files`: a `tfpar.DistributedOptimizer` codec's state in Keras's files (top-k,
  PowerSGD over SGD, Adam in front of PowerSGD): Keras's `BackupAndRestore` stopped inside
  the second epoch then resumed by a fresh model, and `model.save` after one epoch read
  back by `load_weights` after another, each then against two epochs uninterrupted; the
  file's entries; a file without them; another codec's file refused, and files of codecs
  whose entries look the same (top-k at another ratio, threshold).
- `codec_nested`: the same files of PowerSGD's state on two nested models' Dense "proj"
  (Keras paths that repeat: `proj/kernel`, `proj/kernel#2`).
- `guards`: an fp32 DistributedOptimizer's skipped steps in `optimizer.nonfinite_steps`
  and tfpar's `NaNGuard` stopping on them; a custom layer assigning its own non-trainable
  variable in `call` refused before any step, as are one updating its own metric, one
  clipping its trainable kernel in `call`, and variables held by no layer (a
  `keras.Variable` read and annealed by a callback, one assigned in `call`, a `tf.Variable`
  assigned in `call`, one held by the model itself); a layer of unnamed `add_weight`s against
  one device; a Dropout model evaluated by the CLI's `MeshPipelineTrainer` against one
  device's `evaluate`.
- `cli`: each settings of the list `CONFIGS_JSON`, a `python -m tfpar.train` 3D run's (the
  zoo's model, seed, generated data, optimizer and rate, PowerSGD, fp16), as a user
  writes them: the zoo model built with the run's seed, its own `LayoutMap` keys,
  `PipelineParallel`, `compile` (a `tfpar.DistributedOptimizer` for the codec,
  `mixed_float16` for fp16) and `fit` on the run's batches; run i's weights to
  `OUT.i.npz` (tests/test_keras_3d.py compares them with the run's).

Runs `exact` first: its single-device references run before DTensor starts (the mesh
pipeline turns DTensor's all-reduce combining off, which DTensor reads once). The graph
optimizer is the test's choice (tests/graph_optimizer.py), reported as `"grappler"`.
"""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cases  # noqa: E402
import graph_optimizer  # noqa: E402
from tfpar import devices  # noqa: E402

devices.split_cpu(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfpar  # noqa: E402
import keras_codec_files  # noqa: E402  (after the CPU split)
from tfpar import layout  # noqa: E402

BATCH, STEPS, FEATURES, CLASSES = 16, 3, 12, 10
LAYOUTS = {r"up\d/kernel": (None, "model"), r"up\d/bias": ("model",),
           r"down\d/kernel": ("model", None)}


def user_model():
    """A user's functional model with layer names of its own."""
    x = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(64, activation="relu", name="up1")(x)
    h = keras.layers.Dense(64, activation="relu", name="down1")(h)
    h = keras.layers.Dense(64, activation="relu", name="up2")(h)
    h = keras.layers.Dense(16, activation="relu", name="down2")(h)
    out = keras.layers.Dense(CLASSES, name="head")(h)
    return keras.Model(x, out, name="user")


def data(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH * steps, FEATURES)).astype("float32")
    return x, x[:, :CLASSES].argmax(1).astype("int32")


def distribution(axes=("stage", "batch", "model"), schedule="1f1b", microbatches=4,
                 layouts=LAYOUTS):
    mesh = keras.distribution.DeviceMesh((2, 2, 2), list(axes),
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, value in layouts.items():
        layout_map[key] = value
    return layout.PipelineParallel(layout_map=layout_map, microbatches=microbatches,
                                   schedule=schedule)


def compiled(optimizer, weights):
    model = user_model()
    model.set_weights(weights)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def initial_weights():
    keras.utils.set_random_seed(0)
    return user_model().get_weights()


def fit(model, steps=STEPS, epochs=1, callbacks=()):
    x, y = data(steps)
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return history.history["loss"]


class Seen(keras.callbacks.Callback):
    """What a user's callback sees at the epoch's end: its model, and that model's
    weights."""

    def on_epoch_end(self, epoch, logs=None):
        self.model_seen, self.weights = self.model, self.model.get_weights()


def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(p, "float64") - np.asarray(q, "float64"))))
               for p, q in zip(a, b))


# The optimizers of `exact`'s and `powersgd`'s runs, and their one-device references.
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1),
              "adam": lambda: keras.optimizers.Adam(1e-2)}
_ONE_DEVICE = {}


def one_device(name, weights):
    """`user_model` from `weights` (`initial_weights`) fitted on one device (no
    distribution) with `OPTIMIZERS[name]`: losses, weights, `evaluate`, `predict`. The
    reference of `exact` and of `powersgd` (the same run), fitted once a child: a later
    call from other weights is refused, not handed the first one's reference."""
    if name not in _ONE_DEVICE:
        keras.distribution.set_distribution(None)
        model = compiled(OPTIMIZERS[name](), weights)
        x, y = data()
        _ONE_DEVICE[name] = {"loss": fit(model), "weights": model.get_weights(),
                             "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
                             "predict": model.predict(x, batch_size=BATCH, verbose=0),
                             "from": [np.array(w) for w in weights]}
    built = _ONE_DEVICE[name]["from"]
    assert len(built) == len(weights) and all(
        np.array_equal(a, np.asarray(b)) for a, b in zip(built, weights)), \
        f"one_device({name!r}): other initial weights than its cached reference's"
    return _ONE_DEVICE[name]


def exact():
    weights = initial_weights()
    x, y = data()
    folder = tempfile.mkdtemp()
    initial = os.path.join(folder, "initial.weights.h5")
    keras.distribution.set_distribution(None)
    plain = compiled(keras.optimizers.SGD(0.1), weights)
    plain.save_weights(initial)
    initial_evaluate = plain.evaluate(x, y, batch_size=BATCH, verbose=0)
    reference = {name: one_device(name, weights) for name in OPTIMIZERS}
    out = {}
    for name, make in OPTIMIZERS.items():
        keras.distribution.set_distribution(distribution())
        model = compiled(make(), weights)
        ref = reference[name]
        seen = Seen()
        losses = fit(model, callbacks=[seen])
        trainer = model._tfpar_pipeline_trainer
        result = {"weights": diff(model.get_weights(), ref["weights"]),
                  "loss": diff(losses, ref["loss"]),
                  "evaluate": diff(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                                   ref["evaluate"]),
                  "predict": diff([model.predict(x[:-3], batch_size=BATCH, verbose=0)],
                                  [ref["predict"][:-3]]),
                  "stage_layers": [[layer.name for layer in stage.layers[1:]]
                                   for stage in trainer.model.stages],
                  "kernel_shards": _shards(trainer),
                  "callback_model_is_the_users": seen.model_seen is model,
                  "callback_weights": diff(seen.weights, ref["weights"])}
        path = os.path.join(folder, f"{name}.weights.h5")
        model.save_weights(path)
        keras.distribution.set_distribution(None)
        plain = user_model()
        plain.load_weights(path)
        result["saved"] = diff(plain.get_weights(), ref["weights"])
        keras.distribution.set_distribution(distribution())
        # the stages hold the trained weights: the initial ones reach them by this load
        model.load_weights(initial)
        result["loaded_evaluate"] = diff(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                                         initial_evaluate)
        out[name] = result
    return out


def _shards(trainer):
    """Per stage: each kernel's shape on one device (its layout over `model`)."""
    from tensorflow.experimental import dtensor
    out = {}
    for stage in trainer.model.stages:
        for v in stage.trainable_variables:
            if v.path.endswith("kernel"):
                out[v.path] = list(dtensor.unpack(v.value.read_value())[0].shape)
    return out


def codec_state(trainer):
    out = {"max_abs": 0.0, "bytes": [], "names": []}
    for reduction in trainer.reductions or ():
        out["bytes"].append(reduction.comm_stats())
        for name, (variable, _) in reduction.named_state().items():
            out["names"].append(name)
            out["max_abs"] = max(out["max_abs"],
                                 float(np.max(np.abs(layout.to_host(variable)))))
    return out


def powersgd():
    weights = initial_weights()
    out = {}
    uncompressed = {name: one_device(name, weights) for name in OPTIMIZERS}  # `exact`'s
    keras.distribution.set_distribution(distribution())
    # Exact at the codec's limit: at rank 64 every matrix goes whole (its factors would be
    # no smaller); at rank 16 the 64 x 64 kernels go as factors, exact since a step's
    # gradient (16 examples) has rank <= 16. Each against the uncompressed run. (Adam
    # behind the codec, `adam=None`: in front, its warm-up would send the exact mean.)
    runs = {"full_rank": ("adam", lambda: tfpar.DistributedOptimizer(
                keras.optimizers.Adam(1e-2), compression="powersgd", rank=64, adam=None)),
            "rank_16_sgd": ("sgd", lambda: tfpar.DistributedOptimizer(
                keras.optimizers.SGD(0.1), compression="powersgd", rank=16))}
    for name, (reference, make) in runs.items():
        model = compiled(make(), weights)
        out[name] = {"loss": fit(model), "state": codec_state(model._tfpar_pipeline_trainer),
                     "reference_loss": uncompressed[reference]["loss"]}
        out[name]["diff"] = diff(model.get_weights(), uncompressed[reference]["weights"])
        finals = model.get_weights()
    # fp32: a DistributedOptimizer's non-finite step is skipped on every stage
    x, y = data(1)
    model.train_on_batch(x * np.inf, y)
    out["rank_16_sgd"]["nan_step_kept"] = diff(model.get_weights(), finals)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        # Adam in front of PowerSGD: 2 exact steps, then compressed ones
        model = compiled(tfpar.DistributedOptimizer(
            keras.optimizers.Adam(1e-2), compression="powersgd", rank=1,
            adam_warmup_steps=2), weights)
        losses = fit(model, steps=4, epochs=6)
        trainer = model._tfpar_pipeline_trainer
        state = codec_state(trainer)
        before = _stage_values(trainer)
        x, y = data(1)
        model.train_on_batch(x * 1e6, y)  # overflows fp16 in the first layer
        after = _stage_values(trainer)
        out["fp16_rank_1"] = {
            "losses": losses, "state": state,
            "optimizer": type(model.optimizer).__name__,
            "weights_kept": [diff(b["weights"], a["weights"]) for b, a in zip(before, after)],
            "scales": [[b["scale"], a["scale"]] for b, a in zip(before, after)],
            "finite": bool(all(np.isfinite(w).all() for w in model.get_weights())),
            # what model.save would write: the compiled LossScaleOptimizer's own scale
            "model_scale": float(np.asarray(model.optimizer.dynamic_scale)),
            "model_iterations": int(np.asarray(model.optimizer.iterations)),
            "stage_iterations": [int(layout.to_host(o.iterations.value))
                                 for o in trainer.stage_optimizers]}
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return out


def _stage_values(trainer):
    return [{"weights": [np.asarray(layout.to_host(v.value)) for v in stage.weights],
             "scale": float(layout.to_host(optimizer.dynamic_scale.value))}
            for stage, optimizer in zip(trainer.model.stages, trainer.stage_optimizers)]


class Epochs(keras.callbacks.Callback):
    """The model's weights at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


class SetAtEnd(keras.callbacks.Callback):
    """Sets the model's weights in `on_train_end`, as EarlyStopping's best weights do."""

    def __init__(self, weights):
        super().__init__()
        self.to = weights

    def on_train_end(self, logs=None):
        self.model.set_weights(self.to)


class Constant(keras.layers.Layer):
    """A non-trainable weight training never writes (a constant scale)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", trainable=False,
                                     name="scale")

    def call(self, x):
        return x * self.scale


class Interrupt(keras.callbacks.Callback):
    """Raises at the start of batch `at` (no batch-end hook: no per-batch write-back)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            raise KeyboardInterrupt


def state():
    weights = initial_weights()
    out = {}
    keras.distribution.set_distribution(distribution())
    # Dropout: its seed would never move on the stages
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(64, name="up1")(x)
    h = keras.layers.Dropout(0.5, name="drop")(h)
    h = keras.layers.Dense(16, name="down1")(h)
    dropout = keras.Model(x, keras.layers.Dense(CLASSES, name="head")(h))
    dropout.compile(optimizer=keras.optimizers.SGD(0.1),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        fit(dropout)
        out["dropout"] = {"raised": None}
    except tfpar.ConfigError as error:
        out["dropout"] = {"raised": str(error)}
    # a learning rate scheduled to 0 from the second epoch
    model = compiled(keras.optimizers.SGD(0.1), weights)
    epochs = Epochs()
    fit(model, epochs=2, callbacks=[epochs, keras.callbacks.LearningRateScheduler(
        lambda epoch, rate: 0.1 if epoch == 0 else 0.0)])
    trainer = model._tfpar_pipeline_trainer
    x, y = data()
    model.evaluate(x, y, batch_size=BATCH, verbose=0)  # a changed rate is no recompile
    out["rate_zero"] = {"epoch_2_moved": diff(epochs.weights[1], epochs.weights[0]),
                        "epoch_1_moved": diff(epochs.weights[0], weights),
                        "iterations": int(model.optimizer.iterations.numpy()),
                        "steps": 2 * STEPS,
                        "trainer_kept": model._tfpar_pipeline_trainer is trainer}
    # fp32 DistributedOptimizer: skipped steps leave its scale at 1
    x, y = data(1)
    model = compiled(tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1)), weights)
    for _ in range(3):
        model.train_on_batch(x * np.inf, y)
    trainer = model._tfpar_pipeline_trainer
    scales = [float(layout.to_host(o.dynamic_scale.value)) for o in trainer.stage_optimizers]
    model.train_on_batch(x, y)
    alone = compiled(tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1)), weights)
    alone.train_on_batch(x, y)
    out["skipped"] = {"scales": scales,
                      "finite_step": diff(model.get_weights(), alone.get_weights())}
    # a last batch of 4 examples: 4 micro-batches over batch=2 do not split it
    x, y = data(STEPS)
    model = compiled(keras.optimizers.SGD(0.1), weights)
    try:
        model.fit(x[:-12], y[:-12], batch_size=BATCH, verbose=0)
        raised = None
    except tfpar.ConfigError as error:
        raised = str(error)
    trainer = model._tfpar_pipeline_trainer
    out["remainder"] = {"raised": raised, "moved": diff(model.get_weights(), weights),
                        "iterations": int(model.optimizer.iterations.numpy()),
                        "stage_iterations": [int(layout.to_host(o.iterations.value))
                                             for o in trainer.stage_optimizers]}
    # an interrupt at the third batch: the model holds the first two steps
    model = compiled(keras.optimizers.SGD(0.1), weights)
    try:
        fit(model, callbacks=[Interrupt(2)])
    except KeyboardInterrupt:
        pass
    two = compiled(keras.optimizers.SGD(0.1), weights)
    fit(two, steps=2)
    out["interrupted"] = {"against_two_steps": diff(model.get_weights(), two.get_weights()),
                          "moved": diff(model.get_weights(), weights)}
    # a callback's set_weights at training's end stays (EarlyStopping's best weights)
    model = compiled(keras.optimizers.SGD(0.1), weights)
    fit(model, callbacks=[SetAtEnd(weights)])
    out["set_at_end"] = {"moved": diff(model.get_weights(), weights)}
    # a LambdaCallback's batch-end hook sees each step's weights
    model = compiled(keras.optimizers.SGD(0.1), weights)
    seen = []
    fit(model, callbacks=[keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(model.get_weights()))])
    out["lambda"] = {"moved": [diff(seen[i + 1], seen[i]) for i in range(len(seen) - 1)]}
    # a generator's batches; a layer with a constant non-trainable weight is accepted
    x, y = data()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(64, name="up1")(Constant(name="constant")(inputs))
    h = keras.layers.Dense(16, name="down1")(h)
    constant = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))
    constant.compile(optimizer=keras.optimizers.SGD(0.1),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = constant.get_weights()

    def batches():
        for i in range(STEPS):
            yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
    try:
        constant.fit(batches(), steps_per_epoch=STEPS, epochs=1, verbose=0)
        out["generator"] = {"raised": None, "moved": diff(constant.get_weights(), start),
                            "iterations": int(constant.optimizer.iterations.numpy())}
    except Exception as error:  # noqa: BLE001 (the test prints what went wrong)
        out["generator"] = {"raised": f"{type(error).__name__}: {error}"}
    # a new distribution, then a recompile with other metrics: each builds a new trainer
    keras.distribution.set_distribution(distribution(microbatches=2))
    two.evaluate(x, y, batch_size=BATCH, verbose=0)
    microbatches = two._tfpar_pipeline_trainer.M
    two.compile(optimizer=two.optimizer, loss=two.loss)
    two.evaluate(x, y, batch_size=BATCH, verbose=0)
    before = int(two.optimizer.iterations.numpy())
    fit(two, steps=2)  # the rebuilt trainer goes on counting
    out["rebuilt"] = {"microbatches": microbatches,
                      "accuracy": two._tfpar_pipeline_trainer.accuracy,
                      "iterations": [before, int(two.optimizer.iterations.numpy())]}
    return out


def refusals():
    weights = initial_weights()
    out = {}
    attempts = {
        "stage_axis_last": lambda: distribution(("batch", "model", "stage")),
        "chimera": lambda: distribution(schedule="chimera"),
        "backup_and_restore": lambda: distribution()}
    for name, make in attempts.items():
        try:
            keras.distribution.set_distribution(make())
            optimizer = keras.optimizers.SGD(0.1)
            callbacks = []
            if name == "backup_and_restore":
                callbacks = [tfpar.callbacks.BackupAndRestore(tempfile.mkdtemp())]
            model = compiled(optimizer, weights)
            x, y = data(1)
            model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks)
            out[name] = {"raised": None}
        except tfpar.ConfigError as error:
            out[name] = {"raised": str(error)}
        finally:
            keras.distribution.set_distribution(None)
    return out


def resume():
    weights = initial_weights()
    adam = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    keras.distribution.set_distribution(None)
    reference = compiled(adam(), weights)
    fit(reference, epochs=2)
    two_epochs = reference.get_weights()
    folder = tempfile.mkdtemp()
    keras.distribution.set_distribution(distribution())
    out = {}
    # model.save after one epoch, load_model, one more epoch
    model = compiled(adam(), weights)
    fit(model)
    path = os.path.join(folder, "one_epoch.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_iterations = int(loaded.optimizer.iterations.numpy())
    fit(loaded)
    out["save_load"] = {"weights": diff(loaded.get_weights(), two_epochs),
                        "loaded_iterations": loaded_iterations,
                        "iterations": int(loaded.optimizer.iterations.numpy())}
    # Keras's BackupAndRestore: stopped at the second epoch's second batch, resumed by a
    # fresh model (as a restarted script would build it)
    backup = os.path.join(folder, "backup")
    model = compiled(adam(), weights)
    try:
        fit(model, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup),
                                        keras_codec_files.StopAt(1, 1)])
        stopped = False
    except KeyboardInterrupt:
        stopped = True
    model = compiled(adam(), weights)
    losses = fit(model, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    out["backup"] = {"stopped": stopped, "epochs_run": len(losses),
                     "weights": diff(model.get_weights(), two_epochs),
                     "iterations": int(model.optimizer.iterations.numpy())}
    return out


def codec_files():
    """`keras_codec_files.run` on the 3D mesh, from the same initial weights."""
    weights = initial_weights()
    keras.distribution.set_distribution(distribution())
    return keras_codec_files.run(
        lambda model, epochs=1, callbacks=(): fit(model, epochs=epochs, callbacks=callbacks),
        lambda optimizer: compiled(optimizer, weights), diff)


def codec_nested():
    """`keras_codec_files.run_nested` on the 3D mesh: PowerSGD's Q of `_nested`'s two
    "proj" (kernels at or below top-k's dense size: top-k sends them whole)."""
    keras.distribution.set_distribution(distribution(layouts={"proj/kernel": (None, "model")}))

    def compiled_nested(optimizer):
        model = _nested()
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    return keras_codec_files.run_nested(
        lambda model, epochs=1, callbacks=(): fit(model, epochs=epochs, callbacks=callbacks),
        compiled_nested, diff, codec="powersgd")


class RunningMean(keras.layers.Layer):
    """A user's layer keeping a running mean of its inputs in a non-trainable weight,
    assigned in `call` while training."""

    def build(self, shape):
        self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                    trainable=False, name="mean")

    def call(self, x, training=False):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(x, axis=0))
        return x - self.mean


class Tracked(keras.layers.Layer):
    """A user's layer updating its own `keras.metrics.Mean` of its activations in `call`
    (on one device `fit`'s logs report it as "activation_mean")."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.activation_mean = keras.metrics.Mean(name="activation_mean")

    def call(self, x):
        self.activation_mean.update_state(keras.ops.mean(x))
        return x


class Clipped(keras.layers.Layer):
    """A user's layer clipping its trainable kernel in `call` before using it."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 16), name="kernel")

    def call(self, x):
        self.kernel.assign(keras.ops.clip(self.kernel, -0.05, 0.05))
        return x @ self.kernel


# Variables no layer holds, as a user's script keeps them (module-level, made in `guards`)
OUTSIDE = {}


class Annealed(keras.layers.Layer):
    """Scales its input by a `keras.Variable` held by no layer (`OUTSIDE["beta"]`, which
    a callback anneals each epoch, as a KL weight)."""

    def call(self, x):
        return x * OUTSIDE["beta"]


class Counting(keras.layers.Layer):
    """Counts its training calls in a `keras.Variable` held by no layer."""

    def call(self, x, training=False):
        if training:
            OUTSIDE["calls"].assign_add(1.0)
        return x


class RawCounting(keras.layers.Layer):
    """Counts its training calls in a `tf.Variable` (not a Keras variable) of no layer."""

    def call(self, x, training=False):
        if training:
            OUTSIDE["raw_calls"].assign_add(1.0)
        return x


class Tempered(keras.layers.Layer):
    """Divides by a trainable temperature the model holds directly (`model.temperature`,
    trained on one device), read here from `OUTSIDE["temperature"]`."""

    def call(self, x):
        return x / OUTSIDE["temperature"]


class Anneal(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        OUTSIDE["beta"].assign(0.5 * (epoch + 1))


class Penalized(keras.layers.Layer):
    """A user's layer adding a loss term of its own in `call` (`add_loss`)."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


class Unnamed(keras.layers.Layer):
    """A user's layer whose weights have no names (Keras auto-names them)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 16), initializer="glorot_uniform")
        self.b = self.add_weight(shape=(16,), initializer="zeros")

    def call(self, x):
        return keras.ops.relu(x @ self.w + self.b)


def _model_with(layer, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(64, name="up1")(inputs)
    h = layer(h)
    h = keras.layers.Dense(16, name="down1")(h)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _refused(model, callbacks=()):
    """`fit(model)`'s one-line `ConfigError` (or None), and what it left: the weights'
    change and the optimizer's step count."""
    start = model.get_weights()
    try:
        fit(model, callbacks=callbacks)
        raised = None
    except Exception as error:  # noqa: BLE001 (the test reads which error it was)
        raised = f"{type(error).__name__}: {error}"[:300]
    return {"raised": raised, "moved": diff(model.get_weights(), start),
            "iterations": int(model.optimizer.iterations.numpy())}


def guards():
    weights = initial_weights()
    out = {}
    x, y = data()
    # one device first: the unnamed weights' and the dropout model's references
    keras.distribution.set_distribution(None)
    plain = _model_with(Unnamed(name="unnamed"))
    start = plain.get_weights()
    fit(plain)
    unnamed_reference = plain.get_weights()
    dropout = _model_with(keras.layers.Dropout(0.5, name="drop"))
    dropout_weights = dropout.get_weights()
    dropout_reference = dropout.evaluate(x, y, batch_size=BATCH, verbose=0)
    keras.distribution.set_distribution(distribution())
    # fp32 DistributedOptimizer: skipped steps counted where NaNGuard reads them
    model = compiled(tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1)), weights)
    x1, y1 = data(1)
    for _ in range(2):
        model.train_on_batch(x1 * np.inf, y1)
    counted = float(model.optimizer.nonfinite_steps.numpy())
    model = compiled(tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1)), weights)
    bad = x.copy()
    bad[BATCH:2 * BATCH] = np.inf  # the second batch
    try:
        model.fit(bad, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[tfpar.callbacks.NaNGuard()])
        raised = None
    except tfpar.TfparError as error:
        raised = str(error)
    out["nonfinite"] = {"counted": counted, "raised": raised,
                        "iterations": int(model.optimizer.iterations.numpy())}
    # a layer assigning its own non-trainable variable in call: refused before any step
    model = _model_with(RunningMean(name="running"))
    start_running = model.get_weights()
    try:
        fit(model)
        raised = None
    except tfpar.ConfigError as error:
        raised = str(error)
    out["assigns"] = {"raised": raised, "moved": diff(model.get_weights(), start_running),
                      "iterations": int(model.optimizer.iterations.numpy())}
    # what the stateless step would drop, each refused while the first step is traced: a
    # layer's own metric, a trainable weight clipped in call, variables held by no layer
    for name, layer in (("metric", Tracked(name="tracked")),
                        ("clip", Clipped(name="clipped"))):
        out[name] = _refused(_model_with(layer))
    OUTSIDE.update(beta=keras.Variable(0.0, trainable=False, name="beta"),
                   calls=keras.Variable(0.0, trainable=False, name="calls"),
                   temperature=keras.Variable(1.0, name="temperature"))
    out["outside_read"] = _refused(_model_with(Annealed(name="annealed")), [Anneal()])
    out["outside_write"] = _refused(_model_with(Counting(name="counting")))
    import tensorflow as tf
    OUTSIDE["raw_calls"] = tf.Variable(0.0, trainable=False)
    out["outside_raw"] = _refused(_model_with(RawCounting(name="raw_counting")))
    model = _model_with(Tempered(name="tempered"))
    model.temperature = OUTSIDE["temperature"]  # a weight of the model, of no layer
    out["outside_held"] = _refused(model)
    # a layer's own loss terms, which the stages' loss (the compiled loss alone) leaves
    # out: a kernel regularizer, an activity regularizer, add_loss in call
    l2 = keras.regularizers.L2(0.5)
    for name, layer in (("kernel_regularizer",
                         keras.layers.Dense(64, kernel_regularizer=l2, name="decayed")),
                        ("activity_regularizer",
                         keras.layers.Dense(64, activity_regularizer=l2, name="sparse")),
                        ("add_loss", Penalized(name="penalized"))):
        out[name] = _refused(_model_with(layer))
    # a frozen regularized layer (a pretrained block): no term on one device either
    frozen = keras.layers.Dense(64, kernel_regularizer=l2, name="frozen")
    model = _model_with(frozen)
    frozen.trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    out["frozen_regularizer"] = _refused(model)
    # unnamed add_weights (auto-named anew in a stage's copy): against one device
    model = _model_with(Unnamed(name="unnamed"))
    model.set_weights(start)
    try:
        fit(model)
        out["unnamed"] = {"raised": None,
                          "weights": diff(model.get_weights(), unnamed_reference)}
    except Exception as error:  # noqa: BLE001 (the test prints what went wrong)
        out["unnamed"] = {"raised": f"{type(error).__name__}: {error}"}
    # the CLI's MeshPipelineTrainer evaluates in inference mode (Dropout off)
    from tfpar.layout import pipeline
    from tfpar.pipeline.schedule import make_schedule
    model = _model_with(keras.layers.Dropout(0.5, name="drop"))
    model.set_weights(dropout_weights)
    fit_evaluate = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    trainer = model._tfpar_pipeline_trainer
    cli = pipeline.MeshPipelineTrainer(
        trainer.meshes, trainer.model, trainer.stage_optimizers,
        make_schedule("1f1b", 2, 4), keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), accuracy=None)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    cli_losses = [cli.evaluate(batches)["loss"] for _ in range(2)]
    out["eval_dropout"] = {"reference": dropout_reference, "fit_evaluate": fit_evaluate,
                           "cli": cli_losses}
    return out


class Factored(keras.layers.Layer):
    """A user's layer whose weight `y_kernel` Keras names a slot of `x_y_kernel_...`
    when the layer is "x", as a Dense "x_y"'s kernel's."""

    def build(self, shape):
        self.w = self.add_weight(name="y_kernel", shape=(shape[-1], 8))

    def call(self, x):
        return x @ self.w


def _nested(seed=0):
    """Two nested models, each with a Dense "proj" (the slots' names collide)."""
    keras.utils.set_random_seed(seed)

    def block(name):
        inputs = keras.Input((FEATURES,))
        return keras.Model(inputs, keras.layers.Dense(FEATURES, activation="relu",
                                                      name="proj")(inputs), name=name)

    inputs = keras.Input((FEATURES,))
    h = block("block2")(block("block1")(inputs))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))


def _colliding(seed=0):
    """A (12, 8) kernel "x/y_kernel" beside a Dense "x_y" (Adafactor factors both and
    names the factors by the weights' bare names)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    h = Factored(name="x")(inputs)
    h = keras.layers.Dense(8, name="x_y")(h)
    h = keras.layers.Dense(8, name="mid")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))


class Flagged(keras.layers.Layer):
    """Assigns its non-trainable counter in a training call while `update` is set."""
    update = True

    def build(self, shape):
        self.count = self.add_weight(name="count", shape=(), initializer="zeros",
                                     trainable=False)

    def call(self, x, training=False):
        if training and Flagged.update:
            self.count.assign_add(1.0)
        return x


def slots():
    """The stage optimizers' slots paired with the model's by weight, not by name: two
    fits of one epoch equal one of two epochs (and one device); the saved file holds each
    moment. A layer shared across stages, and an error after a refusal, get their lines."""
    x, y = data(2)
    optimizers = {"adam": lambda: keras.optimizers.Adam(1e-2),
                  "adafactor": lambda: keras.optimizers.Adafactor(1e-2)}
    cases_ = {"adam": _nested, "adafactor": _colliding}

    def run(name, epochs):
        model = cases_[name]()
        model.compile(optimizer=optimizers[name](),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        for e in epochs:
            model.fit(x, y, batch_size=BATCH, epochs=e, shuffle=False, verbose=0)
        return model

    keras.distribution.set_distribution(None)
    reference = {name: run(name, [2]).get_weights() for name in cases_}
    keras.distribution.set_distribution(distribution(layouts={}))
    out = {}
    for name in cases_:
        whole, split = run(name, [2]), run(name, [1, 1])
        out[name] = {"split": diff(whole.get_weights(), split.get_weights()),
                     "one_device": diff(split.get_weights(), reference[name])}
        if name == "adam":
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "nested.keras")
                split.save(path)
                keras.distribution.set_distribution(None)
                loaded = keras.saving.load_model(path)
                keras.distribution.set_distribution(distribution(layouts={}))
            out[name]["saved_moments"] = [  # (two "proj" layers: paths repeat)
                [v.path, float(np.abs(np.asarray(v)).max())]
                for v in loaded.optimizer.variables
                if v.name.endswith(("_momentum", "_velocity"))]
    # a layer frozen after the first fit, the same optimizer recompiled: its slots stay as
    # they were, and no other weight takes them (one device's fits say which change)
    def frozen():
        model = _nested()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        before = [np.asarray(v).copy() for v in model.optimizer.variables]
        model.get_layer("block1").trainable = False
        model.compile(optimizer=model.optimizer, loss=loss)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        changed = [i for i, v in enumerate(model.optimizer.variables)
                   if not np.array_equal(before[i], np.asarray(v))]
        return model.get_weights(), changed

    keras.distribution.set_distribution(None)
    one_weights, one_changed = frozen()
    keras.distribution.set_distribution(distribution(layouts={}))
    weights, changed = frozen()
    out["frozen"] = {"one_device": diff(weights, one_weights), "changed": changed,
                     "one_device_changed": one_changed}
    # a layer called in two stages
    inputs = keras.Input((FEATURES,))
    shared = keras.layers.Dense(FEATURES, name="shared")
    h = keras.layers.Dense(FEATURES, name="mid2")(keras.layers.Dense(
        FEATURES, name="mid1")(shared(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(shared(h)))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(x, y, batch_size=BATCH, verbose=0)
        out["shared"] = None
    except Exception as error:  # noqa: BLE001 (the test prints what went wrong)
        out["shared"] = f"{type(error).__name__}: {error}"
    # a refusal, then an unrelated error on the same trainer, then a good fit
    inputs = keras.Input((FEATURES,))
    h = Flagged(name="flag")(keras.layers.Dense(FEATURES, name="a")(inputs))
    h = keras.layers.Dense(FEATURES, name="b")(h)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    raised = []
    for update, inputs in [(True, x), (False, x[:, :, None] * np.ones(2, x.dtype)),
                           (False, x)]:
        Flagged.update = update
        try:
            model.fit(inputs, y, batch_size=BATCH, shuffle=False, verbose=0)
            raised.append(None)
        except Exception as error:  # noqa: BLE001 (the test reads which error it was)
            raised.append(f"{type(error).__name__}: {error}"[:300])
    out["stale"] = {"raised": raised, "iterations": int(model.optimizer.iterations.numpy())}
    return out


def cli():
    from tfpar import ParallelConfig
    out = []
    for i, settings in enumerate(json.loads(sys.argv[2])):
        config = ParallelConfig(**settings)
        if config.mixed_precision == "fp16":
            keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            out.append(_cli(config, f"{sys.argv[3]}.{i}.npz"))
        finally:
            keras.mixed_precision.set_global_policy("float32")
    return out


def _cli(config, path):
    from tfpar import data as data_lib, models
    task = data_lib.make_task(config)
    batches = data_lib.global_batches(config, task, 0, config.steps)
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(config.seed)  # as the CLI builds its model, whole
    initial = models.build(config.model, task.input_shape, task.num_classes,
                           width=config.model_width, depth=config.model_depth).get_weights()
    mesh = keras.distribution.DeviceMesh(
        (config.pipeline_stages, config.data_parallel, config.tensor_parallel),
        ["stage", "batch", "model"], keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense_0/kernel"] = (None, "model")  # the zoo mlp's Megatron pair
    layout_map["dense_0/bias"] = ("model",)
    layout_map["dense_1/kernel"] = ("model", None)
    keras.distribution.set_distribution(layout.PipelineParallel(
        layout_map=layout_map, microbatches=config.microbatches, schedule=config.schedule))
    model = models.build(config.model, task.input_shape, task.num_classes,
                         width=config.model_width, depth=config.model_depth)
    model.set_weights(initial)
    optimizer = (keras.optimizers.Adam if config.optimizer == "adam"
                 else keras.optimizers.SGD)(config.scaled_learning_rate)
    if config.compression != "none":
        front = ({"adam_warmup_steps": config.adam_warmup_steps}
                 if config.optimizer == "adam" else {})
        optimizer = tfpar.DistributedOptimizer(optimizer, compression=config.compression,
                                               rank=config.powersgd_rank, **front)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = (np.concatenate([b[i] for b in batches]) for i in (0, 1))
    weights = [b[2] for b in batches if len(b) > 2]
    history = model.fit(x, y, batch_size=config.global_batch_size, shuffle=False, verbose=0)
    np.savez(path, *model.get_weights())
    return {"paths": [w.path for w in model.weights],
            "unit_sample_weights": bool(all(np.all(w == 1) for w in weights)),
            "iterations": int(model.optimizer.iterations.numpy()),
            "loss": history.history["loss"], "optimizer": type(model.optimizer).__name__,
            "bytes": [r.comm_stats() for r in model._tfpar_pipeline_trainer.reductions or ()]}


CASES = {"exact": exact, "powersgd": powersgd, "state": state, "refusals": refusals,
         "resume": resume, "guards": guards, "slots": slots, "cli": cli,
         "codec_files": codec_files, "codec_nested": codec_nested}


if __name__ == "__main__":
    graph_optimizer.apply()  # the test's choice, before any tf.function
    layout.enable()
    out = cases.run_cases(CASES, sys.argv[1].split(","),
                          after=lambda: keras.distribution.set_distribution(None))
    out["grappler"] = graph_optimizer.setting()  # what the cases ran with
    print(json.dumps(out, default=float), flush=True)
