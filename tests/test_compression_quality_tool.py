"""tools/bench_compression_quality.py runs on a tiny setting: fp32 and one lossy aggregator on
the user-style pipeline, fp32 once more from another initialisation for the band, the
verdict and exit status agree with the JSON it writes."""

import json
import math
import sys

from subproc import ROOT, run


def test_quality_tool_compares_with_fp32(tmp_path):
    out = tmp_path / "q.json"
    proc = run([sys.executable, f"{ROOT}/tools/bench_compression_quality.py", "--tasks=user",
                "--seeds=0", "--aggregators=topk", "--steps=8", "--validation_steps=2",
                "--smooth=4", "--fp32_seeds=1", f"--out={out}"], timeout=400, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    keras_ref, ref, again, summary, topk = result["rows"]
    # fp32's band: the exact run again from initialisation seed 1, the task of seed 0.
    assert (again["reference"], again["run"], again["init_seed"]) == ("band", "fp32-exact", 1)
    assert again["final_loss"] != ref["final_loss"]  # another initialisation
    band = result["bands"]["user seed 0"]
    assert band["init_seeds"] == [0, 1] and band["runs"] == 2 == len(summary["final_losses"])
    losses = (ref["final_loss"], again["final_loss"])
    assert math.isclose(band["band"], (max(losses) - min(losses)) / (sum(losses) / 2))
    assert topk["band"] == band["band"]
    outside = abs(topk["loss_gap"]) > band["band"]
    assert any("outside fp32's" in f for f in topk["fails"]) == outside
    assert "fp32 band" in proc.stdout
    assert (keras_ref["compression"], ref["compression"], topk["compression"]) == (
        "none", "none", "topk")
    assert (keras_ref["reference"], ref["reference"], ref["run"]) == ("keras", "exact",
                                                                     "fp32-exact")
    assert ref["steps"] == topk["steps"] == keras_ref["steps"] == 8
    # No embedding, 2 replicas: Keras's all-reduce and the exact aggregator sum a + b alike.
    assert abs(ref["loss_gap_vs_keras"]) < 1e-4
    for row in (keras_ref, ref, topk):
        assert math.isfinite(row["final_loss"]) and 0 <= row["val_accuracy"] <= 1
    assert topk["loss_gap"] == topk["final_loss"] / ref["final_loss"] - 1
    assert topk["config"]["topk_ratio"] > 0 and ref["config"]["steps"] == 8
    assert proc.returncode == (1 if topk["fails"] else 0)
    assert "worst over tasks and seeds: topk" in proc.stdout
