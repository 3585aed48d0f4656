"""Where each side of `tools/bench_data_parallel.py` spends its CPU time, by function: stock
Keras `fit` against tfpar's, one side per process, sampled by Linux `perf` (TensorFlow's C++
and the interpreter alike) or, with `--cprofile`, the main thread's Python functions.

Each process runs one side (`stock`, `tfpar`, or tfpar with `--without`'s pieces taken out,
as the bench names them) for `--steps` steps of the bench's model on 4 logical CPUs; from
the end of step `--warmup` to the end of the last step `perf record` samples every thread
of the process (`--freq` samples per CPU second), or cProfile times the main thread's
functions in that thread's CPU time. Sides alternate over
`--rounds` processes each. Prints CPU ms per step by kind of thread, by library and the
symbols whose share differs most between the sides (perf), or the Python functions' own
time per step (cProfile); samples / frequency / steps is CPU time per step.

    python tools/profile_dp_sides.py --model=mlp                  # perf, stock vs tfpar
    python tools/profile_dp_sides.py --sides=stock,tfpar,tfpar-data --rounds=3
    python tools/profile_dp_sides.py --cprofile                  # the main thread's Python

Needs `perf` (linux-perf) unless `--cprofile`.
"""

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))


def window_callback(warmup, perf_out, freq):
    """A Keras callback that starts sampling this process at the end of step `warmup`
    (`perf record` attached to it, or cProfile on this thread when `perf_out` is None) and
    stops at the end of the last step; `.result()` then gives the steps and CPU time
    covered."""
    import keras

    class Window(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen, self.proc, self.profile = 0, None, None
            self.first = self.cpu0 = self.cpu1 = None

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == self.params.get("steps"):
                self.stop()  # at the last step's end: nothing of fit's end in the window
            if self.seen != warmup:
                return
            if perf_out is None:
                self.profile = cProfile.Profile(time.thread_time)  # CPU, not waiting
                self.profile.enable()
            else:
                self.proc = subprocess.Popen(
                    ["perf", "record", "-q", "-F", str(freq), "-p", str(os.getpid()),
                     "-o", perf_out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(1.0)  # attached to every thread before the window opens
            self.first, self.cpu0 = self.seen, time.process_time()

        def on_train_end(self, logs=None):
            self.stop()

        def stop(self):
            if self.cpu1 is not None:
                return
            self.cpu1 = time.process_time()
            if self.profile is not None:
                self.profile.disable()
            if self.proc is not None:
                self.proc.send_signal(signal.SIGINT)
                _, err = self.proc.communicate(timeout=120)
                if self.proc.returncode not in (0, -signal.SIGINT):
                    raise SystemExit(f"perf record failed: {err.decode()[-2000:]}")

        def result(self):
            steps = self.seen - self.first
            return {"steps": steps, "cpu_ms": 1000 * (self.cpu1 - self.cpu0) / steps}

    return Window()


def child(args):
    """Runs one side in this process and prints one JSON line (and writes the profile)."""
    import tensorflow as tf

    import bench_data_parallel as bench
    from tfpar import data, devices, strategy
    from tfpar.config import ParallelConfig

    settings = {"model": args.model, "steps": args.steps, "steps_per_epoch": args.steps,
                "cpu_devices": 4, "strategy": "mirrored", "verbose": 0,
                **bench.MODELS[args.model]}
    config = ParallelConfig(**settings)
    devices.split_cpu(config.cpu_devices)
    runtime = strategy.make_runtime(config)
    window = window_callback(args.warmup, None if args.cprofile else args.out, args.freq)
    if args.side == "stock":
        stock = tf.distribute.MirroredStrategy(
            [d.name for d in tf.config.list_logical_devices("CPU")][:config.cpu_devices])
        bench.run_stock(config, stock, data.make_task(config), "generated", args.warmup,
                        callbacks=[window])
    else:
        without = args.side.split("-", 1)[1].split("+") if "-" in args.side else ()
        bench.run_tfpar(config, runtime, args.warmup, without, callbacks=[window])
    if args.cprofile:
        window.profile.dump_stats(args.out)
    print(json.dumps(window.result()))


def perf_samples(path, pid_hint=None):
    """Counter of (thread kind, library, symbol) over `perf script`'s samples of `path`."""
    out = subprocess.run(["perf", "script", "-i", path, "-F", "comm,pid,tid,ip,sym,dso"],
                         capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    line_re = re.compile(r"^\s*(.*?)\s+(\d+)/(\d+)\s+[0-9a-f]+\s+(.*?)\s*\(([^()]*)\)\s*$")
    for line in out.splitlines():
        m = line_re.match(line)
        if not m:
            continue
        comm, pid, tid, sym, dso = m.groups()
        kind = "python (main)" if pid == tid else re.sub(r"\d+", "#", comm)
        dso = os.path.basename(dso)
        if re.fullmatch(r"perf-\d+\.map", dso):
            dso = "jit (oneDNN kernels)"  # code generated at run time, named by its perf map
        counts[kind, dso, short_symbol(sym)] += 1
    return counts


def short_symbol(sym):
    """A C++ symbol without its template arguments and parameters; Eigen's element-wise
    kernels (one `std::_Function_handler<...>` each) by the functors they apply."""
    functors = re.findall(r"(scalar_\w+?_op|\w+Reducer|TensorContraction\w*|TensorBroadcasting"
                          r"|TensorSlicing\w*|TensorConversion\w*)", sym)
    if sym.startswith("std::_Function_handler") and functors:
        return "eigen " + ",".join(dict.fromkeys(functors))
    depth, out = 0, []
    for ch in sym.replace("(anonymous namespace)", "anon"):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).split("(")[0] or "?"


def per_step(counts, key, freq, steps):
    """{group: CPU ms per step} of `counts` grouped by `key(kind, dso, sym)`."""
    out = collections.Counter()
    for k, n in counts.items():
        out[key(*k)] += n
    return {g: 1000 * n / freq / steps for g, n in out.items()}


def print_table(title, sides, limit, order_by_diff=False):
    """`sides`: {side: {group: ms}}; rows by the first side's figure (or by the largest
    difference from it), `limit` rows."""
    names = list(sides)
    groups = set().union(*sides.values())
    base = sides[names[0]]
    if order_by_diff:
        def key(g):
            return -max(abs(sides[s].get(g, 0.0) - base.get(g, 0.0)) for s in names)
    else:
        def key(g):
            return -base.get(g, 0.0)
    print(f"\n{title}")
    print(f"{'':<64}" + "".join(f"{n:>22}" for n in names))
    for g in sorted(groups, key=key)[:limit]:
        label = g if isinstance(g, str) else " | ".join(g)
        print(f"{label[:63]:<64}" + "".join(f"{sides[n].get(g, 0.0):>22.3f}" for n in names))
    print(f"{'all':<64}" + "".join(f"{sum(sides[n].values()):>22.3f}" for n in names))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "transformer"))
    parser.add_argument("--sides", default="stock,tfpar",
                        help="comma-separated: stock, tfpar, tfpar-PIECE[+PIECE] "
                        "(bench_data_parallel's --without pieces)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="processes per side, alternating")
    parser.add_argument("--freq", type=int, default=997, help="perf samples per CPU second")
    parser.add_argument("--cprofile", action="store_true",
                        help="the main thread's Python functions (cProfile) instead of perf")
    parser.add_argument("--limit", type=int, default=30, help="rows per table")
    parser.add_argument("--report", help="print the tables of an earlier run's directory "
                        "(its first line names it) instead of running")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return child(args)

    if args.report:
        with open(os.path.join(args.report, "results.json")) as f:
            saved = json.load(f)
        return report(saved["results"], saved["args"], args.limit)
    sides = args.sides.split(",")
    tmp = tempfile.mkdtemp(prefix="profile_dp_sides.")
    print(f"profiles in {tmp}")
    results = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            out = os.path.join(tmp, f"{side}.{r}")
            proc = subprocess.run(
                [sys.executable, __file__, f"--side={side}", f"--out={out}",
                 f"--model={args.model}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                 f"--freq={args.freq}", *(["--cprofile"] if args.cprofile else [])],
                capture_output=True, text=True, timeout=1200, cwd=ROOT)
            if proc.returncode:
                raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
            results[side].append((json.loads(proc.stdout.strip().splitlines()[-1]), out))
    with open(os.path.join(tmp, "results.json"), "w") as f:
        json.dump({"results": results, "args": vars(args)}, f)
    report(results, vars(args), args.limit)


def report(results, args, limit):
    """Prints the tables of `results` ({side: [(window result, profile path), ...]})."""
    sides = list(results)
    print(f"{args['model']}, 4 replicas; CPU ms per step, {args['rounds']} processes per side "
          f"(steps {args['warmup']}..{args['steps']}); process CPU ms per step (each process): "
          + "; ".join(f"{s} " + " ".join(f"{w['cpu_ms']:.1f}" for w, _ in rs)
                      for s, rs in results.items()))
    if args['cprofile']:
        for side, runs in results.items():
            steps = sum(w["steps"] for w, _ in runs)
            stats = pstats.Stats(*[path for _, path in runs])
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:limit]
            print(f"\n{side}: the main thread's Python functions: own CPU ms per step, calls "
                  f"per step, cumulative CPU ms per step")
            for (file, line, fn), (cc, nc, tt, ct, _) in rows:
                print(f"{1000 * tt / steps:>9.3f} {nc / steps:>8.1f} {1000 * ct / steps:>9.3f}"
                      f"  {os.path.basename(file)}:{line} {fn}")
        return
    counts = {side: sum((perf_samples(path) for _, path in runs), collections.Counter())
              for side, runs in results.items()}
    steps = {side: sum(w["steps"] for w, _ in runs) for side, runs in results.items()}
    by = {"kind of thread": lambda kind, dso, sym: kind,
          "library": lambda kind, dso, sym: dso,
          "symbol (largest differences)": lambda kind, dso, sym: (dso, sym),
          "thread | library (largest differences)": lambda kind, dso, sym: (kind, dso)}
    for title, key in by.items():
        print_table(title, {s: per_step(counts[s], key, args['freq'], steps[s]) for s in sides},
                    limit, order_by_diff="differences" in title)


if __name__ == "__main__":
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    main()
