"""Worker of tests/test_powersgd_step.py, one of two under `MultiWorkerMirroredStrategy`
(`TF_CONFIG=... python tests/powersgd_step_child.py`), one CPU replica each, as
`tools/bench_compression_vs_torch.py` runs PowerSGD: the trainer's mlp, momentum SGD,
PowerSGD rank 4, `--on_nan=stop`.

For one group and for two (`--powersgd_groups`): the collective op types of the step
`fit` traced (`tests/dp_overhead_child.py`'s count), and whether the guard's pass over the
full sums (the `Sum` ops of every gradient) still runs on an ordinary step, i.e. outside a
branch (`If`/`StatelessIf`'s functions). Then a run whose worker 1 has a NaN in its batch
of step 1: the line each worker stops with. Prints one JSON line.
"""

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

import graph_walk  # noqa: E402
from tfpar import ParallelConfig, strategy as strategy_lib  # noqa: E402
from tfpar.errors import TfparError  # noqa: E402
from tfpar.train import train  # noqa: E402

SETTINGS = {"strategy": "multi_worker", "model": "mlp", "model_width": 64, "model_depth": 3,
            "global_batch_size": 16, "optimizer": "momentum", "learning_rate": 0.01,
            "compression": "powersgd", "powersgd_rank": 4, "steps": 2, "steps_per_epoch": 2,
            "collective_timeout_s": 120, "verbose": 0}


def ops_outside_branches(graph):
    """Op type -> count over the step's graph and the functions it calls, leaving out the
    functions only a branch (`If`, `StatelessIf`) calls and what they call."""
    functions = {f.signature.name: f for f in graph.library.function}
    branch_fns = {node.attr[k].func.name for f in [graph.node] +
                  [f.node_def for f in functions.values()] for node in f
                  if node.op in ("If", "StatelessIf") for k in ("then_branch", "else_branch")}

    def called(nodes):
        return {a.func.name for node in nodes for a in node.attr.values()
                if a.func.name in functions}

    seen, todo = set(), called(graph.node) - branch_fns
    while todo:
        name = todo.pop()
        seen.add(name)
        todo |= called(functions[name].node_def) - branch_fns - seen
    counts = collections.Counter(node.op for node in graph.node)
    for name in seen:
        counts.update(node.op for node in functions[name].node_def)
    return counts


def nan_on_worker_1(input_context, config):
    """`--dataset` function: per-replica batches of (x, sign of sum(x)); worker 1's batch of
    step 1 holds a NaN."""
    batch = config.per_replica_batch(input_context.num_replicas_in_sync)
    worker = input_context.input_pipeline_id
    ds = tf.data.Dataset.range(1 << 30).map(
        lambda i: tf.random.stateless_normal([32], seed=tf.stack([i, worker])))
    ds = ds.map(lambda x: (x, tf.cast(tf.reduce_sum(x) > 0, tf.int32)))
    ds = ds.batch(batch, drop_remainder=True).enumerate()
    return ds.map(lambda k, xy: (tf.where((k == 1) & (worker == 1), float("nan"), xy[0]),
                                 xy[1]))


def main():
    runtime = strategy_lib.make_runtime(ParallelConfig(**SETTINGS))
    out = {}
    for groups in (1, 2):
        _, model = train(ParallelConfig(**SETTINGS, powersgd_groups=groups), runtime=runtime)
        graph = graph_walk.fit_step_graph(model)
        everywhere = graph_walk.op_counts(graph)
        out[f"groups{groups}"] = {
            "collectives": {op: n for op, n in everywhere.items() if op.startswith("Collective")},
            "collective_nodes": sorted(
                f"{fn}/{node.name}" for fn, nodes in [("", graph.node)] + [
                    (f.signature.name, f.node_def) for f in graph.library.function]
                for node in nodes if node.op.startswith("Collective")),
            "sums_outside_branches": ops_outside_branches(graph).get("Sum", 0),
            "sums": everywhere.get("Sum", 0),
            "matrices": len(model.optimizer.tfpar_aggregator.qs),
            "variables": len(model.trainable_variables)}
    try:
        train(ParallelConfig(**{**SETTINGS, "steps": 4, "steps_per_epoch": 4},
                             dataset="powersgd_step_child:nan_on_worker_1", num_classes=2),
              runtime=runtime)
        out["nan_on_worker_1"] = "trained on"
    except TfparError as err:
        out["nan_on_worker_1"] = str(err)
    assert strategy_lib.wait_for_workers("end", 120)  # neither leaves the other mid-collective
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
