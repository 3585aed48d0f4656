"""Child of tests/test_compression_timing.py: the scratch copy `measure_comm_fraction` times,
under `MirroredStrategy` over 2 logical CPUs, for PowerSGD, top-k and `auto` with Adam in
front (3 exact warm-up steps, then 2 compressed): the bytes one step of the copy puts on the
wire against the run's last step, and fp32's. One JSON line.

    python tests/scratch_copy_child.py
"""

import json

from tfpar.devices import split_cpu

split_cpu(2)  # before TensorFlow starts

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.compression import AutoAggregator, PowerSGDAggregator, TopKAggregator  # noqa: E402
from tfpar.compression.timing import _scratch_copy  # noqa: E402

ADAM = dict(adam=(0.9, 0.999, 1e-7), adam_warmup_steps=3)


def make(name):
    if name == "powersgd":
        return PowerSGDAggregator(rank=2, adam_variance="local_debiased", **ADAM)
    if name == "topk":
        return TopKAggregator(0.1, union=False, dense_below=0, **ADAM)
    return AutoAggregator(budget_ms=1.0, link=(1e3, 0.0), window=2, start_step=3,
                          adam_variance="local_debiased", **ADAM)


def main():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.RandomState(0)
    # Low rank plus noise, so `auto` plans a rank below its largest.
    u, _ = np.linalg.qr(rng.randn(64, 2))
    w, _ = np.linalg.qr(rng.randn(32, 2))
    grad = tf.constant((u @ np.diag([3.0, 2.0]) @ w.T + 1e-3 * rng.randn(64, 32))
                       .astype("float32"))

    def wire(agg):
        return int(strategy.experimental_local_results(agg.wire_bytes)[0].numpy())

    out = {"fp32": 4 * 64 * 32}
    for name in ("powersgd", "topk", "auto"):
        with strategy.scope():
            variable = tf.Variable(tf.zeros(grad.shape))
            agg = make(name)
            agg.build([variable])

        def one_step(a):
            return strategy.run(lambda: a.all_reduce_sum([grad], [variable]))

        step = tf.function(one_step)
        for _ in range(5):
            step(agg)
        run_bytes, run_step = wire(agg), int(agg.step.numpy())
        with strategy.scope():
            copy = _scratch_copy(agg, [variable])
        tf.function(one_step)(copy)
        out[name] = {"run": run_bytes, "copy": wire(copy), "run_step_before": run_step,
                     "run_step_after": int(agg.step.numpy())}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
