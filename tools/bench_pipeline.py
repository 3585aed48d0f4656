"""Pipeline benchmark: step time and bubble of every schedule against the unpipelined model.

    python tools/bench_pipeline.py --stages=2 --microbatches=2,4,8,16 --json=/tmp/pipe.json

For each schedule and M: the median step time of the pipelined step (one tf.function),
the measured bubble and the theory (K-1)/(V*M+K-1), and the peak stashed micro-batches.

The bubble is measured from outside the step, because timers inside it would serialise
the pipeline: the same graph with all actions chained into one sequence (`serialize=True`)
takes the total busy time T_busy of all stages, so bubble = 1 - T_busy / (K * T_pipelined).
Ops run one thread each (intra-op 1) so that a stage occupies one core, as it would its
own accelerator; on a machine shared with other work the numbers are noisy, so each
configuration takes the fastest of several alternating runs.
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_integer("stages", 2, "pipeline stages K (logical CPU devices)")
flags.DEFINE_list("microbatches", ["2", "4", "8", "16"], "micro-batch counts M to try")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved"], "schedules to try")
flags.DEFINE_integer("virtual_stages", 2, "V for the interleaved schedule")
flags.DEFINE_integer("layers", 8, "Dense blocks in the model")
flags.DEFINE_integer("width", 512, "width of each block")
flags.DEFINE_integer("batch", 256, "global batch size")
flags.DEFINE_integer("steps", 8, "timed runs per configuration (after one warm-up)")
flags.DEFINE_string("json", "", "write the results here")


def _paired_times(fns, steps):
    """Fastest run of each function, taking turns so that load from other processes
    falls on all of them alike (the minimum is the least disturbed run)."""
    for fn in fns:
        fn()  # trace and warm up
    best = [float("inf")] * len(fns)
    for _ in range(steps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main(argv):
    del argv
    K = FLAGS.stages
    import tensorflow as tf  # after absl parsed flags; configure threads before TF starts
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(max(K, 2))
    from tfpar.devices import split_cpu
    split_cpu(K)
    import keras
    import numpy as np
    from tfpar.pipeline.executor import PipelineExecutor, default_devices
    from tfpar.pipeline.partition import partition
    from tfpar.pipeline.schedule import make_schedule, simulate, theory_bubble

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((FLAGS.width,))]
            + [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.layers)],
            name="blocks")

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(FLAGS.batch, FLAGS.width)).astype("float32"))
    y = tf.constant(rng.normal(size=(FLAGS.batch, FLAGS.width)).astype("float32"))
    loss_fn = keras.losses.MeanSquaredError()
    devices = default_devices(K)

    model = build()
    opt = keras.optimizers.SGD(1e-3)
    opt.build(model.trainable_variables)

    @tf.function(jit_compile=False)
    def single_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    rows, base = [], None
    for name in FLAGS.schedules:
        V = FLAGS.virtual_stages if name == "interleaved" else 1
        stages = partition(build(), K * V, devices=[devices[v % K] for v in range(K * V)])
        for M in map(int, FLAGS.microbatches):
            if name == "interleaved" and M % K:
                continue
            sched = make_schedule(name, K, M, V)
            steps = []
            for serialize in (False, True):
                ex = PipelineExecutor(stages, devices, sched, loss_fn, serialize=serialize)
                ex.build_optimizers(keras.optimizers.SGD(1e-3))
                steps.append(tf.function(ex.train_step, jit_compile=False))
            fns = [lambda f=f: f(x, y) for f in steps] + ([single_step] if base is None else [])
            t, busy, *single = _paired_times(fns, FLAGS.steps)
            base = single[0] if single else base
            sim = simulate(sched, K, M, V)
            rows.append({"schedule": name, "stages": K, "microbatches": M, "virtual_stages": V,
                         "step_time_ms": 1e3 * t, "serialized_step_time_ms": 1e3 * busy,
                         "speedup_vs_single": base / t,
                         "bubble_measured": max(0.0, 1 - busy / (K * t)),
                         "bubble_theory": theory_bubble(K, M, V),
                         "peak_stashed_microbatches": max(sim.peak_stash)})
            print(f"  {name} M={M} done", file=sys.stderr, flush=True)

    print(f"K={K}, {FLAGS.layers} x Dense({FLAGS.width}), batch {FLAGS.batch}; "
          f"unpipelined step {1e3 * base:.1f} ms")
    print(f"{'schedule':<12}{'M':>4}{'step ms':>10}{'serial ms':>10}{'vs single':>11}"
          f"{'bubble':>9}{'theory':>9}{'stash':>7}")
    for r in rows:
        print(f"{r['schedule']:<12}{r['microbatches']:>4}{r['step_time_ms']:>10.1f}"
              f"{r['serialized_step_time_ms']:>10.1f}"
              f"{r['speedup_vs_single']:>10.2f}x{r['bubble_measured']:>9.3f}"
              f"{r['bubble_theory']:>9.3f}{r['peak_stashed_microbatches']:>7}")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"single_step_time_ms": 1e3 * base, "rows": rows,
                       "config": {k: FLAGS[k].value for k in (
                           "stages", "layers", "width", "batch", "steps")}}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
