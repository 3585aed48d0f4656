"""A `tfpar.DistributedOptimizer` codec's state in Keras's own files, for the children of
tests/test_keras_3d.py (the 3D mesh) and tests/test_keras_mesh_codecs.py (one mesh): the
same runs on either mesh (`run`), given that mesh's `fit` and compiled model, and the
same assertions on their results (`check_codec`, `check_other_codec`,
`check_without_tfpar`).
Imports no TensorFlow device setup of its own (each child splits its CPUs first)."""

import os
import tempfile

import h5py
import keras
import numpy as np

import tfpar

# Codecs that keep state, each a `DistributedOptimizer` maker: top-k's error feedback and
# PowerSGD's Q over SGD, Adam in front of PowerSGD (2 exact steps, then compressed).
CODECS = {
    "topk": lambda: tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="topk",
                                               ratio=0.1),
    "powersgd": lambda: tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                   compression="powersgd", rank=1),
    "adam_front": lambda: tfpar.DistributedOptimizer(
        keras.optimizers.Adam(1e-2), compression="powersgd", rank=1, adam_warmup_steps=2)}
GROUP = "optimizer/tfpar_codec_state"


class StopAt(keras.callbacks.Callback):
    """Raises at the start of batch `batch` of epoch `epoch` (a run killed there)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt


def entries(path):
    """The codec entries of a Keras weights file (`tfpar.keras_codec_state`'s group)."""
    with h5py.File(path, "r") as f:
        group = f.get(GROUP + "/vars")
        return {} if group is None else {k.replace("|", "/"): np.asarray(group[k])
                                         for k in group}


def run(fit, compiled, diff):
    """Per codec of `CODECS`: two epochs uninterrupted; Keras's `BackupAndRestore` stopped
    inside the second epoch and resumed by a fresh model; `model.save` after one epoch,
    one more epoch, `load_weights` of that file, one more epoch; `load_model` of that
    file, one more epoch; that file's codec entries; a `save_weights` file without them (as files were written before) loaded;
    then a file of another codec refused.

    Args:
        fit: `fit(model, epochs=1, callbacks=())` → the epochs' losses.
        compiled: `compiled(optimizer)` → a model with the same initial weights.
        diff: the largest difference of two weight lists.
    """
    folder = tempfile.mkdtemp()
    out = {}
    for name, make in CODECS.items():
        model = compiled(make())
        fit(model, epochs=2)
        two_epochs = model.get_weights()
        result = {}
        backup = os.path.join(folder, name + "_backup")
        model = compiled(make())
        try:
            fit(model, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup),
                                            StopAt(1, 1)])
            result["stopped"] = False
        except KeyboardInterrupt:
            result["stopped"] = True
        model = compiled(make())
        result["epochs_run"] = len(fit(model, epochs=2, callbacks=[
            keras.callbacks.BackupAndRestore(backup)]))
        result["backup"] = diff(model.get_weights(), two_epochs)
        # Keras's file after one epoch, read back after another
        model = compiled(make())
        fit(model)
        path = os.path.join(folder, name + ".keras")
        model.save(path)
        weights_path = os.path.join(folder, name + ".weights.h5")
        model.save_weights(weights_path)
        fit(model)
        model.load_weights(path)
        fit(model)
        result["load_weights"] = diff(model.get_weights(), two_epochs)
        # ... and by `load_model` (the same distribution): the codec named in the file
        loaded = keras.saving.load_model(path)
        result["loaded_codec"] = type(tfpar.compression.aggregator_of(loaded.optimizer)
                                      ).__name__
        fit(loaded)
        result["load_model"] = diff(loaded.get_weights(), two_epochs)
        result["load_model_iterations"] = int(np.asarray(loaded.optimizer.iterations))
        held = entries(weights_path)
        result["entries"] = sorted(held)
        result["entries_max_abs"] = max([float(np.max(np.abs(v))) for v in held.values()],
                                        default=0.0)
        # a file without the codec's entries loads (the codec's state stays as it is)
        with h5py.File(weights_path, "a") as f:
            if GROUP in f:
                del f[GROUP]
        try:
            model.load_weights(weights_path)
            result["old_file"] = None
        except Exception as error:  # noqa: BLE001
            result["old_file"] = f"{type(error).__name__}: {error}"
        out[name] = result
    # a file of another codec: refused in one line
    model = compiled(CODECS["powersgd"]())
    fit(model)
    try:
        model.load_weights(os.path.join(folder, "topk.keras"))
        out["other_codec"] = None
    except Exception as error:  # noqa: BLE001 (Keras's load wraps a saveable's error)
        out["other_codec"] = f"{type(error).__name__}: {error}"
    # the file in a process without tfpar: its class unregistered, as there
    registered = keras.saving.get_custom_objects()
    own = registered.pop("tfpar>DistributedSGD")
    try:
        keras.saving.load_model(os.path.join(folder, "topk.keras"))
        out["without_tfpar"] = None
    except Exception as error:  # noqa: BLE001
        out["without_tfpar"] = f"{type(error).__name__}: {error}"
    finally:
        registered["tfpar>DistributedSGD"] = own
    return out


def check_codec(run_, codec, weight):
    """The assertions on `run`'s result for `codec`: Keras's BackupAndRestore stopped
    inside the second epoch and resumed by a fresh model, `model.save` after one epoch read
    back by `load_weights` after a second, and by `load_model` (the codec named in the
    file) then one more epoch: each equals two epochs uninterrupted (SGD 1e-6, Adam 1e-5);
    the entries under the model's weight paths (`weight`), as tfpar.train's checkpoints
    name them. Without the codec's state in the file the resumed run starts it afresh."""
    tolerance = 1e-5 if codec == "adam_front" else 1e-6
    assert run_["stopped"] and run_["epochs_run"] == 1, run_
    assert run_["backup"] <= tolerance, run_
    assert run_["load_weights"] <= tolerance, run_
    assert run_["load_model"] <= tolerance, run_
    assert run_["loaded_codec"] == ("TopKAggregator" if codec == "topk"
                                    else "PowerSGDAggregator"), run_
    kind = {"topk": "residual", "powersgd": "powersgd_q", "adam_front": "adam_m"}[codec]
    assert f"codec/{weight}/{kind}" in run_["entries"], run_["entries"]
    assert run_["entries_max_abs"] > 0, run_
    assert run_["old_file"] is None, run_  # a file without them still loads


def check_other_codec(raised):
    """Another codec's file refused: Keras's load_weights wraps a saveable's error in its
    own; tfpar's is one line of it."""
    assert raised is not None, raised
    assert any(line.startswith("the file's codec state") for line in raised.splitlines()), raised


def check_without_tfpar(raised):
    """Stock Keras (tfpar's class unregistered) cannot locate the optimizer's class: one
    line."""
    assert raised is not None and "\n" not in raised, raised
    assert "DistributedSGD" in raised, raised
