"""Checkpoint saves during training: asynchronous against synchronous, interleaved.

One process, one device (or a DTensor mesh: `--mesh=2x2` is data_parallel 2 × tensor_parallel
2 on 4 logical CPUs, its steps run by the mesh trainer, the state gathered whole to host
memory at each save): the zoo's transformer widened (`--width`, `--depth`; Adam, so the
checkpoint holds the weights and two slots each) trains in segments of `--segment` steps,
each segment on one side: `none` (no checkpoint), `sync` (`--nocheckpoint_async`: the step
waits for the files) and `async` (`--checkpoint_async`: the step waits for the copy to
host memory, a thread writes). A side saves every 100 steps (`tfpar.checkpoint.Checkpointer`,
its own directory), at steps 50 and 150 of a 200-step segment, so that an asynchronous
write ends inside its own segment; the segment's time includes waiting for it at the end.
The sides take turns in a rotating order over `--rounds` rounds, after one untimed round.
`--nice=N` adds a fourth side, `async_nice`: `async` with its writer thread at nice N above
training's (Linux sets it per thread), to measure against `async` in the same rounds
(`--rounds` then a multiple of 4 balances the order).

Per side and round: ms per step over the segment, the step-time overhead against `none`
of the same round, and the time the step was blocked per save. Prints the rounds and the
medians over rounds (with min–max), and writes `--out` (JSON).

Where a save's cost goes, in CPU time (steadier than wall time on a loaded machine): the
process's CPU per step over the same window as the wall time (`cpu_ms_per_step`, all
threads: the writer's and the kernel's work for this process included) and its overhead
against `none`; per save, each phase's CPU and wall time in the thread that ran it
(`Checkpointer.costs`: `snapshot`, the step's blocking part; `write`, TensorFlow's writer;
`manifest`, sizes and CRC32; `publish`; `writer`, the async thread's whole work; `save`, a
synchronous save's whole blocking); the bytes the segment wrote (`/proc/self/io`;
unknown, `?`, when the checkpoints' directory is on tmpfs, whose writes it never counts); the
Python garbage collector's time; and whether a save slows the steps after it:
`lost_after_ms`, the excess over the 20 steps before a save of steps 1–10 and 11–40 after
it, and `lost_after_cpu_ms` the same in the process's CPU time (the writer thread's work
included while it runs), with `none`'s steps at the same positions as the control. Every segment ends with
`os.sync()` and `gc.collect()` outside its timed window (`sync_ms`), so that the kernel
does not write one side's files back during another side's segment; `--rounds` should be
a multiple of 3 so that each side runs first, second and third equally often.

    flock /tmp/tfpar-cpu.lock python tools/bench_checkpoint.py --rounds=6

Take the CPU lock yourself.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIDES = ("none", "sync", "async")
EVERY = 100


def timed(checkpointer):
    """A Keras callback: each step's end time and the process's CPU time then, the time
    each save blocked the step and the step's thread's CPU time meanwhile, and which steps
    held a save."""
    import keras

    class Timed(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends, self.blocked, self.save_cpu, self.saved_at = [], [], [], []
            self.cpu_ends = []  # the process's CPU time at each step's end

        def on_train_batch_end(self, batch, logs=None):
            if checkpointer is not None:
                began, saved = time.perf_counter(), checkpointer.saved_step
                cpu = time.thread_time()
                checkpointer.on_train_batch_end(batch, logs)
                if checkpointer.saved_step != saved:
                    self.blocked.append(time.perf_counter() - began)
                    self.save_cpu.append(time.thread_time() - cpu)
                    self.saved_at.append(len(self.ends))
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())

    return Timed()


class GcClock:
    """The garbage collector's time and collections while it is installed."""

    def __init__(self):
        self.seconds, self.collections, self._began = 0.0, 0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.collections += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


# File systems in memory: `/proc/self/io`'s write_bytes never counts their writes.
MEMORY_FS = ("tmpfs", "ramfs")


