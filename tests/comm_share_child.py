"""Child of tests/test_compression_timing.py: `measure_comm_fraction` on two planted cases
whose answer is known without timing luck, then on three aggregators' runs to see that it
leaves their state alone, printed as one JSON line (one TensorFlow start for both tests).

- `slow_collective`: a small model whose aggregator is the plain fp32 all-reduce followed
  by a 0.6 s sleep on the summed buffer (one bucket), so aggregating dominates the step;
- `slow_compute`: a tiny model whose forward pass sleeps 0.6 s and whose gradients go
  through Keras's own all-reduce (a few dozen floats), so aggregating is a sliver of it;
- `aggregators`: `none`, top-k and PowerSGD (inside its plain all-reduce phase) after two
  steps, their residuals and step counter before and after the measurement.

    python tests/comm_share_child.py
"""

import json
import time

from tfpar.devices import split_cpu

split_cpu(2)  # before TensorFlow starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.compression import PowerSGDAggregator, TopKAggregator, wrap_optimizer  # noqa: E402
from tfpar.compression.dense import NoneAggregator  # noqa: E402
from tfpar.compression.timing import measure_comm_fraction  # noqa: E402

DELAY_S = 0.6  # 0.3 left ~0.13 s of margin for the tiny all-reduce under load


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
    """Adds a zero that takes 0.6 s to compute: a model with a heavy forward pass."""

    def call(self, x):
        zero = tf.py_function(_slow_zero, [], tf.float32)
        return x + tf.reshape(zero, [])


def planted(strategy):
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
    return out


def aggregator_state(strategy):
    """Per aggregator: the measured times, and whether its state came out untouched."""
    x = np.random.default_rng(0).normal(size=(64, 256)).astype("float32")
    y = (x[:, :1] > 0).astype("int32")
    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat())

    def state(agg):
        if agg is None:
            return []
        return [v.numpy() for r in agg.residuals.values()
                for v in strategy.experimental_local_results(r)] + [agg.step.numpy()]
    out = {}
    for name, agg in [("none", None), ("topk", TopKAggregator(0.01, union=False, dense_below=0)),
                      ("powersgd", PowerSGDAggregator(rank=4, start_step=10))]:
        with strategy.scope():
            model = keras.Sequential([keras.Input((256,)),
                                      keras.layers.Dense(512, activation="relu"),
                                      keras.layers.Dense(2)])
            opt = keras.optimizers.SGD(0.1)
            model.compile(optimizer=wrap_optimizer(opt, agg) if agg else opt,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
        before = state(agg)
        fraction, times = measure_comm_fraction(strategy, model, data, steps=3)
        out[name] = {"fraction": fraction, **times,
                     "untouched": all(np.array_equal(a, b) for a, b in zip(before, state(agg)))}
    return out


def main():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    # The planted cases first: their timing is measured before anything else has run.
    out = planted(strategy)
    out["aggregators"] = aggregator_state(strategy)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
