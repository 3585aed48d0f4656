"""Child of tests/test_overlap.py, run as both workers of a 2-worker `TF_CONFIG` cluster
(one CPU replica each): the trainer's multi-worker `--compression=none` path in buckets
against Keras's one all-reduce, printed as one JSON line by each worker.

- `bucketed_by_default`: the distribute backend's `build_model` (what `tfpar.train` runs)
  gives a multi-worker `--compression=none` run the fp32 bucket aggregator;
  `unbucketed_has_aggregator`: with `--bucket_mb=0` it keeps Keras's one all-reduce;
- `bit_equal`: 3 `fit` steps from the same weights on the same batches, bucketed
  (`--bucket_mb`, one layer a bucket) and through Keras's one all-reduce: weights compared
  with `array_equal` (2 workers: each sum is `a + b` in either layout);
- `transformer_bit_equal`: the same for the transformer with Adam (its token embedding's
  `IndexedSlices` gradient sent as Keras sends it);
- `checkpointed_aggregators`: none (fp32 buckets keep no state a step reads);
- `matmuls_before_collective`: per all-reduce in the train function `fit` traced for the
  bucketed run (the trainer's own step: forward, backward, the buckets, the update), the
  MatMuls it waits for; `traced_into`: that graph's name;
- `timing`: `measure_comm_fraction` (the metrics JSON's `comm` keys) of both, `rounds`
  times, alternating (0 in the test: on a loaded 2-core machine the medians swing by more
  than the effect; docs/benchmarks/compression_link.md, "Uncompressed buckets across
  workers").

    python tests/overlap_child.py '{"model_width": 256, ...}' ROUNDS TIMED_STEPS

`timeline` (a worker of the shaped-link test): `tools/profile_overlap.py`'s `measure` for
SETTINGS (the bucketed model it builds, `measure_comm_fraction` with its in-step
timestamps: `comm` keys and each step's `timeline_ms`; SETTINGS' `threads`, `pin`,
`calibrate`, `runtime_steps`, `wire` and `track` (`[ratio, settle, per_step]`) as its
flags), and from the traced timeline step:
`timestamp_feeds` (the types of every op that waits for a timestamp taken after the
step's start: none may be a gradient or a collective), `start_stamps` (stamps with no
inputs) and `heavy_after_start` (the MatMuls and convolutions that wait for one),
`waits_for_previous` (per collective), `heavy_before_collective` (the MatMuls and
convolutions each waits for), `heavy` (all of the step's) and `bucket_bytes` (each
collective's), written as JSON to `OUT.<worker index>.json`:

    python tests/overlap_child.py timeline '{"conv_head": [64, 128, 3, 2], ...}' STEPS OUT
"""

import dataclasses
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from tfpar import ParallelConfig, compression, data, optimizers, state
from tfpar.backends.distribute import DistributeBackend
from tfpar.compression import timing
from tfpar.compression.timing import measure_comm_fraction

from graph_walk import ancestors

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import profile_overlap  # noqa: E402  (its models and worker set-up)


def record_traces(aggregator):
    """Wraps `aggregator.all_reduce_sum` so that each trace of it records the graph it is
    traced into (inside `fit`: the trainer's own train function) and the operations it adds
    there. Returns the list the records go to, `(graph, operations)` each."""
    traces, inner = [], aggregator.all_reduce_sum

    def all_reduce_sum(grads, variables):
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        out = inner(grads, variables)
        traces.append((graph, graph.get_operations()[before:]))
        return out

    aggregator.all_reduce_sum = all_reduce_sum
    return traces


def matmuls_before_collectives(graph, operations):
    """For each all-reduce among `operations` (the aggregator's, in `graph`: the train
    function `fit` traced), in program order (last layer's bucket first), how many MatMuls
    (forward and backward) it waits for through data or control edges: a bucket that waits
    for fewer than all backward's MatMuls can cross the link while backward still runs."""
    counts = []
    for op in operations:
        if op.type.startswith("CollectiveReduce"):
            counts.append(sum(o.type == "MatMul" for o in ancestors(op)))
    return counts


