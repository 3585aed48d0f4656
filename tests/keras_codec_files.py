"""A `tfpar.DistributedOptimizer` codec's state in Keras's own files, for the children of
tests/test_keras_3d.py (the 3D mesh) and tests/test_keras_mesh_codecs.py (one mesh): the
same runs on either mesh (`run`; `run_nested`, a model whose weights' Keras paths repeat;
`run_fp16`, `mixed_float16`'s loss scale with the codec), given that mesh's `fit` and
compiled model, and the same assertions on their results (`check_codec`,
`check_other_codec`, `check_lookalikes`, `check_without_tfpar`, `check_nested`,
`check_fp16`).
Imports no TensorFlow device setup of its own (each child splits its CPUs first)."""

import os
import shutil
import tempfile
import warnings

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
# Codecs whose state has the same entries and shapes as top-k's at ratio 0.1 (every lossy
# codec keeps a residual per weight): only the codec the file names tells them apart.
LOOKALIKES = {
    "topk_ratio": lambda: tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     compression="topk", ratio=0.2),
    "threshold": lambda: tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    compression="threshold")}
GROUP = "optimizer/tfpar_codec_state"
IDENTITY = GROUP + "/vars/identity"


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
    """The codec entries of a Keras weights file (`tfpar.keras_codec_state`'s group), its
    `identity` aside."""
    with h5py.File(path, "r") as f:
        group = f.get(GROUP + "/vars")
        return {} if group is None else {k.replace("|", "/"): np.asarray(group[k])
                                         for k in group if k.startswith("codec|")}


def identity(path):
    """The codec a Keras weights file's group names (its `identity` entry), or None."""
    with h5py.File(path, "r") as f:
        if IDENTITY not in f:
            return None
        return tfpar.keras_codec_state.decode_identity(np.asarray(f[IDENTITY]))


def _error(call):
    """`call()`'s error as one string, or None when it returned."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 (Keras's load wraps a saveable's error)
        return f"{type(error).__name__}: {error}"
    return None


def run(fit, compiled, diff):
    """Per codec of `CODECS`, `one_codec`; then a file of another codec refused, one of
    top-k at another ratio and one into threshold (`LOOKALIKES`: the same entries and
    shapes), and stock Keras without tfpar's class.

    Args:
        fit: `fit(model, epochs=1, callbacks=())` → the epochs' losses.
        compiled: `compiled(optimizer)` → a model with the same initial weights.
        diff: the largest difference of two weight lists.
    """
    folder = tempfile.mkdtemp()
    models = {}
    out = {name: one_codec(fit, compiled, diff, make, os.path.join(folder, name), models)
           for name, make in CODECS.items()}
    topk = os.path.join(folder, "topk.keras")
    # a file of another codec: refused in one line, read into PowerSGD's compiled model
    # of `one_codec` (fitted, its codec state made; a new model's trace cost the most)
    out["other_codec"] = _error(lambda: models["powersgd"].load_weights(topk))
    # ... and of a codec whose entries look the same: read into a trained model, and
    # before the first fit (held, refused when the codec's state is made)
    model = compiled(LOOKALIKES["topk_ratio"]())
    fit(model)
    out["lookalike_topk_ratio"] = _error(lambda: model.load_weights(topk))
    model = compiled(LOOKALIKES["threshold"]())
    model.load_weights(topk)
    out["lookalike_threshold"] = _error(lambda: fit(model))
    # the file in a process without tfpar: its class unregistered, as there
    registered = keras.saving.get_custom_objects()
    own = registered.pop("tfpar>DistributedSGD")
    try:
        out["without_tfpar"] = _error(lambda: keras.saving.load_model(topk))
    finally:
        registered["tfpar>DistributedSGD"] = own
    return out


def one_codec(fit, compiled, diff, make, stem, models=None):
    """Two epochs uninterrupted; Keras's `BackupAndRestore` stopped inside the second epoch
    and resumed by a fresh model; `model.save` after one epoch, one more epoch,
    `load_weights` of that file, one more epoch; `load_model` of that file, one more
    epoch; that file's codec entries and identity; the file without its identity (as
    written before it was recorded) read by the loaded model, one more epoch; a
    `save_weights` file without the codec's entries (as files were written before) loaded.
    `make()` gives the optimizer, `stem` the files' path without suffix; `models`, a dict,
    gets the compiled model read by `load_weights` under the codec's name (`stem`'s last
    part), for more checks of a model that fitted with the codec."""
    model = compiled(make())
    fit(model, epochs=2)
    two_epochs = model.get_weights()
    result = {}
    backup = stem + "_backup"
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
    path = stem + ".keras"
    model.save(path)
    weights_path = stem + ".weights.h5"
    model.save_weights(weights_path)
    fit(model)
    model.load_weights(path)
    fit(model)
    result["load_weights"] = diff(model.get_weights(), two_epochs)
    # ... and by `load_model` (the same distribution): the codec named in the file
    loaded = keras.saving.load_model(path)
    result["loaded_codec"] = type(tfpar.compression.aggregator_of(loaded.optimizer)).__name__
    fit(loaded)
    result["load_model"] = diff(loaded.get_weights(), two_epochs)
    result["load_model_iterations"] = int(np.asarray(loaded.optimizer.iterations))
    held = entries(weights_path)
    result["entries"] = sorted(held)
    result["entries_max_abs"] = max([float(np.max(np.abs(v))) for v in held.values()],
                                    default=0.0)
    result["identity"] = identity(weights_path)
    # a file written before the codec's identity was recorded: read by its entries
    unnamed = stem + ".unnamed.weights.h5"
    shutil.copy(weights_path, unnamed)
    with h5py.File(unnamed, "a") as f:
        del f[IDENTITY]
    loaded.load_weights(unnamed)
    fit(loaded)
    result["unnamed"] = diff(loaded.get_weights(), two_epochs)
    # a file without the codec's entries loads (the codec's state stays as it is)
    with h5py.File(weights_path, "a") as f:
        if GROUP in f:
            del f[GROUP]
    result["old_file"] = _error(lambda: model.load_weights(weights_path))
    if models is not None:
        models[os.path.basename(stem)] = model
    return result


def run_nested(fit, compiled, diff, codec="topk"):
    """`one_codec` of `codec` (of `CODECS`) on a model whose weights' Keras paths repeat
    (`compiled` builds it: two nested models' Dense "proj", their codec state under
    `proj/kernel` and `proj/kernel#2`)."""
    return {codec: one_codec(fit, compiled, diff, CODECS[codec],
                             os.path.join(tempfile.mkdtemp(), "nested"))}


def _scale(optimizer):
    """A `LossScaleOptimizer`'s dynamic scale and its count of steps since it last moved."""
    return [float(np.asarray(optimizer.dynamic_scale)), int(np.asarray(optimizer.step_counter))]


