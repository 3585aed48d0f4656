"""Two workers (MultiWorkerMirroredStrategy on localhost, each in its own process with its
own TF_CONFIG, tests/multiworker_child.py): a lossy aggregator keeps both workers' weights
bit-identical."""

import json
import os
import signal
import socket
import subprocess
import sys

from subproc import ROOT, last_json_line, popen

WORKER = os.path.join(ROOT, "tests", "multiworker_child.py")


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_workers(script, n=2, timeout=180):
    """`python script` as each of `n` workers of one TF_CONFIG cluster on localhost: each
    worker's last JSON line."""
    hosts = [f"localhost:{p}" for p in _free_ports(n)]
    procs = []
    for i in range(n):
        env = {"TF_CONFIG": json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})}
        procs.append(popen([sys.executable, script], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-4000:]}"
            outs.append(last_json_line(out))
    finally:
        for p in procs:  # a hung collective must fail the test, never hang it
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return outs


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
