"""Hierarchical all-reduce, Horovod's design: each sum reduce-scattered inside each host,
its pieces all-reduced across hosts (one ring per piece, among the replicas holding it),
and all-gathered inside the host.

A flat ring over the workers of several hosts crosses the slow link between hosts on every
hop of the ring that joins two hosts, each hop carrying `2 (n - 1) / n` of the buffer (1.5×
at 4 workers); the rings across hosts carry `2 (h - 1) / h` of it between them (1× at 2
hosts), and take `2 (h - 1)` hops across the link instead of `2 (n - 1)` rounds gated by
its slowest hop. The steps inside a host use its own fast links.

Two paths, by the hosts' shapes (`Hierarchy.path`, the metrics JSON's `comm.allreduce`):

- "hierarchical" (every host holds the same number `L` of replicas: workers × their local
  devices; Horovod's `NCCLHierarchicalAllreduce` on a homogeneous cluster): the buffer,
  padded with zeros to a multiple of `L` (for bf16 of `2 L`, see below), is
  reduce-scattered inside the host, so its replica of local index `r` holds piece `r` of
  the host's sum; piece `r` is all-reduced across hosts among the replicas of local index
  `r` (`L` rings side by side, each `1 / L` of the buffer: the same bytes across as one
  leader's ring, spread over `L` workers and `L` connections); the pieces are all-gathered
  inside the host and the padding cut off. Each piece is summed on one replica of each
  host and its ring hands every member the same bits, so every replica ends with the same
  sum.
- "hierarchical_leader" (hosts of unequal replica counts; Horovod's non-homogeneous case
  also sends everything through one rank a host): the sum reduced inside each host, all-
  reduced across hosts over one replica per host (the host's first), and handed back: an
  all-reduce inside the host of the leader's total and zeros elsewhere (TensorFlow 2.21's
  broadcast ops take no ordering token; adding zeros rounds nothing, so every replica ends
  with the same bits).

TensorFlow 2.21's `CollectiveReduceScatterV2` has no CPU implementation (probed across
processes: "CollectiveRegistry::Lookup did not find collective implementation"), so the
reduce-scatter is ZeRO's (`tfpar.zero.sharded.reduce_scatter`): `CollectiveAllToAllV2`
(rank `r` receives piece `r` of every member's buffer) and a local sum, a reduce-scatter's
traffic. `CollectiveGatherV2` takes no bfloat16, so a bf16 piece goes through it bitcast,
two entries to an int32 word. A group's ranks follow its devices' full names (task index,
then device: TensorFlow's collective parameter resolver sorts them so, for CPUs and for
one device a worker), which is the local index this module gives each replica: its
worker's place among the host's workers (by worker index), then its device. Several GPUs a
worker, which TensorFlow orders by their links (two hosts may differ), take the leader's
path; on GPUs each device's steps share one ordering token (NCCL runs a device's
collectives in launch order: bucket k+1's steps inside the host may not overtake bucket
k's ring across). Neither GPU case has run here (no GPU on the machine this was built on).

Which workers share a host comes from `TF_CONFIG`'s addresses
(`tfpar.tf_config.ClusterInfo.hosts`: the same host name or IP before the port).
`--allreduce=auto` (the default) turns it on where it can help: several hosts, one of them
with several workers (`tfpar.compat.resolve_allreduce`). It carries every sum an
aggregator hands to `collectives.sum_all`: fp32 buckets (`--compression=none` across
workers), fp16/bf16 buckets, PowerSGD's and `auto`'s P and Q sums and uncompressed
vectors (`auto`'s of a size known only when the step runs), top-k's union values,
Adam-in-front's exact steps; all-gathers (int8, lowbit, threshold, top-k's indices) stay
on the flat ring.

Every step is a collective in groups tfpar forms itself: one per host (its replicas), and
one per local index across hosts (the leaders' alone on the leader path). A collective
waits for the one before it that shares its ordering token; each replica holds three, one
for the steps inside the host before the crossing, one for the step across and one for the
steps back, so bucket k+1's reduce-scatter inside the host waits only for bucket k's and
may run while bucket k crosses the link (with the hand-back on the inside token, as first
built, the buckets' sums ran one after another: docs/benchmarks/compression_link.md
measures both).
"""

import collections
import itertools

import tensorflow as tf

from tfpar import patches, tf_config

