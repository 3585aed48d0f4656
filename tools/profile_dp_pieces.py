"""What three pieces of tfpar's data-parallel step cost alone, in CPU time, beside stock Keras.

`tools/bench_data_parallel.py` times whole steps, which a loaded machine swings by more
than the pieces; here each piece runs alone, many times, in alternating rounds, timed in
the process's CPU time (`time.process_time`: all threads; waiting for a core is not
counted), on 4 logical CPUs (`MirroredStrategy`) with the bench's model and batch:

- `input`: a step's batches from tfpar's input pipeline (`tfpar.data.distributed_dataset`)
  against the stock side's (`Dataset.range → map → batch → prefetch`, split by
  `experimental_distribute_dataset`), 100 steps a round;
- `finite`: `--on_nan=stop`'s check of the summed gradients (a sum per gradient,
  `IsFinite`) made by every replica against replica 0 alone (`tfpar.nan_guard`), on
  the model's gradient shapes; the empty replica step as the baseline;
- `counter`: the guard's per-step read of the skipped-steps counter, through the mirrored
  Keras variable against replica 0's copy.

    python tools/profile_dp_pieces.py --model=mlp

Prints one line per variant: the median over rounds (and every round) of milliseconds of
CPU time per step or call.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))


def cpu_ms(fn, calls):
    began = time.process_time()
    for _ in range(calls):
        fn()
    return 1000 * (time.process_time() - began) / calls


def rounds_of(variants, rounds, calls):
    """{name: [CPU ms per call, one a round]}, the variants' order reversed every round."""
    out = {name: [] for name in variants}
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            out[name].append(cpu_ms(variants[name](), calls))
    return out


def input_variants(config, strategy, task):
    import tensorflow as tf

    import bench_data_parallel
    from tfpar import data

    def reader(make):
        def fresh():
            batches = iter(make())
            next(batches)  # the pipeline started

            def step():
                for t in tf.nest.flatten(next(batches)):
                    strategy.experimental_local_results(t)[0].numpy()
            return step
        return fresh

    return {"input tfpar": reader(lambda: data.distributed_dataset(strategy, config, task)),
            "input stock": reader(lambda: strategy.experimental_distribute_dataset(
                bench_data_parallel.stock_dataset(config, task, "generated")))}


def finite_variants(strategy, model):
    import tensorflow as tf

    with strategy.scope():
        grads = [tf.Variable(tf.ones(v.shape)) for v in model.trainable_variables]

    def check(replicas):
        def body():
            replica = tf.get_static_value(
                tf.distribute.get_replica_context().replica_id_in_sync_group)
            if replica >= replicas:
                return tf.constant(True)
            return tf.math.is_finite(tf.add_n([tf.reduce_sum(g) for g in grads]))
        function = tf.function(lambda: strategy.run(body))
        function()
        return lambda: function
    return {"finite every replica": check(strategy.num_replicas_in_sync),
            "finite replica 0": check(1), "finite none (empty step)": check(0)}


def counter_variants(strategy):
    import keras

    from tfpar import nan_guard

    with strategy.scope():
        optimizer = keras.optimizers.SGD()
        optimizer.build([keras.Variable(1.0)])
        nan_guard.add_counter(optimizer)
    counter = optimizer.nonfinite_steps
    copy = strategy.experimental_local_results(counter.value)[0]
    return {"counter mirrored": lambda: lambda: float(counter.numpy()),
            "counter replica 0's copy": lambda: lambda: float(copy.numpy())}


def main():
    import bench_data_parallel

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(bench_data_parallel.MODELS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cpu_devices", type=int, default=4)
    args = parser.parse_args()

    from tfpar import data, devices, models
    from tfpar import strategy as strategy_lib
    from tfpar.config import ParallelConfig

    config = ParallelConfig(model=args.model, steps=10 ** 4, steps_per_epoch=10 ** 4,
                            cpu_devices=args.cpu_devices, strategy="mirrored",
                            **bench_data_parallel.MODELS[args.model])
    devices.split_cpu(config.cpu_devices)
    strategy = strategy_lib.make_runtime(config).strategy
    task = data.make_task(config)
    model = models.build(config.model, task.input_shape, task.num_classes,
                         width=config.model_width, depth=config.model_depth)
    results = {}
    results.update(rounds_of(input_variants(config, strategy, task), args.rounds, 100))
    results.update(rounds_of(finite_variants(strategy, model), args.rounds, 200))
    results.update(rounds_of(counter_variants(strategy), args.rounds, 1000))
    print(f"{args.model}, {config.cpu_devices} replicas: CPU ms per step or call, median "
          f"over {args.rounds} rounds (each round)")
    for name, values in results.items():
        print(f"{name:<28}{statistics.median(values):>8.3f}   "
              + " ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    from tfpar import cpu_kernels
    cpu_kernels.select("auto")
    main()
