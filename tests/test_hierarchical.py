"""The hierarchical all-reduce (`tfpar.compression.hierarchical`) against the flat ring.

Four workers (two logical CPUs each) on localhost whose `TF_CONFIG` addresses name two
hosts (127.0.0.1 and 127.0.0.2, both loopback), and three (two hosts of 2 and 1 workers,
the leader's path): the groups tfpar forms from them are real TensorFlow collective
groups, only the link between the "hosts" is not slow (the measured speed-up is
`tools/bench_hierarchical.py`'s, on network namespaces). The rulebook's rows and the
choice of `--allreduce=auto` are checked without TensorFlow.
"""

import json
import os
import sys

import pytest

from subproc import ROOT, run_tf_config_workers
from tfpar import ParallelConfig, compat, tf_config
from tfpar.errors import ConfigError

CHILD = os.path.join(ROOT, "tests", "hierarchical_child.py")
# fp32: each sum's order differs ((a+b)+(c+d) against the ring's), a rounding per sum of
# about 1e-7 of the gradient; over 3 SGD steps at lr 0.1 well under 1e-6. fp16 sums in
# fp16 (a rounding of ~1e-3 of the gradient: 1e-4 on the weights); PowerSGD the same fp32
# rounding through its orthogonalisation. Each is checked against the weights' own change.
# Measured on 2026-12-05: 1.5e-8 (fp32), 1.8e-5 (fp16), 1.5e-8 and 3.0e-8 in two runs
# (PowerSGD rank 2). bf16 sums in bf16, 8 bits of significand against fp16's 11: measured
# 1.5e-4 on 2026-12-06 (reduce-scatter path; fp32 1.5e-8, fp16 1.8e-5, PowerSGD 2.2e-8).
TOLERANCE = {"none": 1e-6, "fp16": 1e-4, "bf16": 5e-4, "powersgd": 1e-6}


def two_host_cluster(ports):
    return [f"127.0.0.{1 + i // 2}:{p}" for i, p in enumerate(ports)]


@pytest.fixture(scope="module")
def workers():
    # Two logical CPUs a worker: each host's group holds 4 replicas, 2 of each worker, the
    # case where a worker's replicas must not chain their collectives (ordering tokens),
    # and where the local index of a replica is its worker's place, then its device.
    return run_tf_config_workers(
        lambda i: [sys.executable, CHILD, json.dumps({"cpu_devices": 2})], n=4, timeout=400,
        addresses=two_host_cluster)


@pytest.fixture(scope="module")
def unequal_workers():
    # Workers 0-1 on one host, 2 alone on the other: the leader's path.
    return run_tf_config_workers(
        lambda i: [sys.executable, CHILD, json.dumps({"cases": ["none", "fp16"]})], n=3,
        timeout=400, addresses=two_host_cluster)


def check_against_flat_ring(workers, codec, path):
    for out in workers:
        case = out[codec]
        assert case["allreduce"] == {"hierarchical": path, "flat": "flat"}
        assert case["traced_sums"] > 0
        assert case["max_abs_diff"] <= TOLERANCE[codec], case
        assert case["max_step"] > 100 * TOLERANCE[codec], case  # the tolerance is tight
    # Every worker holds the same weights (each piece's ring hands its members the same
    # bits; the leader's hand-back adds zeros), else the replicas would drift apart unseen.
    assert len({out[codec]["weights_sum"] for out in workers}) == 1


@pytest.mark.parametrize("codec", sorted(TOLERANCE))
def test_weights_equal_the_flat_ring(workers, codec):
    check_against_flat_ring(workers, codec, "hierarchical")


def test_a_buffer_the_host_does_not_divide(workers):
    # Sums whose length is not a multiple of the host's 4 replicas (8 for bf16) were padded
    # and cut back, in the cases above that hold the flat ring's weights.
    for codec in TOLERANCE:
        assert {out[codec]["padded_sums"] > 0 for out in workers} == {True}, codec


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_unequal_hosts_sum_through_a_leader(unequal_workers, codec):
    check_against_flat_ring(unequal_workers, codec, "hierarchical_leader")


