"""Child process for tests/test_keras_zero3.py, on 4 logical CPUs: a user's own functional
Keras model (two inputs as a dict, Dense + LayerNormalization) trained with
`model.fit` under `tfpar.layout.FullyShardedDataParallel` (ZeRO-3) and against the same
model on one device (no distribution), same seed and batches, Adam; prints one JSON line
mapping each case to its result.

Usage: python tests/keras_zero3_child.py CASE[,CASE...]
- `exact`: one device, then ZeRO-3 on a mesh `("batch",)` of 4 and on `("batch", "model")`
  2×2 with tensor-parallel rules: weights after the steps, each weight's layout and its
  elements per device, the layers gathering per layer; `evaluate` and `predict` of the
  4-device model against one device's.
- `codecs`: `tfpar.DistributedOptimizer(Adam, compression="int8"|"fp16")` and the int8
  weight gather, and int8 both ways, each against the uncompressed ZeRO-3 fit: weights
  apart, losses, the bytes `tfpar.metrics.comm_stats` reports (the uncompressed fit's too)
  and the reduce-scatter's own.
- `save`: 2 steps, `model.save` → `keras.saving.load_model` under the same distribution,
  2 more steps, against 4 uninterrupted; `get_weights`, and `save_weights` loaded into a
  model on one device (its predictions against the mesh model's).
- `refusals`: top-k through ZeRO-3; a mesh with a `stage` axis; a mesh without `batch`;
  a layer clipping its own trainable weight in `call` on a plain Keras `DataParallel` mesh
  (without a codec and with int8): its write would be dropped every step.
- `nan`: `compression="none"` with `on_nan="skip_step"`: a step with an infinite input
  leaves the weights and is counted, with Keras's `train_step` and with the model's own.
"""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cases  # noqa: E402
from tfpar import devices  # noqa: E402

devices.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfpar  # noqa: E402
from tfpar import layout  # noqa: E402
from tfpar.errors import ConfigError  # noqa: E402
from tfpar.zero import fsdp as zero  # noqa: E402

BATCH, STEPS = 16, 4
EXTRA, FEATURES, CLASSES = 8, 16, 8
# Megatron's pair on `model`; ZeRO-3 splits each over `batch` on its other dimension
# (a bias split over `model` would have none left: not in the rules)
TP_RULES = {"up/kernel": (None, "model"), "down/kernel": ("model", None)}
_SEEN = {}  # runs a later case compares with


def user_model():
    """A user's functional model: dict inputs, Dense + LayerNormalization. (No Embedding:
    with Adam, Keras on one device updates an embedding from `IndexedSlices`, squaring
    each row's slice before summing a batch's repeats, where every mesh step's gradient
    is dense: 1e-3 apart after one step at lr 1e-3, `DataParallel` alike.)"""
    extra = keras.Input((EXTRA,), name="extra")
    features = keras.Input((FEATURES,), name="features")
    side = keras.layers.Dense(16, activation="tanh", name="side")(extra)
    h = keras.layers.Concatenate()([side, features])
    h = keras.layers.Dense(32, activation="relu", name="up")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(16, activation="relu", name="down")(h)
    out = keras.layers.Dense(CLASSES, name="head")(h)
    return keras.Model({"extra": extra, "features": features}, out, name="user")


def data(steps=STEPS, start=0):
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    x = {"extra": rng.normal(size=(n, EXTRA)).astype("float32"),
         "features": rng.normal(size=(n, FEATURES)).astype("float32")}
    y = (x["features"][:, :CLASSES] + x["extra"][:, :CLASSES]).argmax(1)
    part = slice(BATCH * start, BATCH * (start + steps))
    return {k: v[part] for k, v in x.items()}, y[part].astype("int32")


def mesh(shape=(4,), axes=("batch",)):
    return keras.distribution.DeviceMesh(shape, list(axes), keras.distribution.list_devices())


