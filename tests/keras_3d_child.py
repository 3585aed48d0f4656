"""Child process for tests/test_keras_3d.py, on 8 logical CPUs: a user's own functional
Keras model trained by `model.fit` under `keras.distribution` on a mesh
`("stage", "batch", "model")` of 2 × 2 × 2 (`tfpar.layout.keras_pipeline`); prints one
JSON line mapping each case to its result.

Usage: python tests/keras_3d_child.py CASE[,CASE...]
- `exact`: SGD and Adam, 3 steps of 1F1B with 4 micro-batches, against the same model
  fitted on one device (no distribution) from the same weights and batches: weights,
  losses, `evaluate`, `predict`; `save_weights` read by a plain model, and a reference
  file of the initial weights read by `load_weights` into the trained pipelined model
  then evaluated, against the one-device evaluate at those weights.
- `powersgd`: `tfpar.DistributedOptimizer(..., compression="powersgd")` exact at its
  limit (Adam at full rank, SGD at rank 16 on kernels whose gradients have rank <= 16)
  against the uncompressed run on one device, then a step with infinite inputs (fp32); at
  rank 1 under
  `mixed_float16`: losses, the codec's bytes and state; then a batch that overflows fp16:
  every stage's weights and loss scale before and after.
- `refusals`: the one-line errors of a mesh with the stage axis not first, Chimera on the
  mesh pipeline, Keras's `BackupAndRestore`.

Runs `exact` first: its single-device references run before DTensor starts (the mesh
pipeline turns DTensor's all-reduce combining off, which DTensor reads once).
"""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cases  # noqa: E402
from tfpar import devices  # noqa: E402

devices.split_cpu(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfpar  # noqa: E402
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


def distribution(axes=("stage", "batch", "model"), schedule="1f1b"):
    mesh = keras.distribution.DeviceMesh((2, 2, 2), list(axes),
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, value in LAYOUTS.items():
        layout_map[key] = value
    return layout.PipelineParallel(layout_map=layout_map, microbatches=4, schedule=schedule)


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


def exact():
    weights = initial_weights()
    x, y = data()
    folder = tempfile.mkdtemp()
    initial = os.path.join(folder, "initial.weights.h5")
    keras.distribution.set_distribution(None)
    plain = compiled(keras.optimizers.SGD(0.1), weights)
    plain.save_weights(initial)
    initial_evaluate = plain.evaluate(x, y, batch_size=BATCH, verbose=0)
    reference = {}
    for name, make in (("sgd", lambda: keras.optimizers.SGD(0.1)),
                       ("adam", lambda: keras.optimizers.Adam(1e-2))):
        keras.distribution.set_distribution(None)
        model = compiled(make(), weights)
        reference[name] = {"loss": fit(model), "weights": model.get_weights(),
                           "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
                           "predict": model.predict(x, batch_size=BATCH, verbose=0)}
    out = {}
    for name, make in (("sgd", lambda: keras.optimizers.SGD(0.1)),
                       ("adam", lambda: keras.optimizers.Adam(1e-2))):
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
    out, uncompressed = {}, {}
    for name, make in (("adam", lambda: keras.optimizers.Adam(1e-2)),
                       ("sgd", lambda: keras.optimizers.SGD(0.1))):
        model = compiled(make(), weights)  # on one device: no distribution
        uncompressed[name] = {"loss": fit(model), "weights": model.get_weights()}
    keras.distribution.set_distribution(distribution())
    # Exact at the codec's limit: at rank 64 every matrix goes whole (its factors would be
    # no smaller); at rank 16 the 64 x 64 kernels go as factors, exact since a step's
    # gradient (16 examples) has rank <= 16. Each against the uncompressed run.
    runs = {"full_rank": ("adam", lambda: tfpar.DistributedOptimizer(
                keras.optimizers.Adam(1e-2), compression="powersgd", rank=64)),
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
        model = compiled(tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-2),
                                                    compression="powersgd", rank=1), weights)
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
            "finite": bool(all(np.isfinite(w).all() for w in model.get_weights()))}
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return out


def _stage_values(trainer):
    return [{"weights": [np.asarray(layout.to_host(v.value)) for v in stage.weights],
             "scale": float(layout.to_host(optimizer.dynamic_scale.value))}
            for stage, optimizer in zip(trainer.model.stages, trainer.stage_optimizers)]


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
            model = compiled(keras.optimizers.SGD(0.1), weights)
            x, y = data(1)
            callbacks = ([keras.callbacks.BackupAndRestore(tempfile.mkdtemp())]
                         if name == "backup_and_restore" else [])
            model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks)
            out[name] = {"raised": None}
        except tfpar.ConfigError as error:
            out[name] = {"raised": str(error)}
        finally:
            keras.distribution.set_distribution(None)
    return out


CASES = {"exact": exact, "powersgd": powersgd, "refusals": refusals}


if __name__ == "__main__":
    layout.enable()
    print(json.dumps(cases.run_cases(CASES, sys.argv[1].split(","),
                                     after=lambda: keras.distribution.set_distribution(None)),
                     default=float), flush=True)
