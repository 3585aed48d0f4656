"""`measure_comm_fraction`: the share of a training step spent aggregating gradients, and
how much of the aggregation hides behind the backward pass.

Three traced steps on the same batch: forward + backward alone (`compute`), forward +
backward + the aggregation the model's optimizer really uses (`step`: its tfpar aggregator,
encoding, collectives, decoding; or the plain all-reduce Keras does without one), and the
aggregation alone on gradients computed once (`aggregate`). The share is
`1 - compute / step`: what the collectives manage to overlap with the backward pass inside
the traced step does not count, which is the point. The overlap is the part of the
aggregation that did not lengthen the step, `(compute + aggregate - step) / aggregate`:
0 when the collectives wait for the whole backward pass (one bucket, or no spare core to
run them on), 1 when all of them hide behind it.

Both are medians of timed steps, so noise can push them a little past 0 or 1. The returned
share and `overlap_fraction` are clamped to [0, 1] (the metrics JSON's meaning); the
unclamped values are returned too (`comm_fraction_unclamped`,
`overlap_fraction_unclamped`), and are what tests assert on.

The measurement runs on a scratch copy of the aggregator, so the run's residuals, PowerSGD
Q and step counter are left unchanged (`tests/test_compression_timing.py` compares them
before and after with `array_equal`). The copy times the path the run has reached: past
PowerSGD's plain start, top-k's density warm-up and Adam's exact warm-up (with the run's
Adam moments), and for `auto` at the run's current ranks, with no rank decided while it is
timed (`tests/test_compression_timing.py`: the copy's bytes are the run's). Under
`MultiWorkerMirroredStrategy` every worker must call it (the collectives are collective).
"""

import time

import numpy as np
import tensorflow as tf

from tfpar.compression.keras_hook import aggregator_of


def _scratch_copy(aggregator, variables):
    """A copy of `aggregator` that runs the path the run has reached (call under the
    strategy's scope, in cross-replica context)."""
    settings = aggregator.get_config()
    # Measure the steady compressed path, not PowerSGD's plain start or top-k's denser
    # warm-up (the scratch copy starts at step 0).
    if "start_step" in settings:
        settings["start_step"] = 0
    if "warmup_steps" in settings:
        settings["warmup_steps"] = 0
    if "window" in settings:  # auto: no rank decision between the timed calls
        settings["window"] = 1 << 30
    copy = type(aggregator)(**settings)
    copy.allreduce = aggregator.allreduce  # the run's route across hosts
    copy.build(variables)
    if aggregator.built:  # else the run took no step: nothing reached yet
        # Past Adam's exact warm-up (else every timed call is an fp32 all-reduce), and for
        # `auto` at the run's ranks.
        copy._take_path_of(aggregator)
    return copy


def measure_comm_fraction(strategy, model, dataset, steps=5):
    """Share of a step spent aggregating gradients (0 = none, 1 = all of it).

    Args:
        strategy: the `tf.distribute` strategy the model was built under.
        model: a compiled Keras model (its optimizer's aggregator, if any, is measured).
        dataset: the distributed dataset `fit` trains on; one batch is taken from it.
        steps: timed calls of each step (alternating, after one warm-up call each); the
            medians are compared.

    Returns:
        `(fraction, {"step_ms", "compute_ms", "aggregate_ms", "overlap_fraction",
        "comm_fraction_unclamped", "overlap_fraction_unclamped"})`: `fraction` and
        `overlap_fraction` clamped to [0, 1], the `_unclamped` ones as measured. A fraction
        of 0.0 and `{}` with one replica, where nothing is communicated.
    """
    if strategy.num_replicas_in_sync == 1:
        return 0.0, {}
    variables = [v.value if hasattr(v, "value") and not isinstance(v, tf.Variable) else v
                 for v in model.trainable_variables]
    aggregator = aggregator_of(model.optimizer)
    if aggregator is not None:
        with strategy.scope():
            aggregator = _scratch_copy(aggregator, variables)
    batch = next(iter(dataset))

    def gradients(batch):
        x, y = batch[0], batch[1]
        weight = batch[2] if len(batch) > 2 else None
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True),
                                      sample_weight=weight)
        return tape.gradient(loss, variables)

    def aggregate(grads):
        if aggregator is None:
            return tf.distribute.get_replica_context().all_reduce("SUM", grads)
        return aggregator.all_reduce_sum(grads, variables)

    def checksum(grads):
        # Depend on every gradient, so nothing is pruned from the traced step.
        return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])

    steps_of = {
        "compute": lambda b: checksum(gradients(b)),
        "step": lambda b: checksum(aggregate(gradients(b))),
        # (The identity places the fixed gradients on this replica's device, as the
        # collectives need.)
        "aggregate": lambda g: checksum(aggregate([None if t is None else tf.identity(t)
                                                   for t in g])),
    }
    fns = {name: tf.function(lambda arg, fn=fn: strategy.run(fn, args=(arg,)))
           for name, fn in steps_of.items()}
    # Fixed gradients for "aggregate", kept per replica (each replica sends its own).
    grads = tf.function(lambda b: strategy.run(gradients, args=(b,)))(batch)
    seconds = {name: [] for name in fns}
    for i in range(steps + 1):  # alternating, so a noisy machine slows all alike
        for name, fn in fns.items():
            began = time.perf_counter()
            strategy.experimental_local_results(
                fn(grads if name == "aggregate" else batch))[0].numpy()
            if i:  # the first call traces
                seconds[name].append(time.perf_counter() - began)
    compute, step, alone = (float(np.median(seconds[n]))
                            for n in ("compute", "step", "aggregate"))
    fraction = 1 - compute / step
    overlap = (compute + alone - step) / alone
    return min(1.0, max(0.0, fraction)), {
        "step_ms": 1000 * step, "compute_ms": 1000 * compute, "aggregate_ms": 1000 * alone,
        "overlap_fraction": min(1.0, max(0.0, overlap)),
        "comm_fraction_unclamped": fraction, "overlap_fraction_unclamped": overlap}
