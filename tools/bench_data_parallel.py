"""tfpar's data-parallel `fit` against stock Keras `fit` under `tf.distribute`, side by side.

The stock side is what a user writes without tfpar: its own `tf.distribute.MirroredStrategy`
over the logical CPUs, its own `tf.data` pipeline over the same examples (`Dataset.range →
map(the task's example function) → batch → prefetch`, which Keras splits over the replicas;
`--stock_data=arrays`: the examples materialised into arrays beforehand, then
`from_tensor_slices`), the same Keras model, `compile` and `fit` with no callback but the
bench's clock. The tfpar side is `tfpar.train.train` on tfpar's own runtime (its strategy,
data, optimizer hooks, callbacks). Both sides are timed by the same minimal callback: the
wall time between consecutive `on_train_batch_end` calls, so everything done between two
steps counts, the first `--warmup` steps left out.

Each bench process builds both strategies once and alternates rounds (which side goes
first alternating). Comparing rounds of one process removes what differs between
processes (~15 % here from one process to the next on the same command, larger than the
effect asked about). `--processes` processes repeat the whole thing.

`--without=PIECE[+PIECE],...` adds tfpar sides with pieces of tfpar taken out (`PIECES`:
the finiteness check, the per-step loss (or only its direct read: the `Mean` of before),
the per-step callbacks, the input pipeline, its whole-step batches), timed in the same
rounds (the order of the sides rotating), each against stock: what each piece costs.
Beside the wall time, every side's CPU time per step (all the process's threads,
`time.process_time`) against stock's: waiting for a core held by another process is not
CPU time, so on a loaded machine it moves much less than the wall time. With
`--threads`, each kind of thread's CPU time per step too (`/proc`: the main Python thread,
TensorFlow's inter-op `tf_Compute` pool, its collectives' threads, the unnamed rest).

    python tools/bench_data_parallel.py                  # mlp + transformer, 4 logical CPUs
    python tools/bench_data_parallel.py --quick          # a smoke run in about a minute
    python tools/bench_data_parallel.py --without=nan_check,data   # what two pieces cost
    python tools/bench_data_parallel.py --without=global_input --threads  # the input's cut

Overhead of a round = tfpar's median step time / stock's median step time of the same
round − 1. Reported: the median over rounds with a 95 % bootstrap confidence interval
(rounds resampled with replacement, `--bootstrap` times, seed `--bootstrap_seed`), and every
round's value. Prints a table and writes JSON (`--out`, default
runs/bench_data_parallel.json).
"""

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {"mlp": {"model_width": 1024, "global_batch_size": 256},
          "transformer": {"global_batch_size": 64}}


