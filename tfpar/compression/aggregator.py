"""`Aggregator`: what replaces the plain all-reduce of gradients.

An aggregator is called in replica context with this replica's gradients and returns their
SUM over replicas (Keras has already divided each by the number of replicas). It owns the
per-replica state its method needs — error-feedback residuals, PowerSGD's Q, a step
counter — as `tf.Variable`s created under the strategy scope, so a `tf.train.Checkpoint`
of the optimizer (which tracks `optimizer.tfpar_aggregator`) saves them. Residuals differ
per replica: they are checkpointed through `PerReplicaSlot`, which saves every replica's
own value (gathered from all workers) and gives each its own back on restore, so a resumed
run continues as the uninterrupted one would (tests/test_compression_resume.py: weights
within 1e-6 of the uninterrupted run, batch losses within rtol 1e-5).

Subclasses implement `_exchange_bucket` (one fused fp32 buffer) or `_exchange` (the whole
list); the base class does bucketing, error feedback and the byte count.
"""

import tensorflow as tf

from tfpar import patches
from tfpar.compression import adam_front, buckets, collectives, error_feedback, hierarchical

_ON_READ = tf.VariableSynchronization.ON_READ
# Steps of exact Adam before its second moment freezes (`Aggregator(adam_warmup_steps=)`).
ADAM_WARMUP_STEPS = 50
# After the warm-up, Adam's second moment `v`: "frozen" (1-bit Adam), "live" (updated every
# step from the summed gradient as compression delivered it) or "local" (each replica's own `v`
# moved by its own exact gradient; both `adam_compresses="gradient"`).
# "local_debiased": the same, but a replica's squared gradient carries `replicas` × the summed
# gradient's noise; it moves `v` by `replicas · g² + (1 − 1/replicas) · ĝ²` instead, with ĝ the
# momentum's estimate of the summed gradient (so pure noise counts once, a pure signal once).
ADAM_VARIANCE = ("frozen", "live", "local", "local_debiased")
_LOCAL = adam_front.LOCAL_VARIANCE


