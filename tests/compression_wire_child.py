"""Worker of tests/test_compression_wire.py, one of two under `tfpar.launch` in a network
namespace of their own (tests/wire_namespace_child.py):
`python tests/compression_wire_child.py WIDTH DEPTH WARMUP STEPS`.

Trains a transformer (WIDTH, DEPTH) under `fit` with each aggregator in turn, and a tiny
one for the fixed per-step overhead; reads the loopback's transmit counter after WARMUP
steps and after STEPS more. Worker 0 prints one JSON line: bytes per step by aggregator.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
import tfpar  # noqa: E402
from tfpar import models  # noqa: E402
from tfpar import ParallelConfig, strategy as strategy_lib  # noqa: E402
from tfpar.compression import make_aggregator, wrap_optimizer  # noqa: E402

WIDTH, DEPTH, WARMUP, STEPS = (int(arg) for arg in sys.argv[1:5])
runtime = strategy_lib.make_runtime(ParallelConfig(strategy="multi_worker",
                                                   collective_timeout_s=120))
strategy = runtime.strategy


def lo_tx_bytes():
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no lo in /proc/self/net/dev")


class WireCounter(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # the step has finished
        if batch == WARMUP - 1:
            self.start = lo_tx_bytes()
        elif batch == WARMUP + STEPS - 1:
            self.bytes_per_step = (lo_tx_bytes() - self.start) / STEPS


def dataset(context):
    rng = np.random.default_rng(context.input_pipeline_id)
    tokens = rng.integers(0, 17, (2, 17)).astype("int32")
    return tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()


data = strategy.distribute_datasets_from_function(dataset)
out = {}
for name in ["overhead", "none", "fp16", "int8", "topk", "powersgd"]:
    keras.utils.set_random_seed(0)
    with strategy.scope():
        width, depth = (8, 1) if name == "overhead" else (WIDTH, DEPTH)
        model = models.build("transformer", (16,), 17, width=width, depth=depth)
        optimizer = keras.optimizers.SGD(0.01)
        if name not in ("overhead", "none"):  # fp32 is Keras's own all-reduce
            optimizer = wrap_optimizer(optimizer, make_aggregator(ParallelConfig(
                compression=name, topk_ratio=0.01, topk_union=False, topk_dense_below=0,
                powersgd_rank=4, optimizer="sgd")))  # plain top-k: one all-gather
        model.compile(optimizer=optimizer, jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counter = WireCounter()
    model.fit(data, epochs=1, steps_per_epoch=WARMUP + STEPS, callbacks=[counter], verbose=0)
    agg = getattr(optimizer, "tfpar_aggregator", None)
    out[name] = {"lo_bytes_per_step": counter.bytes_per_step, "params": model.count_params(),
                 "counted": agg.comm_stats() if agg else None}
    del model, optimizer
if runtime.is_chief:
    print(json.dumps(out), flush=True)
# Worker 0 hosts the coordination service: no worker leaves before the others are done.
assert tfpar.wait_for_workers("end", 120)
