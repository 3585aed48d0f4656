"""Child process for tests/test_compression_auto.py: one worker of two,
`TF_CONFIG=... python tests/auto_workers_child.py` (MultiWorkerMirroredStrategy, each worker
its own data). Measures the link, runs `--compression=auto` and Adam's step compressed
against Keras's Adam, prints one JSON line and waits for the other worker before leaving.
"""

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tfpar.compression import AutoAggregator, TopKAggregator, wrap_optimizer  # noqa: E402
from tfpar.compression.auto import measure_link  # noqa: E402

task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=60))

def build(agg, lr=0.01):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
        opt = keras.optimizers.Adam(lr)
        if agg is not None:
            agg.adam = (0.9, 0.999, 1e-7)  # what the trainer and DistributedOptimizer set
            opt = wrap_optimizer(opt, agg)
        opt.build(model.trainable_variables)
    @tf.function
    def step(xb, yb):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(xb, yb)), axis=None)
    return model, step

def digest(model):
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.trainable_variables)).hexdigest()

out = {}
# 0. The link as auto measures it when given none: the same figures on both workers.
began = time.perf_counter()
out["link"] = [float(v) for v in measure_link(strategy)]
out["link_s"] = time.perf_counter() - began

# 1. auto on a planted link (1 MB/s, no latency) with a 5 ms budget: 5,000 bytes a step, so
# the budget's rank is 4 for this model, where both matrices start (start_rank=1 is below
# it). up_share=0: any spectrum doubles, so at each window's end every matrix's rank doubles up
# to its largest (8 for 16x64, 16 for 64x64). A loss-guard raise before step 3 doubles the
# floors at once. Each worker its own data.
rng = np.random.default_rng(task)
x = rng.normal(size=(24, 32, 16)).astype("float32")
y = (x @ np.linspace(-1, 1, 16).reshape(16, 1)).astype("float32")
agg = AutoAggregator(budget_ms=5.0, link=(1e6, 0.0), window=3, eta=10.0, start_step=2,
                     up_share=0.0, down_share=0.0, start_rank=1)
model, step = build(agg)
losses, wire, ranks, errors = [], [], [], []
for i in range(len(x)):
    if i == 3:
        raised = agg.raise_ranks()
    losses.append(float(step(tf.constant(x[i]), tf.constant(y[i]))))
    wire.append(agg.comm_stats()["bytes_on_wire_per_step"])
    ranks.append(sorted(agg.decisions()["ranks"].items()))
    errors.append([[p, agg.error_of(p), agg.top_share_of(p)] for p in (0, 2)])
residual = next(iter(agg.residuals.values()))
out["auto"] = {"hash": digest(model), "losses": losses, "wire": wire, "ranks": ranks,
               "errors": errors, "plan": agg.r_budget, "raised": raised,
               "r_max": sorted(agg.r_max.items()),
               "layers": agg.decisions()["layers"],
               "mean_bytes": agg.decisions()["mean_bytes_per_step"],
               "residual": hashlib.sha256(strategy.experimental_local_results(
                   residual)[0].numpy().tobytes()).hexdigest()}

# 1b. The first rank planned from the exact start (start_rank=None): on the exact sums,
# the same on both workers, so both plan alike.
agg = AutoAggregator(budget_ms=5.0, link=(1e6, 0.0), window=3, start_step=4)
model, step = build(agg)
planned = []
for i in range(8):
    step(tf.constant(x[i]), tf.constant(y[i]))
    planned.append(sorted(agg.decisions()["ranks"].items()))
out["planned"] = {"hash": digest(model), "ranks": planned}

# 2. Adam's step through top-k at ratio 1 (nothing dropped) with the same data on both
# workers: each worker's own moments are then the global ones, so the weights must equal
# Keras's Adam on the plain all-reduce.
x = np.random.default_rng(7).normal(size=(8, 32, 16)).astype("float32")
y = (x @ np.linspace(-1, 1, 16).reshape(16, 1)).astype("float32")
weights = {}
for name, agg in (("keras", None), ("adam_step", TopKAggregator(1.0, union=False, dense_below=0))):
    model, step = build(agg)
    for i in range(len(x)):
        step(tf.constant(x[i]), tf.constant(y[i]))
    weights[name] = [v.numpy() for v in model.trainable_variables]
out["adam_step_max_diff"] = max(float(np.max(np.abs(a - b)))
                                for a, b in zip(weights["keras"], weights["adam_step"]))

# 3. Why top-k's default failed with Adam, and that Adam's step fixes it: a linear loss whose
# gradient is the same every step (1,000 entries of magnitudes 1..2). Keras's Adam moves
# every weight by lr per step; top-k at 1 % (10 entries a step) sends each entry as a spike
# every ~100 steps, which Adam normalises to a fraction of that.
def linear_run(agg, steps=300, lr=1e-3):
    with strategy.scope():
        w = tf.Variable(tf.zeros([1000]))
        opt = keras.optimizers.Adam(lr)
        if agg is not None:
            opt = wrap_optimizer(opt, agg)
        opt.build([w])
    c = tf.linspace(1.0, 2.0, 1000)
    @tf.function
    def step():
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * c) / strategy.num_replicas_in_sync
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            return loss
        strategy.run(replica_fn)
    for _ in range(steps):
        step()
    return float(np.mean(np.abs(w.numpy()))) / (steps * lr)

gradient_agg = TopKAggregator(0.01, union=False, dense_below=0)
adam_agg = TopKAggregator(0.01, union=False, dense_below=0)
adam_agg.adam = (0.9, 0.999, 1e-7)
out["moved"] = {"keras": linear_run(None), "topk_gradient": linear_run(gradient_agg),
                "topk_adam_step": linear_run(adam_agg)}
# 4. After the exact warm-up the second moment is frozen; with a constant gradient Keras's
# own v̂ stays g², so frozen-variance Adam through top-k at ratio 1 must move as Keras does.
frozen = TopKAggregator(1.0, adam_warmup_steps=5, union=False, dense_below=0)
frozen.adam = (0.9, 0.999, 1e-7)
out["frozen"] = {"keras": linear_run(None, steps=40), "topk": linear_run(frozen, steps=40),
                 "step": int(frozen.step.numpy() if not hasattr(frozen.step, "values")
                             else strategy.experimental_local_results(frozen.step)[0].numpy())}
print(json.dumps(out), flush=True)
# Worker 0 hosts the coordination service: no worker leaves before the others are done.
assert tfpar.wait_for_workers("end", 120)
