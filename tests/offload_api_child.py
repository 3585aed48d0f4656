"""Child process for tests/test_offload_api.py: a user's own Keras script with
`tfpar.DistributedOptimizer(offload="optimizer")`.

    python tests/offload_api_child.py train DIR   # tfpar, 2 replicas: one JSON line
    python tests/offload_api_child.py stock DIR   # stock Keras, never imports tfpar

`train`: a model of the user's (an Embedding, whose gradient is `IndexedSlices`, then Dense
layers) is fitted for `STEPS` steps on 2 logical-CPU replicas from the same initial weights
twice, with `keras.optimizers.Adam` and with the offloaded copy; each model is saved
(`model.save`) to DIR/{plain,offload}.keras and its weights file (`save_weights`) next to
it; a third model with an offloaded Adam loads the plain run's weights file (Adam's state
onto the host); two more fits see a NaN label in step 2, with `on_nan="skip_step"` and
"stop" and `tfpar.callbacks.NaNGuard()`. Prints the weights' largest difference, the
optimizer bytes on each device, the host slots' bytes, the loaded host slots' difference
from the plain Adam's, and what each NaN run skipped or where it stopped.

`stock`: loads both `.keras` files with stock Keras and prints the largest difference
between their optimizers' variables (the offloaded file holds Adam's state as Adam's).
"""

import json
import os
import sys

import keras
import numpy as np

STEPS, BATCH, VOCAB = 6, 32, 50


def build():
    tokens = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8)(tokens)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(tokens, keras.layers.Dense(1)(x))


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(STEPS * BATCH, 4)).astype("int32")
    y = (x.sum(axis=1, keepdims=True) / VOCAB).astype("float32")
    return x, y


def train(folder):
    import tfpar
    from tfpar import memory, offload

    strategy = tfpar.make_strategy(cpu_devices=2)
    x, y = data()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        start = build().get_weights()
    out = {"replicas": strategy.num_replicas_in_sync}
    models = {}
    for name in ("plain", "offload"):
        with strategy.scope():
            model = build()
            model.set_weights(start)
            optimizer = keras.optimizers.Adam(0.01)
            if name == "offload":
                optimizer = tfpar.DistributedOptimizer(optimizer, offload="optimizer")
            model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        out[f"{name}_optimizer_bytes_per_device"] = memory.variable_bytes_per_device(
            memory.optimizer_variables(model))
        model.save(os.path.join(folder, f"{name}.keras"))
        model.save_weights(os.path.join(folder, f"{name}.weights.h5"))
        models[name] = model
    plain, offloaded = models["plain"], models["offload"]
    out["weights_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in
                                  zip(plain.get_weights(), offloaded.get_weights()))
    out["offload_stats"] = offload.stats(offloaded.optimizer)
    out["params"] = int(sum(np.size(w) for w in plain.get_weights()))
    out["steps"] = int(offloaded.optimizer.iterations.numpy())

    # The plain run's weights file (Adam's slots as Keras keeps them) into host slots.
    with strategy.scope():
        model = build()
        optimizer = tfpar.DistributedOptimizer(keras.optimizers.Adam(0.01), offload="optimizer")
        model.compile(optimizer=optimizer, loss="mse")
        optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(folder, "plain.weights.h5"))
    # Both per weight, momentum then velocity; Adam's own after iterations, learning rate.
    host = [read() for _, _, (read, _, _) in
            offload.slot_entries(optimizer, model.trainable_weights)]
    resident = [v.numpy() for v in plain.optimizer.variables[2:]]
    assert [a.shape for a in host] == [a.shape for a in resident]
    out["loaded_slots"] = len(host)
    out["loaded_slots_max_diff"] = max(float(np.max(np.abs(a - b)))
                                       for a, b in zip(host, resident))
    out["loaded_iterations"] = int(optimizer.iterations.numpy())

    # A NaN label in one sample of step 2 (0-based): skipped on the host, or fit stops.
    bad = y.copy()
    bad[2 * BATCH + 5] = np.nan
    for on_nan in ("skip_step", "stop"):
        with strategy.scope():
            model = build()
            model.set_weights(start)
            model.compile(optimizer=tfpar.DistributedOptimizer(
                keras.optimizers.Adam(0.01), offload="optimizer", on_nan=on_nan), loss="mse")
        guard = tfpar.callbacks.NaNGuard()
        try:
            model.fit(x, bad, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[guard])
            stopped = None
        except tfpar.TfparError as err:
            stopped = str(err)
        out[on_nan] = {"skipped": guard.skipped, "stopped": stopped,
                       "nonfinite_steps": float(model.optimizer.nonfinite_steps.numpy()),
                       "finite": all(bool(np.all(np.isfinite(w))) for w in model.get_weights()),
                       "slots_finite": all(bool(np.all(np.isfinite(read()))) for _, _, (
                           read, _, _) in offload.slot_entries(model.optimizer,
                                                               model.trainable_weights))}
    print(json.dumps(out), flush=True)


def stock(folder):
    files = {name: keras.models.load_model(os.path.join(folder, f"{name}.keras"))
             for name in ("plain", "offload")}
    assert not any(name == "tfpar" or name.startswith("tfpar.") for name in sys.modules)
    plain, offloaded = ([v.numpy() for v in files[n].optimizer.variables]
                        for n in ("plain", "offload"))
    out = {"classes": [type(files[n].optimizer).__name__ for n in ("plain", "offload")],
           "variables": [len(plain), len(offloaded)],
           "nonzero_slots": sum(bool(np.any(v)) for v in offloaded[2:]),
           "max_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(plain, offloaded))}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    {"train": train, "stock": stock}[sys.argv[1]](sys.argv[2])