def check_count(name, value, zero_means):
    """Raises the one-line `ValueError` for an aggregator argument that must be an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 0 ({zero_means})")


def per_replica_variable(initial_value, name, aggregation):
    """A variable every replica keeps its own copy of (`ON_READ`), updated locally without
    communication. Reading it in cross-replica context aggregates with `aggregation`:
    MEAN for residuals, ONLY_FIRST_REPLICA for state that is identical on all replicas
    (which a plain checkpoint then restores exactly; residuals go through `PerReplicaSlot`).
    """
    return tf.Variable(initial_value, name=name, trainable=False, synchronization=_ON_READ,
                       aggregation=aggregation)


class PerReplicaSlot(patches.Trackable):
    """Checkpoints every replica's own value of an `ON_READ` variable.

    A plain checkpoint of an `ON_READ` variable saves the aggregate (the mean of the
    residuals) and restores it to every replica. This saves all replicas' values stacked
    `[replicas, ...]` in replica order (under `MultiWorkerMirroredStrategy` gathered from
    every worker, so the chief's checkpoint holds them all) and on restore gives each local
    replica its own row. Restored onto a different number of replicas, replica 0 gets the
    sum over the saved rows and the others zero, so the error still owed is kept exactly.

    Args:
        variable: the per-replica variable (a plain variable outside a strategy).
        average: on another world size give every replica the mean of the saved rows
            instead (for state that is an estimate, like Adam's moments, not a debt).
    """

    def __init__(self, variable, average=False):
        self._variable = variable
        self._average = average

    # TensorFlow's checkpoint protocol: registry entry `trackable_tensors` of tfpar.patches.
    def _serialize_to_tensors(self):
        return {"per_replica": _stack_replicas(self._variable)}

    def _restore_from_tensors(self, restored_tensors):
        return _restore_replicas(self._variable, restored_tensors["per_replica"],
                                 self._average)


def _local_components(variable):
    strategy = getattr(variable, "distribute_strategy", None)
    if strategy is None or not hasattr(variable, "values"):
        return None, [variable]
    return strategy, list(strategy.experimental_local_results(variable))


def local_values(variable):
    """This process's replicas' own variables of a per-replica `variable` (the variable
    itself outside a strategy)."""
    return _local_components(variable)[1]


def stack_replicas(variable):
    """Every replica's value of per-replica `variable`, stacked `[replicas, ...]` in replica
    order (under `MultiWorkerMirroredStrategy` gathered from every worker: a collective
    every worker must run)."""
    return _stack_replicas(variable)


def restore_replicas(variable, stacked, average=False):
    """Gives each local replica of `variable` its row of `stacked` (`[rows, ...]`); onto
    another replica count replica 0 takes the rows' sum and the others zero (`average`:
    every replica their mean). See `PerReplicaSlot`."""
    return _restore_replicas(variable, stacked, average)


def _stack_replicas(variable):
    strategy, local = _local_components(variable)
    if strategy is None or strategy.num_replicas_in_sync == len(local):
        return tf.stack([v.read_value() for v in local])
    n = len(local)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: local[ctx.replica_id_in_sync_group % n].read_value()[None])
    return strategy.gather(values, axis=0)


def _restore_replicas(variable, stacked, average=False):
    strategy, local = _local_components(variable)
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    # The global index of this process's first replica: under MultiWorkerMirroredStrategy
    # each task holds its own replicas; a client holding every replica (a pipeline across
    # workers, its stages on other tasks' devices) starts at 0.
    first = 0
    if replicas != len(local):
        first = (tf.DeviceSpec.from_string(local[0].device).task or 0) * len(local)
    saved = stacked.shape[0]
    if saved is not None:
        rows = _rows(stacked, int(saved) == replicas, first, len(local), average)
    else:  # restored in a tf.function (a checkpoint over several tasks): rows unknown
        rows = tf.cond(tf.equal(tf.shape(stacked)[0], replicas),
                       lambda: _rows(stacked, True, first, len(local), average),
                       lambda: _rows(stacked, False, first, len(local), average))
    ops = [v.assign(tf.reshape(tf.cast(r, v.dtype), v.shape)) for v, r in zip(local, rows)]
    return tf.group(ops) if not tf.executing_eagerly() else None


def _rows(stacked, same_replicas, first, local, average):
    """Each local replica's value from the saved rows `stacked`."""
    if same_replicas:
        return [stacked[first + j] for j in range(local)]
    if average:
        return [tf.reduce_mean(stacked, 0)] * local
    # Another world size: global replica 0 takes the whole sum and the others start at
    # zero. The sum over replicas is then exactly the saved sum (adding zeros rounds
    # nothing), where an even split (sum / replicas) rounds when the count is not a
    # power of two; either way the error still owed is sent within the next steps.
    total = tf.reduce_sum(stacked, 0)
    return [total if first == 0 and j == 0 else tf.zeros_like(total) for j in range(local)]


class Aggregator(tf.Module):
    """Base class: sums gradients over replicas, bucket by bucket, with error feedback.

    Args:
        bucket_mb: tensors are fused into buffers, a buffer closed once it holds this many
            MiB (fp32), one collective per buffer, last layers first (so the first
            buffers' collectives overlap the rest of backward).
        error_feedback: keep what compression drops and add it to the next step's gradient
            (ignored by lossless aggregators).
        timeout_s: timeout of each collective (None: wait forever).

    Examples:
        >>> agg = NoneAggregator()                                     # doctest: +SKIP
        >>> summed = strategy.run(lambda g: agg.all_reduce_sum(g, variables), args=(grads,))
    """

    lossy = False
    # Whether a checkpoint holds this aggregator's state (`tfpar.state.aggregators_of`).
    checkpointed = True
    # With Adam in front and its second moment frozen: "step" compresses each replica's Adam
    # step (momentum of its own gradient; top-k), "gradient" compresses the gradient scaled
    # by Adam's frozen denominator and takes the momentum of the sum (PowerSGD). Both are
    # exact when nothing is dropped; which suits which aggregator: docs/guides/compression.md.
    adam_compresses = "step"
    # With "step": after each compressed step every replica's momentum becomes the momentum
    # the summed step applied (`m = Σ sent · c1 · s`, the same on every replica), as DeepSpeed's
    # 1-bit Adam sets its momentum to the compressed all-reduce's result. Without it each
    # replica's own momentum kept pushing entries whose pending step the gradient had not
    # seen yet (it waits in the residual), which overshoots (docs/guides/compression.md).
    # Top-k turns it on at ratio >= 1 − β₁ (`TopKAggregator.adam_sync_momentum`).
    adam_sync_momentum = False
    # With "step" and `adam_sync_momentum`: the share of the synced momentum's continuation
    # (β₁ · m, identical on every replica) applied outside the compression.
    adam_momentum_carry = 0.0
    # `--allreduce` (`tfpar.compression.hierarchical`): how sums cross hosts, resolved in
    # `build` ("auto": hierarchical where TF_CONFIG puts several workers on some host).
    allreduce = "flat"
    hierarchy = None

    def __init__(self, bucket_mb=4.0, error_feedback=True, timeout_s=None, adam=None,
                 adam_warmup_steps=ADAM_WARMUP_STEPS, adam_variance="frozen",
                 adam_refresh_every=0, name=None):
        super().__init__(name=name or type(self).__name__)
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self.error_feedback = bool(error_feedback) and self.lossy
        self.timeout_s = timeout_s
        if adam is not None:
            adam = tuple(float(a) for a in adam)
            if len(adam) != 3 or not (0 <= adam[0] < 1 and 0 <= adam[1] < 1 and adam[2] > 0):
                raise ValueError(f"adam={adam!r} is invalid: need (beta_1, beta_2, epsilon) "
                                 "with betas in [0, 1) and epsilon > 0")
        check_count("adam_warmup_steps", adam_warmup_steps,
                    "0 = per-replica second moments, no warm-up")
        self.adam = adam
        self.adam_warmup_steps = adam_warmup_steps
        self.set_adam_variance(adam_variance, adam_refresh_every)
        self.built = False
        self.trace_count = 0  # Python-side: how many times the collective part was traced

    def set_adam_variance(self, variance="frozen", refresh_every=0):
        """How Adam's second moment `v` moves after the exact warm-up (Adam in front with
        `adam_warmup_steps` > 0; call before the first step).

        Args:
            variance: "frozen" (1-bit Adam: `v` and its bias correction stay as the warm-up
                left them), "live" (`v` takes the square of the summed gradient compression
                delivered, every step) or "local" (each replica moves its own `v` with its
                own exact gradient, `replicas` × its share, and compresses its gradient over
                its own denominator; the momentum is kept of the summed scaled gradients, so
                it and the weights stay the same on every replica; no extra bytes), or
                "local_debiased" (as "local", but `v` moves by `replicas · g² + (1 − 1 /
                replicas) · ĝ²`, ĝ the momentum's estimate of the summed gradient: a
                replica's own gradient carries `replicas` × the summed one's noise; the
                trainer's `--compression=auto` with Adam). "live" only where the gradient is
                compressed (`adam_compresses == "gradient"`); the local ones there and for
                top-k when its momentum is synced after every step (ratio >= 1 - beta_1).
            refresh_every: every this many steps after the warm-up one step is all-reduced
                exactly (fp32) and `v` takes the exact summed gradient, as 0/1 Adam's
                variance updates (Lu et al. 2022); a frozen `v` weighs it as the `K` steps
                since the last update (`v ← β₂ᴷ v + (1 − β₂ᴷ) g²`). 0 = never.
        """
        if variance not in ADAM_VARIANCE:
            raise ValueError(f"adam_variance={variance!r} is invalid: choose from "
                             f"{', '.join(ADAM_VARIANCE)}")
        if variance == "live" and self.adam_compresses != "gradient":
            raise ValueError(f"adam_variance={variance!r} is invalid for "
                             f"{type(self).__name__}: it compresses each replica's Adam step, "
                             "not the gradient; use 'frozen' (optionally with "
                             "adam_refresh_every), 'local' or 'local_debiased'")
        if variance in _LOCAL and not self._takes_local_variance():
            raise ValueError(f"adam_variance={variance!r} is invalid for "
                             f"{type(self).__name__} here: each replica's step over its own "
                             "v needs the momentum synced after every step (top-k at ratio "
                             ">= 1 - beta_1); use 'frozen'")
        check_count("adam_refresh_every", refresh_every, "0 = no exact refresh steps")
        if variance in _LOCAL and refresh_every:
            # A refresh would need the momentum back in the gradient's units, which
            # differ per replica once each divides by its own denominator.
            raise ValueError(f"adam_refresh_every={refresh_every!r} is invalid with "
                             f"adam_variance={variance!r} (each replica's v already moves "
                             "with its exact gradient): use 0, or adam_variance='frozen'")
        self.adam_variance = variance
        self.adam_refresh_every = refresh_every

    def _takes_local_variance(self):
        """Whether each replica can move its own `v` ("local", "local_debiased"): where the
        gradient is compressed, or the step with the momentum synced (kept in the scaled
        units, `m / s`, the same on every replica while their `s` differ)."""
        return self.adam_compresses == "gradient" or self.adam_sync_momentum

    # ---- state -------------------------------------------------------------------------
    def build(self, variables):
        """Creates the aggregator's state for `variables` (call in cross-replica context
        under the strategy scope; `all_reduce_sum` calls it lazily otherwise).

        Args:
            variables: the trainable variables whose gradients will be aggregated.
        """
        if self.built:
            return
        # A plain object, so tf.Module's tracking does not wrap (and try to save) the dict.
        self._layout = _Layout(variables)
        self._replicas = tf.distribute.get_strategy().num_replicas_in_sync  # for byte counts
        self.hierarchy = hierarchical.for_strategy(tf.distribute.get_strategy(), self.allreduce)
        with tf.init_scope():
            self.step = per_replica_variable(
                tf.constant(0, tf.int64), "step", tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.wire_bytes = per_replica_variable(
                tf.constant(self.static_wire_bytes(range(len(variables))), tf.int64),
                "wire_bytes", tf.VariableAggregation.ONLY_FIRST_REPLICA)
            residuals = {}
            if self.error_feedback:
                residuals = {
                    str(i): per_replica_variable(tf.zeros(self._layout.shapes[i]),
                                                 f"residual_{i}", tf.VariableAggregation.MEAN)
                    for i in self._lossy_positions()}
            # The variables themselves stay out of checkpoints (they would save the mean);
            # their slots save every replica's own value.
            self.residuals = patches.no_dependency(residuals)
            # On one replica nothing is compressed, so no step sends a debt loaded from more
            # replicas: `tfpar.state` sets this flag and the next applied step pays it
            # (`keras_hook.pay_debt`). A variable, read in the step: a flag traced into it
            # would miss a load after the first trace and pay zeros on every later step.
            self.debt_owed = patches.no_dependency(
                per_replica_variable(tf.constant(False), "debt_owed",
                                     tf.VariableAggregation.ONLY_FIRST_REPLICA)
                if residuals and self._replicas == 1 else None)
            self.residual_slots = {k: PerReplicaSlot(v) for k, v in residuals.items()}
            moments = {}
            if self.adam is not None:
                moments = {
                    f"{kind}_{i}": per_replica_variable(tf.zeros(shape), f"adam_{kind}_{i}",
                                                        tf.VariableAggregation.MEAN)
                    for i, shape in enumerate(self._layout.shapes) for kind in ("m", "v")}
            self.moments = patches.no_dependency(moments)
            self.moment_slots = {k: PerReplicaSlot(v, average=True)
                                 for k, v in moments.items()}
            self._build_state()
        self.built = True

    def _build_state(self):
        """Subclass hook: extra variables, created inside `tf.init_scope`."""

    # ---- state in checkpoints ------------------------------------------------------------
    # The kind its step counter is saved under (`auto` uses the mesh's name).
    step_kind = "step"

    @property
    def positions(self):
        """How many variables it was built for (0 before `build`)."""
        return len(self._layout.shapes) if self.built else 0

    def position_of(self, variable):
        """The position of `variable` (Keras's or TensorFlow's) among the variables it was
        built for, or None."""
        return self._layout.keys.get(_key(variable)) if self.built else None

    def named_state(self, paths):
        """The state a step reads, under the names a mesh's codecs use (`tfpar.state` saves
        them as `codec/<name>`): `<weight path>/<kind>`, counters of the whole aggregator
        under its first weight's path, as `{name: (variable, rows)}`.

        `rows`: "residual" for error feedback's residuals, one row per replica, each this
        replica's share of what the sum still owes (Keras divided its gradient by the
        replicas; a mesh's rows are in its own gradient's units instead: `tfpar.state`
        converts); "sum" for another per-replica debt (DGC's `dgc_velocity`): onto another
        replica count replica 0 takes the rows' sum; "mean" for a per-replica estimate
        (Adam's `adam_m`, `adam_v` in front of compression): every replica takes their mean
        there; None for what every replica holds alike (the `step` counter, `powersgd_q`,
        `auto`'s ranks and window sums). The last step's byte count is left out (each step
        sets it).

        Args:
            paths: `{position: weight path}` for every position (`positions`).
        """
        out = {f"{paths[0]}/{self.step_kind}": (self.step, None)}
        out.update({f"{paths[int(p)]}/residual": (v, "residual")
                    for p, v in self.residuals.items()})
        for key, variable in self.moments.items():  # "m_3": Adam's m of position 3
            kind, position = key.split("_")
            out[f"{paths[int(position)]}/adam_{kind}"] = (variable, "mean")
        out.update(self.own_named_state(paths))
        return out

    def own_named_state(self, paths):
        """Subclass hook: `named_state` of the variables `_build_state` made."""
        return {}

    def _lossy_positions(self):
        """Positions whose transmission is inexact (they get residuals)."""
        return range(len(self._layout.shapes))

    # ---- the collective part -----------------------------------------------------------
    def all_reduce_sum(self, grads, variables):
        """Sums `grads` over all replicas through this aggregator's compression.

        Call in replica context (inside `strategy.run` or an optimizer's apply).

        Args:
            grads: this replica's gradients (tensors or None), one per variable.
            variables: the variables they belong to (the same list on every step).

        Returns:
            list of the summed gradients, None where `grads` had None; identical on every
            replica.

        Raises:
            RuntimeError: called in cross-replica context.
        """
        ctx = collectives.replica_context()
        if not self.built:
            ctx.merge_call(lambda _: self.build(variables))
        self.trace_count += 1
        present = [i for i, g in enumerate(grads) if g is not None]
        positions = [self._layout.keys[_key(variables[i])] for i in present]
        # A dense gradient can reach here without its static shape (the transformer's on
        # MultiWorkerMirroredStrategy: `(None, 256)` for a `(64, 256)` kernel); the buckets
        # are planned from static shapes, which are its variable's.
        inputs = [tf.cast(grads[i], tf.float32) for i in present]
        inputs = [x if isinstance(x, tf.IndexedSlices) or x.shape.is_fully_defined()
                  else tf.ensure_shape(x, variables[i].shape) for i, x in zip(present, inputs)]
        if self.adam is None:
            summed, nbytes = self._compress_and_exchange(inputs, positions)
        elif not self.adam_warmup_steps:
            summed, nbytes = self._compress_and_exchange(
                self._adam_updates(inputs, positions), positions)
        else:
            summed, nbytes = self._frozen_variance_adam(inputs, positions)
        self.wire_bytes.assign(tf.cast(nbytes, tf.int64))
        self.step.assign_add(1)
        out = list(grads)
        for i, s in zip(present, summed):
            out[i] = tf.cast(s, grads[i].dtype)
        return out

    # Whether `on_exact_step` is called on exact steps (a subclass that plans from them).
    observes_exact = False

    def on_exact_step(self, summed, positions):
        """Subclass hook, on an exact step: `summed`, the values compression will carry
        once it starts (the summed gradients, over Adam's denominator with Adam in front),
        identical on every replica; no bytes are sent for it."""

    def _take_path_of(self, source):
        """Moves this fresh copy of `source` (built for the same variables, cross-replica
        context) to the path `source` has reached, for the comm timing's scratch copy: past
        Adam's exact warm-up, with `source`'s moments."""
        if self.adam is not None and self.adam_warmup_steps:
            self.step.assign(self.adam_warmup_steps)
            for key, var in self.moments.items():
                var.assign(source.moments[key].read_value())

    def _compression_start(self):
        """The first step that compresses (after Adam's exact warm-up, if any)."""
        return self.adam_warmup_steps if self.adam is not None else 0

    def _compress_and_exchange(self, inputs, positions):
        """Error feedback around `_exchange`: returns `(summed, wire_bytes)`."""
        inputs = self._before_compress(inputs, positions)
        residuals = [self.residuals.get(str(p)) for p in positions]
        xs = [error_feedback.corrected(x, r) for x, r in zip(inputs, residuals)]
        summed, local, nbytes = self._exchange(xs, positions)
        for x, r, sent in zip(xs, residuals, local):
            if r is not None:
                r.assign(error_feedback.next_residual(x, sent))
        self._after_compress(inputs, local, positions)
        return summed, nbytes

    def _frozen_variance_adam(self, grads, positions):
        """Adam in front of compression (1-bit Adam and its variants of `v`): the summed
        steps and the wire bytes, by `tfpar.compression.adam_front`."""
        return adam_front.AdamFrontStep(self, positions).run(grads)

    def rescale_residual(self, position, old_scale, new_scale):
        """Error feedback holds `gradient / scale`: when Adam's denominator moves, the
        gradient still owed stays the same (`r · old / new`)."""
        r = self.residuals[str(position)]
        r.assign(r * (old_scale / new_scale))

    def _adam_updates(self, grads, positions):
        """Adam moved in front of compression: each replica keeps Adam's moments of its own
        gradient and compresses its Adam step `m̂ / (√v̂ + ε) / replicas`; the optimizer
        then applies the summed steps linearly (`wrap_optimizer`).

        Compressing gradients that Adam then normalises fails: error feedback turns a
        coordinate's steady gradient `g` into a spike `T·g` every `T` steps, whose mean is
        `g` but whose root mean square is `√T·g`, so Adam moves that coordinate at `1/√T` of
        its speed. Compressing Adam's step instead keeps error
        feedback's guarantee on what is applied: every step Adam computed is applied, late.
        """
        beta_1, beta_2, eps = self.adam
        replicas = collectives.replica_context().num_replicas_in_sync
        t = tf.cast(self.step + 1, tf.float32)
        c1 = 1 - tf.pow(beta_1, t)
        c2 = 1 - tf.pow(beta_2, t)
        out = []
        for g, p in zip(grads, positions):
            # This replica's own gradient (Keras divided it); embeddings' IndexedSlices dense.
            g = tf.convert_to_tensor(g) * replicas
            m, v = self.moments[f"m_{p}"], self.moments[f"v_{p}"]
            m_new = m + (g - m) * (1 - beta_1)
            v_new = v + (tf.square(g) - v) * (1 - beta_2)
            m.assign(m_new)
            v.assign(v_new)
            # Keras's own form of the bias correction (ε added to the uncorrected √v).
            out.append(m_new * (tf.sqrt(c2) / c1) / (tf.sqrt(v_new) + eps) / replicas)
        return out

    def _before_compress(self, xs, positions):
        """Subclass hook: what to compress instead of this replica's fp32 gradients `xs`
        (before error feedback adds the residuals)."""
        return xs

    def _after_compress(self, inputs, local, positions):
        """Subclass hook: `inputs` (what `_before_compress` returned) plus the residuals
        were compressed, and this replica's own message decodes to `local`."""

    def _exchange(self, xs, positions):
        """Sums the corrected gradients `xs` (fp32) over replicas, bucket by bucket.

        Returns:
            `(summed, local, wire_bytes)`: the sums; what this replica's own message decodes
            to (for error feedback); bytes this replica handed to collectives.
        """
        plan = buckets.plan_buckets([x.shape for x in xs], self.bucket_bytes)
        summed, local, nbytes = [None] * len(xs), [None] * len(xs), 0
        for bucket in plan:
            s, loc, b = self._exchange_bucket(buckets.pack(xs, bucket), bucket)
            summed_parts = buckets.unpack(s, bucket)
            local_parts = buckets.unpack(loc, bucket) if loc is not None else {}
            for j in bucket.positions:
                summed[j] = summed_parts[j]
                local[j] = local_parts.get(j, xs[j])
            nbytes += b
        return summed, local, nbytes

    def _exchange_bucket(self, flat, bucket):
        """Sums one fused fp32 buffer (laid out as `bucket`) over replicas.

        Returns:
            `(summed, local_decoded or None if exact, wire_bytes)`.
        """
        raise NotImplementedError

    # ---- bytes on the wire -------------------------------------------------------------
    def static_wire_bytes(self, positions):
        """Bytes per step handed to collectives for these variable positions, from shapes
        (subclasses with data-dependent sizes return an estimate)."""
        shapes = [self._layout.shapes[p] for p in positions]
        plan = buckets.plan_buckets(shapes, self.bucket_bytes)
        return sum(self._bucket_wire_bytes(b) for b in plan)

    def _bucket_wire_bytes(self, bucket):
        """Bytes handed to collectives for one `buckets.Bucket`."""
        raise NotImplementedError

    def comm_stats(self):
        """Bytes this replica hands to collectives per step, as measured on the last step
        (before any step: from shapes), against the plain all-reduce of the gradients.

        Returns:
            `{"bytes_on_wire_per_step": int, "bytes_uncompressed_per_step": int,
            "compression_ratio": float, "allreduce": "flat" | "hierarchical" |
            "hierarchical_leader"}` (ratio = uncompressed / on the wire: 2.0 for fp16; how
            its sums crossed hosts, `tfpar.compression.hierarchical`'s paths).

        Raises:
            RuntimeError: before `build`.
        """
        if not self.built:
            raise RuntimeError(f"{type(self).__name__}.comm_stats() needs build() first")
        raw = sum(_numel(s) * n for s, n in zip(self._layout.shapes, self._layout.itemsizes))
        wire = int(self.wire_bytes.numpy())
        return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": raw,
                "compression_ratio": raw / wire if wire else 1.0,
                "allreduce": (self.hierarchy.path if self.hierarchy is not None
                              and self.hierarchy.traced else "flat")}

    def get_config(self):
        """The constructor arguments (for logs and the metrics JSON)."""
        return {"bucket_mb": self.bucket_bytes / 2 ** 20, "error_feedback": self.error_feedback,
                "timeout_s": self.timeout_s, "adam": self.adam,
                "adam_warmup_steps": self.adam_warmup_steps,
                "adam_variance": self.adam_variance,
                "adam_refresh_every": self.adam_refresh_every}

    @property
    def collective_options(self):
        return collectives.Route(collectives.options(self.timeout_s), self.hierarchy)


class _Layout:
    """Static facts about the variables an aggregator was built for."""

    def __init__(self, variables):
        self.keys = {_key(v): i for i, v in enumerate(variables)}
        self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self.itemsizes = [tf.as_dtype(v.dtype).size for v in variables]


def _key(variable):
    # Keras hands over the tf.Variable behind each keras.Variable; under a strategy that is
    # the distributed container, the same object on every step.
    if not isinstance(variable, tf.Variable) and hasattr(variable, "value"):
        variable = variable.value
    return variable.ref()


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n
