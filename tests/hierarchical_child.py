"""Child of tests/test_hierarchical.py, run as each worker of a `TF_CONFIG` cluster whose
addresses name two hosts: workers 0-1 on one and 2-3 on the other, 2 logical CPUs each (a
host group holds 4 replicas: the reduce-scatter's path), or 0-1 and 2 (unequal hosts: the
leader's path). For each codec of `CASES`, the trainer's model summing through the
hierarchical all-reduce and the same model on the flat ring, from the same weights, 3 `fit`
steps on the same batches.
Prints one JSON line:

- `auto`: what `--allreduce=auto` resolves to on this cluster (`compat.resolve_allreduce`);
- per case: `allreduce` (the aggregators' `comm_stats()`, the metrics JSON's
  `comm.allreduce`) of each model, `traced_sums` (sums the hierarchy traced: it ran, not
  the flat ring), `padded_sums` (of them, those whose length the host's replicas do not
  divide: padded), `max_abs_diff` (weights, hierarchical vs flat), `max_step` (the largest
  change of a weight over the 3 steps: what a tolerance is measured against), `weights_sum`
  (of the hierarchical model's weights, as text: equal on every worker);
- `dynamic`: a sum of a length known only when it runs, against tf.distribute's
  (`dynamic_sums`).

    python tests/hierarchical_child.py ['{"cpu_devices": 2}']    # settings for every run

`"cases": [...]` among the settings runs only those codecs of `CASES`.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

from tfpar import ParallelConfig, compat, compression, data, tf_config
from tfpar.compression import hierarchical
from tfpar.backends.distribute import DistributeBackend

CASES = {"none": {}, "fp16": {}, "bf16": {}, "powersgd": {"powersgd_rank": 2}}
STEPS = 3


def fit(model, runtime, config, task):
    model.fit(data.distributed_dataset(runtime.strategy, config, task),
              steps_per_epoch=STEPS, epochs=1, verbose=0)


def main(settings):
    base = dict(strategy="multi_worker", model="mlp", optimizer="sgd", learning_rate=0.1,
                global_batch_size=32, verbose=0, seed=0, bucket_mb=0.05, **settings)
    cases = base.pop("cases", list(CASES))
    backend = DistributeBackend()
    runtime = backend.build_runtime(ParallelConfig(**base))
    out = {"auto": compat.resolve_allreduce(ParallelConfig(**base), tf_config.load())}
    for codec in cases:
        extra = CASES[codec]
        models = {}
        for allreduce in ("hierarchical", "flat"):
            config = ParallelConfig(**base, compression=codec, allreduce=allreduce, **extra)
            task = data.make_task(config)
            models[allreduce] = backend.build_model(config, runtime, task)
        start = models["flat"].get_weights()
        models["hierarchical"].set_weights(start)
        for model in models.values():
            fit(model, runtime, config, task)
        aggs = {k: compression.aggregator_of(m.optimizer) for k, m in models.items()}
        pairs = list(zip(models["hierarchical"].get_weights(), models["flat"].get_weights()))
        out[codec] = {
            "allreduce": {k: a.comm_stats()["allreduce"] for k, a in aggs.items()},
            "traced_sums": aggs["hierarchical"].hierarchy.traced,
            "padded_sums": aggs["hierarchical"].hierarchy.padded,
            "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs),
            "weights_sum": repr(sum(float(np.sum(a, dtype=np.float64)) for a, _ in pairs)),
            "max_step": max(float(np.max(np.abs(b - s)))
                            for (_, b), s in zip(pairs, start))}
    out["dynamic"] = dynamic_sums(runtime.strategy)
    print(json.dumps(out), flush=True)


def dynamic_sums(strategy):
    """A sum whose length is known only when the step runs (as `auto`'s, past its exact
    start), 13 entries (no multiple of a host's replicas), through the hierarchy and
    through tf.distribute's all-reduce: small integers, so both sums are exact. Per dtype,
    the largest difference, the lengths that came back and the ring's total (of the first
    local replica's sum)."""
    with strategy.scope():
        hierarchy = hierarchical.for_strategy(strategy, "hierarchical")
    out = {}
    for dtype in (tf.float32, tf.bfloat16):
        @tf.function(input_signature=[tf.TensorSpec([None], dtype)])
        def both(x):
            def replica_fn(x):
                ctx = tf.distribute.get_replica_context()
                x = x + tf.cast(ctx.replica_id_in_sync_group, dtype)
                return hierarchy.sum(x), ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)
            return strategy.run(replica_fn, args=(x,))
        mine, ring = both(tf.range(13, dtype=tf.float32) if dtype == tf.float32
                          else tf.cast(tf.range(13), dtype))
        pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
                 for a, b in zip(strategy.experimental_local_results(mine),
                                 strategy.experimental_local_results(ring))]
        out[dtype.name] = {"max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs),
                           "lengths": sorted({len(a) for a, _ in pairs}),
                           "ring_total": float(np.sum(pairs[0][1]))}
    return out


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
