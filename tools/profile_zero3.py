"""Where ZeRO-3's step time goes: its pieces beside the same pieces of plain data
parallelism on the same DTensor mesh.

    python tools/profile_zero3.py                   # transformer 256 x 4, 4 logical CPUs
    python tools/profile_zero3.py --rounds=3 --calls=5

Each variant runs in its own child process (DTensor reads its all-reduce combining once a
process), built as `tfpar.train` builds a mesh run (`tfpar.layout.run.build`: the model,
the optimizer, `MeshTrainer`), on the same model, batch and optimizer as `tools/
bench_memory.py --overhead`:

- `mesh-plain`: no ZeRO, data parallelism on the mesh (`batch` = 4 replicas), DTensor's
  all-reduce combining on (its default);
- `mesh-plain-nocombine`: the same with combining off, as every ZeRO-3 run has it;
- `mesh-plain+recompute`: the same with `--recompute=full` (every layer recomputed in the
  backward pass, as ZeRO-3 recomputes each layer it gathers): recomputation's cost alone;
- `zero3-sumgather`: `zero3` with DTensor's own lowering of a gather (a zero-padded
  all-reduce: `tfpar.patches.COLLECTIVE_GATHER` set to 0), as ZeRO-3 ran before;
- `zero3`: `--zero_stage=3` as the trainer runs it (prefetch on, every layer resharded
  after forward, gathers lowered to all-gathers);
- `zero3-keeplast`: the same but for the last block and the layers after it, kept whole
  from forward to backward (`--zero_keep_last_layers=-1`);
- `zero3-keep`: `--zero_stage=3 --nozero_reshard_after_forward` (each layer gathered once,
  its whole weights and activations kept for the backward: no recomputation);
- `plain` (mirrored): `python -m tfpar.train --strategy=mirrored` in a child, whole step
  only (the baseline `bench_memory.py --overhead` compares against).

In each child every piece is its own compiled function on the trainer's model and
variables, called `--calls` times back to back after two untimed calls, the last call's
outputs waited for (a call on the mesh returns before its devices finish), the pieces'
order reversed every round: `forward` (the loss: ZeRO-3's forward gathers and compute), `forward+backward`
(the gradients too: ZeRO-3's regathers, recomputation and reduce-scatters; plain's
all-reduce), `step` (the trainer's compiled step on a batch already on the mesh: the
optimizer's update on the pieces and the writes too), `batch+step` (the step as `fit`
calls it: the batch placed on the mesh, the logs read back), and for ZeRO-3 `gathers` (every gathered weight relayouted whole once,
nothing else: one forward pass's gathers alone). Wall milliseconds per call (median of the
calls) and the process's CPU milliseconds per call (all threads; waiting for a core not
counted), each the median over the child's `--inner_rounds` and then over `--rounds`
rounds. `--trace` adds each variant's `step` under TensorFlow's profiler: CPU ms per step
by op type (host op events of every executor thread summed). Variants alternate within a round, so a
slower spell of the machine hits them all.

Prints a table and writes JSON (default runs/profile_zero3_<time>.json): {"variants":
{name: {piece: {"wall_ms": [per round], "cpu_ms": [per round]}}}, "model", "devices",
"batch"}.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

VARIANTS = {  # name: (ParallelConfig settings, DTensor's all-reduce combining on, env)
    "mesh-plain": ({}, True, {}),
    "mesh-plain-nocombine": ({}, False, {}),
    "mesh-plain+recompute": ({"recompute": "full"}, False, {}),
    "zero3-sumgather": ({"zero_stage": 3}, False, {"LOWER_DTENSOR_GATHER_TO_"
                                                   "COLLECTIVE_GATHER_V2": "0"}),  # off
    "zero3": ({"zero_stage": 3}, False, {}),
    "zero3-keeplast": ({"zero_stage": 3, "zero_keep_last_layers": -1}, False, {}),
    "zero3-keep": ({"zero_stage": 3, "zero_reshard_after_forward": False}, False, {}),
}
MIRRORED = "plain"
PIECES = ("gathers", "forward", "forward+backward", "step", "batch+step")


def _config(args, settings):
    from tfpar import ParallelConfig
    return ParallelConfig(model="transformer", model_width=args.width,
                          model_depth=args.depth, cpu_devices=args.devices,
                          global_batch_size=args.batch, optimizer="adam", seed=0,
                          verbose=0, **settings)


def _pieces(trainer, model, batch):
    """{piece: a callable running it once} on `trainer`'s model and this batch."""
    from tfpar.layout import step
    from tfpar.zero import fsdp
    from tensorflow.experimental import dtensor

    mesh, x, y = trainer.mesh, *trainer._on_mesh(batch, training=True)[:2]
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    loss_fn = trainer.loss

    def forward():
        mapping = (list(zip(trainable, step._read(trainable)))
                   + list(zip(non_trainable, step._read(non_trainable))))
        return step._forward_loss(model, loss_fn, mapping, x, y, None, True)[1]

    def forward_backward():
        import tensorflow as tf
        tv = step._read(trainable)
        with tf.GradientTape() as tape:
            tape.watch(tv)
            mapping = (list(zip(trainable, tv))
                       + list(zip(non_trainable, step._read(non_trainable))))
            loss = step._forward_loss(model, loss_fn, mapping, x, y, None, True)[1]
        return [loss] + [tf.convert_to_tensor(g) for g in tape.gradient(loss, tv)]

    def gathers():
        return [dtensor.relayout(v.value.read_value(), fsdp.whole_over_batch(layout))
                for v in trainable if (layout := fsdp._split_layout(v)) is not None]

    on_mesh = trainer._on_mesh(batch, training=True)
    out = {"forward": step._checked(mesh, forward, "forward"),
           "forward+backward": step._checked(mesh, forward_backward, "forward+backward"),
           "step": lambda: trainer._train(*on_mesh),
           "batch+step": lambda: trainer._step(batch)}
    if fsdp.split_over_batch(trainable):
        out["gathers"] = step._checked(mesh, gathers, "gathers")
    return out


