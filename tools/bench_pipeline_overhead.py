"""Where a pipelined step's time goes as the micro-batch count M grows, on the peer's model.

    python tools/bench_pipeline_overhead.py --microbatches=4,8,16 --rounds=3

The model and threads are `bench_pipeline_peer`'s (8 x Dense(1024, relu) + Dense(16), batch
2048, SGD momentum, K=2 stages on 2 logical CPUs, one thread per op). Per M the tool times
the pipelined step (wall clock and the process's CPU seconds) and splits its CPU seconds:

- `physics`: M x the CPU seconds of the same model's forward and backward, unpipelined, on
  one micro-batch (batch / M rows) on one logical CPU. Smaller micro-batches make each
  matmul less efficient: this part grows with M whatever the executor does.
- `optimizer`: one SGD-momentum update of all weights (the same at every M).
- `accumulate`: the ops that sum each micro-batch's weight gradients (from a profile of one
  step; `s<stage>_<B|W><mb>_c<chunk>/add` in the executor's name scopes).
- `rest`: CPU seconds no op of the reference accounts for: the executor's dispatch of M times
  more ops, copies between the logical devices, the thread pools' waiting.

CPU seconds count work, not waiting, so they move less than wall time when other jobs share
the machine; `idle` = K x wall - CPU is the core time the step left unused (the bubble and any
waits). Figures are medians over `--rounds` alternating rounds with the spread [min-max].
With --json the same in {"benchmark": "pipeline_overhead", "rows": [...]}.
"""

import json
import os
import re
import statistics
import sys
import time

from absl import app, flags

import peer_mlp
from peer_mlp import BATCH, K

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_list("microbatches", ["4", "8", "16"], "micro-batch counts M")
flags.DEFINE_string("schedule", "1f1b", "the tfpar schedule to split")
flags.DEFINE_integer("steps", 4, "timed steps per configuration and round")
flags.DEFINE_integer("rounds", 3, "alternating rounds")
flags.DEFINE_string("json", "", "write the results here")

_ACCUMULATE = re.compile(r"(^|/)s\d+_[BW]\d+_c\d+/add(_\d+)?:")


def _measure(fn, steps):
    """(wall seconds, CPU seconds) per call: medians over `steps` calls."""
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(wall), statistics.median(cpu)


def _op_seconds(timeline_lib, fn):
    """Profiles one call of `fn`; returns (all op seconds, accumulation op seconds)."""
    events = timeline_lib.profiled_events(fn)
    ops = [(n, e - b) for n, b, e in events if re.search(r":[A-Z_][A-Za-z0-9_]*$", n)]
    return (sum(d for _, d in ops) / 1e6,
            sum(d for n, d in ops if _ACCUMULATE.search(n)) / 1e6)


def _fmt(values, digits=3):
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}-{max(values):.{digits}f}]")


def main(argv):
    del argv
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(K)
    from tfpar.devices import split_cpu
    split_cpu(K)
    import keras
    import numpy as np
    from tfpar.pipeline import timeline as timeline_lib
    from tfpar.pipeline.executor import PipelineExecutor, default_devices
    from tfpar.pipeline.partition import partition
    from tfpar.pipeline.schedule import make_schedule

    Ms = sorted(set(map(int, FLAGS.microbatches)))
    x, y = (tf.constant(a) for a in peer_mlp.batch(np))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    devices = default_devices(K)
    V = 2 if FLAGS.schedule == "interleaved" else 1

    fns = {}
    for M in Ms:
        ex = PipelineExecutor(partition(peer_mlp.model(keras), K * V,
                                        devices=[devices[v % K] for v in range(K * V)]),
                              devices, make_schedule(FLAGS.schedule, K, M, V), loss_fn)
        ex.build_optimizers(keras.optimizers.SGD(0.05, momentum=0.9))
        step = tf.function(ex.train_step, jit_compile=False)
        fns[("pipelined", M)] = lambda step=step: step(x, y)[0].numpy()

        # The unpipelined forward and backward of one micro-batch on one logical CPU.
        ref = peer_mlp.model(keras)
        b = BATCH // M

        @tf.function(jit_compile=False)
        def micro(ref=ref, b=b):
            with tf.device(devices[0]), tf.GradientTape() as tape:
                loss = loss_fn(y[:b], ref(x[:b], training=True))
            return loss, tape.gradient(loss, ref.trainable_variables)

        fns[("micro", M)] = lambda micro=micro: micro()[0].numpy()

    model = peer_mlp.model(keras)
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)
    fixed = [tf.ones_like(v) * 1e-6 for v in model.trainable_variables]

    @tf.function(jit_compile=False)
    def update():
        with tf.device(devices[0]):
            opt.apply(fixed, model.trainable_variables)
        return tf.constant(0.0)

    fns[("optimizer", 0)] = lambda: update().numpy()
    for fn in fns.values():
        fn()
        fn()  # trace and warm up
    rounds = []
    for r in range(FLAGS.rounds):
        load = os.getloadavg()[0]
        rounds.append({"load_1min": load, **{f"{k[0]}:{k[1]}": _measure(fn, FLAGS.steps)
                                             for k, fn in fns.items()}})
        print(f"round {r}: load {load:.2f}", file=sys.stderr, flush=True)
    profiled = {M: _op_seconds(timeline_lib, fns[("pipelined", M)]) for M in Ms}

    print(f"8 x Dense(1024) + head, batch {BATCH}, K={K}, {FLAGS.schedule}, one thread per op, "
          f"{FLAGS.steps} steps x {FLAGS.rounds} rounds, load (1 min) at round starts "
          f"{[round(r['load_1min'], 2) for r in rounds]}; seconds per step, median "
          f"[min-max] over rounds")
    print(f"{'M':>3}{'wall':>22}{'CPU':>22}{'physics (M x micro)':>22}{'optimizer':>11}"
          f"{'accumulate':>11}{'rest':>22}{'idle (K wall - CPU)':>22}")
    rows = []
    for M in Ms:
        wall = [r[f"pipelined:{M}"][0] for r in rounds]
        cpu = [r[f"pipelined:{M}"][1] for r in rounds]
        physics = [M * r[f"micro:{M}"][1] for r in rounds]
        opt_cpu = [r["optimizer:0"][1] for r in rounds]
        acc = profiled[M][1]
        rest = [c - p - o - acc for c, p, o in zip(cpu, physics, opt_cpu)]
        idle = [K * w - c for w, c in zip(wall, cpu)]
        rows.append({"microbatches": M, "schedule": FLAGS.schedule, "wall_s": wall,
                     "cpu_s": cpu, "physics_cpu_s": physics, "optimizer_cpu_s": opt_cpu,
                     "accumulate_op_s": acc, "profiled_op_s": profiled[M][0],
                     "rest_cpu_s": rest, "idle_core_s": idle,
                     "micro_wall_s": [r[f"micro:{M}"][0] for r in rounds]})
        print(f"{M:>3}{_fmt(wall):>22}{_fmt(cpu):>22}{_fmt(physics):>22}"
              f"{statistics.median(opt_cpu):>11.3f}{acc:>11.3f}{_fmt(rest):>22}{_fmt(idle):>22}")
    print("physics: M x (CPU s of one micro-batch's forward+backward, unpipelined, one "
          "logical CPU); accumulate: op time of the gradient sums in one profiled step; "
          "rest = CPU - physics - optimizer - accumulate")
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump({"benchmark": "pipeline_overhead", "rows": rows, "rounds": rounds},
                      f, indent=1)


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    app.run(main)
