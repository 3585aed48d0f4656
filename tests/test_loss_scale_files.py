"""fp16's loss scale around a `tfpar.DistributedOptimizer` in Keras's own files.

Under `mixed_float16` Keras's `LossScaleOptimizer` wraps the `DistributedOptimizer`, and
Keras's class writes and reads its own variables and the inner optimizer's as one list.
On tf.distribute the file names Keras's own classes (stock Keras loads it): its
`LossScaleOptimizer` around a `DistributedOptimizer` writes the entries stock Keras's class
around the plain optimizer holds, without tfpar's counter of skipped steps
(`tfpar.keras_codec_state.write_plain`), and reads those or a file with the counter
(`read_either`, which `CodecLossScaleOptimizer` on a mesh takes too); child
`lso_resume_child.py`.
"""

import os
import sys
import warnings

import keras
import numpy as np
import pytest

from subproc import ROOT, last_json_line, run

CHILD = os.path.join(ROOT, "tests", "lso_resume_child.py")
# Stock Keras goes on without the codec (the compression is not in the file): with
# compression="fp16" one epoch differs from the compressed run by the gradients' float16
# rounding (measured 6.6e-6); without compression the maths is the same (exact).
STOCK_TOLERANCE = {"none": 0.0, "fp16": 1e-4, "offload": 0.0}


# "offload": Adam's slots in host memory, written by the inner optimizer's own save; the
# file held the loss scale's 4 entries and 2 of Adam's (6 against the 14 stock Keras builds)
# before the loss scale's file took the inner optimizer's entries.
@pytest.mark.parametrize("case", ["none", "fp16", "offload"])
def test_load_model_of_an_fp16_distributed_optimizer_file_keeps_the_loss_scale(
        case, tmp_path, report_measured):
    """2 epochs uninterrupted against 1 epoch → `model.save` → `keras.saving.load_model`
    in a fresh process → 1 epoch, on `MirroredStrategy` over 2 logical CPUs. Before the
    file held 15 entries against the 14 stock Keras builds: Keras skipped the loss scale's
    (restarted at 32768 for 512 saved) and the run skipped overflowing steps again."""
    train = last_json_line(run([sys.executable, CHILD, "train", str(tmp_path), case],
                               timeout=600).stdout)
    assert (train["strategy"], train["replicas"]) == ("MirroredStrategy", 2), train
    assert train["optimizer"] == "LossScaleOptimizer", train
    assert train["saved"][0] < 2.0 ** 15, train  # the scale moved: a restart would show
    assert train["saved"][2] < 8, train  # overflowing steps were skipped in the epoch
    for who in ("stock", "tfpar"):
        out = last_json_line(run([sys.executable, CHILD, "resume", str(tmp_path), case, who],
                                 timeout=600, fresh=who == "stock").stdout)
        report_measured(f"fp16 {case} DistributedOptimizer, load_model ({who}) + 1 epoch "
                        f"against 2 epochs: max |dw| = {out['max_diff']:.2e}")
        assert out["tfpar_imported"] == (who == "tfpar") and out["replicas"] == 2, out
        # the file names Keras's own classes, and holds what they build
        assert out["loaded_class"] == ["LossScaleOptimizer", "Adam"], out
        assert out["loaded_variables"] == train["file_entries"], (out, train)
        assert out["warnings"] == [], out["warnings"]
        assert out["loaded"] == train["saved"], (out, train)  # scale, counter, iterations
        if who == "tfpar":  # compiled again with the codec, the file's state read into it
            assert out["reloaded"] == train["saved"], (out, train)
        assert out["after"] == train["two"], (out, train)
        tolerance = STOCK_TOLERANCE[case] if who == "stock" else 0.0
        assert out["max_diff"] <= tolerance, (out, tolerance)


def _built(cls, distributed):
    """`cls` (a `LossScaleOptimizer` class) around SGD with momentum, or a
    `DistributedOptimizer` of it (with its counter `nonfinite_steps`), built for one
    weight of 3 entries: the loss scale's 4 variables, SGD's 2 and its momentum (7)."""
    import tfpar
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    if distributed:
        inner = tfpar.DistributedOptimizer(inner, compression="none")
    optimizer = cls(inner)
    optimizer.build([keras.Variable(np.zeros(3, "float32"))])
    return optimizer