def thread_cpu_seconds():
    """{thread kind: CPU seconds (user+sys) so far} over this process's threads, a kind
    being the thread's name without its digits (TensorFlow names its pools' threads:
    the inter-op executor's, the intra-op (Eigen) pool's, tf.data's); Linux only (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        kind = "python (main)" if tid == str(os.getpid()) else re.sub(r"\d+", "#", name)
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def step_clock(threads=False):
    """A minimal Keras callback: the time of every `on_train_batch_end`; with `threads`,
    the CPU time of each kind of thread (`thread_cpu_seconds`) at every batch end too."""
    import keras

    class StepClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends, self.cpu_ends, self.thread_ends = [], [], []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())
            if threads:
                self.thread_ends.append(thread_cpu_seconds())

    return StepClock()


def median_step_ms(clock, warmup):
    gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][max(warmup - 1, 0):]
    return 1000 * statistics.median(gaps)


def cpu_step_ms(clock, warmup):
    """The process's CPU time (every thread: the step's, the input pipeline's) per step,
    the mean over the steps after `warmup`. Waiting for a core another process holds is not
    CPU time, so on a loaded machine this moves far less than the wall time."""
    first = max(warmup - 1, 0)
    steps = len(clock.cpu_ends) - 1 - first
    return 1000 * (clock.cpu_ends[-1] - clock.cpu_ends[first]) / steps


def thread_step_ms(clock, warmup):
    """{thread kind: CPU ms per step} over the steps after `warmup` (`step_clock(threads=
    True)`), or {} when the clock did not record threads. Clock ticks are 10 ms: the
    figures are means over many steps, not single steps."""
    if not clock.thread_ends:
        return {}
    first = max(warmup - 1, 0)
    steps = len(clock.thread_ends) - 1 - first
    begin, end = clock.thread_ends[first], clock.thread_ends[-1]
    return {kind: 1000 * (end[kind] - begin.get(kind, 0.0)) / steps for kind in end}


def stock_dataset(config, task, source):
    """The stock side's own `tf.data` pipeline over the examples tfpar feeds (example i
    from (seed, i), global batch after global batch), which Keras splits over the replicas.

    `source="generated"`: each example made by the task's function inside the pipeline, as
    tfpar's pipeline does (equal input work on both sides). `source="arrays"`: the examples
    materialised once into arrays, then `from_tensor_slices` (no generation while timed).
    """
    import numpy as np
    import tensorflow as tf

    examples = tf.data.Dataset.range(config.steps * config.global_batch_size)
    if source == "generated":
        ds = examples.map(task.example_fn, num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True)
    else:
        batches = [tuple(np.asarray(t) for t in batch)
                   for batch in examples.map(task.example_fn).batch(config.global_batch_size)]
        ds = tf.data.Dataset.from_tensor_slices(
            tuple(np.concatenate(column) for column in zip(*batches)))
    return ds.batch(config.global_batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def run_stock(config, strategy, task, source, warmup, threads=False, callbacks=()):
    """Stock Keras: dataset, model, compile and fit under the user's own strategy
    (`callbacks`: more, after the bench's clock)."""
    import keras

    from tfpar import models

    keras.utils.set_random_seed(config.seed)
    dataset = stock_dataset(config, task, source)
    with strategy.scope():
        model = models.build(config.model, task.input_shape, task.num_classes,
                             width=config.model_width, depth=config.model_depth)
        model.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      jit_compile=False)
    clock = step_clock(threads)
    history = model.fit(dataset, epochs=1, steps_per_epoch=config.steps, callbacks=[clock, *callbacks],
                        verbose=0, shuffle=False)
    return {"step_ms": median_step_ms(clock, warmup), "cpu_ms": cpu_step_ms(clock, warmup),
            "thread_ms": thread_step_ms(clock, warmup),
            "mean_loss": float(history.history["loss"][-1])}  # Keras: the epoch's mean


def run_tfpar(config, runtime, warmup, without=(), threads=False, callbacks=()):
    """`tfpar.train.train` with the bench's clock (and `callbacks` after it); `without`:
    pieces of tfpar taken out for the run (`ablation`)."""
    from tfpar.train import train

    clock = step_clock(threads)
    with ablation(without, config):
        metrics = train(config, callbacks=[clock, *callbacks], runtime=runtime)[0]
    losses = metrics["loss_history"]
    return {"step_ms": median_step_ms(clock, warmup), "cpu_ms": cpu_step_ms(clock, warmup),
            "thread_ms": thread_step_ms(clock, warmup),
            "mean_loss": float(sum(losses) / len(losses)) if losses else float("nan")}


# What `--without` can take out of the tfpar side, one piece at a time, to see what each
# costs (the run still trains the same steps on the same examples).
PIECES = {
    "nan_check": "the optimizer's finiteness check of the summed gradients and its counter "
                 "(tfpar.nan_guard), and the NaNGuard callback reading it every step",
    "step_loss": "the per-step loss metric in the train step (metrics.report_step_loss); "
                 "the recorder reads Keras's running mean instead",
    "direct_step_loss": "the per-step loss read from the value Keras's step hands its loss "
                        "tracker (metrics.report_step_loss, since 2026-12-06): a Mean of its "
                        "own emptied, updated and read every step instead, as before",
    "callbacks": "the per-step hooks of tfpar's own callbacks (StepRecorder, NaNGuard)",
    "data": "tfpar's input pipeline: the stock side's dataset instead, split by Keras",
    "global_input": "the whole-step batches under MirroredStrategy (data.distributed_dataset,"
                    " since 2026-12-06): each replica's batches made by the input pipeline "
                    "instead (distribute_datasets_from_function), as before",
}


