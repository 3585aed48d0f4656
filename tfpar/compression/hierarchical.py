"""Hierarchical all-reduce: a sum reduced inside each host, all-reduced across hosts over one
replica per host (the host's leader), then handed back to every replica of the host.

A flat ring over the workers of several hosts crosses the slow link between hosts on every
hop of the ring that joins two hosts, each hop carrying `2 (n - 1) / n` of the buffer (1.5×
at 4 workers); the leaders' ring carries `2 (h - 1) / h` (1× at 2 hosts), and it takes
`2 (h - 1)` hops across the link instead of `2 (n - 1)` rounds gated by its slowest hop.
The steps inside a host use its own fast links.

Which workers share a host comes from `TF_CONFIG`'s addresses
(`tfpar.tf_config.ClusterInfo.hosts`: the same host name or IP before the port).
`--allreduce=auto` (the default) turns it on where it can help: several hosts, one of them
with several workers (`tfpar.compat.resolve_allreduce`). It carries every sum an
aggregator hands to `collectives.sum_all`: fp32 buckets (`--compression=none` across
workers), fp16/bf16 buckets, PowerSGD's and `auto`'s P and Q sums and uncompressed
vectors, top-k's union values, Adam-in-front's exact steps; all-gathers (int8, lowbit, threshold, top-k's
indices) stay on the flat ring.

Every step is a `CollectiveReduceV2`, in groups tfpar forms itself: one per host (its
replicas) and one of the leaders. A collective waits for the one before it that shares its
ordering token; each replica holds three, one for the reduces inside the host, one for the
step across and one for the hand-backs, so bucket k+1's reduce inside the host waits only
for bucket k's reduce inside and may run while bucket k crosses the link (with the
hand-back on the inside token, as first built, the buckets' sums ran one after another:
docs/benchmarks/compression_link.md measures both). TensorFlow 2.21's broadcast ops take no
ordering token (without one, two local replicas' collectives chain in program order and
deadlock), so the hand-back is an all-reduce inside the host of the leader's total and
zeros elsewhere: adding zeros rounds nothing, so every replica ends with the same bits,
and at two replicas a host it moves the bytes a broadcast would.
"""

import collections
import itertools

import tensorflow as tf

from tfpar import patches, tf_config

# The leaders' group; host h's group is `_GROUP_KEY + 1 + h`. Far from the keys tf.distribute
# hands out (they count up from 1) and from ZeRO's (`tfpar.zero.sharded`, 0x2E40).
_GROUP_KEY = 0x4E50
# Three instance keys per sum (inside, across, back). The k-th sum traced on local replica i
# takes the same keys on every replica and worker, as tf.distribute's own collectives do:
# every worker traces the same steps in the same order, and the replicas of one worker
# count separately (they trace one after another, yet meet in the same collectives).
_FIRST_INSTANCE = 0x4E500
_instances = collections.defaultdict(lambda: itertools.count(_FIRST_INSTANCE, 3))


class Hierarchy:
    """The collective groups of one worker's replicas and how each sums.

    Args:
        hosts: training processes per host (`ClusterInfo.hosts`).
        worker_index: this process's index among them.
        local_replicas: replicas (devices) each worker holds.
        tokens: per local replica's device three resources, the ordering tokens of its
            reduces inside the host, of those across hosts and of its hand-backs.
    """

    def __init__(self, hosts, worker_index, local_replicas, tokens):
        self.host = next(h for h, members in enumerate(hosts) if worker_index in members)
        self.num_hosts = len(hosts)
        self.host_replicas = len(hosts[self.host]) * local_replicas
        self.leader_worker = hosts[self.host][0] == worker_index
        self.tokens = tokens
        self.traced = 0  # sums traced through this hierarchy (Python-side)

    def sum(self, flat, timeout_s=None):
        """The sum of `flat` over every replica of every host (call in replica context)."""
        self.traced += 1
        replica = patches.replica_index() or 0
        key = next(_instances[replica])
        inside_token, across_token, back_token = self.tokens[replica]
        inside = _GROUP_KEY + 1 + self.host

        def reduce(x, size, group, instance, token):
            if size == 1:
                return x
            return tf.raw_ops.CollectiveReduceV2(
                input=x, group_size=size, group_key=group, instance_key=instance,
                ordering_token=[token.handle], merge_op="Add", final_op="Id",
                timeout_seconds=timeout_s or 0)

        host_total = reduce(flat, self.host_replicas, inside, key, inside_token)
        if self.leader_worker and replica == 0:
            mine = reduce(host_total, self.num_hosts, _GROUP_KEY, key + 1, across_token)
        else:
            mine = tf.zeros_like(host_total)
        return reduce(mine, self.host_replicas, inside, key + 2, back_token)


def for_strategy(strategy, allreduce, cluster=None):
    """The `Hierarchy` an aggregator under `strategy` sums through, or None for the flat ring.

    Call in cross-replica context under `strategy`'s scope (an aggregator's `build`).

    Args:
        strategy: the `tf.distribute` strategy.
        allreduce: "flat" or "hierarchical" (`tfpar.compat.resolve_allreduce`'s answer).
        cluster: the parsed `TF_CONFIG` (default: read from the environment).
    """
    cluster = tf_config.load() if cluster is None else cluster
    # The rulebook refuses "hierarchical" where it cannot run (`tfpar.compat`'s `allreduce`
    # rows); a caller outside the trainer keeps the flat ring there.
    if (allreduce != "hierarchical" or cluster is None or cluster.worker_index is None
            or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)):
        return None
    devices = strategy.extended.worker_devices
    tokens = []
    with tf.init_scope():
        for device in devices:
            with tf.device(device):
                tokens.append(tuple(patches.plain_variable(0.) for _ in range(3)))
    return Hierarchy(cluster.hosts, cluster.worker_index, len(devices), tokens)
