"""Child process for tests/test_lso_resume.py: a user's own Keras script under
`mixed_float16` on `tf.distribute.MirroredStrategy` (2 logical CPUs) with a
`tfpar.DistributedOptimizer`, saved with `model.save` after one epoch and loaded with
Keras's own `keras.saving.load_model` in a fresh process.

    python tests/lso_resume_child.py train DIR CASE         # tfpar: one JSON line
    python tests/lso_resume_child.py resume DIR CASE stock  # never imports tfpar
    python tests/lso_resume_child.py resume DIR CASE tfpar  # imports tfpar

CASE "none": `DistributedOptimizer(Adam, compression="none")`, which Keras's `compile`
wraps in its own `LossScaleOptimizer`; "fp16": `DistributedOptimizer` of the user's own
`LossScaleOptimizer(Adam, dynamic_growth_steps=2)` with `compression="fp16"`; "offload":
"none"'s with `offload="optimizer"` (Adam's slots in host memory). The targets
are large enough that Keras's initial loss scale (2**15) overflows the float16 backward
pass: the first steps are skipped and the scale halved, so a loaded run whose scale
restarted would skip steps again.

`train`: two epochs uninterrupted (weights to DIR/CASE_two.npz), then the same initial
weights one epoch and `model.save(DIR/CASE.keras)`; prints each run's loss scale, its
count of steps since it moved and the optimizer's `iterations`, and how many entries the
file's optimizer group holds.

`resume ... stock`: 2 logical CPUs and `MirroredStrategy` built with TensorFlow alone,
`keras.saving.load_model` under its scope (the file names Keras's own classes), one more
epoch with the loaded optimizer (the compression is not in the file). `resume ... tfpar`:
`tfpar.make_strategy`, `load_model`, then to go on with the same `DistributedOptimizer`:
`compile` with it, build it and `model.load_weights` of the same file (as the guide says
for a state Keras's classes do not carry). Both print the loaded scale, counter and
`iterations`, Keras's "Skipping variable loading" warnings, the same after one more epoch,
and the largest difference of the weights from the uninterrupted run's.
"""

import json
import os
import sys
import warnings
import zipfile

import numpy as np

EPOCH_STEPS, BATCH, FEATURES = 8, 32, 8


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EPOCH_STEPS * BATCH, FEATURES)).astype("float32")
    y = (300.0 * rng.normal(size=(EPOCH_STEPS * BATCH, 1))).astype("float32")
    return x, y


def build():
    import keras
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1)])


def make_optimizer(case):
    import keras
    import tfpar
    if case == "none":  # Keras's compile wraps it in its own LossScaleOptimizer
        return tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-2), compression="none")
    if case == "offload":  # the same, Adam's slots in host memory (`tfpar.offload`)
        return tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-2), compression="none",
                                          offload="optimizer")
    return tfpar.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), dynamic_growth_steps=2), compression="fp16")


def state(optimizer):
    """The loss scale, its steps since it last moved, and the optimizer's iterations."""
    return [float(np.asarray(optimizer.dynamic_scale)), int(np.asarray(optimizer.step_counter)),
            int(np.asarray(optimizer.iterations))]


def fit(model, epochs):
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def file_entries(path):
    """The number of entries in the `.keras` file's group `optimizer/vars`."""
    import h5py
    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as raw:
        with h5py.File(raw, "r") as weights:
            return len(weights["optimizer/vars"].keys())


def train(folder, case):
    import keras
    import tfpar

    strategy = tfpar.make_strategy("mirrored", cpu_devices=2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        start = build().get_weights()
    out = {"replicas": strategy.num_replicas_in_sync, "strategy": type(strategy).__name__}
    for epochs in (2, 1):
        with strategy.scope():
            model = build()
            model.set_weights(start)
            model.compile(optimizer=make_optimizer(case), loss="mse")
        fit(model, epochs)
        out["optimizer"] = type(model.optimizer).__name__
        if epochs == 2:
            out["two"] = state(model.optimizer)
            np.savez(os.path.join(folder, f"{case}_two.npz"), *model.get_weights())
        else:
            out["saved"] = state(model.optimizer)
            path = os.path.join(folder, f"{case}.keras")
            model.save(path)
            out["file_entries"] = file_entries(path)
    print(json.dumps(out), flush=True)


def resume(folder, case, who):
    import tensorflow as tf
    if who == "tfpar":
        import tfpar
        strategy = tfpar.make_strategy("mirrored", cpu_devices=2)
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    import keras
    keras.mixed_precision.set_global_policy("mixed_float16")
    path = os.path.join(folder, f"{case}.keras")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with strategy.scope():
            model = keras.saving.load_model(path)
            loaded = model.optimizer
            out = {"loaded_class": [type(loaded).__name__,
                                    type(loaded.inner_optimizer).__name__],
                   "loaded_variables": len(loaded.variables), "loaded": state(loaded)}
            if who == "tfpar":
                model.compile(optimizer=make_optimizer(case), loss="mse")
                model.optimizer.build(model.trainable_variables)
                model.load_weights(path)
                out["reloaded"] = state(model.optimizer)
    out["warnings"] = [str(w.message) for w in caught if "variable loading" in str(w.message)]
    fit(model, 1)
    two = np.load(os.path.join(folder, f"{case}_two.npz"))
    out["after"] = state(model.optimizer)
    out["max_diff"] = max(float(np.max(np.abs(w - two[f"arr_{i}"])))
                          for i, w in enumerate(model.get_weights()))
    out["tfpar_imported"] = any(n == "tfpar" or n.startswith("tfpar.") for n in sys.modules)
    out["replicas"] = strategy.num_replicas_in_sync
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3])
    else:
        resume(sys.argv[2], sys.argv[3], sys.argv[4])
