"""Child process for tests/test_compression_aggregators.py:
`python tests/aggregators_child.py CKPT_DIR`.

Runs every aggregator on a MirroredStrategy of 4 logical CPUs with known per-replica
gradients (`strategy.run`), against the exact sum; the top-k residuals' checkpoint is
written under CKPT_DIR. Prints one JSON line of results by case.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from tfpar.devices import split_cpu  # noqa: E402
import tensorflow as tf  # noqa: E402
split_cpu(4)
from tfpar.compression import (  # noqa: E402
    AutoAggregator, CastAggregator, Int8Aggregator, NoneAggregator, LowBitAggregator,
    PowerSGDAggregator, ThresholdAggregator, TopKAggregator)

CKPT_DIR = sys.argv[1]
R = 4
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(R)])
rng = np.random.default_rng(0)
SHAPES = [(64, 48), (48,), (3, 3, 4, 8)]
with strategy.scope():
    variables = [tf.Variable(tf.zeros(s), name=f"v{i}") for i, s in enumerate(SHAPES)]

def low_rank(shape, rank):
    n, m = int(np.prod(shape[:-1])), shape[-1]
    shared = rng.normal(size=(rank, m))  # same row space on every replica: the sum has rank <= r
    return [(rng.normal(size=(n, rank)) @ shared).reshape(shape).astype(np.float32)
            for _ in range(R)]

RANDOM = [[rng.normal(size=s).astype(np.float32) for _ in range(R)] for s in SHAPES]
LOWRANK = [low_rank(SHAPES[0], 2), RANDOM[1], low_rank(SHAPES[2], 2)]

def stepper(agg, grads):
    table = [tf.constant(np.stack(g)) for g in grads]  # [replica, ...] per variable
    @tf.function
    def step():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            return agg.all_reduce_sum([t[rid] for t in table], variables)
        return strategy.run(fn)
    def run():
        out = step()
        per_replica = [[v.numpy() for v in strategy.experimental_local_results(o)] for o in out]
        same = all(np.array_equal(p[0], q) for p in per_replica for q in p)
        return [p[0] for p in per_replica], same
    return run

def max_err(out, grads):
    return max(float(np.max(np.abs(o - np.sum(g, 0)))) for o, g in zip(out, grads))

res = {}
gmax = max(float(np.max(np.abs(np.sum(g, 0)))) for g in RANDOM)
res["gmax"] = gmax
for name, agg in [("none", NoneAggregator()), ("fp16", CastAggregator("fp16")),
                  ("bf16", CastAggregator("bf16")), ("int8", Int8Aggregator()),
                  ("int8_sr", Int8Aggregator(stochastic_rounding=True)),
                  ("topk_full", TopKAggregator(1.0, union=False, dense_below=0)),
                  ("small_buckets", NoneAggregator(bucket_mb=0.005))]:
    out, same = stepper(agg, RANDOM)()
    res[name] = {"err": max_err(out, RANDOM), "same": same, "stats": agg.comm_stats(),
                 "traced": agg.trace_count}

# int8 bound: each replica's error is at most half its scale (max|g_r| / 127 / 2).
res["int8_bound"] = sum(max(float(np.max(np.abs(g[r]))) for g in RANDOM) / 254 for r in range(R))

# Low-bit codes are exact where every block's entries share one magnitude (each replica its
# own): the sign at 1 bit, the largest code at 3.
SIGNED = [[(np.sign(g[r]) * (r + 1) * (i + 1)).astype(np.float32) for r in range(R)]
          for i, g in enumerate(RANDOM)]
for bits in (1, 3):
    agg = LowBitAggregator(bits)
    out, same = stepper(agg, SIGNED)()
    res[f"lowbit{bits}_signed"] = {"err": max_err(out, SIGNED), "same": same,
                                   "stats": agg.comm_stats()}

# PowerSGD is exact when the summed gradient has rank <= r; biases go uncompressed.
agg = PowerSGDAggregator(rank=4)
out, same = stepper(agg, LOWRANK)()
res["powersgd_lowrank"] = {"err": max_err(out, LOWRANK), "same": same, "stats": agg.comm_stats(),
                           "scale": max(float(np.max(np.abs(np.sum(g, 0)))) for g in LOWRANK)}

# start_step: plain all-reduce (exact, full bytes) for 2 steps, then compressed.
agg = PowerSGDAggregator(rank=1, start_step=2)
run = stepper(agg, RANDOM)
res["powersgd_start"] = []
for _ in range(3):
    out, same = run()
    res["powersgd_start"].append({"err": max_err(out, RANDOM), "same": same,
                                  "bytes": agg.comm_stats()["bytes_on_wire_per_step"]})

# Error feedback under the strategy: Σ outputs + Σ residuals over replicas == Σ gradients.
for name, agg in [("ef_topk", TopKAggregator(0.05, union=False, dense_below=0)),
                  ("ef_powersgd", PowerSGDAggregator(rank=1)),
                  ("ef_lowbit", LowBitAggregator(block=64)),
                  ("ef_threshold", ThresholdAggregator(threshold=1.5)),
                  # auto (rank 1 on a 1 kB/s link): 2 exact steps (residuals emptied), then
                  # compressed, its ranks decided at windows' ends (steps 3 and 5)
                  ("ef_auto", AutoAggregator(budget_ms=1.0, link=(1e3, 0.0), window=2,
                                             start_step=2))]:
    run = stepper(agg, RANDOM)
    total = [np.zeros(s, np.float32) for s in SHAPES]
    for _ in range(6):
        out, same = run()
        total = [t + o for t, o in zip(total, out)]
    local = strategy.experimental_local_results
    residual_sum = [sum(v.numpy() for v in local(agg.residuals[str(i)]))
                    if str(i) in agg.residuals else 0 for i in range(len(SHAPES))]
    per_replica_differ = not np.array_equal(
        *[v.numpy() for v in strategy.experimental_local_results(agg.residuals["0"])][:2])
    res[name] = {"err": max(float(np.max(np.abs(t + r - 6 * np.sum(g, 0))))
                            for t, r, g in zip(total, residual_sum, RANDOM)),
                 "same": same, "residuals_differ": per_replica_differ,
                 "stats": agg.comm_stats()}
    if name == "ef_topk":
        # Checkpoint: a restore gives every replica back its own residual.
        path = tf.train.Checkpoint(agg=agg).save(os.path.join(CKPT_DIR, "agg"))
        fresh = TopKAggregator(0.05, union=False, dense_below=0)
        with strategy.scope():
            fresh.build(variables)
        tf.train.Checkpoint(agg=fresh).restore(path).assert_existing_objects_matched()
        before = [[v.numpy() for v in strategy.experimental_local_results(agg.residuals[k])]
                  for k in sorted(agg.residuals)]
        after = [[v.numpy() for v in strategy.experimental_local_results(fresh.residuals[k])]
                 for k in sorted(agg.residuals)]
        res["ckpt"] = {"own": all(np.array_equal(a, b) for x, y in zip(before, after)
                                  for a, b in zip(x, y)),
                       "differ": not np.array_equal(after[0][0], after[0][1]),
                       "step": int(fresh.step.numpy())}

# Top-k density warm-up: each step sends what the schedule says (bytes counted per step),
# one trace serves every step, and error feedback still conserves the sum.
agg = TopKAggregator(0.05, warmup_steps=4, warmup_start=0.5, union=False, dense_below=0)
run = stepper(agg, RANDOM)
total = [np.zeros(s, np.float32) for s in SHAPES]
steps = []
for step in range(6):
    out, same = run()
    total = [t + o for t, o in zip(total, out)]
    steps.append({"same": same, "traced": agg.trace_count,
                  "bytes": agg.comm_stats()["bytes_on_wire_per_step"],
                  "expected": agg.wire_bytes_at(step),
                  "k": [agg.k(int(np.prod(s)), step) for s in SHAPES]})
residual_sum = [sum(v.numpy() for v in strategy.experimental_local_results(agg.residuals[str(i)]))
                for i in range(len(SHAPES))]
res["warmup"] = {"steps": steps,
                 "err": max(float(np.max(np.abs(t + r - 6 * np.sum(g, 0))))
                            for t, r, g in zip(total, residual_sum, RANDOM)),
                 "config_roundtrip": TopKAggregator(**agg.get_config()).get_config()
                                     == agg.get_config()}

# Threshold: the bytes on the wire follow the largest count over replicas.
agg = ThresholdAggregator(threshold=2.0)
out, same = stepper(agg, RANDOM)()
counts = [sum(int(np.sum(np.abs(g[r]) >= 2.0)) for g in RANDOM) for r in range(R)]
kept = [sum(np.where(np.abs(g[r]) >= 2.0, g[r], 0) for r in range(R)) for g in RANDOM]
res["threshold"] = {"err": max(float(np.max(np.abs(o - k))) for o, k in zip(out, kept)),
                    "same": same, "bytes": agg.comm_stats()["bytes_on_wire_per_step"],
                    "expected_bytes": 4 + 8 * max(counts)}
print(json.dumps(res))