# Host h's group is `_GROUP_KEY + 1 + h`; the ring across hosts of the replicas of local
# index r is `_ACROSS_KEY + r`, the leaders' `_GROUP_KEY`. Far from the keys tf.distribute
# hands out (they count up from 1) and from ZeRO's (`tfpar.zero.sharded`, 0x2E40).
_GROUP_KEY = 0x4E50
_ACROSS_KEY = _GROUP_KEY + 0x400
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
            steps inside the host before the crossing, of those across hosts and of its
            steps back.
    """

    def __init__(self, hosts, worker_index, local_replicas, tokens, ranks_known=True):
        self.host = next(h for h, members in enumerate(hosts) if worker_index in members)
        self.num_hosts = len(hosts)
        self.host_replicas = len(hosts[self.host]) * local_replicas
        # This worker's place among its host's workers: its replicas' first local index.
        self.first_local = sorted(hosts[self.host]).index(worker_index) * local_replicas
        self.leader_worker = self.first_local == 0
        # The pieces need equal hosts and ranks that follow the local index (`ranks_known`:
        # not for several GPUs a worker, which TensorFlow orders by their links); the
        # leader's sums need neither.
        self.path = ("hierarchical" if len({len(m) for m in hosts}) == 1 and ranks_known
                     else "hierarchical_leader")
        self.tokens = tokens
        self.traced = 0  # sums traced through this hierarchy (Python-side)
        self.padded = 0  # of them, sums whose length is not a multiple of the pieces'

    def sum(self, flat, timeout_s=None):
        """The sum of 1-D `flat` over every replica of every host (call in replica
        context)."""
        self.traced += 1
        replica = patches.replica_index() or 0
        key = next(_instances[replica])
        tokens = self.tokens[replica]
        if self.path == "hierarchical":
            total = self._sharded(flat, self.first_local + replica, key, tokens, timeout_s)
        else:
            total = self._leader(flat, replica, key, tokens, timeout_s)
        total.set_shape(flat.shape)
        return total

    def _sharded(self, flat, rank, key, tokens, timeout_s):
        # Reduce-scatter inside the host, piece `rank` across hosts, all-gather inside.
        inside_token, across_token, back_token = (t.handle for t in tokens)
        inside = _GROUP_KEY + 1 + self.host
        size = self.host_replicas
        timeout = timeout_s or 0
        # bf16 pieces are gathered as int32 words of two entries: an even piece length.
        multiple = size * (2 if flat.dtype == tf.bfloat16 else 1)
        n = flat.shape[0]
        if n is None:
            n = tf.shape(flat)[0]
            flat = tf.pad(flat, [[0, (multiple - n % multiple) % multiple]])
        elif n % multiple:
            self.padded += 1
            flat = tf.pad(flat, [[0, multiple - n % multiple]])
        if size > 1:
            pieces = tf.raw_ops.CollectiveAllToAllV2(
                input=tf.reshape(flat, [size, -1]), group_size=size, group_key=inside,
                instance_key=key, ordering_token=[inside_token], timeout_seconds=timeout)
            mine = tf.add_n(tf.unstack(pieces, size))
        else:
            mine = flat
        mine = tf.raw_ops.CollectiveReduceV2(
            input=mine, group_size=self.num_hosts, group_key=_ACROSS_KEY + rank,
            instance_key=key + 1, ordering_token=[across_token], merge_op="Add",
            final_op="Id", timeout_seconds=timeout)
        if size > 1:
            words = mine
            if mine.dtype == tf.bfloat16:
                words = tf.bitcast(tf.reshape(mine, [-1, 2]), tf.int32)
            whole = tf.raw_ops.CollectiveGatherV2(
                input=words, group_size=size, group_key=inside, instance_key=key + 2,
                ordering_token=[back_token], timeout_seconds=timeout)
            if mine.dtype == tf.bfloat16:
                whole = tf.reshape(tf.bitcast(whole, tf.bfloat16), [-1])
        else:
            whole = mine
        return whole[:n]

    def _leader(self, flat, replica, key, tokens, timeout_s):
        # Reduce inside the host, the leaders' ring across, the leader's total handed back.
        inside_token, across_token, back_token = tokens
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
    from tfpar import compat
    cluster = tf_config.load() if cluster is None else cluster
    # The rulebook refuses "hierarchical" where it cannot run (`tfpar.compat`'s `allreduce`
    # rows); a caller outside the trainer keeps the flat ring there (one host, or no host
    # with several workers, too).
    if (allreduce != "hierarchical" or cluster is None or cluster.worker_index is None
            or not compat.several_on_some_host(cluster)
            or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)):
        return None
    devices = strategy.extended.worker_devices
    # On GPUs TensorFlow runs a device's NCCL collectives on one stream in the order they
    # were launched: with a token per step, bucket k+1's all-to-all launched before
    # bucket k's ring across could wait on a peer that launched them the other way round.
    # One token a device there (the buckets' steps one after another); not run on a GPU.
    gpu = any(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices)
    tokens = []
    with tf.init_scope():
        for device in devices:
            with tf.device(device):
                own = [patches.plain_variable(0.) for _ in range(1 if gpu else 3)]
                tokens.append(tuple(own * 3)[:3])
    # Several GPUs a worker: TensorFlow orders a task's GPUs in a group by their links,
    # which two hosts may see differently, so ranks need not follow the local index the
    # pieces are paired by: those take the leader's path, whose sums need no order.
    return Hierarchy(cluster.hosts, cluster.worker_index, len(devices), tokens,
                     ranks_known=not (gpu and len(devices) > 1))
