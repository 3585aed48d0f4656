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

`hidden_fraction` does not subtract separately timed calls. A fourth traced step (the
`step` above) carries `tf.timestamp()` ops: one at its start, one that waits for every
gradient (backward's end), and per collective the aggregation hands to the link one that
waits for the collective's inputs and one that waits for the collective; every replica's
are gathered after the step (another call). From them `tfpar.overlap` takes when each
collective was busy (from when every replica could start it, and when the traced graph
makes it wait for the collective before, that one had ended, until the last replica has
its result) and the part of that busy time before the last replica's backward ended. The
timestamps wait for what they time and nothing waits for them: they are left out of
`tf.function`'s program-order chain of stateful ops (`tfpar.patches.run_independently`),
so no gradient or collective waits for one (`tests/test_overlap.py` walks the traced
graph). They are only in this timed step, never in a training step; only with one replica
a process (as across workers).

A collective counts as busy from when every worker had its inputs ready, and the runtime
may start it later (no thread free to launch it): the head's bucket could count as
crossing while it still waits. `runtime_steps` more timeline steps run under TensorFlow's
profiler, which records when each worker's executor started each collective op; busy from
the later worker's start, the share is `hidden_fraction_runtime`, beside the share from
inputs ready on the same profiled steps, and `launch_delay_ms` says how long after its
inputs each collective started. (Neither sees when the bytes move: gRPC's threads may
send later still.)
"""

import time

import numpy as np
import tensorflow as tf

from tfpar import patches
from tfpar.compression.keras_hook import aggregator_of
from tfpar.overlap import busy_intervals, hidden_share

# Collective ops that set up rather than communicate.
_SET_UP = ("CollectiveInitializeCommunicator", "CollectiveAssignGroupV2")


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


def _stamp(after):
    """`tf.timestamp()` once every op in `after` has run; no other op waits for it."""
    with tf.control_dependencies(after):
        seconds = tf.timestamp()
    patches.run_independently(seconds.op)
    return seconds


def _waits_for(op, earlier):
    """Whether graph op `op` waits for op `earlier` (through data or control edges)."""
    seen, stack = set(), [op]
    while stack:
        node = stack.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent is earlier:
                return True
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return False


def timeline_step(gradients, aggregate, collectives):
    """A replica function `batch -> (stamps, checksum)`: forward, backward and `aggregate`
    with the timestamps `tfpar.overlap.busy_intervals` reads (forward waits for the first;
    nothing waits for the others). Each trace appends the collectives it timed (graph ops,
    program order) to the list `collectives`."""
    def step(batch):
        start = _stamp([])
        # The step's one ordering: forward starts after the start's stamp (a root op, which
        # the executor may otherwise run at any point of the step).
        with tf.control_dependencies([start]):
            batch = tf.nest.map_structure(tf.identity, batch)
        grads = gradients(batch)
        backward_end = _stamp([t.op for t in tf.nest.flatten(grads, expand_composites=True)
                               if t is not None])
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        summed = aggregate(grads)
        found = [op for op in graph.get_operations()[before:]
                 if (op.type.startswith("Collective") and op.type not in _SET_UP)
                 or op.type.startswith("Nccl")]
        collectives.append(found)
        stamps = [start, backward_end]
        for op in found:
            # Ready: its data and control inputs (as known when traced) have run.
            stamps += [_stamp([t.op for t in op.inputs] + list(op.control_inputs)),
                       _stamp([op])]
        return tf.stack(stamps), _checksum(summed)
    return step


def _profiled_starts(run, ops, steps, stamps):
    """Runs `run()` (`steps` timeline steps, each appending its stamps' values to the list
    `stamps`) under TensorFlow's profiler; per step, per op of `ops` (the collectives,
    program order), when the executor started it, on `tf.timestamp`'s clock, NaN where the
    profiler reported no start inside that step (the profiler's clock has another origin:
    the offset is the median of each stamp's value minus the start of its own `Timestamp`
    op's event, paired in order of time from the last). None when it reported less than
    half the stamps."""
    from tfpar.pipeline.timeline import profiled_events
    events = profiled_events(run)
    # The stamps in order of time on either clock (each lies inside its op's event); from
    # the last, in case the profiler missed the first ones while it started.
    began = np.sort([b for name, b, _ in events if name.endswith(":Timestamp")])
    values = np.sort(np.concatenate(stamps))
    paired = min(len(began), len(values))
    if paired < len(values) / 2:
        return None
    offset = float(np.median(values[-paired:] - began[-paired:] / 1e6))
    starts = np.full((steps, len(ops)), np.nan)
    for k, op in enumerate(ops):
        # Host op events are named `name:Type`; a collective is async, its event starts
        # when the executor calls it: inside the step, before its end's stamp.
        for b in (b / 1e6 + offset for name, b, _ in events if name == f"{op.name}:{op.type}"):
            for i, step in enumerate(stamps):
                if step[0] <= b <= step[3 + 2 * k] + 1e-3:
                    starts[i, k] = b
    return starts


def _runtime_view(strategy, timeline_fn, gather, batch, ops, waits, steps):
    """`steps` timeline steps under the profiler: their hidden share with each collective
    busy from its inputs (`hidden_fraction`: its hidden time is an upper bound; the share
    usually is: a collective crossing after backward that starts later than its inputs
    shrinks the busy time, not the hidden time, so the runtime's share can come out
    higher) and from its start as the runtime saw it (`hidden_fraction_runtime`, the later
    worker's start), medians and
    `steps_hidden` (both, per step); per collective, how long after its inputs the later
    worker started it (`launch_delay_ms`, median over the steps) and the least such delay
    of any worker (`launch_delay_min_ms`: the clocks agree if it is not below 0). A step
    in which a worker's profiler reported no start of a collective is left out (on every
    worker: the gathered rows say so); None when no step is left."""
    results = []

    def run():
        for _ in range(steps):
            stamps, checksum = timeline_fn(batch)
            strategy.experimental_local_results(checksum)[0].numpy()
            results.append(strategy.experimental_local_results(stamps)[0].numpy())

    starts = _profiled_starts(run, ops, steps, results)
    if starts is None:  # still gather (the other workers do), as NaN: no view anywhere
        starts = np.full((steps, len(ops)), np.nan)
    bound, strict, delays, least = [], [], [], np.inf
    for stamps, began in zip(results, starts):
        strict_stamps, delay = stamps.copy(), np.zeros_like(stamps)
        # Busy from the collective's start, never before its inputs (a clock's rounding
        # must not loosen the bound).
        strict_stamps[2::2] = np.maximum(stamps[2::2], began)
        delay[2::2] = np.asarray(began) - stamps[2::2]
        rows = strategy.experimental_local_results(gather(
            tf.constant(np.stack([stamps, strict_stamps, delay]))))[0].numpy()
        if np.isnan(rows).any():  # a worker's profiler missed this step: left out
            continue
        bound.append(hidden_share(*busy_intervals(rows[:, 0], waits))[0])
        strict.append(hidden_share(*busy_intervals(rows[:, 1], waits))[0])
        later = rows[:, 1].max(axis=0)[2::2] - rows[:, 0].max(axis=0)[2::2]
        delays.append(1000 * later)
        least = min(least, 1000 * float(rows[:, 2, 2::2].min()))
    if not bound or any(h is None for h in bound + strict):
        return None
    return {"hidden_fraction": float(np.median(bound)),
            "hidden_fraction_runtime": float(np.median(strict)),
            "steps_hidden": [[round(b, 3), round(t, 3)] for b, t in zip(bound, strict)],
            "launch_delay_ms": [round(float(d), 2) for d in np.median(delays, axis=0)],
            "launch_delay_min_ms": round(least, 3)}


def _checksum(grads):
    # Depend on every gradient, so nothing is pruned from the traced step.
    return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])


def measure_comm_fraction(strategy, model, dataset, steps=5, runtime_steps=0,
                          after_timeline_step=None, timelines_per_step=1):
    """Share of a step spent aggregating gradients (0 = none, 1 = all of it).

    Args:
        strategy: the `tf.distribute` strategy the model was built under.
        model: a compiled Keras model (its optimizer's aggregator, if any, is measured).
        dataset: the distributed dataset `fit` trains on; one batch is taken from it.
        steps: timed calls of each step (alternating, after one warm-up call each); the
            medians are compared.
        runtime_steps: timeline steps to run after them under TensorFlow's profiler (0:
            none), for `runtime_view`.
        after_timeline_step: None, or a function called after each timed timeline step
            with its `(backward end, [(begin, end) per collective])` in seconds from the
            step's start (`tfpar.overlap.busy_intervals`: the same on every worker), before
            the next step runs (a benchmark re-shapes its link there).
        timelines_per_step: timeline steps run in a row at each timed step (more of the
            figures read from them, at less time than more timed steps of every kind).

    Returns:
        `(fraction, {"step_ms", "compute_ms", "aggregate_ms", "overlap_fraction",
        "comm_fraction_unclamped", "overlap_fraction_unclamped", "collectives",
        "hidden_fraction", "comm_busy_ms", "backward_end_ms", "timeline_ms"})`: `fraction`
        and `overlap_fraction` clamped to [0, 1], the `_unclamped` ones as measured; how
        many collectives a step runs; `hidden_fraction` (`tfpar.overlap.hidden_share`,
        the same on every worker), the collectives' busy time and backward's end from the
        step's start, medians over the timeline steps, and each step's `timeline_ms`
        (`{"backward_end": ms, "collectives": [[begin, end] ms, ...]}`); these four only
        when a step runs a collective and the process has one replica; each entry of
        `timeline_ms` also holds `start_skew`, how far apart the workers started the step, and
        `start_s`, when the first did (seconds, `tf.timestamp`'s clock).
        With `runtime_steps`, `runtime_view` (see `_runtime_view`; None when the profiler
        did not see the collectives) and its `hidden_fraction_runtime`.
        A fraction of 0.0 and `{}` with one replica, where nothing is communicated.
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

    collectives = []
    steps_of = {
        "compute": lambda b: _checksum(gradients(b)),
        "step": lambda b: _checksum(aggregate(gradients(b))),
        # (The identity places the fixed gradients on this replica's device, as the
        # collectives need.)
        "aggregate": lambda g: _checksum(aggregate([None if t is None else tf.identity(t)
                                                    for t in g])),
    }
    if len(strategy.extended.worker_devices) == 1:
        # One replica a process, as across workers (the replicas of one process are
        # traced in turns into one graph; their collectives could not be told apart).
        steps_of["timeline"] = timeline_step(gradients, aggregate, collectives)
    fns = {name: tf.function(lambda arg, fn=fn: strategy.run(fn, args=(arg,)))
           for name, fn in steps_of.items()}
    # Every replica's timestamps, gathered after the timed step (not inside it).
    gather = tf.function(lambda stamps: strategy.run(
        lambda s: tf.distribute.get_replica_context().all_gather(s[None], axis=0),
        args=(stamps,)))
    # Fixed gradients for "aggregate", kept per replica (each replica sends its own).
    grads = tf.function(lambda b: strategy.run(gradients, args=(b,)))(batch)
    seconds = {name: [] for name in fns}
    timeline, skews, waits = [], [], None
    for i in range(steps + 1):  # alternating, so a noisy machine slows all alike
        for name, fn in [(n, f) for n, f in fns.items()
                         for _ in range(timelines_per_step if n == "timeline" and i else 1)]:
            began = time.perf_counter()
            result = fn(grads if name == "aggregate" else batch)
            if name == "timeline":
                stamps, result = result
            strategy.experimental_local_results(result)[0].numpy()
            if i:  # the first call traces
                seconds[name].append(time.perf_counter() - began)
            if name == "timeline":
                if waits is None:  # the first replica's collectives, with their final edges
                    waits = [k > 0 and _waits_for(op, collectives[0][k - 1])
                             for k, op in enumerate(collectives[0])]
                if i and waits:
                    rows = strategy.experimental_local_results(gather(stamps))[0].numpy()
                    timeline.append(busy_intervals(rows, waits))
                    if after_timeline_step is not None:
                        after_timeline_step(*timeline[-1])
                    starts = rows.reshape(len(rows), -1)[:, 0]
                    skews.append((float(starts.min()), float(np.ptp(starts))))
    compute, step, alone = (float(np.median(seconds[n]))
                            for n in ("compute", "step", "aggregate"))
    fraction = 1 - compute / step
    overlap = (compute + alone - step) / alone
    times = {"step_ms": 1000 * step, "compute_ms": 1000 * compute, "aggregate_ms": 1000 * alone,
             "overlap_fraction": min(1.0, max(0.0, overlap)),
             "comm_fraction_unclamped": fraction, "overlap_fraction_unclamped": overlap,
             "collectives": len(collectives[0]) if collectives else 0}
    shares = [hidden_share(*t) for t in timeline]
    if shares and shares[0][0] is not None:
        times.update(hidden_fraction=float(np.median([h for h, _ in shares])),
                     comm_busy_ms=1000 * float(np.median([b for _, b in shares])),
                     backward_end_ms=1000 * float(np.median([e for e, _ in timeline])),
                     timeline_ms=[{"backward_end": round(1000 * e, 2),
                                   "collectives": [[round(1000 * b, 2), round(1000 * f, 2)]
                                                   for b, f in spans],
                                   "start_skew": round(1000 * skew, 2), "start_s": first}
                                  for (e, spans), (first, skew) in zip(timeline, skews)])
        if runtime_steps:
            view = _runtime_view(strategy, fns["timeline"], gather, batch, collectives[0],
                                 waits, runtime_steps)
            times["runtime_view"] = view
            if view is not None:
                times["hidden_fraction_runtime"] = view["hidden_fraction_runtime"]
    return min(1.0, max(0.0, fraction)), times