def _plain_file(size=3):
    """The file's entries of Keras's class around the plain SGD (`_built`'s 7 variables):
    the loss scale 512, the momentum 7s (`size` of them)."""
    source = _built(keras.optimizers.LossScaleOptimizer, distributed=False)
    source.dynamic_scale.assign(512.0)
    source.variables[6].assign(np.full(3, 7.0, "float32"))
    store = {}
    source.save_own_variables(store)
    store["6"] = np.full(size, 7.0, "float32")
    return store


def _values(optimizer):
    return [np.asarray(v).tolist() for v in optimizer.variables]


def _loss_scale_classes():
    import tfpar  # noqa: F401  (DistributedOptimizer sets Keras's class's file methods)
    from tfpar.keras_codec_state import CodecLossScaleOptimizer
    tfpar.DistributedOptimizer("sgd", compression="none")
    return [CodecLossScaleOptimizer, keras.optimizers.LossScaleOptimizer]


@pytest.mark.parametrize("index", [0, 1])
def test_a_file_with_or_without_the_counter_is_read_and_other_shapes_fall_back(index):
    """`read_either`'s checks, each able to fail: a file one entry longer whose last entry
    is one number loads without it; one whose last entry is not one number, or whose
    entries have other shapes, falls back to Keras's own load (its warning, nothing
    assigned: without the checks the momentum would be read from the wrong entry or
    Keras's assign would raise); a file without the counter loads into an optimizer with
    one (the counter kept)."""
    cls = _loss_scale_classes()[index]

    plain = _built(cls, distributed=False)
    extra = {**_plain_file(), "7": np.asarray(3.0, "float32")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Skipping variable loading"
        plain.load_own_variables(extra)
    assert _values(plain)[6] == [7.0] * 3 and _values(plain)[3] == 512.0
    for store in ({**_plain_file(), "7": np.zeros(2, "float32")},  # not one number, last
                  {**_plain_file(size=4), "7": np.asarray(3.0, "float32")}):  # a shape
        fresh = _built(cls, distributed=False)
        before = _values(fresh)
        with pytest.warns(UserWarning, match="Skipping variable loading"):
            fresh.load_own_variables(store)
        assert _values(fresh) == before

    counted = _built(cls, distributed=True)
    assert len(counted.variables) == 8  # the inner optimizer's counter, last
    counted.inner_optimizer.nonfinite_steps.assign(2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counted.load_own_variables(_plain_file())
    assert _values(counted)[6] == [7.0] * 3 and _values(counted)[7] == 2.0
    fresh = _built(cls, distributed=True)
    before = _values(fresh)
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        fresh.load_own_variables(_plain_file(size=4))  # the same count, another shape
    assert _values(fresh) == before


def test_keras_class_around_a_distributed_optimizer_writes_what_stock_keras_reads():
    """Keras's `LossScaleOptimizer` around a `DistributedOptimizer` off a mesh writes its
    variables without the counter (7 of 8), which Keras's class around the plain
    optimizer reads with no warning; with every entry (a file written before) it reads
    them all, counter too."""
    cls = _loss_scale_classes()[1]
    live = _built(cls, distributed=True)
    live.inner_optimizer.nonfinite_steps.assign(4.0)
    live.dynamic_scale.assign(512.0)
    store = {}
    live.save_own_variables(store)
    assert len(store) == 7 and float(store["3"]) == 512.0, sorted(store)  # dynamic_scale
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stock = _built(cls, distributed=False)
        stock.load_own_variables(store)
    assert float(np.asarray(stock.dynamic_scale)) == 512.0
    older = {str(i): np.asarray(v) for i, v in enumerate(live.variables)}
    again = _built(cls, distributed=True)
    again.load_own_variables(older)
    assert _values(again) == _values(live)


def test_the_patch_notices_a_keras_change(monkeypatch):
    from tfpar import patches
    from tfpar.patches import keras_optimizer
    assert patches.check_targets(["loss_scale_files"]) == []
    monkeypatch.setattr(keras_optimizer, "_LSO_OWN_AT_IMPORT", ["save_own_variables"])
    monkeypatch.setitem(keras_optimizer.FRAGMENTS, "loss_scale_files", [
        ("LossScaleOptimizer.variables", lambda: keras_optimizer._LSO.variables.fget,
         "not Keras's code")])
    problems = patches.check_targets(["loss_scale_files"])
    assert len(problems) == 2 and all("loss_scale_files" in p for p in problems), problems
