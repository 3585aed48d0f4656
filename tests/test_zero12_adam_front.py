"""ZeRO 1/2 with Adam in front of lowbit, top-k and PowerSGD (`tfpar.zero.sharded`'s
`adam_in_front`, the default with Adam): data parallelism's step
(`tfpar.compression.adam_front`) through the codec's aggregator.

One child (tests/zero_child.py, 2 replicas, mlp, Adam, same seed and data): the exact
warm-up against uncompressed ZeRO-2; each codec's compressed steps (warm-up 2 of 5 steps)
against data parallelism with the same codec, and its bytes; a checkpoint of ZeRO-2 resumed
on data parallelism and one of data parallelism resumed on ZeRO-2, each against the
target's uninterrupted run; under `--on_nan=skip_step` a non-finite step skipped with every
replica's state untouched (tests/zero12_adam_front_child.py). The fp16 overflow with Adam
in front is in tests/test_zero12_codecs.py (its child, tests/zero12_codecs_child.py).
"""

import json
import os
import sys

import pytest

from subproc import ROOT, last_json_line, run
from test_zero import ADAM, BASE, max_diff, weights

CHILD = os.path.join(ROOT, "tests", "zero_child.py")
CODECS = ("lowbit", "topk", "powersgd")
WARM = {"adam_warmup_steps": 2}  # steps 3-5 compressed


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero12_front")
    mlp = {**BASE, "strategy": "mirrored", "cpu_devices": 2, "model": "mlp", **ADAM}
    z2 = {**mlp, "zero_stage": 2}
    cases = [{"name": "z2-none", **z2},
             # The default warm-up (50 steps) covers all 5: exact fp32 sums, Keras's Adam.
             {"name": "z2-lowbit-warmup", **z2, "compression": "lowbit"}]
    for codec in CODECS:
        save = ({"checkpoint_dir": str(folder / "from-z2")} if codec == "lowbit" else {})
        cases += [{"name": f"z2-{codec}", **z2, "compression": codec, **WARM, **save},
                  {"name": f"dp-{codec}", **mlp, "compression": codec, **WARM,
                   **({"checkpoint_dir": str(folder / "from-dp")} if codec == "lowbit"
                      else {})}]
    # Each checkpoint (5 steps, Adam's moments and the codec's residuals in it) resumed on
    # the other backend for 5 more, against that backend's uninterrupted 10.
    ten = {"compression": "lowbit", **WARM, "steps": 10}
    cases += [{"name": "dp-whole", **mlp, **ten},
              {"name": "dp-from-z2", **mlp, **ten, "checkpoint_dir": str(folder / "from-z2")},
              {"name": "z2-whole", **z2, **ten},
              {"name": "z2-from-dp", **z2, **ten, "checkpoint_dir": str(folder / "from-dp")}]
    prefix = str(folder / "w")
    out = run([sys.executable, CHILD, json.dumps(cases), prefix], timeout=900)
    return prefix, last_json_line(out.stdout)


def _diff(prefix, a, b):
    return max_diff(weights(f"{prefix}.{a}.npz"), weights(f"{prefix}.{b}.npz"))


def test_zero12_adam_front_warmup_is_uncompressed_zero(trained, report_measured):
    prefix, results = trained
    d = _diff(prefix, "z2-lowbit-warmup", "z2-none")
    report_measured(f"zero12 Adam in front: warm-up vs uncompressed ZeRO-2, max |dw| = {d:.2e}")
    assert d <= 1e-6, d
    # The warm-up's sums travel as fp32 all-reduces: as many bytes as fp32, not lowbit's.
    assert (results["z2-lowbit-warmup"]["comm"]["bytes_on_wire_per_step"]
            > 0.5 * results["z2-none"]["comm"]["bytes_on_wire_per_step"])


