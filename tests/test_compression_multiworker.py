"""Two workers (MultiWorkerMirroredStrategy on localhost, each in its own process with its
own TF_CONFIG, tests/multiworker_child.py): a lossy aggregator keeps both workers' weights
bit-identical."""

import os
import sys

from subproc import ROOT, run_tf_config_workers

WORKER = os.path.join(ROOT, "tests", "multiworker_child.py")


def _run_workers(script, n=2, timeout=180):
    """`python script` as each of `n` workers of one TF_CONFIG cluster on localhost: each
    worker's last JSON line."""
    return run_tf_config_workers(lambda i: [sys.executable, script], n, timeout)


def test_two_workers_end_with_identical_weights():
    a, b = _run_workers(WORKER)
    for name in ("powersgd", "topk"):
        assert a[name]["traced"] >= 1 and b[name]["traced"] >= 1
        assert a[name]["hash"] == b[name]["hash"], f"{name}: workers' weights differ"
        # Each worker keeps its own error-feedback residual.
        assert a[name]["residual_hash"] != b[name]["residual_hash"]
        assert a[name]["losses"] == b[name]["losses"]  # the global loss, reduced
        assert a[name]["losses"][-1] < 0.5 * a[name]["losses"][0], a[name]["losses"]
    for w in (a, b):
        assert w["ckpt"]["own"] and w["ckpt"]["rows"] == 2, w["ckpt"]
    assert 1 / a["topk"]["comm"]["compression_ratio"] <= 0.11
    assert 1 / a["powersgd"]["comm"]["compression_ratio"] < 0.2
