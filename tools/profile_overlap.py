"""How much of the gradient exchange hides behind backward, inside one traced step: two
workers on a shaped link.

Two `MultiWorkerMirroredStrategy` workers (tools/shaped_link.py, needs root) build the
trainer's multi-worker `--compression=none` model (fp32 sums in `--bucket_mb` buckets, last
layers first) and run `tfpar.compression.timing.measure_comm_fraction`: its timeline step
(forward, backward, the buckets' all-reduces) carries in-step timestamps, gathered from
both workers after each step. Per step it prints when backward ended and when each
all-reduce was busy (from the step's start), and the share of the busy time before
backward's end (`hidden_fraction`, the metrics JSON's `comm.hidden_fraction`); then the
medians, with the separately timed calls (`compute`: forward + backward alone,
`aggregate`: the sums alone) that say whether the run is communication-bound.

`--model=conv_head` is not in the zoo: `--convs` 3x3 convolutions of `--width` channels
over the convnet task's 16x16 images, average-pooled by `--pool`, a dense layer of
`--hidden` units over them, logits. Its first layers hold the computation and its last the
parameters (as a CNN with a dense head), so the head's bucket is ready right after forward;
`--recompute=full` makes backward 3/4 of the computation.

`--intra_op` and `--inter_op` set each worker's TensorFlow threads (0: TensorFlow picks);
`--pin` keeps worker i's threads on the i-th core it may use (a warning when it may use
fewer than 2).
`--calibrate=R` first runs 2 timeline steps at `--batch`, then measures at the global batch
where backward would end at R of the all-reduces' busy time (scaled in proportion from
those 2 steps): it aims the run at communication-bound by that margin, no more; on a
loaded machine backward's length changes after the calibration, and the measured steps
need not keep the ratio (docs/benchmarks/compression_link.md: they were as spread as
without it).
`--track=K` re-shapes the link between the timeline steps (each worker its own side, from
the same gathered stamps) so that the all-reduces would keep it busy K times as long as
backward takes (`LinkTracker`): a communication-bound step by about that margin however
the machine's load moves backward's length from one minute to the next (it lags a load
that moves from step to step; the aim, corrected by how far recent steps missed it, stays
at most 1.25 or K); `track` in the JSON holds each step's rate and the medians over the
timeline steps after the first `--settle` (run at a rate set from fewer steps), with what
the step saved against forward + backward timed alone (`saved_fraction`), how much longer
backward took in the step than alone (`backward_stretch`) and the ring's time at the tc
rate alone over backward (`link_alone_ratio`): the stamps' share counts the busy time
before backward's end, which the exchange itself may have lengthened. `--per_step=N`
runs N timeline steps in a row at each of the `--steps`. The "alone" figures are timed
between the timeline steps, at the rate the tracker set last. Refused: `--track` of 0 or
less, `--per_step` below 1, a `--settle` that leaves no step, and `--track` with
`--runtime_steps`.
`--runtime_steps=N` adds N steps under TensorFlow's profiler: the share with each
all-reduce busy from when the runtime started it, not from when its inputs were ready
(`hidden_fraction_runtime`; not with `--track`: a worker died during the profiled steps
in 3 of 9 such runs, 2026-12-06: docs/benchmarks/compression_link.md). `--wire` reads
worker 0's veth every millisecond: the share of the bytes it sent in each timed step that
had left before backward ended (`wire_hidden`), the link's own account.

    python tools/profile_overlap.py --model=conv_head --batch=128 --recompute=full
    python tools/profile_overlap.py --model=mlp --width=256 --depth=8 --batch=2048
    python tools/profile_overlap.py --width=64 --hidden=128 --convs=3 --pool=2 --bucket_mb=1 \
        --intra_op=1 --inter_op=2 --batch=24 --steps=4 --runtime_steps=2 --wire
    python tools/profile_overlap.py --rate=50mbit --width=64 --hidden=128 --convs=3 --pool=2 \
        --bucket_mb=1 --intra_op=1 --inter_op=2 --pin --batch=128 --steps=3 --per_step=5 \
        --track=1.12 --wire
"""

import argparse
import json
import os
import sys
import tempfile

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))  # tfpar, from a checkout
PORT = 23529


