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
    allreduce_p   one fp32 all-reduce of the P round's size (P's + uncompressed tensors)
    allreduce_q   one fp32 all-reduce of the Q round's size
    allreduce_1   one fp32 all-reduce of one float (a collective round's latency)
    gather_1      one all-gather of one float

Each piece is printed as wall-clock ms and worker 0's CPU ms (user + system, all threads of
the process), medians over the calls.

`aggregate` minus the pieces it is made of (error_fb + encode_p + orthogonalize + encode_q
+ decode + the rounds it runs) is what the pieces do not account for: dispatch, copies,
packing, waiting. Needs root and iproute2.

    python tools/profile_powersgd.py --global_batch_size=32
"""

import argparse
import json
import os
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global_batch_size", type=int, default=32)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--model_width", type=int, default=1024)
    p.add_argument("--model_depth", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--groups", type=int, default=2,
                   help="PowerSGDAggregator(groups=) of the *_groups pieces")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "profile_powersgd.json"))
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from shaped_link import ShapedLink

    settings = {"batch": args.global_batch_size, "rank": args.rank, "width": args.model_width,
                "depth": args.model_depth, "calls": args.calls, "groups": args.groups}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        os.remove(args.out)
    with ShapedLink(rate=args.rate) as link:
        codes, log = link.run_workers(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(settings),
             args.out], PORT, args.timeout, env={"PYTHONPATH": ROOT})
        if any(codes):
            print(f"profile_powersgd: workers exited {codes}\n{log}", file=sys.stderr)
            return 1
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
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
