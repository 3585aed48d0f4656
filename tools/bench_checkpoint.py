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

Per side and round: ms per step over the segment, the step-time overhead against `none`
of the same round, and the time the step was blocked per save. Prints the rounds and the
medians over rounds (with min–max), and writes `--out` (JSON).

    flock /tmp/tfpar-cpu.lock python tools/bench_checkpoint.py --rounds=5

Take the CPU lock yourself.
"""

import argparse
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
    """A Keras callback: each step's end time, and the time each save blocked the step."""
    import keras

    class Timed(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends, self.blocked = [], []

        def on_train_batch_end(self, batch, logs=None):
            if checkpointer is not None:
                began, saved = time.perf_counter(), checkpointer.saved_step
                checkpointer.on_train_batch_end(batch, logs)
                if checkpointer.saved_step != saved:
                    self.blocked.append(time.perf_counter() - began)
            self.ends.append(time.perf_counter())

    return Timed()


def segment(fit, checkpointer, steps):
    """Trains `steps` steps with `fit(steps, callbacks)`; returns (seconds for steps 2..end
    plus the wait for the last write, [seconds each save blocked])."""
    clock = timed(checkpointer)
    fit(steps, [clock])
    began = time.perf_counter()
    if checkpointer is not None:
        checkpointer.wait()
    waited = time.perf_counter() - began
    return clock.ends[-1] - clock.ends[0] + waited, clock.blocked


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--segment", type=int, default=200, help="steps per side and round")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--mesh", default="", help="DPxTP: a DTensor mesh of data_parallel × "
                   "tensor_parallel logical CPUs (default: one device)")
    p.add_argument("--dir", default="", help="where the checkpoints go (default: a new "
                   "temporary directory, deleted at the end)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_checkpoint.json"))
    args = p.parse_args()
    if args.segment % EVERY or args.segment < 2 * EVERY:
        p.error(f"--segment must be a multiple of {EVERY}, at least {2 * EVERY}")
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
    checkpointers = {"none": None}
    for side in ("sync", "async"):
        checkpointers[side] = Checkpointer(
            config.replace(checkpoint_dir=os.path.join(folder, side), checkpoint_every=EVERY,
                           checkpoint_async=side == "async"), model, runtime)
        for step in range(EVERY // 2):  # saves in mid-segment: at 50, 150, ...
            checkpointers[side].on_train_batch_end(step)
    rounds = []
    try:
        for r in range(args.rounds + 1):
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            order = SIDES[r % 3:] + SIDES[:r % 3]
            row = {"load": load, "order": list(order)}
            for side in order:
                seconds, blocked = segment(fit, checkpointers[side], args.segment)
                row[side] = {"ms_per_step": 1000 * seconds / (args.segment - 1),
                             "blocked_ms": [1000 * b for b in blocked]}
            for side in ("sync", "async"):
                row[side]["overhead"] = (row[side]["ms_per_step"] / row["none"]["ms_per_step"]
                                         - 1)
            if r == 0:
                print(f"warm-up round (load {load}): none {row['none']['ms_per_step']:.1f} "
                      "ms/step", flush=True)
                continue
            rounds.append(row)
            print(f"round {r}/{args.rounds} (load {load}, order {'/'.join(order)}): "
                  f"none {row['none']['ms_per_step']:.1f} ms/step; " + "; ".join(
                      f"{s} {row[s]['ms_per_step']:.1f} ms/step ({100 * row[s]['overhead']:+.2f} "
                      f"%), blocked {statistics.median(row[s]['blocked_ms']):.0f} ms per save"
                      for s in ("sync", "async")), flush=True)
        size = sum(os.path.getsize(os.path.join(folder, "sync", name))
                   for name in os.listdir(os.path.join(folder, "sync"))
                   if name.startswith(f"ckpt-{checkpointers['sync'].saved_step}."))
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    summary = {}
    for side in SIDES:
        per_step = [row[side]["ms_per_step"] for row in rounds]
        summary[side] = {"ms_per_step": statistics.median(per_step)}
        if side != "none":
            over = [row[side]["overhead"] for row in rounds]
            blocked = [b for row in rounds for b in row[side]["blocked_ms"]]
            summary[side].update(overhead=statistics.median(over), overhead_min=min(over),
                                 overhead_max=max(over), blocked_ms=statistics.median(blocked),
                                 blocked_ms_min=min(blocked), blocked_ms_max=max(blocked))
    print(f"\ntransformer width {args.width} depth {args.depth}, {params:,} parameters, Adam, "
          f"{'mesh ' + args.mesh if args.mesh else 'one device'}: "
          f"{size / 2 ** 20:.0f} MiB a checkpoint; a save every {EVERY} steps, batch "
          f"{args.batch}; medians over {args.rounds} rounds (min–max)")
    print(f"  {'side':6} {'ms/step':>8} {'overhead %':>22} {'blocked ms per save':>26}")
    for side in SIDES:
        s = summary[side]
        over = (f"{100 * s['overhead']:+.2f} ({100 * s['overhead_min']:+.2f}–"
                f"{100 * s['overhead_max']:+.2f})" if side != "none" else "")
        blocked = (f"{s['blocked_ms']:.0f} ({s['blocked_ms_min']:.0f}–{s['blocked_ms_max']:.0f})"
                   if side != "none" else "")
        print(f"  {side:6} {s['ms_per_step']:8.1f} {over:>22} {blocked:>26}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "parameters": params, "checkpoint_bytes": size,
                   "rounds": rounds, "summary": summary}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    # The trainer's default kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS is set), not the
    # processor's, before TensorFlow starts here.
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    sys.exit(main())
