"""Child process for tests/test_layout_keras_state.py: Keras's state API on a model laid out
by `keras.distribution` (after `tfpar.layout.enable()`) on 4 logical CPUs — weights read and
written, files saved on a 2×2 mesh loaded onto 1×4 and onto one device, `load_model`,
callbacks in `evaluate`/`predict`, `ModelCheckpoint`, `BackupAndRestore` — and a model
compiled with `tfpar.DistributedOptimizer` saved for a process without tfpar
(tests/keras_stock_load_child.py). Prints one JSON line.

Usage: python tests/layout_keras_state_child.py DIR (files are written into DIR)
"""

import io
import json
import os
import sys

from tfpar import devices

devices.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfpar  # noqa: E402
from tfpar import layout  # noqa: E402
# the comparisons the stock-Keras side makes (that file imports only keras and numpy)
from keras_stock_load_child import equal, max_diff  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 32)).astype("float32")
Y = RNG.integers(0, 10, size=32)


def user_model():
    """A user's functional model: its weight paths are `up/kernel` …, the same when
    `load_model` rebuilds it (a Sequential's carry the model's name only when built)."""
    inputs = keras.Input((32,))
    h = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(32, name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(h), name="user_mlp")


def model_parallel(dp, tp):
    mesh = keras.distribution.DeviceMesh((dp, tp), ["batch", "model"],
                                         devices=keras.distribution.list_devices()[:dp * tp])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")  # columns over `model`
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)  # rows over `model`
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def built(distribution, seed=0):
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(seed)
    model = user_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, metrics=["accuracy"])
    return model


def specs(model):
    """{path: [its sharding specs, the shape of device 0's shard]} of weights on a mesh."""
    return {v.path: [list(v.value.layout.sharding_specs),
                     list(dtensor.unpack(v.value.read_value())[0].shape)]
            for v in model.weights if layout.is_dvariable(v)}


def weights_api(model):
    """get_weights / set_weights / assign / numpy on sharded and replicated weights."""
    out = {}
    arrays = [RNG.normal(size=w.shape).astype("float32") for w in model.weights]
    model.set_weights(arrays)
    out["set_get_roundtrip"] = equal(model.get_weights(), arrays)
    up = model.get_layer("up").kernel  # (32, 64), columns over model=2 on 2×2
    # each device holds the columns its `model` coordinate owns, after set_weights
    shards = [t.numpy() for t in dtensor.unpack(up.value.read_value())]
    mesh = up.value.layout.mesh
    expected = [arrays[0][:, 32 * mesh.device_location(i)[1]:32 * (mesh.device_location(i)[1] + 1)]
                for i in range(4)]
    out["shards_follow_layout"] = equal(shards, expected)
    out["shard_shape"] = list(shards[0].shape)
    new = RNG.normal(size=up.shape).astype("float32")
    up.assign(new)
    out["assign_sharded"] = bool(np.array_equal(up.numpy(), new)
                                 and np.array_equal(np.array(up), new))
    head = model.get_layer("head").kernel  # replicated
    head.assign(new[:, :10])
    out["assign_replicated"] = bool(np.array_equal(np.asarray(head), new[:, :10])
                                    and np.array_equal(dtensor.unpack(
                                        head.value.read_value())[3].numpy(), new[:, :10]))
    text = io.StringIO()
    model.summary(print_fn=lambda line, **_: text.write(line + "\n"))
    out["summary_trainable"] = [line.strip() for line in text.getvalue().splitlines()
                                if "Trainable params" in line]
    return out


def save_and_load(folder):
    out = {}
    model = built(model_parallel(2, 2))
    out["weights_api"] = weights_api(model)
    keras.utils.set_random_seed(0)
    model.set_weights([w.numpy() for w in user_model().weights])  # a fresh start again
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    saved, predictions = model.get_weights(), model.predict(X, batch_size=8, verbose=0)
    optimizer_state = [np.asarray(v) for v in model.optimizer.variables]
    model.save_weights(os.path.join(folder, "mesh22.weights.h5"))
    model.save(os.path.join(folder, "mesh22.keras"))
    np.savez(os.path.join(folder, "mesh22.npz"), x=X, predictions=predictions,
             **{f"w{i}": w for i, w in enumerate(saved)})
    out["specs_2x2"] = specs(model)

    # the weights file onto a 1×4 mesh and onto one device (no distribution)
    for name, distribution in [("1x4", model_parallel(1, 4)), ("single", None)]:
        other = built(distribution, seed=1)
        other.optimizer.build(other.trainable_variables)  # as in Keras: else no optimizer state
        other.load_weights(os.path.join(folder, "mesh22.weights.h5"))
        out[f"weights_file_on_{name}"] = {
            "bit_equal": equal(other.get_weights(), saved),
            "on_mesh": layout.is_dvariable(other.weights[0]), "specs": specs(other),
            "predict_diff": max_diff(other.predict(X, batch_size=8, verbose=0), predictions),
            "optimizer_state_equal": equal([np.asarray(v) for v in other.optimizer.variables],
                                           optimizer_state)}

    # DataParallel: every weight whole on every device; a weight assigned from another
    # mesh's variable (this 2×2 model's)
    data_parallel = built(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()), seed=1)
    data_parallel.load_weights(os.path.join(folder, "mesh22.weights.h5"))
    out["weights_file_on_data_parallel"] = {
        "bit_equal": equal(data_parallel.get_weights(), saved), "specs": specs(data_parallel)}
    data_parallel.get_layer("up").kernel.assign(model.get_layer("up").kernel * 2.0)
    out["assign_from_another_mesh"] = bool(np.array_equal(
        data_parallel.get_layer("up").kernel.numpy(), saved[0] * 2.0))

    # the .keras file: under 1×4 laid out by its map; without a distribution a plain model
    for name, distribution in [("1x4", model_parallel(1, 4)), ("single", None)]:
        keras.distribution.set_distribution(distribution)
        loaded = keras.models.load_model(os.path.join(folder, "mesh22.keras"))
        out[f"load_model_{name}"] = {
            "bit_equal": equal(loaded.get_weights(), saved),
            "on_mesh": layout.is_dvariable(loaded.weights[0]), "specs": specs(loaded),
            "optimizer": type(loaded.optimizer).__name__,
            "optimizer_state_equal": equal([np.asarray(v) for v in loaded.optimizer.variables],
                                           optimizer_state),
            "predict_diff": max_diff(loaded.predict(X, batch_size=8, verbose=0), predictions)}

    # loaded on the mesh it was saved on, training goes on as if never saved
    keras.distribution.set_distribution(model_parallel(2, 2))
    loaded = keras.models.load_model(os.path.join(folder, "mesh22.keras"))
    loaded.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    out["resumed_after_load_model_bit_equal"] = equal(loaded.get_weights(), model.get_weights())
    out["resumed_iterations"] = int(loaded.optimizer.iterations.numpy())
    return out


