"""Pipeline benchmark: every schedule, K stages and M micro-batches side by side, against
the same model unpipelined on one device.

    python tools/bench_pipeline.py --stages=2,4 --microbatches=2,4,8,16 \\
        --json=/tmp/pipe.json --timeline=/tmp/pipe_timeline
    python tools/bench_pipeline.py --quick      # a smoke run, well under 2 minutes
    python tools/bench_pipeline.py --stages=2 --layers=8 --width=1024 --batch=2048 \\
        --microbatches=4,8,16 --schedules=1f1b,interleaved,zb_h1,chimera --rounds=3

Configurations are built first, then timed in `--rounds` rounds, each running every
configuration in turn (the table's last two columns give the median over rounds and the
spread of the rounds' medians). Per configuration: step time (median, p90, fastest over
all rounds' steps) of the pipelined step (one tf.function), the bubble measured two ways
against the theory (K-1)/(V*M+K-1) and against the schedule simulated with each stage's
real cost in matmuls (`matmuls`), the peak stashed micro-batches of the schedule (from the
schedule simulator, not measured), and the allocator's peak memory during a step.

Bubble, two ways (timers inside the step would serialise the pipeline); the table's columns:
- `serial bubble` (JSON `bubble_measured`): the same graph with all actions chained into one
  sequence (`serialize=True`) takes the total busy time T_busy of all stages, so
  bubble = 1 - T_busy / (K * T_pipelined), from the fastest of alternating runs.
- `profiled` (JSON `bubble_profiled`): the median over `--profiles` steps, each under the
  TensorFlow profiler; every op is mapped to its stage and action by name scope
  (`tfpar.pipeline.timeline`). The spread [min-max] is printed when `--profiles` > 1 (JSON
  `bubble_profiled_all`). This is the
  column the pipeline benchmark page (docs/benchmarks/pipelines.md) quotes as "bubble measured".
Ops run one thread each (intra-op 1) so that a stage occupies one core, as it would its
own accelerator: the machine needs at least K free cores for the pipeline to overlap.

Peak memory: TensorFlow's CPU allocator reports its peak only when
TF_CPU_ALLOCATOR_USE_BFC=true is set before TensorFlow starts; this tool sets it (unless
the environment already says otherwise) and prints "n/a" where the allocator still cannot
say. On CPU all logical devices share one allocator, so the figure is the sum over the
stages (per device on GPUs): it is not a per-stage stash measurement.

Output: a table, and with --json a file {"benchmark": "pipeline", "runs": [...]} whose
runs have the metrics-JSON shape (`tfpar.metrics`: config, strategy, replicas, workers,
steps, final_loss, examples_per_sec, step_time_ms, pipeline, memory); each pipeline block
also holds its profiled `timeline` (`tfpar.pipeline.timeline.to_dict`, which
`tfpar.report` draws) and `peak_stash_source: "simulated"`. With --timeline=P
the measured timeline of one configuration (--timeline_run) goes to P.png (if matplotlib
is installed), P.trace.json (Chrome trace: chrome://tracing or ui.perfetto.dev) and P.txt.
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags

# The CPU allocator tracks its peak only with BFC, chosen when TensorFlow starts.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["2", "4"], "pipeline stages K to try (logical CPU devices)")
flags.DEFINE_list("microbatches", ["2", "4", "8", "16"], "micro-batch counts M to try")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved"], "schedules to try "
                  "(also zb_h1, chimera)")
flags.DEFINE_integer("virtual_stages", 2, "V for the interleaved schedule")
flags.DEFINE_integer("layers", 8, "Dense blocks in the model (a multiple of K*V balances)")
flags.DEFINE_integer("width", 512, "width of each block")
flags.DEFINE_integer("batch", 256, "global batch size")
flags.DEFINE_integer("steps", 8, "timed runs per configuration and round (after one "
                     "warm-up)")
flags.DEFINE_integer("rounds", 1, "rounds: every configuration timed and profiled once per "
                     "round, in turn; the table gives the median over rounds and the "
                     "spread [min-max] of the rounds' medians")
flags.DEFINE_bool("one_op_at_a_time", False, "each stage runs its ops one at a time "
                  "(PipelineExecutor's one_op_at_a_time)")
flags.DEFINE_integer("profiles", 1, "profiled steps per configuration (the bubble is their "
                     "median)")
flags.DEFINE_bool("quick", False, "smoke run: K=2,4, M=2,4, a small model, 3 steps")
flags.DEFINE_string("json", "", "write the results here")
flags.DEFINE_string("timeline", "", "path prefix for the measured timeline picture/trace")
flags.DEFINE_string("timeline_run", "1f1b:2:8", "SCHEDULE:K:M whose timeline to draw "
                    "(with --quick: M is capped at the largest M tried)")


def _paired_times(fns, steps, warm=True):
    """All run times of each function, taking turns so that load from other processes
    falls on all of them alike (after one untimed run of each, with `warm`)."""
    for fn in fns if warm else ():
        fn()  # trace and warm up
    times = [[] for _ in fns]
    for _ in range(steps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def _spread(values, digits):
    """'median [min-max]' of a list of numbers."""
    return (f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-"
            f"{max(values):.{digits}f}]")


def _step_time_ms(times):
    ms = sorted(1e3 * t for t in times)
    return {"median": statistics.median(ms), "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "min": ms[0]}


def _matmul_theory(schedule, K, M, V, name=None):
    """The schedule's simulated bubble with each stage's cost in matmuls of this model: a
    chunk of n Dense layers runs n in its forward, n for the weight gradients and n for the
    input gradients, except the first chunk of stage 0, whose first layer needs none (the
    model's input has no gradient). The balanced theory assumes every stage costs the same,
    which a model of equal layers split by parameters cannot give. Chimera's stages each
    hold a whole stage of each pipeline, and the simulator takes one cost per stage: its
    two first stages' saved matmul is left out (each costs 2n, not 2n - 1)."""
    from tfpar.pipeline.schedule import simulate
    if name == "chimera":
        n = FLAGS.layers / K
        return simulate(schedule, K, M, 1, f_cost=n, b_cost=2 * n).bubble
    n = FLAGS.layers / (K * V)
    f = [n] * K
    b = [2 * n - (1 / V if s == 0 else 0) for s in range(K)]
    return simulate(schedule, K, M, V, f_cost=f, b_cost=b, w_cost=f).bubble


def main(argv):
    del argv
    if FLAGS.quick:
        for name, value in (("stages", ["2", "4"]), ("microbatches", ["2", "4"]),
                            ("width", 256), ("batch", 64), ("steps", 3)):
            if not FLAGS[name].present:
                FLAGS[name].value = value
    Ks = sorted(set(map(int, FLAGS.stages)))
    Ms = sorted(set(map(int, FLAGS.microbatches)))
    import tensorflow as tf  # after absl parsed flags; configure threads before TF starts
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(max(max(Ks), 2))
    from tfpar.devices import split_cpu
    split_cpu(max(Ks))
    import keras
    import numpy as np
    from tfpar.metrics import peak_rss_mb
    from tfpar.pipeline import timeline as timeline_lib
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
    model_desc = {"layers": FLAGS.layers, "width": FLAGS.width, "batch": FLAGS.batch,
                  "steps": FLAGS.steps}

    def peak_memory_mb(fn):
        """The allocator's peak during `fn()` in MB, or None where it keeps no statistics
        (CPU without TF_CPU_ALLOCATOR_USE_BFC=true)."""
        device = "CPU:0" if not tf.config.list_logical_devices("GPU") else "GPU:0"
        try:
            tf.config.experimental.reset_memory_stats(device)
        except (ValueError, tf.errors.OpError):
            fn()
            return None
        fn()
        return tf.config.experimental.get_memory_info(device)["peak"] / 2**20

    def mb(value, width):
        return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.1f}"

    model = build()
    opt = keras.optimizers.SGD(1e-3)
    opt.build(model.trainable_variables)

    @tf.function(jit_compile=False)
    def single_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    single_fn = lambda: single_step().numpy()  # noqa: E731
    (single_times,) = _paired_times([single_fn], FLAGS.steps)
    base = _step_time_ms(single_times)
    runs = [{"config": {"schedule": "none", "stages": 1, **model_desc},
             "strategy": "OneDeviceStrategy", "replicas": 1, "workers": 1,
             "steps": FLAGS.steps, "final_loss": float(single_fn()),
             "examples_per_sec": FLAGS.batch / (base["median"] / 1e3),
             "step_time_ms": base,
             "memory": {"peak_rss_mb": peak_rss_mb(),
                        "peak_tensor_mb": peak_memory_mb(single_fn),
                        "params_per_device": [model.count_params()]}}]

    draw_name, draw_K, draw_M = FLAGS.timeline_run.split(":")
    draw_K, draw_M = int(draw_K), min(int(draw_M), max(Ms))
    drawn = None
    configs = []  # every (schedule, K, M) with its pipelined and serialised steps
    for K in Ks:
        devices = default_devices(K)
        for name in FLAGS.schedules:
            V = FLAGS.virtual_stages if name == "interleaved" else 1
            stages = partition(build(), K * V, devices=[devices[v % K] for v in range(K * V)])
            if name == "chimera":  # the second pipeline's copies (PipelineModel.split)
                stages += partition(build(), K, devices=devices[::-1])[::-1]
            params = [sum(s.count_params() for s in stages[d::K]) for d in range(K)]
            for M in Ms:
                if (name == "interleaved" and M % K) or (name == "chimera" and M % 2) \
                        or FLAGS.batch % M:
                    continue
                sched = make_schedule(name, K, M, V)
                steps = []
                for serialize in (False, True):
                    ex = PipelineExecutor(stages, devices, sched, loss_fn, serialize=serialize,
                                          one_op_at_a_time=FLAGS.one_op_at_a_time)
                    ex.build_optimizers(keras.optimizers.SGD(1e-3))
                    steps.append(tf.function(ex.train_step, jit_compile=False))
                fns = [lambda f=f: f(x, y)[0].numpy() for f in steps]
                for fn in fns:
                    fn()  # trace and warm up
                configs.append({"name": name, "K": K, "M": M, "V": V, "sched": sched,
                                "fns": fns, "params": params, "piped": [], "serial": [],
                                "timelines": [], "round_ms": [], "round_bubbles": []})
                print(f"  K={K} {name} M={M} built", file=sys.stderr, flush=True)

    # Rounds: every configuration once per round, in turn, so that a change in the
    # machine's load falls on all of them alike.
    loads = []
    for r in range(FLAGS.rounds):
        loads.append(os.getloadavg()[0])
        for c in configs:
            piped, serial = _paired_times(c["fns"], FLAGS.steps, warm=False)
            c["piped"] += piped
            c["serial"] += serial
            c["round_ms"].append(1e3 * statistics.median(piped))
            tls = [timeline_lib.profile(c["fns"][0], c["K"]) for _ in range(FLAGS.profiles)]
            c["timelines"] += tls
            c["round_bubbles"].append(statistics.median(t.bubble for t in tls))
        print(f"  round {r} done (load {loads[-1]:.2f})", file=sys.stderr, flush=True)

    for c in configs:
        name, K, M, V, sched, fns = (c[k] for k in ("name", "K", "M", "V", "sched", "fns"))
        t, busy = _step_time_ms(c["piped"]), _step_time_ms(c["serial"])
        tls = c["timelines"]
        bubbles = [t_.bubble for t_ in tls]
        tl = sorted(tls, key=lambda t_: t_.bubble)[(len(tls) - 1) // 2]  # the median
        if (name, K, M) == (draw_name, draw_K, draw_M):
            drawn = (tl, f"{name} K={K} M={M}")
        sim = simulate(sched, K, M, V)
        runs.append({
            "config": {"schedule": name, "stages": K, "microbatches": M,
                       "virtual_stages": V, **model_desc},
            "strategy": "pipeline", "replicas": 1, "workers": 1,
            "steps": FLAGS.steps * FLAGS.rounds, "final_loss": float(fns[0]()),
            "examples_per_sec": FLAGS.batch / (t["median"] / 1e3),
            "step_time_ms": {**t, "rounds": c["round_ms"]},
            "pipeline": {
                "stages": K, "microbatches": M, "schedule": name, "virtual_stages": V,
                "bubble_measured": max(0.0, 1 - busy["min"] / (K * t["min"])),
                "bubble_profiled": tl.bubble,
                "bubble_profiled_all": bubbles,
                "bubble_profiled_rounds": c["round_bubbles"],
                "bubble_theory": theory_bubble(K, M, V, name),
                "bubble_theory_stage_costs": _matmul_theory(sched, K, M, V, name),
                "peak_stashed_microbatches": max(sim.peak_stash),
                "peak_stash_source": "simulated",
                "timeline": timeline_lib.to_dict(tl),
                "serialized_step_time_ms": busy,
                "speedup_vs_unpipelined": base["min"] / t["min"]},
            "memory": {"peak_rss_mb": peak_rss_mb(),
                       "peak_tensor_mb": peak_memory_mb(fns[0]),
                       "params_per_device": c["params"]}})

    print(f"{FLAGS.layers} x Dense({FLAGS.width}), batch {FLAGS.batch}, "
          f"one_op_at_a_time={FLAGS.one_op_at_a_time}, load (1 min) {os.getloadavg()[0]:.2f}, "
          f"{FLAGS.steps} timed steps x {FLAGS.rounds} rounds (load at round starts "
          f"{[round(v, 2) for v in loads]}); unpipelined step {base['min']:.1f} ms "
          f"(median {base['median']:.1f}), peak {mb(runs[0]['memory']['peak_tensor_mb'], 0)} MB")
    print(f"{'K':>2} {'schedule':<12}{'M':>3}{'step ms':>9}{'serial':>8}{'vs 1 dev':>9}"
          f"{'serial bubble':>14}{'profiled':>9}{'theory':>8}{'matmuls':>8}{'stash(sim)':>11}"
          f"{'peak MB':>9}"
          + (f"{'rounds: step ms med [min-max]':>32}{'profiled [min-max]':>22}"
             if FLAGS.rounds > 1 else ""))
    for r in runs[1:]:
        p = r["pipeline"]
        print(f"{p['stages']:>2} {p['schedule']:<12}{p['microbatches']:>3}"
              f"{r['step_time_ms']['min']:>9.1f}{p['serialized_step_time_ms']['min']:>8.1f}"
              f"{p['speedup_vs_unpipelined']:>8.2f}x{p['bubble_measured']:>14.3f}"
              f"{p['bubble_profiled']:>9.3f}"
              + (f" [{min(p['bubble_profiled_all']):.3f}-{max(p['bubble_profiled_all']):.3f}]"
                 if FLAGS.profiles > 1 else "")
              + f"{p['bubble_theory']:>8.3f}"
              f"{p['bubble_theory_stage_costs']:>8.3f}"
              f"{p['peak_stashed_microbatches']:>11}{mb(r['memory']['peak_tensor_mb'], 9)}"
              + (f"{_spread(r['step_time_ms']['rounds'], 1):>32}"
                 f"{_spread(p['bubble_profiled_rounds'], 3):>22}" if FLAGS.rounds > 1 else ""))
    print("serial bubble: 1 - (all actions chained into one sequence) / (K x pipelined step), "
          "fastest runs (JSON bubble_measured)\nprofiled: one step under the TensorFlow "
          "profiler, ops mapped to stages (JSON bubble_profiled; the pipeline benchmark "
          "page's \"bubble measured\")\ntheory: (K-1)/(V*M+K-1) (zb_h1: simulated with "
          "equal F, B, W); "
          "matmuls: the schedule simulated with each stage's cost in this model's matmuls "
          "(stage 0 skips its first layer's input gradient: JSON bubble_theory_stage_costs)"
          " (chimera: simulated with each stage's two copies at 2n matmuls backward)"
          "\nrounds: the median over rounds of each round's median step, the spread of "
          "those medians; the profiled bubble likewise (one profiled step per round with "
          "--profiles=1)"
          "\nstash(sim): peak stashed micro-batches "
          "from the schedule simulator, not measured; peak MB: allocator peak summed over "
          "the logical CPUs")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"benchmark": "pipeline", "cpu_count": os.cpu_count(), "runs": runs},
                      f, indent=1)
    if FLAGS.timeline and drawn:
        tl, title = drawn
        text = f"{title} (measured)\n{timeline_lib.draw(tl)}\n"
        with open(FLAGS.timeline + ".txt", "w") as f:
            f.write(text)
        timeline_lib.write_chrome_trace(tl, FLAGS.timeline + ".trace.json", title)
        png = timeline_lib.plot(tl, FLAGS.timeline + ".png", title)
        print(text + f"timeline: {FLAGS.timeline}.trace.json, .txt"
              + (", .png" if png else " (no .png: matplotlib is not installed)"))


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    app.run(main)
