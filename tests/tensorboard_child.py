"""Child process for tests: `python tests/tensorboard_child.py LOG_ROOT` trains with
`tfpar.callbacks.TensorBoard` twice — data parallel on 2 CPU replicas with int8 gradients
and fp16 loss scaling (a loss scale so large that the first steps overflow), then a 2-stage
pipeline — and prints a JSON line with what the event files should show."""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tfpar.compression import aggregator_of  # noqa: E402


def main():
    root = sys.argv[1]
    strategy = tfpar.make_strategy(cpu_devices=2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    initial_scale = 2.0 ** 20
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.LossScaleOptimizer(
            tfpar.DistributedOptimizer(keras.optimizers.SGD(0.01), compression="int8"),
            initial_scale=initial_scale)
        model.compile(optimizer=optimizer, loss="mse")
    board = tfpar.callbacks.TensorBoard(os.path.join(root, "data_parallel"),
                                        measure_comm=dataset.take(1))
    model.fit(dataset, epochs=2, steps_per_epoch=10, verbose=0, callbacks=[board])
    keras.mixed_precision.set_global_policy("float32")
    scale = float(optimizer.dynamic_scale.numpy())
    facts = {"steps": 20, "loss_scale": scale,
             # steps the loss scale skipped (it halves on each), and steps the inner
             # DistributedOptimizer skipped for a non-finite all-reduced gradient
             "skipped_steps": round(math.log2(initial_scale / scale))
             + int(optimizer.inner_optimizer.nonfinite_steps.numpy()),
             "bytes_on_wire": aggregator_of(optimizer).comm_stats()["bytes_on_wire_per_step"]}

    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    pipeline = tfpar.PipelineModel.split(plain, stages=2, schedule="1f1b", microbatches=4)
    pipeline.compile(optimizer="sgd", loss="mse")
    pipeline.fit(x[:64], y[:64], batch_size=16, epochs=1, verbose=0,
                 callbacks=[tfpar.callbacks.TensorBoard(os.path.join(root, "pipeline"))])
    print(json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