def fsdp(**options):
    return layout.FullyShardedDataParallel(mesh(), **options)


def fsdp_tp():
    m = mesh((2, 2), ("batch", "model"))
    layout_map = keras.distribution.LayoutMap(m)
    for key, axes in TP_RULES.items():
        layout_map[key] = axes
    return layout.FullyShardedDataParallel(layout_map=layout_map)


def adam(compression=None):
    if compression is None:
        return keras.optimizers.Adam(1e-3)
    return tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-3), compression=compression)


def compiled(optimizer):
    keras.utils.set_random_seed(0)
    model = user_model()
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, steps=STEPS, start=0):
    x, y = data(steps, start)
    return model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]


def run(distribution, compression=None):
    """`(model, losses)` of a seeded model fitted under `distribution` (None: one
    device); `model.initial`: its weights before (`host`)."""
    keras.distribution.set_distribution(distribution)
    model = compiled(adam(compression))
    initial = host(model)
    losses = fit(model)
    object.__setattr__(model, "initial", initial)
    return model, losses


def host(model):
    return {v.path: np.asarray(layout.to_host(v.value) if layout.is_dvariable(v)
                               else v.numpy(), "float64") for v in model.weights}


def diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def layouts(model):
    """Each trainable weight's sharding specs and its elements per device."""
    return {v.path: {"specs": list(dtensor.fetch_layout(v.value).sharding_specs),
                     "size": int(np.prod(v.shape)),
                     "per_device": layout.shard_sizes([v])}
            for v in model.trainable_variables}


def one_device():
    if "one" not in _SEEN:
        model, losses = run(None)
        x, y = data()
        _SEEN["one"] = {"weights": host(model), "losses": losses,
                        "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0,
                                                   return_dict=True),
                        "predict": model.predict(x, batch_size=BATCH, verbose=0)}
    return _SEEN["one"]


def zero3():
    if "zero3" not in _SEEN:
        model, losses = run(fsdp())
        _SEEN["zero3"] = (model, losses, host(model))
    return _SEEN["zero3"]


def exact():
    one = one_device()
    model, losses, weights = zero3()
    x, y = data()
    out = {"diff": diff(weights, one["weights"]), "moved": diff(weights, model.initial),
           "losses": losses, "one_losses": one["losses"],
           "layouts": layouts(model), "per_layer": list(model._tfpar_fsdp_layers),
           "optimizer_per_device": layout.shard_sizes(model.optimizer.variables),
           "optimizer_size": int(sum(np.prod(v.shape) for v in model.optimizer.variables)),
           "reductions": len(model.tfpar_reductions)}
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    out["evaluate"] = {k: [float(evaluated[k]), float(one["evaluate"][k])]
                       for k in one["evaluate"]}
    out["predict_diff"] = float(np.max(np.abs(
        model.predict(x, batch_size=BATCH, verbose=0) - one["predict"])))
    # frozen after its fit (no trainable weights left): predict as before
    expected = model.predict(x, batch_size=BATCH, verbose=0)
    model.trainable = False
    out["frozen_predict_diff"] = float(np.max(np.abs(
        model.predict(x, batch_size=BATCH, verbose=0) - expected)))
    model.trainable = True
    tp, tp_losses = run(fsdp_tp())
    out["tp"] = {"diff": diff(host(tp), one["weights"]), "layouts": layouts(tp),
                 "per_layer": list(tp._tfpar_fsdp_layers)}
    return out


