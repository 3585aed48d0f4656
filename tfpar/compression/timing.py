"""`measure_comm_fraction`: the share of a training step spent aggregating gradients.

Two traced steps on the same batch: forward + backward alone, and forward + backward +
the aggregation the model's optimizer really uses (its tfpar aggregator: encoding,
collectives, decoding; or the plain all-reduce Keras does without one). The share is
`1 - compute / (compute + aggregation)`; what the collectives manage to overlap with the
backward pass inside the traced step does not count, which is the point.

The measurement runs on a scratch copy of the aggregator, so the run's residuals, PowerSGD
Q and step counter are untouched and training continues bit for bit. Under
`MultiWorkerMirroredStrategy` every worker must call it (the collectives are collective).
"""

import time

import numpy as np
import tensorflow as tf


def _scratch_copy(aggregator, variables):
    settings = aggregator.get_config()
    if "start_step" in settings:
        settings["start_step"] = 0  # measure the compressed path, not the plain warm-up
    copy = type(aggregator)(**settings)
    copy.build(variables)
    return copy


def _aggregator_of(optimizer):
    agg = getattr(optimizer, "tfpar_aggregator", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    return agg if agg is not None or inner is None else _aggregator_of(inner)


def measure_comm_fraction(strategy, model, dataset, steps=5):
    """Share of a step spent aggregating gradients (0 = none, 1 = all of it).

    Args:
        strategy: the `tf.distribute` strategy the model was built under.
        model: a compiled Keras model (its optimizer's aggregator, if any, is measured).
        dataset: the distributed dataset `fit` trains on; one batch is taken from it.
        steps: timed calls of each step (alternating, after one warm-up call each); the
            medians are compared.

    Returns:
        `(fraction, {"step_ms": ..., "compute_ms": ...})`; a fraction of 0.0 with one
        replica, where nothing is communicated.
    """
    if strategy.num_replicas_in_sync == 1:
        return 0.0, {}
    variables = [v.value if hasattr(v, "value") and not isinstance(v, tf.Variable) else v
                 for v in model.trainable_variables]
    aggregator = _aggregator_of(model.optimizer)
    if aggregator is not None:
        with strategy.scope():
            aggregator = _scratch_copy(aggregator, variables)
    batch = next(iter(dataset))

    def make(aggregate):
        def step(batch):
            x, y = batch[0], batch[1]
            weight = batch[2] if len(batch) > 2 else None
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True),
                                          sample_weight=weight)
            grads = tape.gradient(loss, variables)
            if aggregate:
                if aggregator is None:
                    grads = tf.distribute.get_replica_context().all_reduce("SUM", grads)
                else:
                    grads = aggregator.all_reduce_sum(grads, variables)
            # Depend on every gradient, so nothing is pruned from the traced step.
            return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])
        return tf.function(lambda b: strategy.run(step, args=(b,)))

    fns = {aggregate: make(aggregate) for aggregate in (False, True)}
    seconds = {False: [], True: []}
    for i in range(steps + 1):  # alternating, so a noisy machine slows both alike
        for aggregate, fn in fns.items():
            began = time.perf_counter()
            strategy.experimental_local_results(fn(batch))[0].numpy()
            if i:  # the first call traces
                seconds[aggregate].append(time.perf_counter() - began)
    compute, step = (float(np.median(seconds[a])) for a in (False, True))
    fraction = min(1.0, max(0.0, 1 - compute / step))
    return fraction, {"step_ms": 1000 * step, "compute_ms": 1000 * compute}
