"""Child of tests/test_compression_timing.py: `measure_comm_fraction` on two planted cases
whose answer is known without timing luck, printed as one JSON line.

- `slow_collective`: a small model whose aggregator is the plain fp32 all-reduce followed
  by a 0.3 s sleep on the summed buffer (one bucket), so aggregating dominates the step;
- `slow_compute`: a tiny model whose forward pass sleeps 0.3 s and whose gradients go
  through Keras's own all-reduce (a few dozen floats), so aggregating is a sliver of it.

    python tests/comm_share_child.py
"""

import json
import time

from tfpar.devices import split_cpu

split_cpu(2)  # before TensorFlow starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.compression import wrap_optimizer  # noqa: E402
from tfpar.compression.dense import NoneAggregator  # noqa: E402
from tfpar.compression.timing import measure_comm_fraction  # noqa: E402

DELAY_S = 0.3


def _sleep_then(t):
    time.sleep(DELAY_S)
    return t


class SlowCollective(NoneAggregator):
    """The fp32 all-reduce, then a sleep before the sum is handed back: a slow link."""

    def _exchange_bucket(self, flat, bucket):
        total, local, nbytes = super()._exchange_bucket(flat, bucket)
        slow = tf.py_function(_sleep_then, [total], tf.float32)
        slow.set_shape(total.shape)
        return slow, local, nbytes


def _slow_zero():
    return _sleep_then(np.float32(0.0))


class SlowForward(keras.layers.Layer):
    """Adds a zero that takes 0.3 s to compute: a model with a heavy forward pass."""

    def call(self, x):
        zero = tf.py_function(_slow_zero, [], tf.float32)
        return x + tf.reshape(zero, [])


strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
out = {}
for case, width, slow_layer, aggregator in [
        ("slow_collective", 256, False, SlowCollective(bucket_mb=64)),
        ("slow_compute", 8, True, None)]:
    x = rng.normal(size=(32, width)).astype("float32")
    y = (x[:, :1] > 0).astype("int32")
    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat())
    with strategy.scope():
        layers = [keras.Input((width,))] + ([SlowForward()] if slow_layer else []) + [
            keras.layers.Dense(width, activation="relu"), keras.layers.Dense(2)]
        model = keras.Sequential(layers)
        opt = keras.optimizers.SGD(0.1)
        model.compile(optimizer=wrap_optimizer(opt, aggregator) if aggregator else opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
    fraction, times = measure_comm_fraction(strategy, model, data, steps=3)
    out[case] = {"fraction": fraction, **times}
print(json.dumps(out), flush=True)