def pair(backend, config, runtime, task):
    """The trainer's model for `config` (bucketed across workers) and the same model with
    Keras's one all-reduce, from the same weights."""
    bucketed = backend.build_model(config, runtime, task)
    plain = backend.build_model(config, runtime, task)
    with runtime.strategy.scope():
        plain.compile(optimizer=optimizers.make_optimizer(config, bucketed=False),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.set_weights(bucketed.get_weights())
    return bucketed, plain


def fit_and_compare(runtime, config, task, bucketed, plain):
    """3 `fit` steps of both on the same batches: (bit-equal, largest difference)."""
    for model in (bucketed, plain):
        model.fit(data.distributed_dataset(runtime.strategy, config, task),
                  steps_per_epoch=3, epochs=1, verbose=0)
    pairs = list(zip(bucketed.get_weights(), plain.get_weights()))
    return (all(np.array_equal(a, b) for a, b in pairs),
            max(float(np.max(np.abs(a - b))) for a, b in pairs))


def main(settings, rounds, timed_steps):
    config = ParallelConfig(strategy="multi_worker", model="mlp", optimizer="sgd",
                            verbose=0, **settings)
    backend = DistributeBackend()
    runtime = backend.build_runtime(config)
    task = data.make_task(config)
    bucketed, plain = pair(backend, config, runtime, task)
    out = {"bucketed_by_default":
           compression.aggregator_of(bucketed.optimizer) is not None,
           "plain_has_aggregator": compression.aggregator_of(plain.optimizer) is not None,
           "unbucketed_has_aggregator": compression.aggregator_of(backend.build_model(
               dataclasses.replace(config, bucket_mb=0), runtime, task).optimizer) is not None,
           # fp32 buckets keep no state a step reads: nothing beside the model in a checkpoint
           "checkpointed_aggregators": sorted(
               n for n in state.LayoutState(bucketed).entries() if n.startswith("codec/")),
           "grad_bytes": 4 * sum(int(np.prod(v.shape)) for v in bucketed.trainable_variables)}

    def dataset():
        return data.distributed_dataset(runtime.strategy, config, task)

    traces = record_traces(compression.aggregator_of(bucketed.optimizer))
    out["bit_equal"], out["max_abs_diff"] = fit_and_compare(runtime, config, task, bucketed,
                                                            plain)
    # The transformer with Adam: its token embedding's gradient is `IndexedSlices`, which
    # Keras's Adam updates slice by slice; the buckets must send them as Keras does.
    words = ParallelConfig(strategy="multi_worker", model="transformer", optimizer="adam",
                           verbose=0, global_batch_size=16, seed=0)
    words_task = data.make_task(words)
    out["transformer_bit_equal"], out["transformer_max_abs_diff"] = fit_and_compare(
        runtime, words, words_task, *pair(backend, words, runtime, words_task))
    out["trace_count"] = compression.aggregator_of(bucketed.optimizer).trace_count
    out["matmuls_before_collective"] = matmuls_before_collectives(*traces[-1])
    out["traced_into"] = traces[-1][0].name  # the train function fit traced
    out["timing"] = {"bucketed": [], "plain": []}
    for _ in range(rounds):
        for name, model in (("bucketed", bucketed), ("plain", plain)):
            _, times = measure_comm_fraction(runtime.strategy, model, dataset(),
                                             steps=timed_steps)
            out["timing"][name].append(times)
    print(json.dumps(out), flush=True)


# The ops forward and backward spend their time in (a recomputed forward's too).
HEAVY = ("MatMul", "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter")


def waiting_on(graph, roots):
    """Every op in `graph` that waits (through data or control edges) for an op of
    `roots`."""
    children = {}
    for op in graph.get_operations():
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            children.setdefault(parent, []).append(op)
    seen, stack = set(), list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


def timeline(settings, timed_steps, out):
    settings = dict(settings)
    calibrate = settings.pop("calibrate", 0.0)
    runtime_steps = settings.pop("runtime_steps", 0)
    wire = settings.pop("wire", False)
    track = settings.pop("track", None)
    traced, inner = [], timing.timeline_step

    def recording(gradients, aggregate, collectives):
        traced.append(collectives)
        return inner(gradients, aggregate, collectives)

    timing.timeline_step = recording
    times = profile_overlap.measure(settings, timed_steps, calibrate, runtime_steps, wire,
                                    track)
    found = traced[-1][0]  # the measured step's (after calibration's)
    graph = found[0].graph
    stamps = [op for op in graph.get_operations() if op.type == "Timestamp"]
    first = [op for op in stamps if not op.inputs and not op.control_inputs]
    times.update(
        # what waits for a stamp after the step's start (none may be a gradient or a
        # collective), and how many of the step's MatMuls and convolutions wait for the start
        timestamp_feeds=sorted({op.type for op in waiting_on(
            graph, [op for op in stamps if op not in first])}),
        start_stamps=len(first),
        heavy_after_start=sum(op.type in HEAVY for op in waiting_on(graph, first)),
        waits_for_previous=[k > 0 and found[k - 1] in ancestors(op)
                            for k, op in enumerate(found)],
        heavy_before_collective=[sum(o.type in HEAVY for o in ancestors(op)) for op in found],
        heavy=sum(op.type in HEAVY for op in graph.get_operations()),
        bucket_bytes=[4 * int(np.prod(op.inputs[0].shape)) for op in found])
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(f"{out}.{index}.json", "w") as f:
        json.dump(times, f)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if sys.argv[1] == "timeline":
        timeline(json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