@contextlib.contextmanager
def ablation(without, config):
    """Takes `without`'s pieces (keys of `PIECES`) out of tfpar for the duration."""
    from unittest import mock

    import keras

    from tfpar import data, metrics, nan_guard

    class Quiet(nan_guard.NaNGuard):
        def on_train_begin(self, logs=None):
            pass

        def on_train_batch_end(self, batch, logs=None):
            pass

    def running_loss(self, batch, logs=None):
        self.step_seconds.append(time.perf_counter() - self._begin)
        self.batch_losses.append(float(logs["loss"]))

    patches = []
    if "nan_check" in without:
        patches += [mock.patch.object(nan_guard, "skip_nonfinite_updates",
                                      lambda optimizer, skip=True: optimizer),
                    mock.patch.object(nan_guard, "NaNGuard", Quiet)]
    if "step_loss" in without:
        patches += [mock.patch.object(metrics, "report_step_loss", lambda model: None),
                    mock.patch.object(metrics.StepRecorder, "on_train_batch_end", running_loss)]
    if "direct_step_loss" in without and "step_loss" not in without:
        patches.append(mock.patch.object(metrics, "report_step_loss", functools.partial(
            metrics.report_step_loss, direct=False)))
    if "callbacks" in without:
        patches += [mock.patch.object(metrics.StepRecorder, "on_train_batch_begin",
                                      keras.callbacks.Callback.on_train_batch_begin),
                    mock.patch.object(metrics.StepRecorder, "on_train_batch_end",
                                      keras.callbacks.Callback.on_train_batch_end),
                    mock.patch.object(nan_guard, "NaNGuard", Quiet)]
    if "global_input" in without:
        def by_replica(strategy, config, task, start_step=0):
            return strategy.distribute_datasets_from_function(
                lambda context: data.pipeline_dataset(config, task, context, start_step))
        patches.append(mock.patch.object(data, "distributed_dataset", by_replica))
    if "data" in without:
        def stock_data(strategy, config, task, start_step=0):
            return stock_dataset(config, task, "generated")
        patches.append(mock.patch.object(data, "distributed_dataset", stock_data))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def bench_process(settings, rounds, warmup, source, ablations=(), threads=False):
    """One process: both strategies once, then `rounds` rounds of every side (stock, tfpar,
    tfpar without each of `ablations`), the order rotating from round to round."""
    import tensorflow as tf

    from tfpar import data, devices, strategy
    from tfpar.config import ParallelConfig

    config = ParallelConfig(**settings)
    devices.split_cpu(config.cpu_devices)  # process-wide, before TensorFlow starts: both sides
    runtime = strategy.make_runtime(config)
    stock = tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")][:config.cpu_devices])
    task = data.make_task(config)
    sides = {"stock": lambda: run_stock(config, stock, task, source, warmup, threads),
             "tfpar": lambda: run_tfpar(config, runtime, warmup, threads=threads)}
    for pieces in ablations:
        sides[f"tfpar-{pieces}"] = (
            lambda pieces=pieces: run_tfpar(config, runtime, warmup, pieces.split("+"),
                                            threads))
    names = list(sides)
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(sides[name]())
    return out


def thread_medians(rounds):
    """{thread kind: the median over `rounds` (dicts of CPU ms per step) of its CPU ms per
    step}, a kind missing from a round counting 0 there."""
    kinds = sorted({kind for r in rounds for kind in r})
    return {kind: statistics.median(r.get(kind, 0.0) for r in rounds) for kind in kinds}


def print_threads(name, thread_ms):
    """One line per kind of thread busy more than 0.1 ms a step on any side: its CPU ms per
    step on every side (columns), the median over rounds."""
    roles = list(thread_ms)
    kinds = sorted({k for ms in thread_ms.values() for k, v in ms.items() if v > 0.1},
                   key=lambda k: -thread_ms["stock"].get(k, 0.0))
    print(f"{name}: CPU ms per step by kind of thread (median over rounds)")
    print(f"{'thread':<36}" + "".join(f"{role:>26}" for role in roles))
    for kind in kinds + ["all"]:
        cells = [sum(ms.values()) if kind == "all" else ms.get(kind, 0.0)
                 for ms in thread_ms.values()]
        print(f"{kind:<36}" + "".join(f"{v:>26.2f}" for v in cells))


def bootstrap_ci(values, statistic, resamples, seed, level=0.95):
    """Percentile bootstrap interval of `statistic` over `values` resampled with
    replacement."""
    import numpy as np

    rng = np.random.default_rng(seed)
    values = np.asarray(values)
    stats = sorted(statistic(values[rng.integers(0, len(values), len(values))])
                   for _ in range(resamples))
    low = stats[int((1 - level) / 2 * resamples)]
    high = stats[min(int((1 + level) / 2 * resamples), resamples - 1)]
    return low, high


