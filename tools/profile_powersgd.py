"""Where one PowerSGD step's time goes, two workers across the shaped link.

Two workers (`MultiWorkerMirroredStrategy`, one CPU replica each) in network namespaces
joined by a veth pair shaped to `--rate` (tools/shaped_link.py), the MLP of
`tools/bench_compression.py` (~6.3 M parameters), one batch. Each piece of a step runs as its
own traced function on fixed inputs, the pieces alternating over `--calls` timed calls; the
medians are printed in milliseconds:

    compute       forward + backward
    step          forward + backward + the aggregator (what `fit` runs)
    aggregate     the aggregator alone on fixed gradients (error feedback, encode,
                  collectives, decode, state updates)
    guard_sums, guard_factors
                  the aggregator, then `--on_nan`'s check whether its sums are finite:
                  a pass over the full sums (before 2026-12-06), or PowerSGD's factors
                  vouching for them (`certainly_finite`; the pass only where they do not)
    step_groups, aggregate_groups
                  the same with the matrices in `--groups` groups, each with its own P
                  and Q rounds (the last layers' rounds while backward goes on)
    error_fb      gradient + residual, for the compressed matrices
    encode_p      P = M Q for every matrix
    orthogonalize P̂ from the summed P's
    encode_q      Q = Mᵀ P̂ for every matrix
    decode        P̂ Q_sumᵀ and the new residuals (in place: minus this replica's share)
    error_fb_p    error feedback then `M Q` (the P round's compute before its all-reduce)
    error_fb_p_xla, decode_xla
                  error_fb_p and decode, each compiled by XLA as one function
                  (`tf.function(jit_compile=True)`): what XLA's fusion saves of them
    update        momentum SGD's update of every weight from the gradients, as Keras's SGD
                  makes it (`m = m·momentum − lr·g; w += m`: element-wise ops, two
                  assignments), on copies of the weights
    update_fused  the same as TensorFlow's one fused kernel (`--fused_update`)
    allreduce_p   one fp32 all-reduce of the P round's size (P's + uncompressed tensors)
    allreduce_q   one fp32 all-reduce of the Q round's size
    allreduce_1   one fp32 all-reduce of one float (a collective round's latency)
    gather_1      one all-gather of one float

Each piece is printed as wall-clock ms and worker 0's CPU ms (user + system, all threads of
the process), medians over the calls.

With `--fit_steps=A,B` it then also trains the model as `tools/bench_compression_vs_torch.py`
does (`tools/bench_compression.py`'s worker pair, momentum SGD, lr 0.01, PowerSGD at
`--rank`) for A and then B steps and prints `fit`'s CPU ms per step and worker: the two
workers' CPU time (user + system, all threads) of the longer run minus the shorter's, over
the steps between and the two workers (start-up and tracing cancel out); the pieces above
are parts of it, and what they leave is the optimizer's update and `fit`'s own work.

`aggregate` minus the pieces it is made of (error_fb + encode_p + orthogonalize + encode_q
+ decode + the rounds it runs) is what the pieces do not account for: dispatch, copies,
packing, waiting. Needs root and iproute2.

    python tools/profile_powersgd.py --global_batch_size=32
    python tools/profile_powersgd.py --global_batch_size=256 --fit_steps=12,36
    # fit alone (no pieces), with more of the trainer's settings
    python tools/profile_powersgd.py --global_batch_size=256 --fit_steps=12,36 --calls=0 \
        --fit_settings='{"fused_update": true}'
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 23476


def worker(settings_json, out_path):
    from tfpar import cpu_kernels
    # The trainer's kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS says otherwise), chosen
    # before TensorFlow starts, as `python -m tfpar.train` does.
    cpu_kernels.select(json.loads(settings_json).get("cpu_kernels", "auto"))
    import numpy as np
    import tensorflow as tf

    from tfpar import nan_guard
    from tfpar.compression import collectives, error_feedback, powersgd
    from tfpar.compression.aggregator import per_replica_variable
    from tfpar.compression.lowrank import PowerSGDAggregator
    from tfpar.models import build

    s = json.loads(settings_json)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build("mlp", (32,), 10, s["width"], s["depth"])
        agg = PowerSGDAggregator(rank=s["rank"])
        grouped = PowerSGDAggregator(rank=s["rank"], groups=s["groups"])
    variables = [v.value for v in model.trainable_variables]
    with strategy.scope():
        agg.build(variables)
        grouped.build(variables)
        # Copies of the weights and their momenta for the update pieces (this replica's own).
        copies, momenta = ([per_replica_variable(tf.zeros(v.shape), f"{kind}{k}",
                                                 tf.VariableAggregation.ONLY_FIRST_REPLICA)
                            for k, v in enumerate(variables)] for kind in ("w", "m"))
    per_replica = s["batch"] // strategy.num_replicas_in_sync
    rng = np.random.RandomState(strategy.cluster_resolver.task_id)
    x = tf.constant(rng.randn(per_replica, 32).astype("float32"))
    y = tf.constant(rng.randint(0, 10, per_replica).astype("int32"))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def gradients():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, variables)

    def checksum(ts):
        # The first row of each output: depends on the whole output (nothing is pruned) at
        # a negligible cost of its own.
        return tf.add_n([tf.reduce_sum(tf.reshape(t, [-1])[:1]) for t in ts])

    matrices = agg._matrices()
    rest = [i for i in range(len(variables)) if i not in matrices]
    shapes = [powersgd.matrix_shape(v.shape) for v in variables]
    n_p = sum(shapes[i][0] * agg.qs[str(i)].shape[1] for i in matrices) + sum(
        int(np.prod(variables[i].shape)) for i in rest)
    n_q = sum(shapes[i][1] * agg.qs[str(i)].shape[1] for i in matrices)

    def mats(grads):
        return [tf.reshape(grads[i], shapes[i]) for i in matrices]

    def qs():
        return [agg.qs[str(i)] for i in matrices]

    def prepare():
        g = gradients()
        ms = mats(g)
        ps = agg._encode_p(ms, qs())
        p_hats = agg._orthogonalize(ps)
        return {"g": g, "ps": ps, "p_hats": p_hats, "q_locals": agg._encode_q(ms, p_hats)}

    # Inputs computed once and kept per replica; the identities place them on the
    # replica's device, as the collectives need.
    fixed = tf.function(lambda: strategy.run(prepare))()

    def decode(a):
        out = []
        share = 1.0 / strategy.num_replicas_in_sync
        for k, i in enumerate(matrices):
            summed = agg._decode_sum(a["p_hats"][k], a["q_locals"][k], variables[i].shape)
            # The residual as the aggregator forms it: in place, minus this replica's share.
            error_feedback.subtract_scaled(agg.residuals[str(i)], summed, share)
            out += [summed]
        return out

    def error_fb_p(a):
        corrected = [error_feedback.accumulate(agg.residuals[str(i)], a["g"][i])
                     for i in matrices]
        return agg._encode_p([tf.reshape(c, shapes[i]) for c, i in zip(corrected, matrices)],
                             qs())

    def update(a):
        for w, m, g in zip(copies, momenta, a["g"]):
            m.assign(m * 0.9 - g * 0.01)
            w.assign_add(m)
        return [w.read_value() for w in copies]

    def update_fused(a):
        for w, m, g in zip(copies, momenta, a["g"]):
            tf.raw_ops.ResourceApplyKerasMomentum(
                var=w.handle, accum=m.handle, lr=tf.constant(0.01), grad=g,
                momentum=tf.constant(0.9), use_nesterov=False)
        return [w.read_value() for w in copies]

    def xla(fn):
        compiled = tf.function(fn, jit_compile=True)
        return lambda a: compiled(a)

    def guarded(a, factors):
        """The aggregator's sums and `tfpar.nan_guard`'s check of them, as the optimizer
        runs it with the factors' word (`factors`) or without."""
        summed = agg.all_reduce_sum(a["g"], variables)
        finite = nan_guard.sums_finite(summed, agg.certainly_finite() if factors else None)
        return checksum(summed) + tf.cast(finite, tf.float32)

    def inputs(fn):
        return lambda a: fn(tf.nest.map_structure(tf.identity, a))

    pieces = {
        "compute": lambda a: checksum(gradients()),
        "step": lambda a: checksum(agg.all_reduce_sum(gradients(), variables)),
        "aggregate": inputs(lambda a: checksum(agg.all_reduce_sum(a["g"], variables))),
        "guard_sums": inputs(lambda a: guarded(a, factors=False)),
        "guard_factors": inputs(lambda a: guarded(a, factors=True)),
        "step_groups": lambda a: checksum(grouped.all_reduce_sum(gradients(), variables)),
        "aggregate_groups": inputs(lambda a: checksum(grouped.all_reduce_sum(a["g"],
                                                                             variables))),
        "error_fb": inputs(lambda a: checksum(
            [error_feedback.accumulate(agg.residuals[str(i)], a["g"][i]) for i in matrices])),
        "encode_p": inputs(lambda a: checksum(agg._encode_p(mats(a["g"]), qs()))),
        "orthogonalize": inputs(lambda a: checksum(agg._orthogonalize(a["ps"]))),
        "encode_q": inputs(lambda a: checksum(agg._encode_q(mats(a["g"]), a["p_hats"]))),
        "decode": inputs(lambda a: checksum(decode(a))),
        "error_fb_p": inputs(lambda a: checksum(error_fb_p(a))),
        "error_fb_p_xla": inputs(xla(lambda a: checksum(error_fb_p(a)))),
        "decode_xla": inputs(xla(lambda a: checksum(decode(a)))),
        "update": inputs(lambda a: checksum(update(a))),
        "update_fused": inputs(lambda a: checksum(update_fused(a))),
        "allreduce_p": lambda a: checksum([collectives.sum_all(tf.zeros([n_p]),
                                                                agg.collective_options)[0]]),
        "allreduce_q": lambda a: checksum([collectives.sum_all(tf.zeros([n_q]),
                                                                agg.collective_options)[0]]),
        "allreduce_1": lambda a: checksum([collectives.sum_all(tf.zeros([1]), agg.collective_options)[0]]),
        "gather_1": lambda a: checksum([collectives.gather_rows(tf.zeros([1]),
                                                                agg.collective_options)[0]]),
    }
    fns = {k: tf.function(lambda g, fn=fn: strategy.run(fn, args=(g,)))
           for k, fn in pieces.items()}
    seconds = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for i in range(s["calls"] + 2):  # alternating; the first two calls trace and warm up
        for k, fn in fns.items():
            began, began_cpu = time.perf_counter(), time.process_time()
            strategy.experimental_local_results(fn(fixed))[0].numpy()
            if i >= 2:
                seconds[k].append(time.perf_counter() - began)
                cpu[k].append(time.process_time() - began_cpu)
    result = {k: 1000 * float(np.median(v)) for k, v in seconds.items()}
    # This worker's CPU time (every thread of the process, user + system) per call: what
    # the machine's load changes least.
    result["cpu"] = {k: 1000 * float(np.median(v)) for k, v in cpu.items()}
    result["bytes_p"], result["bytes_q"] = 4 * n_p, 4 * n_q
    if strategy.cluster_resolver.task_id == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def fit_cpu_ms(args, counts):
    """`fit`'s CPU ms per step and worker between `counts` (two step counts: the slope of
    the workers' whole CPU, start-up's ~10 CPU-s and its run-to-run spread included), the
    median step's wall ms of each run, and the median step's CPU ms in worker 0 of each
    run (its process time between step ends, from the third step on: no start-up)."""
    import bench_compression
    from shaped_link import ShapedLink

    out_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "profile_powersgd_fit")
    os.makedirs(out_dir, exist_ok=True)
    cpu, wall, in_run = [], [], []
    for steps in counts:
        settings = {"model": "mlp", "model_width": args.model_width,
                    "model_depth": args.model_depth, "global_batch_size": args.global_batch_size,
                    "optimizer": "momentum", "learning_rate": 0.01, "steps": steps,
                    "steps_per_epoch": steps, "seed": 0, "powersgd_rank": args.rank,
                    **json.loads(args.fit_settings)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with ShapedLink(rate=args.rate) as link:
            run = bench_compression.run_one(link, "powersgd", settings, out_dir, args.timeout,
                                            extra=0, comm_steps=0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        wall.append(run["step_time_ms"]["median"])
        ends = run.get("process_cpu_s", [])[2:]
        in_run.append(1000 * statistics.median(b - a for a, b in zip(ends, ends[1:]))
                      if len(ends) > 1 else None)
    return 1000 * (cpu[1] - cpu[0]) / (counts[1] - counts[0]) / 2, wall, in_run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global_batch_size", type=int, default=32)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--model_width", type=int, default=1024)
    p.add_argument("--model_depth", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="timed calls per piece (0: no pieces)")
    p.add_argument("--groups", type=int, default=2,
                   help="PowerSGDAggregator(groups=) of the *_groups pieces")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "profile_powersgd.json"))
    p.add_argument("--fit_steps", default="",
                   help="two step counts A,B: also fit's CPU ms per step (see above)")
    p.add_argument("--fit_settings", default="{}",
                   help="JSON: more ParallelConfig settings for --fit_steps' runs")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    try:
        counts = [int(c) for c in args.fit_steps.split(",") if c]
    except ValueError:
        counts = []
    if args.fit_steps and (len(counts) != 2 or not 0 < counts[0] < counts[1]):
        p.error(f"--fit_steps={args.fit_steps!r} is invalid: two step counts A,B with "
                "0 < A < B, e.g. 12,36")
    if args.calls < 0 or (args.calls == 0 and not counts):
        p.error(f"--calls={args.calls} is invalid: at least 1, or 0 with --fit_steps (fit "
                "alone)")
    try:
        fit_settings = json.loads(args.fit_settings)
    except ValueError:
        fit_settings = None
    # the settings the tool sets itself are not the user's to change (the pieces and fit
    # measure one configuration)
    own = {"model", "model_width", "model_depth", "global_batch_size", "optimizer",
           "learning_rate", "steps", "steps_per_epoch", "seed", "powersgd_rank",
           "compression"}
    if not isinstance(fit_settings, dict) or own & set(fit_settings):
        p.error(f"--fit_settings={args.fit_settings!r} is invalid: a JSON object of other "
                f"ParallelConfig settings than {', '.join(sorted(own))} (set by the tool's "
                "own flags), e.g. '{\"fused_update\": true}'")
    sys.path.insert(0, ROOT)
    try:
        from tfpar import ParallelConfig
        ParallelConfig(**fit_settings)
    except Exception as error:  # an unknown or bad setting, before anything runs
        p.error(f"--fit_settings={args.fit_settings!r} is invalid: {error}")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    settings = {"batch": args.global_batch_size, "rank": args.rank, "width": args.model_width,
                "depth": args.model_depth, "calls": args.calls, "groups": args.groups}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        os.remove(args.out)
    result = {}
    if args.calls > 0:
        result = pieces(args, settings)
        if result is None:
            return 1
    if counts:
        (result["fit_cpu_per_step"], result["fit_step_ms"],
         result["fit_step_cpu_ms"]) = fit_cpu_ms(args, counts)
        in_run = " / ".join("—" if c is None else f"{c:.1f}" for c in result["fit_step_cpu_ms"])
        print(f"  fit: {result['fit_cpu_per_step']:.1f} CPU ms per step and worker (steps "
              f"{counts[0]} to {counts[1]}, start-up's spread in it); median step "
              f"{in_run} CPU ms in worker 0, {result['fit_step_ms'][0]:.1f} / "
              f"{result['fit_step_ms'][1]:.1f} ms wall")
        with open(args.out, "w") as f:
            json.dump(result, f)
    print(f"wrote {args.out}")
    return 0


