"""Two workers (MultiWorkerMirroredStrategy on localhost, each in its own process with its
own TF_CONFIG): a lossy aggregator keeps both workers' weights bit-identical."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

from subproc import last_json_line, popen

WORKER = r"""
import hashlib, json, os
import numpy as np
import tensorflow as tf
import keras
from tfpar.compression import PowerSGDAggregator, TopKAggregator, wrap_optimizer

task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=60))
rng = np.random.default_rng(task)  # each worker sees different data
x = rng.normal(size=(20, 32, 16)).astype("float32")
y = (x @ np.linspace(-1, 1, 16).reshape(16, 1)).astype("float32")
out = {}
for name, agg in [("powersgd", PowerSGDAggregator(rank=2, start_step=3)),
                  ("topk", TopKAggregator(0.05))]:
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
        opt = wrap_optimizer(keras.optimizers.SGD(0.05), agg)
        opt.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                # Divided by all replicas, as Keras does: the aggregator returns the sum.
                loss = tf.reduce_mean((model(xb) - yb) ** 2) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(xb, yb)), axis=None)

    losses = [float(step(tf.constant(x[i]), tf.constant(y[i]))) for i in range(len(x))]
    weights = b"".join(v.numpy().tobytes() for v in model.trainable_variables)
    residual = agg.residuals["0"] if "0" in agg.residuals else next(iter(agg.residuals.values()))
    out[name] = {"hash": hashlib.sha256(weights).hexdigest(), "losses": losses,
                 "traced": agg.trace_count, "comm": agg.comm_stats(),
                 "residual_hash": hashlib.sha256(strategy.experimental_local_results(
                     residual)[0].numpy().tobytes()).hexdigest()}

# Checkpoint round trip: every worker's replica gets its own residual back (the save
# gathers all workers' residuals, so one file holds them all). agg: the top-k one.
import tempfile
path = tf.train.Checkpoint(agg=agg).save(os.path.join(tempfile.mkdtemp(), "agg"))
saved = dict(tf.train.list_variables(path))
with strategy.scope():
    fresh = TopKAggregator(0.05)
    fresh.build([v.value for v in model.trainable_variables])
tf.train.Checkpoint(agg=fresh).restore(path).assert_existing_objects_matched()
own = [strategy.experimental_local_results(agg.residuals[k])[0].numpy() for k in agg.residuals]
back = [strategy.experimental_local_results(fresh.residuals[k])[0].numpy()
        for k in agg.residuals]
out["ckpt"] = {"own": all(np.array_equal(a, b) for a, b in zip(own, back)),
               "rows": saved["agg/residual_slots/0/.ATTRIBUTES/per_replica"][0]}
print(json.dumps(out), flush=True)
# Worker 0 hosts the coordination service: no worker leaves before the others are done.
import tfpar
assert tfpar.wait_for_workers("end", 120)
"""


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_workers(code, n=2, timeout=180):
    hosts = [f"localhost:{p}" for p in _free_ports(n)]
    procs = []
    for i in range(n):
        env = {"TF_CONFIG": json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})}
        procs.append(popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
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
