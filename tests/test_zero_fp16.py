"""fp16 loss scaling with ZeRO 1/2 (`--zero_stage=1|2 --mixed_precision=fp16`).

Keras's `LossScaleOptimizer` wraps the ZeRO optimizer: it unscales each replica's
gradients in fp32 before the ZeRO update, which reduce-scatters them. ZeRO 1/2 on
tf.distribute run the very forward and backward of fp16 data parallelism (the same
strategy, the same fp16 casts), so against fp16 data parallelism on the same seed and
data the weights after 5 steps differ only by the fp32 sum and update order: the plain
ZeRO tolerances of tests/test_zero.py hold (1e-6 momentum, 1e-5 Adam; measured
2026-12-05: 0 and 7.5e-9), and the int8 reduce-scatter within its codec's tolerance of
tests/test_zero_compression.py. A resumed fp16 run (scale, slots, residual) ends where
the uninterrupted one does. tests/zero_fp16_child.py forces an overflowing step (one
infinite input, on replica 0): every replica skips it, nothing moves but the scale; in
float32 with `--on_nan=skip_step` ZeRO's own check skips it and counts it once.
"""

import json
import os
import sys

import numpy as np

from subproc import ROOT, last_json_line, run, run_concurrently
from test_zero import ADAM, BASE, MOMENTUM, max_diff, weights
from test_zero_compression import TOLERANCE

CHILD = os.path.join(ROOT, "tests", "zero_child.py")
SKIP_CHILD = os.path.join(ROOT, "tests", "zero_fp16_child.py")


def test_zero_1_2_with_fp16_train_as_fp16_data_parallel(tmp_path, report_measured):
    where = {**BASE, "strategy": "mirrored", "cpu_devices": 2, "mixed_precision": "fp16"}
    mlp = {**where, "model": "mlp", **MOMENTUM}
    tr = {**where, "model": "transformer", "model_depth": 1, **ADAM}
    ckpt = str(tmp_path / "ckpt")
    cases = [{"name": "mlp-dp", **mlp}, {"name": "mlp-z1", **mlp, "zero_stage": 1},
             {"name": "mlp-z2-int8", **mlp, "zero_stage": 2, "compression": "int8",
              "checkpoint_dir": ckpt},
             {"name": "tr-dp", **tr}, {"name": "tr-z2", **tr, "zero_stage": 2}]
    # mlp-z2-int8 saved its 5 steps: "resumed" goes on to 10 against "whole".
    long = {**mlp, "zero_stage": 2, "compression": "int8", "steps": 10}
    cases += [{"name": "whole", **long}, {"name": "resumed", **long, "checkpoint_dir": ckpt}]
    prefix = str(tmp_path / "w")
    out, skip_out = run_concurrently([
        lambda: run([sys.executable, CHILD, json.dumps(cases), prefix], timeout=600),
        lambda: run([sys.executable, SKIP_CHILD], timeout=600)])
    results = last_json_line(out.stdout)

    def diff(a, b):
        return max_diff(weights(f"{prefix}.{a}.npz"), weights(f"{prefix}.{b}.npz"))

    for name, ref, tolerance in (("mlp-z1", "mlp-dp", 1e-6), ("tr-z2", "tr-dp", 1e-5)):
        d = diff(name, ref)
        report_measured(f"zero fp16: {name} vs {ref}, max |dw| after 5 steps = {d:.2e}")
        assert d <= tolerance, (name, d)
        assert results[name]["comm"]["bytes_on_wire_per_step"] > results[ref]["comm"][
            "bytes_on_wire_per_step"]  # ZeRO's own collectives ran (pieces + gather)
    d = diff("mlp-z2-int8", "mlp-dp")
    report_measured(f"zero fp16: mlp-z2-int8 vs mlp-dp, max |dw| after 5 steps = {d:.2e}")
    assert 0 < d <= TOLERANCE["int8"], d
    comm = results["mlp-z2-int8"]["comm"]
    assert comm["compression_ratio"] > 1.3, comm  # int8 pieces + the fp32 weight gather
    loss, ref_loss = results["mlp-z2-int8"]["final_loss"], results["mlp-dp"]["final_loss"]
    assert abs(loss - ref_loss) <= 0.02 * abs(ref_loss), (loss, ref_loss)
    # Sharded state stays sharded under the LossScaleOptimizer.
    assert max(results["tr-z2"]["optimizer_state_bytes_per_device"]) <= 0.55 * max(
        results["tr-dp"]["optimizer_state_bytes_per_device"])

    assert results["resumed"]["resumed_from_step"] == 5
    assert diff("resumed", "whole") == 0
    np.testing.assert_array_equal(results["resumed"]["loss_history"],
                                  results["whole"]["loss_history"][5:])

    skips = last_json_line(skip_out.stdout)
    for name, r in skips.items():
        fp16 = "fp32" not in name
        # Something to move: Adam's m and v pieces on both replicas, and (int8) each
        # replica's residual.
        assert r["slot_pieces"] == 4 and r["slots_largest"] > 0, (name, r)
        assert r["residuals"] == (2 if "int8" in name else 0), (name, r)
        if r["residuals"]:
            assert r["residual_largest"] > 0, (name, r)
        # The step with one infinite input is skipped by both replicas: no weight, slot
        # piece or residual moved; with fp16 the step count stays and the scale halves.
        if fp16:  # (in float32 whether the loss is finite depends on the CPU's ReLU)
            assert not np.isfinite(r["skipped_loss"]), (name, r)
        assert r["weights_moved"] == r["slots_moved"] == r["residual_moved"] == 0, (name, r)
        if fp16:
            assert r["iterations"][1] == r["iterations"][0] == 2, (name, r)
            assert r["scales"][1] == r["scales"][0] / 2, (name, r)
        else:  # the optimizer's step count still advances (tfpar.nan_guard)
            assert r["iterations"] == [2, 3] and r["scales"] == [None, None], (name, r)
        # ZeRO's count of skipped steps (the NaN guard and TensorBoard's skipped_steps read
        # it): with fp16 the LossScaleOptimizer skipped before ZeRO's update ran, which
        # must not count it again beside the halved scale; in float32 ZeRO skipped it on
        # every replica and counts it once (it counted the replicas, 2, before ababedf).
        assert r["nonfinite_steps"] == [0.0, 0.0 if fp16 else 1.0], (name, r)
        # The next step trains again, finite.
        assert r["weights_moved_next"] > 0 and r["slots_moved_next"] > 0, (name, r)
        if r["residuals"]:
            assert r["residual_moved_next"] > 0, (name, r)
        assert all(np.isfinite(r["losses"])), (name, r)
        # Saved with tfpar.state and loaded into a fresh model: the halved scale, the
        # step, the count, the pieces and residuals come back, and the next step is the same.
        assert r["loaded_scale"] == r["scales"][1], (name, r)
        assert r["loaded_iterations"] == r["iterations"][1], (name, r)
        assert r["loaded_nonfinite_steps"] == r["nonfinite_steps"][1], (name, r)
        assert r["loaded_diff"] == 0 and r["resumed_next_diff"] == 0, (name, r)
    assert sorted(skips) == ["z1", "z2-int8", "z2-int8-fp32-skip"]
    report_measured(f"zero fp16: overflowing step skipped, scale {skips['z1']['scales']}")