def fp16_topk():
    """Top-k over SGD behind the user's own `LossScaleOptimizer`, its scale doubled after
    every 2 finite steps (a scale that moves inside the run)."""
    return tfpar.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic_growth_steps=2), compression="topk", ratio=0.1)


def run_fp16(fit, compiled, diff, make=fp16_topk):
    """Under `mixed_float16`, `make()`'s optimizer: two epochs uninterrupted; `model.save`
    after one epoch, `load_model`, one more epoch: the weights and the loss scale against
    the uninterrupted run's, and Keras's warnings at the load."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = compiled(make())
        fit(model, epochs=2)
        two_epochs, result = model.get_weights(), {"scale": _scale(model.optimizer)}
        model = compiled(make())
        fit(model)
        result["saved_scale"] = _scale(model.optimizer)
        path = os.path.join(tempfile.mkdtemp(), "fp16.keras")
        model.save(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras.saving.load_model(path)
        result["load_warnings"] = [str(w.message) for w in caught
                                   if "variable loading" in str(w.message)]
        result["loaded"] = [
            isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer),
            type(tfpar.compression.aggregator_of(loaded.optimizer)).__name__]
        result["loaded_scale"] = _scale(loaded.optimizer)
        fit(loaded)
        result["load_model"] = diff(loaded.get_weights(), two_epochs)
        result["load_model_scale"] = _scale(loaded.optimizer)
        return result
    finally:
        keras.mixed_precision.set_global_policy("float32")


def check_fp16(run_, tolerance=1e-6):
    """`run_fp16`'s result: `load_model` gives the loss scale the file holds (no variable
    of the optimizer skipped), and one more epoch equals two uninterrupted, scale too."""
    assert run_["loaded"] == [True, "TopKAggregator"], run_
    assert run_["saved_scale"][0] != 2.0 ** 15, run_  # moved from Keras's initial scale
    assert run_["load_warnings"] == [], run_["load_warnings"]
    assert run_["loaded_scale"] == run_["saved_scale"], run_
    assert run_["load_model_scale"] == run_["scale"], run_
    assert run_["load_model"] <= tolerance, run_


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
    assert run_["unnamed"] <= tolerance, run_  # a file without the identity, as before
    named = {"codec": "topk" if codec == "topk" else "powersgd"}
    if codec == "adam_front":
        named["adam_front"] = True
    assert named.items() <= run_["identity"].items(), run_["identity"]
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


def check_lookalikes(out):
    """A file of top-k at ratio 0.1 read into top-k at 0.2 (after a fit) and into
    threshold (before the first fit: refused when the codec's state is made): the same
    entries and shapes, refused in one line naming both codecs."""
    # in `DistributedOptimizer`'s words (`ratio`), not the mesh's (`topk_ratio`)
    for name, differ in (("topk_ratio", "ratio"), ("threshold", "codec")):
        raised = out["lookalike_" + name]
        assert raised is not None, name
        lines = [line for line in raised.splitlines()
                 if "the file's codec state was written by" in line]
        assert len(lines) == 1, raised
        assert "compression='topk'" in lines[0] and " ratio=0.1" in lines[0], lines[0]
        assert "topk_ratio" not in lines[0], lines[0]
        assert f"differ in {differ}" in lines[0], lines[0]
    # refused by the fit that makes the codec's state: tfpar's own error, one line
    assert out["lookalike_threshold"].startswith("TfparError: "), out["lookalike_threshold"]
    assert len(out["lookalike_threshold"].splitlines()) == 1, out["lookalike_threshold"]


def check_nested(run_, codec):
    """`run_nested`'s result for `codec`: each "proj" named apart (`#2`) and each file's
    state equal to two epochs uninterrupted (`check_codec`'s assertions)."""
    check_codec(run_, codec, "proj/kernel")
    kind = {"topk": "residual", "powersgd": "powersgd_q"}[codec]
    assert f"codec/proj/kernel#2/{kind}" in run_["entries"], run_["entries"]


def check_without_tfpar(raised):
    """Stock Keras (tfpar's class unregistered) cannot locate the optimizer's class: one
    line."""
    assert raised is not None and "\n" not in raised, raised
    assert "DistributedSGD" in raised, raised