class Record(keras.callbacks.Callback):
    """What Keras's loops hand to a user's callback."""

    def __init__(self):
        super().__init__()
        self.calls, self.outputs, self.epochs, self.test_end = [], [], [], None

    def on_test_begin(self, logs=None):
        self.calls.append("test_begin")

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(f"test_batch_{batch}")

    def on_test_end(self, logs=None):
        self.test_end = dict(logs)

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(f"predict_batch_{batch}")
        self.outputs.append(np.asarray(logs["outputs"]))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((epoch, self.model.get_weights()))


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def callbacks(folder):
    out = {}
    model = built(model_parallel(2, 2))
    record = Record()
    logs = model.evaluate(X, Y, batch_size=8, verbose=0, callbacks=[record], return_dict=True)
    predictions = model.predict(X, batch_size=8, verbose=0, callbacks=[record])
    out["evaluate_predict"] = {
        "calls": record.calls, "test_end_equals_result": record.test_end == logs,
        "outputs_are_the_predictions": bool(np.array_equal(np.concatenate(record.outputs),
                                                           predictions))}

    # ModelCheckpoint (weights only and the whole model) in fit on the mesh
    checkpoints = os.path.join(folder, "checkpoints")
    record = Record()
    model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "e{epoch}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "e{epoch}.keras")), record])
    after_first = record.epochs[0][1]
    fresh = built(model_parallel(1, 4), seed=1)
    fresh.load_weights(os.path.join(checkpoints, "e1.weights.h5"))
    whole = keras.models.load_model(os.path.join(checkpoints, "e2.keras"))
    out["model_checkpoint"] = {
        "files": sorted(os.listdir(checkpoints)),
        "epoch_1_weights_bit_equal": equal(fresh.get_weights(), after_first),
        "epoch_2_model_bit_equal": equal(whole.get_weights(), model.get_weights())}

    # BackupAndRestore: interrupted at the start of epoch 2, resumed by a new fit
    reference = built(model_parallel(2, 2))
    reference.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0)
    backup = os.path.join(folder, "backup")
    interrupted = built(model_parallel(2, 2))
    try:
        interrupted.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
        out["interrupted"] = False
    except RuntimeError:
        out["interrupted"] = True
    resumed, record = built(model_parallel(2, 2), seed=1), Record()  # other initial weights
    history = resumed.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup), record])
    out["backup_and_restore"] = {
        "epochs_run": [epoch for epoch, _ in record.epochs],
        "history_epochs": len(history.history["loss"]),
        "iterations": int(resumed.optimizer.iterations.numpy()),
        "bit_equal_to_uninterrupted": equal(resumed.get_weights(), reference.get_weights())}
    return out


def adam_variables(optimizer):
    """The variables of the Adam under `optimizer`: all but tfpar's skipped-step counter,
    which Keras's file does not hold (stock Keras would not know it)."""
    counter = optimizer.nonfinite_steps
    return [v for v in optimizer.variables if v is not counter]


def distributed_optimizer(folder):
    """A model compiled with tfpar.DistributedOptimizer (no strategy: one replica, Adam's
    own update), saved for tests/keras_stock_load_child.py."""
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(0)
    model = user_model()
    model.compile(optimizer=tfpar.DistributedOptimizer(keras.optimizers.Adam(1e-2),
                                                       compression="powersgd", rank=1),
                  loss=LOSS)
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.save(os.path.join(folder, "distributed.keras"))
    np.savez(os.path.join(folder, "distributed.npz"),
             predictions=model.predict(X, batch_size=8, verbose=0),
             **{f"o{i}": np.asarray(v) for i, v in enumerate(adam_variables(model.optimizer))})
    return {"optimizer_class": type(model.optimizer).__name__,
            "aggregator": type(tfpar.compression.aggregator_of(model.optimizer)).__name__}


def main(folder):
    layout.enable()
    out = {}
    for name, case in [("save_and_load", save_and_load), ("callbacks", callbacks),
                       ("distributed_optimizer", distributed_optimizer)]:
        try:
            out[name] = case(folder)
        except Exception:  # noqa: BLE001 - reported to the test that reads this case
            import traceback
            out[name] = {"error": traceback.format_exc()[-5000:]}
        finally:
            keras.distribution.set_distribution(None)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
