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

With `--breakdown`, `train_step` on the fixed batch is also timed with pieces taken out (each
variant traced with the piece replaced, then timed alternating with the others), and its
pieces alone:

    fwd_bwd                     forward + loss + backward (the gradients, nothing applied)
    fwd_bwd_aggregate           the same + the aggregator's `all_reduce_sum`
    step_no_guard               `train_step` with Keras's own `_backend_update_step` (no
                                finite check of the summed gradients, no skipped-step count)
    step_no_update              `train_step` with `update_step` a no-op (aggregator and guard
                                still run; weights and slots unchanged)
    step_no_metrics             `train_step` returning the loss tracker alone (no
                                `compute_metrics`: accuracy)
    step_bare                   all three taken out

`train_step_fixed_data` minus a variant is that piece's cost inside the step.

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
    from tfpar import cpu_kernels
    # The trainer's kernels (oneDNN unless TF_ENABLE_ONEDNN_OPTS says otherwise), chosen
    # before TensorFlow starts, as `python -m tfpar.train` does.
    cpu_kernels.select(json.loads(settings_json).get("cpu_kernels", "auto"))
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as keras_trainer

    from tfpar import ParallelConfig, data
    from tfpar.train import train

    settings = json.loads(settings_json)
    calls = settings.pop("calls")
    breakdown = settings.pop("breakdown")
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
    fns = {}
    if breakdown:
        fns.update(_breakdown(model, strategy, fixed))
    fns.update({
        "keras_train_function": lambda: train_function(iterator)["loss"],
        "train_function_local_logs": lambda: local_logs(iterator)["loss"],
        "train_step_fixed_data": lambda: strategy.experimental_local_results(
            step(fixed)["loss"])[0],
        "data_only": next_batch,
        "reduce_mean_noaxis": lambda: mean(one),
    })
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


def _breakdown(model, strategy, fixed):
    """`--breakdown`'s functions: name -> a call returning a float tensor."""
    import contextlib

    import tensorflow as tf
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    optimizer = model.optimizer
    aggregator = getattr(optimizer, "tfpar_aggregator", None)
    variables = [v.value for v in model.trainable_variables]

    def gradients(data):
        x, y = data[0], data[1]
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
        return tape.gradient(loss, variables)

    def checksum(ts):
        # The first entry of each: depends on the whole output at a negligible cost.
        return tf.add_n([tf.reduce_sum(tf.reshape(t, [-1])[:1]) for t in ts])

    def aggregate(data):
        grads = gradients(data)
        if aggregator is None:
            ctx = tf.distribute.get_replica_context()
            return checksum([ctx.all_reduce("SUM", g) for g in grads])
        return checksum(aggregator.all_reduce_sum(grads, variables))

    def patched(**attrs):
        """Instance attributes of `optimizer` or `model` set while a variant is traced."""
        @contextlib.contextmanager
        def scope():
            owners = {"update_step": optimizer, "_backend_update_step": optimizer,
                      "compute_metrics": model}
            for name, value in attrs.items():
                setattr(owners[name], name, value)
            try:
                yield
            finally:
                for name in attrs:
                    delattr(owners[name], name)
        return scope

    no_guard = {"_backend_update_step": lambda g, v, lr: TFOptimizer._backend_update_step(
        optimizer, g, v, lr)}
    no_update = {"update_step": lambda g, v, lr: None}
    no_metrics = {"compute_metrics": lambda *a, **k: {"loss": model._loss_tracker.result()}}
    variants = {"step_no_guard": patched(**no_guard), "step_no_update": patched(**no_update),
                "step_no_metrics": patched(**no_metrics),
                "step_bare": patched(**no_guard, **no_update, **no_metrics)}
    fns = {}
    for name, fn in (("fwd_bwd", lambda d: checksum(gradients(d))),
                     ("fwd_bwd_aggregate", aggregate)):
        run = tf.function(lambda d, fn=fn: strategy.run(fn, args=(d,)))
        fns[name] = lambda run=run: strategy.experimental_local_results(run(fixed))[0]
    for name, scope in variants.items():
        run = tf.function(lambda d: strategy.run(model.train_step, args=(d,)))
        with scope():  # traced here, with the piece replaced
            run(fixed)
        fns[name] = lambda run=run: strategy.experimental_local_results(run(fixed)["loss"])[0]
    return fns


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global_batch_size", type=int, default=32)
    p.add_argument("--compression", default="powersgd")
    p.add_argument("--powersgd_rank", type=int, default=4)
    p.add_argument("--fused_update", action="store_true",
                   help="momentum SGD through the fused kernel (tfpar's --fused_update)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time train_step with pieces taken out, and its pieces alone")
    p.add_argument("--tfpar_root", default=ROOT,
                   help="checkout whose tfpar the workers import (this one by default; "
                        "another for a before/after breakdown)")
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
                "calls": args.calls, "breakdown": args.breakdown}
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if os.path.exists(out):
        os.remove(out)
    with ShapedLink(rate=args.rate) as link:
        codes, log = link.run_workers(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(settings),
             out], PORT, args.timeout, env={"PYTHONPATH": os.path.abspath(args.tfpar_root)})
        if any(codes):
            print(f"profile_fit_step: workers exited {codes}\n{log}", file=sys.stderr)
            return 1
    with open(out) as f:
        result = json.load(f)
    print(f"{args.compression}, batch {args.global_batch_size}, {args.rate}, fused_update "
          f"{args.fused_update}, tfpar of {os.path.abspath(args.tfpar_root)}, median of "
          f"{args.calls} calls (ms)")
    for k, v in result.items():
        print(f"  {k:26} {v:8.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