def test_zero12_adam_front_steps_are_data_parallel_steps(trained, report_measured):
    prefix, results = trained
    for codec in CODECS:
        z2, dp = results[f"z2-{codec}"], results[f"dp-{codec}"]
        d = _diff(prefix, f"z2-{codec}", f"dp-{codec}")
        off = _diff(prefix, f"z2-{codec}", "z2-none")
        z2_bytes, dp_bytes = (r["comm"]["bytes_on_wire_per_step"] for r in (z2, dp))
        none_bytes = results["z2-none"]["comm"]["bytes_on_wire_per_step"]
        report_measured(f"zero12 Adam in front: {codec} vs data parallel max |dw| = {d:.2e} "
                        f"(vs uncompressed ZeRO-2 {off:.2e}); {z2_bytes} B/step, data "
                        f"parallel {dp_bytes}, uncompressed ZeRO-2 {none_bytes}")
        assert d <= 1e-5, (codec, d)
        # The codec ran: its error is in the weights (10x above the comparison's bound)...
        assert off > 1e-4, (codec, off)
        # ... and its bytes are data parallelism's, under uncompressed ZeRO-2's.
        assert z2_bytes == dp_bytes, (codec, z2_bytes, dp_bytes)
        assert z2_bytes < none_bytes, (codec, z2_bytes, none_bytes)
        assert z2["loss_history"] == pytest.approx(dp["loss_history"], rel=1e-5, abs=1e-6)


def test_zero12_adam_front_checkpoint_moves_to_and_from_data_parallel(trained,
                                                                      report_measured):
    prefix, results = trained
    for resumed, whole in (("dp-from-z2", "dp-whole"), ("z2-from-dp", "z2-whole")):
        assert results[resumed]["resumed_from_step"] == 5, resumed
        d = _diff(prefix, resumed, whole)
        report_measured(f"zero12 Adam in front: {resumed} vs {whole}, max |dw| = {d:.2e}")
        # Without the moments the counter would restart the warm-up (tfpar.state): steps
        # 6-7 exact, far from the compressed run.
        assert d <= 1e-5, (resumed, d)
        assert results[resumed]["loss_history"] == pytest.approx(
            results[whole]["loss_history"][5:], rel=1e-5, abs=1e-6)


def test_zero12_adam_front_is_the_default_for_adam_and_says_its_memory(caplog):
    import keras

    from tfpar import ParallelConfig, compression
    from tfpar.zero import sharded

    def config(**kw):
        return ParallelConfig(**{"zero_stage": 2, "optimizer": "adam", "compression": "topk",
                                 **kw})

    assert sharded.adam_in_front(config())
    assert sharded.adam_in_front(config(zero_stage=1, compression="powersgd"))
    assert not sharded.adam_in_front(config(compress_adam_step=False))
    assert not sharded.adam_in_front(config(offload="optimizer"))  # the owner's update
    assert not sharded.adam_in_front(config(optimizer="momentum"))
    assert not sharded.adam_in_front(config(compression="int8"))
    with caplog.at_level("WARNING"):
        opt = sharded.wrap_optimizer(keras.optimizers.Adam(beta_1=0.8), 2, codec="topk",
                                     codec_options={"union": True},
                                     aggregator=compression.make_aggregator(config()))
    lines = [r.getMessage() for r in caplog.records if "--zero_stage=1|2" in r.getMessage()
             or "--topk_union" in r.getMessage()]
    # One line: Adam in front, whole-size moments; the union works here (no union line).
    assert lines == [sharded.adam_front_line("topk")], lines
    assert "whole-size" in lines[0]
    assert opt.tfpar_zero_aggregator.adam[0] == pytest.approx(0.8)  # the optimizer's own
    with pytest.raises(ValueError, match="keras.optimizers.Adam"):
        sharded.wrap_optimizer(keras.optimizers.SGD(), 2, codec="topk",
                               aggregator=compression.make_aggregator(config()))


def test_zero12_adam_front_skips_a_nonfinite_step_with_its_state_untouched():
    # --on_nan=skip_step (fp32): one infinite input on replica 0 after a compressed step;
    # the aggregator does not run (one scalar all-reduce decides), so no weight, residual,
    # moment or step counter moves on either replica, and the next step trains on.
    child = os.path.join(ROOT, "tests", "zero12_adam_front_child.py")
    results = last_json_line(run([sys.executable, child], timeout=600).stdout)
    assert sorted(results) == ["lowbit", "topk"]
    for codec, r in results.items():
        assert r["codec_largest"] > 0, (codec, r)  # residuals and moments hold something
        assert r["weights_moved"] == r["codec_moved"] == 0, (codec, r)
        assert r["skipped"] == [0.0, 1.0, 1.0], (codec, r)
        assert r["weights_moved_next"] > 0 and r["codec_moved_next"] > 0, (codec, r)
        assert r["weights_finite"], (codec, r)
