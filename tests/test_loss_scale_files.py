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

import pytest

from subproc import ROOT, last_json_line, run

CHILD = os.path.join(ROOT, "tests", "lso_resume_child.py")
# Stock Keras goes on without the codec (the compression is not in the file): with
# compression="fp16" one epoch differs from the compressed run by the gradients' float16
# rounding (measured 6.6e-6); without compression the maths is the same (exact).
STOCK_TOLERANCE = {"none": 0.0, "fp16": 1e-4}


@pytest.mark.parametrize("case", ["none", "fp16"])
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