def pieces(args, settings):
    """Runs the workers' pieces and prints them; their result (None if a worker failed)."""
    from shaped_link import ShapedLink

    with ShapedLink(rate=args.rate) as link:
        codes, log = link.run_workers(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(settings),
             args.out], PORT, args.timeout, env={"PYTHONPATH": ROOT})
        if any(codes):
            print(f"profile_powersgd: workers exited {codes}\n{log}", file=sys.stderr)
            return None
    with open(args.out) as f:
        result = json.load(f)
    rounds = result["allreduce_p"] + result["allreduce_q"]
    parts = sum(result[k] for k in ("error_fb", "encode_p", "orthogonalize", "encode_q",
                                    "decode")) + rounds
    print(f"PowerSGD rank {args.rank}, batch {args.global_batch_size}, {args.rate}, "
          f"median of {args.calls} calls (ms); P round {result['bytes_p'] / 1e3:.0f} kB, "
          f"Q round {result['bytes_q'] / 1e3:.0f} kB")
    print(f"  {'piece':14} {'wall':>8} {'CPU':>8}")
    for k, v in result.items():
        if not k.startswith("bytes") and k != "cpu":
            print(f"  {k:14} {v:8.2f} {result['cpu'][k]:8.2f}")
    print(f"  {'aggregate - pieces':14} {result['aggregate'] - parts:8.2f}")
    return result


if __name__ == "__main__":
    sys.exit(main())
