"""Forward + backward of the bench MLP alone, TensorFlow against PyTorch, one process at a time.

The compute half of a data-parallel step in `tools/bench_compression_vs_torch.py`, without any
communication: the same shapes as the PyTorch peer's model (2048 → 1024 ×5 → 16, ReLU,
~6.3 M parameters, cross-entropy) on one worker's batch (`--batch`, default 128 = 256 / 2),
gradients of every weight, `--calls` timed calls after 3 untimed, median ms. Sides, each its
own process, run one after the other and alternate over `--rounds`:

    tf_threads_N       TensorFlow (Keras 3 `Dense` layers, `tf.function`), N intra-op threads
                       (inter-op 1), Eigen's kernels (TensorFlow's default here)
    tf_onednn_N        the same with TF_ENABLE_ONEDNN_OPTS=1
    torch_threads_N    PyTorch, `torch.set_num_threads(N)` (the peer runs 1 per rank)

    flock /tmp/tfpar-cpu.lock python tools/profile_mlp_compute.py \
        --torch_py=$HOME/.venvs/torch-peer/bin/python

On a 2-core machine a 2-worker run gives each worker about one core: compare the 1-thread
rows with the peer's own.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = [2048, 1024, 1024, 1024, 1024, 1024, 16]


def tf_side(threads, batch, calls):
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    layers = [keras.layers.Dense(n, activation="relu" if k < len(SIZES) - 2 else None)
              for k, n in enumerate(SIZES[1:])]
    model = keras.Sequential([keras.Input((SIZES[0],)), *layers])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, SIZES[0])).astype("float32"))
    y = tf.constant(rng.integers(0, SIZES[-1], batch).astype("int32"))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        return tf.add_n([tf.reshape(g, [-1])[0] for g in grads])

    times = []
    for i in range(calls + 3):
        began = time.perf_counter()
        step().numpy()
        if i >= 3:
            times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def torch_side(threads, batch, calls):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    layers = []
    for k in range(len(SIZES) - 1):
        layers.append(torch.nn.Linear(SIZES[k], SIZES[k + 1]))
        if k < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (batch,), generator=g)
    times = []
    for i in range(calls + 3):
        began = time.perf_counter()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if i >= 3:
            times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--torch_py", required=False, help="the peer's Python (with torch)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sides", default="tf_threads_1,tf_threads_2,tf_onednn_1,torch_threads_1")
    p.add_argument("--side", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        kind, threads = args.side.rsplit("_", 1)
        fn = torch_side if kind.startswith("torch") else tf_side
        print(json.dumps(fn(int(threads), args.batch, args.calls)))
        return 0
    sides = args.sides.split(",")
    got = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
            env["TF_ENABLE_ONEDNN_OPTS"] = "1" if "onednn" in side else "0"
            py = args.torch_py if side.startswith("torch") else sys.executable
            out = subprocess.run([py, os.path.abspath(__file__), "--side", side, "--batch",
                                  str(args.batch), "--calls", str(args.calls)], env=env,
                                 capture_output=True, text=True, check=True)
            got[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"forward + backward, batch {args.batch}, median ms of {args.calls} calls per round")
    for side, ms in got.items():
        print(f"  {side:16} " + "  ".join(f"{m:7.1f}" for m in ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