@pytest.mark.parametrize("which, replicas", [("workers", 8), ("unequal_workers", 3)])
def test_a_sum_of_a_length_known_when_it_runs(request, which, replicas):
    # As `auto`'s sums past its exact start: 13 entries (padded to 16 on the 4-replica
    # hosts), each replica's own small integers, so the sum is exact both ways.
    for out in request.getfixturevalue(which):
        for dtype, case in out["dynamic"].items():
            assert case["lengths"] == [13], (dtype, case)
            assert case["max_abs_diff"] == 0, (dtype, case)
            assert case["ring_total"] == replicas * 78 + 13 * replicas * (replicas - 1) // 2


def test_auto_picks_hierarchical_on_two_hosts(workers):
    assert [out["auto"] for out in workers] == ["hierarchical"] * 4


def cluster(addresses, index=0):
    return tf_config.parse(tf_config.make(addresses, index))


def test_hosts_from_addresses():
    k = cluster(["a:1", "b:2", "a:3", "[::1]:4", "[::1]:5"])
    assert k.hosts == [[0, 2], [1], [3, 4]]


def test_which_path_each_cluster_takes():
    # The pieces need equal hosts and ranks that follow the local index (not known for
    # several GPUs a worker); the leader's sums need neither. A direct call on one host
    # keeps the flat ring. (No collective runs: these are the paths' choices alone.)
    from tfpar.compression import hierarchical
    tokens = [(None, None, None)] * 2
    assert hierarchical.Hierarchy([[0, 1], [2, 3]], 0, 2, tokens).path == "hierarchical"
    assert hierarchical.Hierarchy([[0, 1], [2]], 0, 2, tokens).path == "hierarchical_leader"
    assert hierarchical.Hierarchy([[0, 1], [2, 3]], 0, 2, tokens,
                                  ranks_known=False).path == "hierarchical_leader"
    strategy = object()  # never reached: one host decides first
    assert hierarchical.for_strategy(strategy, "hierarchical",
                                     cluster(["localhost:1", "localhost:2"])) is None


def test_auto_and_the_rulebook():
    two = cluster(two_host_cluster([1, 2, 3, 4]))
    one_each = cluster(["127.0.0.1:1", "127.0.0.2:2"])
    one_host = cluster(["localhost:1", "localhost:2"])
    config = ParallelConfig(strategy="multi_worker")
    assert compat.resolve_allreduce(config, two) == "hierarchical"
    assert compat.resolve_allreduce(config, one_each) == "flat"
    assert compat.resolve_allreduce(config, one_host) == "flat"
    assert compat.resolve_allreduce(ParallelConfig(compression="int8"), two) == "flat"
    assert compat.resolve_allreduce(ParallelConfig(zero_stage=1), two) == "flat"
    # Nothing of theirs is summed: top-k without the union, Keras's own all-reduce.
    no_union = {"compression": "topk", "topk_union": False}
    keras_allreduce = {"compression": "none", "bucket_mb": 0}
    assert compat.resolve_allreduce(ParallelConfig(compression="topk"), two) == "hierarchical"
    for settings in (no_union, keras_allreduce):
        assert compat.resolve_allreduce(ParallelConfig(**settings), two) == "flat"
    wanted = ParallelConfig(strategy="multi_worker", allreduce="hierarchical")
    compat.check_inputs(wanted, two)
    for k in (one_each, one_host):
        with pytest.raises(ConfigError, match="allreduce='hierarchical' is invalid: TF_CONFIG "
                                              "puts its 2 workers on"):
            compat.check_inputs(wanted, k)
    for settings in ({"compression": "lowbit"}, {"zero_stage": 2},
                     {"offload": "optimizer", "optimizer": "adam"},
                     {"tensor_parallel": 2, "cpu_devices": 2}, {"keras": 2}, no_union,
                     keras_allreduce):
        with pytest.raises(ConfigError, match="allreduce='hierarchical' is invalid"):
            ParallelConfig(allreduce="hierarchical", **settings)