def file_system(path):
    """The type of the file system `path` is on (from /proc/mounts, Linux), or None."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return None
    return kind


def written_bytes(folder):
    """The bytes this process has caused to be written to storage (Linux), or None:
    unknown, also when `folder` is in memory (tmpfs: its writes reach no storage, so they
    would read as 0)."""
    if file_system(folder) in MEMORY_FS:
        return None
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    except (OSError, StopIteration):
        return None


def lost_after(ends, positions, before=20, windows=((1, 10), (11, 40))):
    """Per position `k` (a step whose interval `ends[k] - ends[k-1]` held a save): the ms
    that steps `k+a … k+b` took beyond the median of the `before` steps before `k`, per
    window `(a, b)`."""
    steps = [b - a for a, b in zip(ends, ends[1:])]  # steps[i] ends at ends[i + 1]
    out = []
    for k in positions:
        i = k - 1  # the save's own interval in `steps`
        if i - before < 0 or i + windows[-1][1] >= len(steps):
            continue
        base = statistics.median(steps[i - before:i])
        out.append({f"{a}-{b}": 1000 * sum(d - base for d in steps[i + a:i + b + 1])
                    for a, b in windows})
    return out


def segment(fit, checkpointer, steps, folder):
    """Trains `steps` steps with `fit(steps, callbacks)` (the checkpoints under `folder`);
    returns (seconds for steps 2..end plus the wait for the last write, [seconds each save
    blocked], the rest of what was measured as a dict)."""
    clock = timed(checkpointer)
    first = checkpointer.costs.count if checkpointer is not None else 0
    wrote = written_bytes(folder)
    with GcClock() as collector:
        fit(steps, [clock])
        began = time.perf_counter()
        if checkpointer is not None:
            checkpointer.wait()
        waited = time.perf_counter() - began
        cpu = time.process_time() - clock.cpu_ends[0]
    seconds = clock.ends[-1] - clock.ends[0] + waited
    wrote = written_bytes(folder) - wrote if wrote is not None else None
    # The save's files on disk before the next segment (outside the timed window).
    began = time.perf_counter()
    os.sync()
    synced = time.perf_counter() - began
    gc.collect()
    positions = clock.saved_at or list(range(EVERY // 2 - 1, steps, EVERY))
    extra = {"cpu_ms_per_step": 1000 * cpu / (steps - 1),
             "save_cpu_ms": [1000 * c for c in clock.save_cpu],
             "costs": checkpointer.costs.since(first) if checkpointer is not None else [],
             "written_mib": wrote / 2 ** 20 if wrote is not None else None,
             "gc_ms": 1000 * collector.seconds, "gc_collections": collector.collections,
             "sync_ms": 1000 * synced,
             "lost_after_ms": lost_after(clock.ends, positions),
             "lost_after_cpu_ms": lost_after(clock.cpu_ends, positions)}
    return seconds, clock.blocked, extra


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="a multiple of 3 balances the "
                   "order")
    p.add_argument("--rotate", type=int, default=0, help="start the sides' rotation this "
                   "many places on (runs of one round each, rotated 0, 1, 2, make a "
                   "balanced set)")
    p.add_argument("--segment", type=int, default=200, help="steps per side and round")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--mesh", default="", help="DPxTP: a DTensor mesh of data_parallel × "
                   "tensor_parallel logical CPUs (default: one device)")
    p.add_argument("--nice", type=int, default=0, help="N > 0: a fourth side, async_nice, "
                   "whose writer thread runs at nice N above training's")
    p.add_argument("--dir", default="", help="where the checkpoints go (default: a new "
                   "temporary directory, deleted at the end)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_checkpoint.json"))
    args = p.parse_args()
    if not 0 <= args.nice <= 19:
        p.error(f"--nice={args.nice}: must be from 0 (no async_nice side) to 19")
    if args.segment % EVERY or args.segment < 2 * EVERY:
        p.error(f"--segment must be a multiple of {EVERY}, at least {2 * EVERY}")
    from tfpar.checkpoint_writer import Costs
    if args.segment // EVERY > Costs.MAX:
        p.error(f"--segment={args.segment}: {args.segment // EVERY} saves a segment, "
                f"Checkpointer.costs keeps {Costs.MAX}; use at most {Costs.MAX * EVERY}")
    from tfpar import ParallelConfig, backends, data
    from tfpar.checkpoint import Checkpointer

    folder = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    layout = {"strategy": "one_device"}
    if args.mesh:
        try:
            dp, tp = (int(n) for n in args.mesh.lower().split("x"))
        except ValueError:
            p.error(f"--mesh={args.mesh}: use DPxTP, e.g. 2x2")
        layout = {"data_parallel": dp, "tensor_parallel": tp, "cpu_devices": dp * tp}
    config = ParallelConfig(model="transformer", model_width=args.width, model_depth=args.depth,
                            optimizer="adam", global_batch_size=args.batch, steps=10 ** 6,
                            steps_per_epoch=10 ** 6, verbose=0, **layout)
    backend = backends.for_config(config)
    runtime = backend.build_runtime(config)
    task = data.make_task(config)
    model = backend.build_model(config, runtime, task)
    if args.mesh:
        batches = iter(data.mesh_dataset(config, task, runtime.mesh.shape[0]))

        def fit(steps, callbacks):
            backend.trainer.fit(batches, epochs=1, steps_per_epoch=steps, verbose=0,
                                callbacks=callbacks)
    else:
        dataset = data.distributed_dataset(runtime.strategy, config, task)

        def fit(steps, callbacks):
            model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0,
                      callbacks=callbacks)
    params = model.count_params()
    sides = SIDES + (("async_nice",) if args.nice else ())
    saving = sides[1:]
    checkpointers = {"none": None}
    for side in saving:
        checkpointers[side] = Checkpointer(
            config.replace(checkpoint_dir=os.path.join(folder, side), checkpoint_every=EVERY,
                           checkpoint_async=side != "sync"), model, runtime,
            writer_nice=args.nice if side == "async_nice" else 0)
        for step in range(EVERY // 2):  # saves in mid-segment: at 50, 150, ...
            checkpointers[side].on_train_batch_end(step)
    rounds = []
    try:
        for r in range(args.rounds + 1):
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            turn = (r + args.rotate) % len(sides)
            order = sides[turn:] + sides[:turn]
            row = {"load": load, "order": list(order)}
            for side in order:
                seconds, blocked, extra = segment(fit, checkpointers[side], args.segment,
                                                 folder)
                row[side] = {"ms_per_step": 1000 * seconds / (args.segment - 1),
                             "blocked_ms": [1000 * b for b in blocked], **extra}
            for side in saving:
                row[side]["overhead"] = (row[side]["ms_per_step"] / row["none"]["ms_per_step"]
                                         - 1)
                row[side]["cpu_overhead"] = (row[side]["cpu_ms_per_step"]
                                             / row["none"]["cpu_ms_per_step"] - 1)
            if r == 0:
                print(f"warm-up round (load {load}): none {row['none']['ms_per_step']:.1f} "
                      "ms/step", flush=True)
                continue
            rounds.append(row)
            print(f"round {r}/{args.rounds} (load {load}, order {'/'.join(order)}): "
                  f"none {row['none']['ms_per_step']:.1f} ms/step; " + "; ".join(
                      f"{s} {row[s]['ms_per_step']:.1f} ms/step ({100 * row[s]['overhead']:+.2f} "
                      f"%, CPU {100 * row[s]['cpu_overhead']:+.2f} %), blocked "
                      f"{statistics.median(row[s]['blocked_ms']):.0f} ms per save"
                      for s in saving), flush=True)
        size = sum(os.path.getsize(os.path.join(folder, "sync", name))
                   for name in os.listdir(os.path.join(folder, "sync"))
                   if name.startswith(f"ckpt-{checkpointers['sync'].saved_step}."))
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    summary = {}
    for side in sides:
        per_step = [row[side]["ms_per_step"] for row in rounds]
        summary[side] = {"ms_per_step": statistics.median(per_step)}
        if side != "none":
            over = [row[side]["overhead"] for row in rounds]
            blocked = [b for row in rounds for b in row[side]["blocked_ms"]]
            summary[side].update(overhead=statistics.median(over), overhead_min=min(over),
                                 overhead_max=max(over), blocked_ms=statistics.median(blocked),
                                 blocked_ms_min=min(blocked), blocked_ms_max=max(blocked))
        summary[side].update(accounting(rounds, side))
    print(f"\ntransformer width {args.width} depth {args.depth}, {params:,} parameters, Adam, "
          f"{'mesh ' + args.mesh if args.mesh else 'one device'}: "
          f"{size / 2 ** 20:.0f} MiB a checkpoint; a save every {EVERY} steps, batch "
          f"{args.batch}; medians over {args.rounds} rounds (min–max)")
    print(f"  {'side':6} {'ms/step':>8} {'overhead %':>22} {'blocked ms per save':>26}")
    for side in sides:
        s = summary[side]
        over = (f"{100 * s['overhead']:+.2f} ({100 * s['overhead_min']:+.2f}–"
                f"{100 * s['overhead_max']:+.2f})" if side != "none" else "")
        blocked = (f"{s['blocked_ms']:.0f} ({s['blocked_ms_min']:.0f}–{s['blocked_ms_max']:.0f})"
                   if side != "none" else "")
        print(f"  {side:6} {s['ms_per_step']:8.1f} {over:>22} {blocked:>26}")
    print_accounting(summary, args.rounds, sides)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "parameters": params, "checkpoint_bytes": size,
                   "rounds": rounds, "summary": summary}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


PHASES = ("save", "snapshot", "write", "manifest", "publish", "trace", "writer")


def _spread(values):
    return ({"median": statistics.median(values), "min": min(values), "max": max(values)}
            if values else None)


def accounting(rounds, side):
    """The CPU-time figures of `side` over `rounds` (medians, min, max)."""
    out = {"cpu_ms_per_step": statistics.median(row[side]["cpu_ms_per_step"]
                                                for row in rounds)}
    if side != "none":
        out["cpu_overhead"] = _spread([row[side]["cpu_overhead"] for row in rounds])
        out["save_cpu_ms"] = _spread([c for row in rounds for c in row[side]["save_cpu_ms"]])
        costs = [c for row in rounds for c in row[side]["costs"]]
        out["phases"] = {f"{phase}_{kind}": _spread([c[f"{phase}_{kind}"] for c in costs
                                                     if f"{phase}_{kind}" in c])
                         for phase in PHASES for kind in ("cpu_ms", "ms")
                         if any(f"{phase}_{kind}" in c for c in costs)}
    written = [row[side]["written_mib"] for row in rounds if row[side]["written_mib"] is not None]
    out["written_mib"] = statistics.median(written) if written else None
    for key in ("gc_ms", "sync_ms"):
        out[key] = _spread([row[side][key] for row in rounds])
    for key in ("lost_after_ms", "lost_after_cpu_ms"):
        lost = [entry for row in rounds for entry in row[side][key]]
        out[key] = ({window: _spread([entry[window] for entry in lost])
                     for window in lost[0]} if lost else None)
    return out


def print_accounting(summary, rounds, sides=SIDES):
    """The CPU-time table: per side, the process's CPU per step and its overhead, each
    phase's CPU per save, and the ms lost by the steps after a save."""
    print(f"\nCPU time (all the process's threads), medians over {rounds} rounds (min–max); "
          "per save: each phase's CPU ms in the thread that ran it")
    print(f"  {'side':6} {'CPU ms/step':>11} {'CPU overhead %':>22} {'MiB/seg':>8} "
          f"{'gc ms':>6} {'sync ms':>8}  lost after a save, steps 1–10 / 11–40: CPU ms "
          "(wall ms)")
    for side in sides:
        s = summary[side]
        over = s.get("cpu_overhead")
        over = (f"{100 * over['median']:+.2f} ({100 * over['min']:+.2f}–"
                f"{100 * over['max']:+.2f})" if over else "")
        lost, wall = s["lost_after_cpu_ms"], s["lost_after_ms"]
        lost = (" / ".join(f"{lost[w]['median']:+.0f} ({wall[w]['median']:+.0f})"
                           for w in lost) if lost else "")
        written = f"{s['written_mib']:.0f}" if s["written_mib"] is not None else "?"
        print(f"  {side:6} {s['cpu_ms_per_step']:11.1f} {over:>22} {written:>8} "
              f"{s['gc_ms']['median']:6.0f} {s['sync_ms']['median']:8.0f}  {lost}")
    for side in sides[1:]:
        phases = summary[side]["phases"]
        cells = [f"{phase} {phases[phase + '_cpu_ms']['median']:.0f} "
                 f"({phases[phase + '_ms']['median']:.0f} wall)"
                 for phase in PHASES if phase + "_cpu_ms" in phases]
        print(f"  {side} per save, CPU ms: " + "; ".join(cells)
              + f"; the step's thread while blocked "
                f"{summary[side]['save_cpu_ms']['median']:.0f}")


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here.
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    sys.exit(main())