def main():
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per process")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--cpu_devices", type=int, default=4)
    parser.add_argument("--stock_data", choices=("generated", "arrays"), default="generated",
                        help="the stock pipeline generates each example as tfpar does, or "
                        "reads arrays made beforehand")
    parser.add_argument("--without", default="",
                        help="comma-separated extra tfpar sides, each with pieces taken out "
                        "(joined by +): " + ", ".join(PIECES))
    parser.add_argument("--bootstrap", type=int, default=10000)
    parser.add_argument("--bootstrap_seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 steps, 2 rounds, mlp only")
    parser.add_argument("--threads", action="store_true",
                        help="also each kind of thread's CPU time per step, every side "
                        "(median over rounds): where a side's CPU time goes")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_data_parallel.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ablations = [a for a in args.without.split(",") if a]
        print(json.dumps(bench_process(json.loads(args.child), args.rounds, args.warmup,
                                       args.stock_data, ablations, args.threads)))
        return
    for side in filter(None, args.without.split(",")):
        unknown = set(side.split("+")) - set(PIECES)
        if unknown:
            parser.error(f"--without={args.without}: {', '.join(sorted(unknown))} is not a "
                         f"piece; use {', '.join(PIECES)} (joined by + for one side)")
    if args.quick:
        args.models, args.steps, args.rounds, args.processes = "mlp", 20, 2, 1

    report, rows = {}, []
    for name in args.models.split(","):
        settings = {"model": name, "steps": args.steps, "steps_per_epoch": args.steps,
                    "cpu_devices": args.cpu_devices, "strategy": "mirrored", "verbose": 0,
                    **MODELS[name]}
        rounds = {}
        for _ in range(args.processes):
            out = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(settings),
                 f"--rounds={args.rounds}", f"--warmup={args.warmup}",
                 f"--stock_data={args.stock_data}", f"--without={args.without}",
                 *(["--threads"] if args.threads else [])],
                capture_output=True, text=True, timeout=1800, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"bench process failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            for role, runs in result.items():
                rounds.setdefault(role, []).extend(runs)
        per_round = {role: [r["step_ms"] for r in rs] for role, rs in rounds.items()}
        cpu_per_round = {role: [r["cpu_ms"] for r in rs] for role, rs in rounds.items()}
        median = {role: statistics.median(ms) for role, ms in per_round.items()}
        sides = {}
        for role in per_round:
            if role == "stock":
                continue
            overheads = [t / s - 1 for t, s in zip(per_round[role], per_round["stock"])]
            low, high = bootstrap_ci(overheads, np.median, args.bootstrap, args.bootstrap_seed)
            cpu = [t / s - 1 for t, s in zip(cpu_per_round[role], cpu_per_round["stock"])]
            sides[role] = {"overhead_per_round": overheads,
                           "overhead": float(np.median(overheads)), "ci95": [low, high],
                           "cpu_overhead_per_round": cpu,
                           "cpu_overhead": float(np.median(cpu))}
            rows.append((name, role, median["stock"], median[role], sides[role]["overhead"],
                         low, high, overheads, sides[role]["cpu_overhead"]))
        report[name] = {"settings": settings, "step_ms_per_round": per_round,
                        "cpu_ms_per_round": cpu_per_round,
                        "step_ms": median, **sides.pop("tfpar"), "rounds": args.rounds
                        * args.processes,
                        # The same work on both sides: equal mean losses over the run.
                        "mean_loss": {role: [r["mean_loss"] for r in rs]
                                      for role, rs in rounds.items()}}
        if sides:
            report[name]["without"] = sides
        if args.threads:
            report[name]["thread_ms"] = {role: thread_medians([r["thread_ms"] for r in rs])
                                         for role, rs in rounds.items()}

    print(f"{'model':<12}{'side':<24}{'stock ms':>10}{'side ms':>10}{'overhead':>10}"
          f"{'95% CI':>20}{'rounds: min … max':>22}{'n':>4}{'CPU':>8}")
    for name, role, stock, ours, overhead, low, high, each, cpu in rows:
        ci = f"[{low:+.1%}, {high:+.1%}]"
        spread = f"{min(each):+.1%} … {max(each):+.1%}"
        print(f"{name:<12}{role:<24}{stock:>10.2f}{ours:>10.2f}{overhead:>+10.1%}{ci:>20}"
              f"{spread:>22}{len(each):>4}{cpu:>+8.1%}")
    print("CPU: the median over rounds of the process's CPU time per step against stock's")
    for name, role, *_, each, _ in rows:
        print(f"{name} {role} per round: " + " ".join(f"{v:+.1%}" for v in each))
    for name in report:
        if "thread_ms" in report[name]:
            print_threads(name, report[name]["thread_ms"])
    for name in report:
        losses = report[name]["mean_loss"]
        gap = max(abs(a - b) for a, b in zip(losses["stock"], losses["tfpar"]))
        print(f"{name} mean loss over a run, largest stock/tfpar gap of a round: {gap:.2e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here or in any child (they inherit it).
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    main()
