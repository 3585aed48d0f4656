"""What tfpar's data-parallel step adds to stock Keras `fit`'s, from the traced step's ops
(tests/dp_overhead_child.py: 2 logical CPUs, `MirroredStrategy`), which no machine load
changes. Step times, side by side: `tools/bench_data_parallel.py`
(docs/benchmarks/data_parallel.md), which breaks the difference down (`--without`).
"""

import json
import sys

import pytest

from subproc import ROOT, last_json_line, run

REPLICAS = 2


def collectives(ops):
    return {op: n for op, n in ops.items() if op.startswith(("Collective", "Nccl"))}


@pytest.fixture(scope="module")
def traced():
    out = run([sys.executable, f"{ROOT}/tests/dp_overhead_child.py"], timeout=300)
    result = last_json_line(out.stdout)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
    return result


def test_no_collective_beyond_stock_keras(traced):
    # `--compression=none` in one process: Keras's own all-reduce, no aggregator, no
    # all-reduce of a finiteness flag (fp16's and skip_step's agree through the sums).
    assert collectives(traced["stock"]), traced["stock"]  # the all-reduce is counted
    for on_nan in ("stop", "skip_step"):
        assert collectives(traced[on_nan]) == collectives(traced["stock"]), on_nan


def test_one_finiteness_pass_for_every_replica_when_only_stopping(traced):
    # The default `--on_nan=stop` counts non-finite sums; the replicas hold the same sums,
    # so replica 0 checks them once (it was once a pass per replica, ~1/R of the update's
    # reads each) and no per-variable branch runs; skip_step guards each replica's update.
    assert traced["stock"].get("IsFinite", 0) == 0
    assert traced["stop"]["IsFinite"] == 1
    assert traced["stop"].get("If", 0) == traced["stock"].get("If", 0)
    assert traced["skip_step"]["IsFinite"] == REPLICAS
    assert traced["skip_step"]["If"] > traced["stock"].get("If", 0)


def test_the_step_loss_takes_no_variable(traced):
    # The metrics JSON's per-step loss is read from the value Keras's step hands its loss
    # tracker (`tfpar.metrics.report_step_loss`), not from a `Mean` of its own emptied,
    # updated and read every step (4 assignments and 4 reads a replica, 128 ops of the
    # 169 tfpar's MLP step had beyond stock's on 4 replicas): the step assigns and reads
    # no variable stock's does not; the finiteness counter's addition is the one write.
    for kind in ("AssignVariableOp", "ReadVariableOp"):
        assert traced["stop"].get(kind, 0) == traced["stock"].get(kind, 0), kind
    added = traced["stop"].get("AssignAddVariableOp", 0) - traced["stock"].get(
        "AssignAddVariableOp", 0)
    assert added == REPLICAS, added  # nonfinite_steps, on every replica's device


def test_a_nan_on_another_replica_still_stops_the_run(traced):
    # Replica 1's batch of step 1 holds the NaN; replica 0 sees it through the all-reduce.
    assert traced["nan_on_replica_1"].startswith(
        "gradients became non-finite at step 1 (on_nan=stop)"), traced["nan_on_replica_1"]


def test_one_pipeline_feeds_whole_steps_cut_by_tf_distribute(traced):
    # Stock Keras's input under MirroredStrategy: one batch a step, cut into the replicas'
    # shares by tf.distribute (`experimental_distribute_dataset`); fed replica by replica
    # (`distribute_datasets_from_function`) the MLP's step took ~6 % more CPU time
    # (docs/benchmarks/data_parallel.md). The replicas' batches are the same.
    for accum, examples in (("accum1", 16), ("accum2", 32)):
        got = traced["input"][accum]
        assert got["class"] == "DistributedDataset", got
        assert got["examples_per_replica"] == examples, got
        assert got["equal"], got