def wait(outputs):
    """Returns once every DTensor in `outputs` is computed: a call on the mesh returns
    before its devices are done (each device's ops run in order, asynchronously), so one
    entry of each device's part is read back."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    for tensor in tf.nest.flatten(outputs):
        if tf.is_tensor(tensor) and dtensor.is_dtensor(tensor):
            for part in dtensor.unpack(tensor):
                tf.reshape(part, [-1])[:1].numpy()


def timed(fn, calls):
    """(wall ms, CPU ms) per call of `calls` calls of `fn` back to back, the last one's
    outputs waited for (the reading back itself, timed again once done, taken off)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        out = fn()
    wait(out)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    extra_wall, extra_cpu = time.perf_counter(), time.process_time()
    wait(out)
    wall -= time.perf_counter() - extra_wall
    cpu -= time.process_time() - extra_cpu
    return 1000 * wall / calls, 1000 * cpu / calls


def op_times(fn, calls, logdir):
    """{op type: ms per call} of `calls` calls of `fn` under TensorFlow's profiler: the
    host's op events (`name:Type`, every executor thread summed, so CPU time rather than
    wall time)."""
    import tensorflow as tf
    from tfpar import profiling
    tf.profiler.experimental.start(logdir)
    for _ in range(calls):
        out = fn()
    wait(out)
    tf.profiler.experimental.stop()
    totals = {}
    for name, start, end in profiling.read_events(
            logdir, keep=lambda n: profiling.op_type(n) is not None):
        kind = profiling.op_type(name)
        totals[kind] = totals.get(kind, 0) + (end - start) / 1e3
    return {k: v / calls for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def child(args):
    """Times the pieces of `args.child`; prints one JSON line."""
    settings, combine, env = VARIANTS[args.child]
    os.environ.update(env)
    config = _config(args, settings)
    from tfpar import data
    from tfpar.backends.dtensor import DTensorBackend
    from tfpar.layout import run
    from tfpar.layout.mesh import no_all_reduce_combining
    if not combine:
        no_all_reduce_combining("profile", args.child, "a variant without combining")
    runtime = DTensorBackend().build_runtime(config)
    task = data.make_task(config)
    _, model, trainer = run.build(config, task, runtime.mesh)
    batch = data.global_batches(config, task, 0, 1)[0]
    pieces = _pieces(trainer, model, batch)
    for fn in pieces.values():  # traced, first runs done
        timed(fn, 2)
    out = {name: {"wall_ms": [], "cpu_ms": []} for name in pieces}
    for round_ in range(args.inner_rounds):
        for name in (list(pieces) if round_ % 2 == 0 else list(pieces)[::-1]):
            wall, cpu = timed(pieces[name], args.calls)
            out[name]["wall_ms"].append(wall)
            out[name]["cpu_ms"].append(cpu)
    result = {name: {k: statistics.median(v) for k, v in d.items()}
              for name, d in out.items()}
    if args.trace:
        import tempfile
        with tempfile.TemporaryDirectory() as logdir:
            result["ops"] = op_times(pieces["step"], args.calls, logdir)
    print(json.dumps(result), flush=True)


def _run_child(args, name):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={name}",
           f"--width={args.width}", f"--depth={args.depth}", f"--devices={args.devices}",
           f"--batch={args.batch}", f"--calls={args.calls}",
           f"--inner_rounds={args.inner_rounds}"] + (["--trace"] if args.trace else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=args.timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{name}: exit {proc.returncode}: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(lines[-1])


def _run_mirrored(args):
    import train_run
    steps = 2 + args.calls  # the first step (tracing) is in the median: 2 more than calls
    metrics, error, _ = train_run.train(
        ["--model=transformer", f"--model_width={args.width}", f"--model_depth={args.depth}",
         f"--cpu_devices={args.devices}", f"--global_batch_size={args.batch}",
         f"--steps={steps}", f"--steps_per_epoch={steps}", "--optimizer=adam",
         "--strategy=mirrored"], args.timeout)
    if error is not None:
        raise SystemExit(f"{MIRRORED}: {error}")
    return {"batch+step": {"wall_ms": metrics["step_time_ms"]["median"]}}


def _table(results, names):
    med = {n: {p: {k: statistics.median(v) for k, v in d.items()}
               for p, d in results[n].items() if p != "ops"} for n in names}
    print(f"\n{'variant':<22}" + "".join(f"{p + ' ms':>20}" for p in PIECES)
          + "   (wall, CPU in brackets)")
    for n in names:
        cells = []
        for p in PIECES:
            d = med[n].get(p)
            cells.append("-" if d is None else f"{d['wall_ms']:.1f}" + (
                f" [{d['cpu_ms']:.0f}]" if "cpu_ms" in d else ""))
        print(f"{n:<22}" + "".join(f"{c:>20}" for c in cells))
    print()
    for zero in ("zero3-sumgather", "zero3", "zero3-keeplast", "zero3-keep"):
        if zero in med and "mesh-plain-nocombine" in med:
            _difference(zero, med[zero], med["mesh-plain-nocombine"])
    _ops(results, names)
    return med


def _difference(zero, z, p):
    """`zero`'s pieces minus mesh-plain-nocombine's, wall and CPU."""
    def part(d, kind):
        fwd, fb, st = (d[k][kind] for k in ("forward", "forward+backward", "step"))
        return {"forward": fwd, "backward": fb - fwd, "optimizer+writes": st - fb,
                "step": st}
    for kind in ("wall_ms", "cpu_ms"):
        a, b = part(z, kind), part(p, kind)
        print(f"{zero} - mesh-plain-nocombine ({kind}): " + ", ".join(
            f"{k} {a[k] - b[k]:+.1f}" for k in a) + f"; gathers alone {z['gathers'][kind]:.1f}")


def _ops(results, names):
    for n in names:
        if results[n].get("ops"):
            ops = results[n]["ops"]
            kinds = {k for round_ in ops for k in round_}
            per = {k: statistics.median(r.get(k, 0.0) for r in ops) for k in kinds}
            top = sorted(per.items(), key=lambda kv: -kv[1])[:12]
            print(f"{n}: CPU ms per step by op type (profiler; {sum(per.values()):.0f} in "
                  f"all): " + ", ".join(f"{k} {v:.1f}" for k, v in top))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per piece a round")
    parser.add_argument("--inner_rounds", type=int, default=2,
                        help="rounds of the pieces inside each child")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the variants")
    parser.add_argument("--only", default="", help="comma-separated variants")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default="")
    parser.add_argument("--trace", action="store_true",
                        help="also each variant's step under TensorFlow's profiler: CPU ms "
                             "per step by op type (the top ones printed)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    names = [n for n in [*VARIANTS, MIRRORED] if not args.only or n in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(names) if args.only else set()
    if unknown:
        raise SystemExit(f"--only={args.only}: unknown {sorted(unknown)}; expected names "
                         f"from {[*VARIANTS, MIRRORED]}")
    print(f"transformer {args.width} x {args.depth}, {args.devices} logical CPUs, batch "
          f"{args.batch}, Adam; {args.calls} calls x {args.inner_rounds} inner rounds a "
          f"piece, {args.rounds} rounds", flush=True)
    results = {n: {} for n in names}
    for round_ in range(args.rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            got = _run_mirrored(args) if name == MIRRORED else _run_child(args, name)
            if "ops" in got:
                results[name].setdefault("ops", []).append(got.pop("ops"))
            for piece, d in got.items():
                slot = results[name].setdefault(piece, {k: [] for k in d})
                for k, v in d.items():
                    slot[k].append(v)
            print(f"  round {round_ + 1} {name}: " + ", ".join(
                f"{p} {d['wall_ms']:.1f}" for p, d in got.items()), flush=True)
    _table(results, names)
    path = args.json or os.path.join(
        ROOT, "runs", time.strftime("profile_zero3_%Y%m%d_%H%M%S.json"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": "profile_zero3", "model": f"transformer {args.width}x"
                   f"{args.depth}", "devices": args.devices, "batch": args.batch,
                   "calls": args.calls, "variants": results}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
