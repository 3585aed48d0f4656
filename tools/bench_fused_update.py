"""Momentum SGD's update alone: Keras's ops against TensorFlow's fused kernel, interleaved.

The variables of `tools/bench_compression.py`'s MLP (~6.3 M parameters, width 1024, depth
7), one process, one device: `optimizer.apply` of fixed dense gradients inside a
`tf.function`, Keras's `SGD(momentum=0.9).update_step` against
`tfpar.optimizers.FusedMomentumMixin` (`ResourceApplyKerasMomentum`), alternating call by
call over `--calls` calls per round and `--rounds` rounds (the first 3 calls of each side
untimed). Prints per round and side the median wall and CPU milliseconds of one update (CPU
time of the process: every thread), then the medians over rounds, and writes `--out` (JSON).

    flock /tmp/tfpar-cpu.lock python tools/bench_fused_update.py --rounds=5

Take the CPU lock yourself.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40, help="timed calls per side and round")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_fused_update.json"))
    args = p.parse_args()
    import keras
    import numpy as np
    import tensorflow as tf

    from tfpar import ParallelConfig, data, models, optimizers

    config = ParallelConfig(model="mlp", model_width=1024, model_depth=7,
                            optimizer="momentum", learning_rate=0.01)
    task = data.make_task(config)
    model = models.build("mlp", task.input_shape, task.num_classes, width=1024, depth=7)
    variables = model.trainable_variables
    rng = np.random.RandomState(0)
    grads = [tf.constant(rng.randn(*v.shape).astype("float32") * 1e-3) for v in variables]
    params = sum(int(np.prod(v.shape)) for v in variables)
    sides = {}
    for name, fused in (("keras", False), ("fused", True)):
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        if fused:
            optimizers.fuse_momentum(opt)
        opt.build(variables)
        sides[name] = tf.function(lambda opt=opt: opt.apply(grads, variables) and None)
    rounds = []
    for r in range(args.rounds):
        times = {k: {"wall": [], "cpu": []} for k in sides}
        load = loadavg()
        for i in range(args.calls + 3):
            for k, fn in (sides.items() if i % 2 == 0 else reversed(sides.items())):
                wall, cpu = time.perf_counter(), time.process_time()
                fn()
                float(variables[0].value[0, 0])  # the update has finished
                if i >= 3:
                    times[k]["wall"].append(1000 * (time.perf_counter() - wall))
                    times[k]["cpu"].append(1000 * (time.process_time() - cpu))
        row = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
        row["load"] = load
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds} (load {load}): " + ", ".join(
            f"{k} wall {row[k]['wall']:.2f} cpu {row[k]['cpu']:.2f} ms" for k in sides),
            flush=True)
    summary = {k: {m: statistics.median(row[k][m] for row in rounds) for m in ("wall", "cpu")}
               for k in sides}
    print(f"\n{params:,} parameters, median over {args.rounds} rounds of per-round medians "
          f"({args.calls} calls), ms per update")
    print(f"  {'side':6} {'wall':>8} {'cpu':>8}")
    for k in sides:
        print(f"  {k:6} {summary[k]['wall']:8.2f} {summary[k]['cpu']:8.2f}")
    print(f"  fused/keras wall {summary['fused']['wall'] / summary['keras']['wall']:.2f}, "
          f"cpu {summary['fused']['cpu'] / summary['keras']['cpu']:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "parameters": params, "rounds": rounds,
                   "summary": summary}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    sys.exit(main())