def conv_head(config, runtime, task, channels, hidden, convs=2, pool=1):
    """The `--model=conv_head` model, compiled with the trainer's optimizer bucketed as
    across workers (and `config.recompute` applied)."""
    import keras

    from tfpar import optimizers, recompute

    with runtime.strategy.scope():
        inputs = x = keras.Input(task.input_shape)
        for _ in range(convs):
            x = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(x)
        if pool > 1:
            x = keras.layers.AveragePooling2D(pool)(x)
        x = keras.layers.Dense(hidden, activation="relu")(keras.layers.Flatten()(x))
        model = keras.Model(inputs, keras.layers.Dense(task.num_classes)(x))
        recompute.apply(model, config)
        model.compile(optimizer=optimizers.make_optimizer(config, bucketed=True),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    return model


def pinned_core(allowed, index):
    """`--pin`: the core worker `index` runs on, of the cores this process may use
    (`allowed`, sorted); with fewer than 2 of them, says on stderr that the workers share
    one."""
    if len(allowed) < 2:
        print(f"profile_overlap: --pin: only {len(allowed)} core allowed ({allowed}); the "
              "workers share it", file=sys.stderr)
    return allowed[index % len(allowed)]


def build(settings):
    """`(config, runtime, task, model)` for a worker: `settings` are `ParallelConfig`
    fields, plus `conv_head: [channels, hidden(, convs, pool)]` for that model and
    `threads: [intra-op, inter-op]` (0 or absent: TensorFlow picks) and `pin: true` (each
    worker's threads on a core of its own, `--pin`)."""
    import tensorflow as tf

    from tfpar import ParallelConfig, data
    from tfpar.backends.distribute import DistributeBackend

    settings = dict(settings)
    head = settings.pop("conv_head", None)
    intra, inter = settings.pop("threads", (0, 0))
    if settings.pop("pin", False):  # this worker's threads on one core, its index's
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        os.sched_setaffinity(0, {pinned_core(sorted(os.sched_getaffinity(0)), index)})
    # before the runtime starts
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    config = ParallelConfig(strategy="multi_worker", optimizer="sgd", verbose=0,
                            **{"model": "convnet" if head else "mlp", **settings})
    backend = DistributeBackend()
    runtime = backend.build_runtime(config)
    task = data.make_task(config)
    model = (conv_head(config, runtime, task, *head) if head
             else backend.build_model(config, runtime, task))
    return config, runtime, task, model


class WireSampler:
    """This worker's side of the link, read in a thread: `(time.time(), bytes sent)` every
    `period` seconds from its veth's `tx_bytes` (counted as tc lets them out, the shaped
    link's own time; `time.time()` is the clock `tf.timestamp` reads)."""

    def __init__(self, device, period=0.001):
        import threading

        self.fd = os.open(f"/sys/class/net/{device}/statistics/tx_bytes", os.O_RDONLY)
        self.period, self.samples = period, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import time
        while not self.done.is_set():
            self.samples.append((time.time(), int(os.pread(self.fd, 32, 0))))
            time.sleep(self.period)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        os.close(self.fd)


def wire_shares(samples, timeline_ms):
    """Per timeline step, the share of the bytes this worker sent during the step (from its
    start to the last all-reduce's end) that had left by backward's end: the hidden share
    as the link saw it. None for a step the samples do not cover or with nothing sent."""
    import numpy as np

    times, sent = np.array(samples, dtype=np.float64).T
    shares = []
    for step in timeline_ms:
        start = step["start_s"]
        end = start + max(e for _, e in step["collectives"]) / 1000
        if not times[0] <= start < end <= times[-1]:
            shares.append(None)
            continue
        at = np.interp([start, start + step["backward_end"] / 1000, end], times, sent)
        shares.append(float((at[1] - at[0]) / (at[2] - at[0])) if at[2] > at[0] else None)
    return shares


class LinkTracker:
    """`--track`: called after each timed timeline step (`measure_comm_fraction`'s
    `after_timeline_step`), it re-shapes this worker's veth (`shaped_link.reshape`) so
    that the next step's all-reduces would keep the link busy `ratio` times as long as
    backward takes. The busy time at a rate is taken as the ring all-reduce of
    `grad_bytes` at that rate (`tfpar.plan.cost.ring_allreduce_seconds`) plus what each
    step was busy beyond it (gRPC, the workers' skew), and backward's end and that excess
    as medians of the last `window` steps; from the third step on, the aim is corrected by
    how far the medians of the last `window` steps at rates it set missed it (a load that
    grows during the run lengthens backward after the steps the rate was set from), by at
    most 1.25x either way, and the aim kept at most `max_aim` (or `ratio`, if larger): more
    than half hides only while the link is busy less than about 1.4x backward. `steps`: per
    step, the rate it ran at, its backward end and busy time."""

    def __init__(self, device, tbf, ratio, grad_bytes, window=4, bounds=(2e6, 1e9),
                 max_aim=1.25):
        import shaped_link

        self.device, self.tbf, self.ratio, self.window, self.bounds = (
            device, tbf, ratio, window, bounds)
        self.max_aim = max(ratio, max_aim)
        self.grad_bytes = grad_bytes
        self.rate = shaped_link.bits_per_second(tbf["rate"])
        self.steps = []

    def link_seconds(self, rate):
        from tfpar.plan.cost import ring_allreduce_seconds
        return ring_allreduce_seconds(self.grad_bytes, 2, rate / 8)

    def __call__(self, backward_end, intervals):
        import numpy as np
        import shaped_link

        from tfpar.overlap import hidden_share

        busy = hidden_share(backward_end, intervals)[1]
        self.steps.append({"rate_mbit": self.rate / 1e6, "backward_end_ms": 1000 * backward_end,
                           "busy_ms": 1000 * busy})
        recent = self.steps[-self.window:]
        excess = np.median([s["busy_ms"] / 1e3 - self.link_seconds(1e6 * s["rate_mbit"])
                            for s in recent])
        # (the first ran at the link's own rate)
        aim, aimed = self.ratio, self.steps[1:][-self.window:]
        if len(aimed) >= 2:
            missed = (np.median([s["busy_ms"] for s in aimed])
                      / np.median([s["backward_end_ms"] for s in aimed]))
            aim = min(self.max_aim,
                      self.ratio * float(np.clip(self.ratio / missed, 0.8, 1.25)))
        wanted = aim * np.median([s["backward_end_ms"] / 1e3 for s in recent]) - excess
        # the link's time at 1 bit/s over the time it should take
        rate = self.link_seconds(1.0) / wanted if wanted > 0 else self.bounds[1]
        self.rate = float(np.clip(rate, *self.bounds))
        shaped_link.reshape(self.device, self.rate, self.tbf)


def tracked(times, tracker, settle):
    """The medians of the timed steps after the first `settle`, the link set from measured
    steps: `hidden_fraction`, `comm_busy_ms`, `backward_end_ms`, `wire_hidden_fraction`
    (with `--wire`; None where no step is left), with the tracker's ratio and steps; and
    the planner's account of them: `planner_link_ratio`, its ring all-reduce of the
    gradients at each step's rate (`LinkTracker.link_seconds`, no latency) over the
    measured busy time, and `planner_step_ratio`, backward's end plus
    (1 − the hidden share) of that all-reduce (the formula `--dp_overlap` charges, with the
    measured backward) over when the step's last all-reduce ended.

    And what the step saved, against forward + backward timed alone (`times`'
    `compute_ms`, at the rate the link had then): `step_end_ms`, when the last all-reduce
    ended (median); `saved_fraction`, (forward + backward alone + busy − that end) / busy
    (medians), the share of the exchange the step did not add to its length (the stamps'
    share counts busy time before backward's end, and the exchange itself may lengthen
    backward); `backward_stretch`, backward's end in the step over forward + backward
    alone; `link_alone_ratio`, the ring all-reduce at the tracked rates over backward's end
    (medians): the tc rate's own share of backward, without gRPC's time."""
    import numpy as np

    from tfpar.overlap import hidden_share

    kept = times.get("timeline_ms", [])[settle:]
    shares = [hidden_share(t["backward_end"], t["collectives"]) for t in kept]
    links = [1000 * tracker.link_seconds(1e6 * s["rate_mbit"]) for s in tracker.steps[settle:]]
    out = {"ratio": tracker.ratio, "settle": settle, "steps": tracker.steps}
    for key, values in (("hidden_fraction", [h for h, _ in shares]),
                        ("comm_busy_ms", [b for _, b in shares]),
                        ("backward_end_ms", [t["backward_end"] for t in kept]),
                        ("wire_hidden_fraction", times.get("wire_hidden", [])[settle:])):
        known = [v for v in values if v is not None]
        out[key] = float(np.median(known)) if known else None
    out.update(dict.fromkeys(("step_end_ms", "saved_fraction", "backward_stretch",
                              "link_alone_ratio")))
    if kept:
        out["step_end_ms"] = float(np.median([max(e for _, e in t["collectives"])
                                              for t in kept]))
        alone = times.get("compute_ms")
        if alone and out["comm_busy_ms"]:
            out["saved_fraction"] = ((alone + out["comm_busy_ms"] - out["step_end_ms"])
                                     / out["comm_busy_ms"])
            out["backward_stretch"] = out["backward_end_ms"] / alone
        if links:
            out["link_alone_ratio"] = float(np.median(links)) / out["backward_end_ms"]
    if links and out["hidden_fraction"] is not None:
        out["planner_link_ratio"] = float(np.median(
            [link / b for link, (_, b) in zip(links, shares)]))
        out["planner_step_ratio"] = float(np.median(
            [(t["backward_end"] + (1 - out["hidden_fraction"]) * link)
             / max(e for _, e in t["collectives"]) for link, t in zip(links, kept)]))
    return out


def calibrated_batch(runtime, config, task, model, ratio, steps):
    """The global batch at which backward would end at `ratio` of the gradient sums' busy
    time inside the step: both read from `steps` timeline steps at
    `config.global_batch_size` (medians; the same on every worker), the batch scaled in
    proportion, a multiple of the replicas."""
    from tfpar import data
    from tfpar.compression.timing import measure_comm_fraction

    strategy = runtime.strategy
    _, times = measure_comm_fraction(
        strategy, model, data.distributed_dataset(strategy, config, task), steps=steps)
    wanted = (config.global_batch_size * ratio * times["comm_busy_ms"]
              / times["backward_end_ms"])
    replicas = strategy.num_replicas_in_sync
    return max(replicas, replicas * round(wanted / replicas)), times


def measure(settings, steps, calibrate=0.0, runtime_steps=0, wire=False, track=None):
    """`measure_comm_fraction`'s figures for `settings` on this worker; with `calibrate`,
    at `calibrated_batch`'s batch for that ratio (then also `calibration`: the batch and
    the times it was chosen from); with `wire`, `wire_hidden`: `wire_shares` of the timed
    steps, from this worker's veth (`TFPAR_BENCH_DEVICES`), and their median
    `wire_hidden_fraction`; with `track=(ratio, settle, timeline steps per timed step)`,
    the link re-shaped by a `LinkTracker` between the timeline steps, and `track`:
    `tracked`'s medians."""
    import contextlib
    import dataclasses

    import numpy as np

    from tfpar import data
    from tfpar.compression.timing import measure_comm_fraction
    from tfpar.strategy import wait_for_workers

    config, runtime, task, model = build(settings)
    calibration = None
    if calibrate:
        batch, first = calibrated_batch(runtime, config, task, model, calibrate, steps=2)
        calibration = {"from_batch": config.global_batch_size, "batch": batch,
                       "ratio": calibrate, "backward_end_ms": first["backward_end_ms"],
                       "comm_busy_ms": first["comm_busy_ms"]}
        config = dataclasses.replace(config, global_batch_size=batch)
    sampler, tracker = contextlib.nullcontext(), None
    if wire or track:
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        device = os.environ["TFPAR_BENCH_DEVICES"].split(",")[index]
    if wire:
        sampler = WireSampler(device)
    grad_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if track:
        tracker = LinkTracker(device, json.loads(os.environ["TFPAR_BENCH_TBF"]), track[0],
                              grad_bytes)
    with sampler:
        _, times = measure_comm_fraction(
            runtime.strategy, model, data.distributed_dataset(runtime.strategy, config, task),
            steps=steps, runtime_steps=runtime_steps, after_timeline_step=tracker,
            timelines_per_step=track[2] if track else 1)
    # No worker leaves while another still pulls its last collective's data ("Socket
    # closed").
    wait_for_workers()
    if calibration:
        times["calibration"] = calibration
    if wire and "timeline_ms" in times:
        shares = wire_shares(sampler.samples, times["timeline_ms"])
        times["wire_hidden"] = shares
        known = [s for s in shares if s is not None]
        times["wire_hidden_fraction"] = float(np.median(known)) if known else None
    if tracker:
        times["track"] = tracked(times, tracker, track[1])
    return times


def settings_of(args):
    settings = {"global_batch_size": args.batch, "bucket_mb": args.bucket_mb,
                "recompute": args.recompute, "seed": 0}
    if args.model == "conv_head":
        settings["conv_head"] = [args.width, args.hidden, args.convs, args.pool]
    else:
        settings.update(model_width=args.width, model_depth=args.depth)
    if args.intra_op or args.inter_op:
        settings["threads"] = [args.intra_op, args.inter_op]
    if args.pin:
        settings["pin"] = True
    return settings


def refusal(args):
    """One line naming the setting, its value and what would work, for flags that cannot
    run together or would report nothing; None when they can."""
    if args.per_step < 1:
        return f"--per_step={args.per_step}: must be at least 1 (timeline steps a timed step)"
    if args.track is None:
        return None
    if args.track <= 0:
        return (f"--track={args.track}: must be above 0, the link's busy time over backward's "
                "(e.g. 1.12); leave it out to keep --rate throughout")
    if args.runtime_steps:
        return (f"--runtime_steps={args.runtime_steps} with --track: a worker died in "
                "TensorFlow's profiler in 3 of 9 such runs; use one or the other")
    if not 0 <= args.settle < args.steps * args.per_step:
        return (f"--settle={args.settle}: leaves none of the --steps x --per_step = "
                f"{args.steps * args.per_step} timeline steps to report; use 0 to "
                f"{args.steps * args.per_step - 1}")
    return None


def number(value, spec):
    """`value` formatted by `spec`, or "-" for None (nothing measured)."""
    return "-" if value is None else format(value, spec)


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rounds = [measure(settings_of(args), args.steps, args.calibrate, args.runtime_steps,
                      args.wire,
                      (args.track, args.settle, args.per_step) if args.track else None)]
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        with open(args.worker, "w") as f:
            json.dump({"settings": settings_of(args), "rate": args.rate, "rounds": rounds}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate of each direction")
    parser.add_argument("--model", choices=("conv_head", "mlp"), default="conv_head")
    parser.add_argument("--width", type=int, default=32,
                        help="conv_head: channels; mlp: units")
    parser.add_argument("--hidden", type=int, default=64, help="conv_head: the dense units")
    parser.add_argument("--convs", type=int, default=2, help="conv_head: convolutions")
    parser.add_argument("--pool", type=int, default=1,
                        help="conv_head: average pooling before the dense layer (1: none)")
    parser.add_argument("--intra_op", type=int, default=0,
                        help="intra-op threads per worker (0: TensorFlow picks)")
    parser.add_argument("--inter_op", type=int, default=0,
                        help="inter-op threads per worker (0: TensorFlow picks)")
    parser.add_argument("--pin", action="store_true",
                        help="each worker's threads on a core of its own (worker i: core i)")
    parser.add_argument("--calibrate", type=float, default=0.0,
                        help="measure at the batch where backward ends at this share of the "
                             "all-reduces' busy time (0: at --batch)")
    parser.add_argument("--track", type=float, default=None,
                        help="re-shape the link between steps so that the all-reduces keep "
                             "it busy this many times backward's length (absent: --rate "
                             "throughout)")
    parser.add_argument("--settle", type=int, default=2,
                        help="--track: timeline steps left out of its medians (the first, at "
                             "a rate set from fewer steps)")
    parser.add_argument("--per_step", type=int, default=1,
                        help="--track: timeline steps run in a row at each timed step")
    parser.add_argument("--runtime_steps", type=int, default=0,
                        help="steps under the profiler: each all-reduce busy from its start")
    parser.add_argument("--wire", action="store_true",
                        help="also the hidden share of the bytes worker 0 sent (its veth)")
    parser.add_argument("--depth", type=int, default=8, help="mlp: layers")
    parser.add_argument("--batch", type=int, default=128, help="global batch (2 workers)")
    parser.add_argument("--bucket_mb", type=float, default=0.25)
    parser.add_argument("--recompute", default="full", help="the trainer's --recompute")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each kind")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for both workers")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the JSON file worker 0 writes
    args = parser.parse_args()
    if refusal(args):
        parser.error(refusal(args))
    if args.worker:
        return worker(args)
    sys.path.insert(0, TOOLS)
    from shaped_link import ShapedLink

    from tfpar.overlap import hidden_share

    with tempfile.TemporaryDirectory() as folder, ShapedLink(rate=args.rate) as link:
        out = os.path.join(folder, "rounds.json")
        codes, log = link.run_workers([sys.executable, os.path.abspath(__file__),
                                       *sys.argv[1:], f"--worker={out}"], PORT, args.timeout)
        if any(codes):
            print(f"profile_overlap: workers exited {codes}\n{log}", file=sys.stderr)
            return 1
        with open(out) as f:
            result = json.load(f)
    for times in result["rounds"]:
        if "calibration" in times:
            c = times["calibration"]
            print(f"calibrated: at batch {c['from_batch']} backward ends "
                  f"{c['backward_end_ms']:.0f} ms, all-reduces busy "
                  f"{c['comm_busy_ms']:.0f} ms -> "
                  f"batch {c['batch']} (ratio {c['ratio']})")
        for step in times.get("timeline_ms", []):
            hidden, _ = hidden_share(step["backward_end"], step["collectives"])
            print(f"backward ends {step['backward_end']:7.1f} ms | all-reduces busy "
                  + ", ".join(f"{b:.0f}-{e:.0f}" for b, e in step["collectives"])
                  + f" ms | hidden {hidden:.2f} | workers' starts "
                  f"{step['start_skew']:.1f} ms apart")
        view = times.get("runtime_view")
        if view:
            print("profiled steps: hidden from inputs ready / from the runtime's start "
                  + ", ".join(f"{b:.2f}/{t:.2f}" for b, t in view["steps_hidden"])
                  + f" | launch delay (median) {view['launch_delay_ms']} ms")
        elif "runtime_view" in times:
            print("profiled steps: the profiler did not report each all-reduce once a step")
        if "wire_hidden" in times:
            print("on the wire (worker 0's bytes sent before backward ends): "
                  + ", ".join("-" if s is None else f"{s:.2f}" for s in times["wire_hidden"]))
        if "track" in times:
            t = times["track"]
            print("tracked: link rate (Mbit/s) a step ran at "
                  + ", ".join(f"{s['rate_mbit']:.0f}" for s in t["steps"])
                  + f" | after the first {t['settle']}: hidden "
                  f"{number(t['hidden_fraction'], '.2f')}"
                  + ("" if t["wire_hidden_fraction"] is None
                     else f" (wire {t['wire_hidden_fraction']:.2f})")
                  + f" of {number(t['comm_busy_ms'], '.0f')} ms busy, backward ends "
                  f"{number(t['backward_end_ms'], '.0f')} ms (ratio {t['ratio']})")
            print(f"tracked, against forward + backward alone: the step saved "
                  f"{number(t['saved_fraction'], '.2f')} of the busy time (last all-reduce "
                  f"ends {number(t['step_end_ms'], '.0f')} ms), backward stretched "
                  f"{number(t['backward_stretch'], '.2f')}x, the ring at the tracked rates "
                  f"alone {number(t['link_alone_ratio'], '.2f')} of backward")
        print(f"median: hidden {times.get('hidden_fraction', float('nan')):.2f} of "
              f"{times.get('comm_busy_ms', float('nan')):.0f} ms busy, backward ends "
              f"{times.get('backward_end_ms', float('nan')):.0f} ms | alone"
              + (" (at the tracked rates)" if "track" in times else "") + ": forward + "
              f"backward {times['compute_ms']:.0f} ms, sums {times['aggregate_ms']:.0f} ms, "
              f"both {times['step_ms']:.0f} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
