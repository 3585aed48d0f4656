"""tools/bench_compression_quality.py runs on a tiny setting: fp32 and one lossy aggregator on
the user-style pipeline, the verdict and exit status agree with the JSON it writes."""

import json
import math
import sys

from subproc import ROOT, run


def test_quality_tool_compares_with_fp32(tmp_path):
    out = tmp_path / "q.json"
    proc = run([sys.executable, f"{ROOT}/tools/bench_compression_quality.py", "--tasks=user",
                "--seeds=0", "--aggregators=topk", "--steps=8", "--validation_steps=2",
                "--smooth=4", f"--out={out}"], timeout=400, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    keras_ref, ref, topk = result["rows"]
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
