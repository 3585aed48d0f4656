"""The collectives aggregators use, on `tf.distribute`'s replica context.

Everything here is called in replica context and works unchanged under `MirroredStrategy`
(which routes collectives through `merge_call`) and `MultiWorkerMirroredStrategy` (which
issues them directly).

An aggregator hands its collectives a `Route`: the `CommunicationOptions` and, across hosts,
the `tfpar.compression.hierarchical.Hierarchy` its sums go through (`sum_all`); gathers
stay on tf.distribute's flat ring.
"""

import collections

import tensorflow as tf

# What an aggregator's collectives take: `options` (`CommunicationOptions`) and `hierarchy`
# (a `hierarchical.Hierarchy`, or None for tf.distribute's flat ring).
Route = collections.namedtuple("Route", ["options", "hierarchy"])


def options(timeout_s=None):
    """`CommunicationOptions` for one already-fused buffer: no further packing by TF, and a
    timeout so a dead peer becomes an error instead of a hang."""
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=0, timeout_seconds=timeout_s)


def replica_context():
    """The current replica context; raises if called in cross-replica context.

    Raises:
        RuntimeError: called outside `strategy.run` / the optimizer's apply.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("gradient aggregators run in replica context: call them from "
                           "inside strategy.run(...) or the optimizer's apply_gradients")
    return ctx


def nbytes(tensor):
    """Bytes of `tensor`: a Python int when its shape is static, else an int64 tensor."""
    size = tensor.shape.num_elements()
    if size is None:
        size = tf.size(tensor, out_type=tf.int64)
    return size * tensor.dtype.size


def sum_all(flat, opts):
    """Sum of `flat` over all replicas (every replica gets the same result).

    Args:
        flat: this replica's tensor.
        opts: `CommunicationOptions`, or a `Route` (with a hierarchy: summed inside each
            host, across hosts, back).

    Returns:
        `(sum, bytes of the message this replica sums)` (with a hierarchy too: the same
        count as the flat ring's, so the compression ratio keeps its meaning).
    """
    ctx = replica_context()
    if isinstance(opts, Route) and opts.hierarchy is not None:
        return opts.hierarchy.sum(flat, opts.options.timeout_seconds), nbytes(flat)
    opts = opts.options if isinstance(opts, Route) else opts
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, flat, options=opts), nbytes(flat)


def gather_rows(flat, opts):
    """Every replica's 1-D `flat` stacked (lengths must agree); `opts` as `sum_all`'s (a
    gather always takes tf.distribute's flat ring).

    Returns:
        `([replicas, len] tensor, bytes this replica handed to the collective)`.
    """
    ctx = replica_context()
    opts = opts.options if isinstance(opts, Route) else opts
    gathered = ctx.all_gather(flat, axis=0, options=opts)
    return tf.reshape(gathered, [ctx.num_replicas_in_sync, -1]), nbytes(flat)


def replica_cond(pred, true_fn, false_fn, args):
    """`tf.cond` whose branches may run collectives, called in replica context.

    `MirroredStrategy` cannot run a collective (a `merge_call`) inside a `tf.cond` built in
    replica context, so there the condition is moved to cross-replica context and each
    branch re-enters the replicas, as Keras's LossScaleOptimizer does. Where the strategy
    needs no merge call (MultiWorkerMirroredStrategy) it is a plain `tf.cond`.

    Args:
        pred: boolean scalar, equal on all replicas.
        true_fn, false_fn: `(*args) -> nested tensors` of the same structure; they must
            take every per-replica input through `args`, not through closures (under
            MirroredStrategy a closure would only see the first replica's tensors).
        args: tuple of (nested) per-replica tensors.

    Returns:
        This replica's result of the chosen branch.
    """
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        return tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))

    def merge_fn(strategy, pred, *args):
        pred = strategy.experimental_local_results(pred)[0]
        return tf.cond(pred,
                       lambda: strategy.extended.call_for_each_replica(true_fn, args),
                       lambda: strategy.extended.call_for_each_replica(false_fn, args))

    return replica_context().merge_call(merge_fn, args=(pred, *args))
