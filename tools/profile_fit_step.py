"""Where `fit`'s step goes beyond forward + backward + aggregator, two workers on the shaped link.

Two workers (`MultiWorkerMirroredStrategy`, one CPU replica each) in network namespaces
joined by a veth pair shaped to `--rate` (tools/shaped_link.py) train the MLP of
`tools/bench_compression.py` (~6.3 M parameters, momentum SGD, lr 0.01) with `--compression`
for `--steps` steps through `tfpar.train.train`, then time, alternating over `--calls` calls
(medians, ms; every call ends by reading the loss):

    fit_median_ms               `fit`'s median step (tfpar's step recorder)
    keras_train_function        Keras's `train_function` on the training iterator, in a loop
                                (what `fit` runs, without its callbacks)
    train_function_local_logs   the same, the logs not averaged across workers
    train_step_fixed_data       `train_step` on one fixed batch: no input pipeline, no logs'
                                reduction (forward, backward, aggregator, optimizer update,
                                loss and metrics)
    data_only                   one batch from the training iterator
    reduce_mean_noaxis          one cross-worker mean of a float (a round's latency)

    python tools/profile_fit_step.py --global_batch_size=32 --compression=powersgd

Needs root and iproute2.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 23491


def worker(settings_json, out_path):
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as keras_trainer

    from tfpar import ParallelConfig, data
    from tfpar.train import train

    settings = json.loads(settings_json)
    calls = settings.pop("calls")
    config = ParallelConfig(**settings)
    result, model = train(config)
    strategy = model.distribute_strategy
    iterator = iter(data.distributed_dataset(strategy, config, data.make_task(config)))
    fixed = next(iterator)
    train_function = model.train_function
    # A second train function whose logs stay per worker (no cross-worker reduction).
    installed = keras_trainer.reduce_per_replica
    keras_trainer.reduce_per_replica = lambda values, strategy, reduction: tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0] if hasattr(v, "values") else v,
        values)
    try:
        model.train_function = None
        model.make_train_function(force=True)
        local_logs = model.train_function
    finally:
        keras_trainer.reduce_per_replica = installed
        model.train_function = train_function
    step = tf.function(lambda batch: strategy.run(model.train_step, args=(batch,)))
    next_batch = tf.function(
        lambda: strategy.experimental_local_results(iterator.get_next())[0][0][0, 0])
    one = strategy.run(lambda: tf.constant(1.0))
    mean = tf.function(lambda v: strategy.reduce("MEAN", v, axis=None))
    fns = {
        "keras_train_function": lambda: train_function(iterator)["loss"],
        "train_function_local_logs": lambda: local_logs(iterator)["loss"],
        "train_step_fixed_data": lambda: strategy.experimental_local_results(
            step(fixed)["loss"])[0],
        "data_only": next_batch,
        "reduce_mean_noaxis": lambda: mean(one),
    }
    seconds = {k: [] for k in fns}
    for i in range(calls + 2):  # alternating; the first two calls trace and warm up
        for k, fn in fns.items():
            began = time.perf_counter()
            float(np.asarray(fn()))
            if i >= 2:
                seconds[k].append(time.perf_counter() - began)
    out = {"fit_median_ms": result["step_time_ms"]["median"]}
    out.update({k: 1000 * float(np.median(v)) for k, v in seconds.items()})
    if strategy.cluster_resolver.task_id == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global_batch_size", type=int, default=32)
    p.add_argument("--compression", default="powersgd")
    p.add_argument("--powersgd_rank", type=int, default=4)
    p.add_argument("--fused_update", action="store_true",
                   help="momentum SGD through the fused kernel (tfpar's --fused_update)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "profile_fit_step.json"))
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from shaped_link import ShapedLink

    settings = {"model": "mlp", "model_width": 1024, "model_depth": 7,
                "global_batch_size": args.global_batch_size, "optimizer": "momentum",
                "learning_rate": 0.01, "steps": args.steps, "steps_per_epoch": args.steps,
                "seed": 0, "powersgd_rank": args.powersgd_rank,
                "compression": args.compression, "strategy": "multi_worker", "verbose": 0,
                "fused_update": args.fused_update,
                "calls": args.calls}
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if os.path.exists(out):
        os.remove(out)
    with ShapedLink(rate=args.rate) as link:
        codes, log = link.run_workers(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(settings),
             out], PORT, args.timeout, env={"PYTHONPATH": ROOT})
        if any(codes):
            print(f"profile_fit_step: workers exited {codes}\n{log}", file=sys.stderr)
            return 1
    with open(out) as f:
        result = json.load(f)
    print(f"{args.compression}, batch {args.global_batch_size}, {args.rate}, fused_update "
          f"{args.fused_update}, median of "
          f"{args.calls} calls (ms)")
    for k, v in result.items():
        print(f"  {k:26} {v:8.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