def codecs():
    plain_model, plain_losses, plain = zero3()
    out = {}
    for name, distribution, compression in (("int8", fsdp(), "int8"),
                                            ("fp16", fsdp(), "fp16"),
                                            ("int8_gather", fsdp(weight_gather="int8"),
                                             None),
                                            ("int8_both", fsdp(weight_gather="int8"),
                                             "int8")):
        model, losses = run(distribution, compression)
        out[name] = {"diff": diff(host(model), plain), "losses": losses,
                     "plain_losses": plain_losses,
                     "comm": tfpar.metrics.comm_stats(model, 4),
                     "reduction_comm": [r.comm_stats() for r in model.tfpar_reductions],
                     "gather_bytes": [zero.gather_bytes(model), zero.gather_bytes(plain_model)],
                     "reduction": [type(r).__name__ for r in model.tfpar_reductions]}
    out["plain_comm"] = tfpar.metrics.comm_stats(plain_model, 4)
    out["plain_gather_bytes"] = zero.gather_bytes(plain_model)
    return out


def save():
    folder = tempfile.mkdtemp()
    _, _, uninterrupted = zero3()
    keras.distribution.set_distribution(fsdp())
    model = compiled(adam())
    fit(model, 2)
    path = os.path.join(folder, "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    fit(loaded, 2, start=2)
    out = {"resumed_diff": diff(host(loaded), uninterrupted),
           "loaded_split": all("batch" in spec["specs"] for spec in layouts(loaded).values()),
           "iterations": int(layout.to_host(loaded.optimizer.iterations.value))}
    whole = loaded.get_weights()
    out["get_weights_shapes"] = [list(w.shape) for w in whole]
    out["model_shapes"] = [list(v.shape) for v in loaded.weights]
    out["get_weights_diff"] = max(float(np.max(np.abs(w - host(loaded)[v.path])))
                                  for w, v in zip(whole, loaded.weights))
    weights_path = os.path.join(folder, "user.weights.h5")
    loaded.save_weights(weights_path)
    x, _ = data()
    mesh_predict = loaded.predict(x, batch_size=BATCH, verbose=0)
    keras.distribution.set_distribution(None)
    plain = user_model()
    plain.load_weights(weights_path)
    out["plain_is_plain"] = not any(layout.is_dvariable(v) for v in plain.weights)
    out["plain_predict_diff"] = float(np.max(np.abs(
        plain.predict(x, batch_size=BATCH, verbose=0) - mesh_predict)))
    out["plain_weights_diff"] = diff(host(plain), host(loaded))
    # a DistributedOptimizer without a codec (no reduction to run): Adam's state through
    # save -> load_model (its file held the counter a plain Adam lacks: Keras skipped all)
    keras.distribution.set_distribution(fsdp())
    model = compiled(adam("none"))
    fit(model, 2)
    model.save(path)
    loaded = keras.saving.load_model(path)
    out["none_optimizer_diff"] = max(
        float(np.max(np.abs(layout.to_host(a.value) - layout.to_host(b.value))))
        for a, b in zip(model.optimizer.variables, loaded.optimizer.variables))
    out["none_moments"] = float(sum(np.abs(layout.to_host(v.value)).sum()
                                    for v in loaded.optimizer.variables
                                    if "momentum" in v.path))
    return out


class Penalized(keras.layers.Layer):
    """A user's Dense-like layer adding a loss term of its own in `call`."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 16), name="w")

    def call(self, x):
        h = x @ self.w
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h)))
        return h


class ConvBlock(keras.layers.Layer):
    """A user's layer holding a convolution as an attribute (not in a `layers` list)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(8, 3, name="inner_conv")

    def call(self, x):
        return self.conv(x)


class Clipped(keras.layers.Layer):
    """A user's layer that clips its own trainable weight in `call`."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 16), name="w")

    def call(self, x):
        self.w.assign(keras.ops.clip(self.w, -0.05, 0.05))
        return x @ self.w


def _refused(make):
    try:
        make()
    except ConfigError as err:
        return {"raised": "ConfigError", "line": str(err), "lines": len(str(err).splitlines())}
    return {"raised": None}


def refusals():
    def topk():
        keras.distribution.set_distribution(fsdp())
        model = compiled(tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    compression="topk", ratio=0.5))
        fit(model, 1)

    def clip(compression, distribution=None, layer=None):
        # a layer clipping its own trainable weight in call on a plain Keras mesh (no
        # ZeRO-3), through the step without a codec and the per-replica codec step; under
        # ZeRO-3 (the layer gathering its own weights in a scope of its own), that and a
        # layer adding a loss term in call
        keras.distribution.set_distribution(distribution or keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()))
        keras.utils.set_random_seed(0)
        features = keras.Input((FEATURES,), name="features")
        model = keras.Model(features, keras.layers.Dense(CLASSES, name="head")(
            (layer or Clipped(name="clipped"))(features)))
        model.compile(optimizer=adam(compression),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = data(1)
        model.fit(x["features"], y, batch_size=BATCH, verbose=0)

    def conv(layer=None):
        # a convolution under a codec on a plain Keras mesh: it failed inside DTensor in 14
        # lines ('tf.TensorListSetItem' op ComputeLayoutForward error); also one a user's
        # layer holds as an attribute (a walk over `layers` lists did not see it)
        keras.distribution.set_distribution(keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()))
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8, 8, 4)),
                                  layer or keras.layers.Conv2D(8, 3, name="conv"),
                                  keras.layers.Flatten(), keras.layers.Dense(8, name="head")])
        model.compile(optimizer=adam("int8"),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.default_rng(0).normal(size=(BATCH, 8, 8, 4)).astype("float32")
        model.fit(x, np.zeros(BATCH, "int32"), batch_size=BATCH, verbose=0)

    return {"clip": _refused(lambda: clip(None)), "clip_codec": _refused(lambda: clip("int8")),
            "clip_zero3": _refused(lambda: clip(None, fsdp())),
            "add_loss_zero3": _refused(lambda: clip(None, fsdp(), Penalized(name="penalized"))),
            "add_loss_whole": _refused(lambda: clip(
                None, fsdp(gather_per_layer=False), Penalized(name="penalized"))),
            "conv": _refused(conv),
            "conv_in_layer": _refused(lambda: conv(ConvBlock(name="block"))),
            "topk": _refused(topk),
            "stage": _refused(lambda: layout.FullyShardedDataParallel(
                mesh((2, 2, 1), ("stage", "batch", "model")))),
            "no_batch": _refused(lambda: layout.FullyShardedDataParallel(
                mesh((4,), ("data",))))}


class OwnStep(keras.Model):
    """A user's model with its own `train_step`: its tape, its optimizer's `apply`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return self.compute_metrics(x, y, pred)


def nan():
    """`DistributedOptimizer(Adam, compression="none", on_nan="skip_step")`: no codec to
    run (DTensor's own reduce-scatter), a batch with an infinite input still skipped —
    with Keras's `train_step` and with the model's own."""
    out = {}
    for name in ("keras", "own"):
        keras.distribution.set_distribution(fsdp())
        optimizer = tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                               compression="none", on_nan="skip_step")
        if name == "keras":
            model = compiled(optimizer)
        else:
            keras.utils.set_random_seed(0)
            plain = user_model()
            model = OwnStep(plain.inputs, plain.outputs)
            model.compile(optimizer=optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = data(1)
        model.train_on_batch(x, y)
        before = host(model)
        bad = {k: v.copy() for k, v in x.items()}
        bad["features"][0, 0] = np.inf
        model.train_on_batch(bad, y)
        after = host(model)
        model.train_on_batch(x, y)
        out[name] = {"reductions": len(model.tfpar_reductions),
                     "moved_by_bad": diff(after, before),
                     "moved_after": diff(host(model), after),
                     "skipped": float(layout.to_host(model.optimizer.nonfinite_steps.value))}
    return out


CASES = {"exact": exact, "codecs": codecs, "save": save, "refusals": refusals, "nan": nan}

if __name__ == "__main__":
    layout.enable()
    out = cases.run_cases(CASES, sys.argv[1].split(","),
                          after=lambda: keras.distribution.set_distribution(None))
    print(json.dumps(out, default=float), flush=True)
