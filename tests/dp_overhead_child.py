"""Child of tests/test_dp_overhead.py: the op types of the traced train step (the function
Keras's `fit` runs each step, with every function it calls) of stock Keras `fit` and of
tfpar's (`tfpar.train.train`, `--compression=none`, `--on_nan` stop and skip_step) on one
`MirroredStrategy` of 2 logical CPUs, the same model and batch; and the line a stop-mode
run ends with when only replica 1's batch of step 1 holds a NaN (only replica 0 checks the
summed gradients: the NaN must reach it through the sum); the training input's class and
its batches against the pipeline made replica by replica. Prints one JSON line.

    python tests/dp_overhead_child.py
"""

import json

import numpy as np
import tensorflow as tf

import graph_walk
from tfpar import ParallelConfig, data, devices, strategy
from tfpar.errors import TfparError
from tfpar.train import train

SETTINGS = {"model": "mlp", "model_width": 64, "global_batch_size": 32, "steps": 3,
            "steps_per_epoch": 3, "cpu_devices": 2, "strategy": "mirrored", "verbose": 0}


def op_types(model):
    """Op type -> count in the step function Keras's `fit` traced for `model` and every
    function in its library (the replicas' bodies, the optimizer's update)."""
    return dict(graph_walk.op_counts(graph_walk.fit_step_graph(model)))


def stock_model(config, stock, task):
    """What a user writes without tfpar: the same model, compile and fit."""
    import keras
    import tensorflow as tf

    from tfpar import models

    examples = tf.data.Dataset.range(config.steps * config.global_batch_size)
    dataset = examples.map(task.example_fn).batch(config.global_batch_size,
                                                  drop_remainder=True)
    with stock.scope():
        model = models.build(config.model, task.input_shape, task.num_classes,
                             width=config.model_width)
        model.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      jit_compile=False)
    model.fit(dataset, epochs=1, steps_per_epoch=config.steps, verbose=0, shuffle=False)
    return model


def nan_on_replica_1(input_context, config):
    """`--dataset` function: per-replica batches of (x, sign of sum(x)); replica 1's batch
    of step 1 holds a NaN. (Batch k of this one input pipeline goes to replica k % 2.)"""
    batch = config.per_replica_batch(input_context.num_replicas_in_sync)
    ds = tf.data.Dataset.range(1 << 30).map(
        lambda i: tf.random.stateless_normal([8], seed=tf.stack([i, 7])))
    ds = ds.map(lambda x: (x, tf.cast(tf.reduce_sum(x) > 0, tf.int32)))
    ds = ds.batch(batch, drop_remainder=True).enumerate()
    return ds.map(lambda k, xy: (tf.where(k == 1 * 2 + 1, float("nan"), xy[0]), xy[1]))


def replica_batches(dataset, steps):
    """`steps` steps of a distributed dataset: per step, each replica's (x, y) as arrays."""
    iterator = iter(dataset)
    return [[tuple(np.asarray(t) for t in replica) for replica in zip(
        *(v.values for v in next(iterator)))] for _ in range(steps)]


def input_pipelines(strategy):
    """The training input under `MirroredStrategy`: what `data.distributed_dataset` builds
    (its class), and whether its replicas' batches from step 3 on equal those of the
    pipeline made replica by replica (`data.pipeline_dataset`), with accumulation too."""
    out = {}
    for accum in (1, 2):
        config = ParallelConfig(**SETTINGS, grad_accum_steps=accum)
        task = data.make_task(config)
        ours = data.distributed_dataset(strategy, config, task, start_step=3)
        by_replica = strategy.distribute_datasets_from_function(
            lambda context: data.pipeline_dataset(config, task, context, 3))
        a, b = replica_batches(ours, 3), replica_batches(by_replica, 3)
        out[f"accum{accum}"] = {
            "class": type(ours).__name__, "examples_per_replica": int(a[0][0][0].shape[0]),
            "equal": all(np.array_equal(u, v) for step_a, step_b in zip(a, b)
                         for ra, rb in zip(step_a, step_b) for u, v in zip(ra, rb))}
    return out


def main():
    config = ParallelConfig(**SETTINGS)
    devices.split_cpu(config.cpu_devices)
    runtime = strategy.make_runtime(config)
    stock = tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")][:config.cpu_devices])
    out = {"stock": op_types(stock_model(config, stock, data.make_task(config))),
           "input": input_pipelines(runtime.strategy)}
    for on_nan in ("stop", "skip_step"):
        model = train(ParallelConfig(**SETTINGS, on_nan=on_nan), runtime=runtime)[1]
        out[on_nan] = op_types(model)
    try:
        train(ParallelConfig(**{**SETTINGS, "steps": 4, "steps_per_epoch": 4},
                             dataset="dp_overhead_child:nan_on_replica_1", num_classes=2),
              runtime=runtime)
        out["nan_on_replica_1"] = "trained on"
    except TfparError as err:
        out["nan_on_replica_1"] = str(err)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
