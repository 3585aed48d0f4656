"""CPU offload of the optimizer state (`--offload=optimizer`), as ZeRO-Offload and FSDP's
`cpu_offload` do: the slots (SGD's momentum, Adam's m and v) live in host memory and the
update runs there; the devices keep the weights and compute forward and backward.

A step, after the backward pass:

1. device -> host: the summed gradient (one copy; with ZeRO each replica its own piece of
   the reduce-scatter), and for Adam with an embedding's `IndexedSlices` gradient its
   summed squared slices (what Keras adds into `v`, see `tfpar.zero.sharded._adam`). On
   one process's replicas (`MirroredStrategy`) this streams, as ZeRO-Offload does: each
   weight's gradient is summed on the first replica's device by itself and leaves for the
   host as soon as the backward pass has produced it, so the devices never hold every
   gradient summed at once, nor the buffers of Keras's all-reduce of the whole set
   (docs/benchmarks/memory.md measures what that saves). Across workers the whole set is
   all-reduced first;
2. on the host, in NumPy, the optimizer's own formulas in Keras's order of operations
   (`adam_step`, `momentum_step`), updating the host slots in place; the scalars they need
   (Adam's `alpha` from the step count) are computed on the device as Keras computes them;
3. host -> device: the step to add to the weights, which every replica applies to its copy
   (`assign_sub`/`assign_add`, Keras's own last operation), so the weights stay mirrored
   and equal those of the run without offload. Streamed, the steps come back one weight at
   a time, each applied before the next is asked for (no whole step tensor on a device).

The weights are not copied to the host and back: the host never holds a second copy that a
checkpoint restore or `set_weights` could leave stale. The bytes copied per step (`stats`)
are the gradient down and the step up, once per local replica.

What "host" means on a CPU-only machine: the logical CPUs the replicas run on share one
TensorFlow allocator (`tfpar.memory`), so a variable placed on another logical CPU would
still count against the same cap. The host state is therefore kept outside TensorFlow, in
NumPy arrays of the process (the Python heap): TensorFlow's allocator, whose peak
`tfpar.memory` reads and whose cap `TF_CPU_BFC_MEM_LIMIT_IN_MB` sets, plays the devices'
memory, the rest of the process the host's. This shows what leaves the devices and what
crosses per step; it cannot show the speed of a real PCIe link (both sides are the same
RAM here) nor pinned-memory effects.

Checkpoints name the host slots as Keras names a single optimizer's
(`optimizer/<weight path>/momentum`, `tfpar.state`), so a checkpoint moves between offloaded
and device-resident runs. Which settings combine with offload is the rulebook's
(`tfpar.compat`): data parallelism and ZeRO 1/2 on tf.distribute, momentum SGD or Adam.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from tfpar import nan_guard, patches
from tfpar.errors import ConfigError
from tfpar.zero import sharded

MODES = ("none", "optimizer", "optimizer+params")


def slot_names(optimizer):
    """The slots `optimizer` (Keras SGD or Adam) keeps per weight."""
    if isinstance(optimizer, keras.optimizers.Adam):
        return ("momentum", "velocity")
    return ("momentum",) if optimizer.momentum else ()


def adam_step(m, v, grad, square, alpha, beta_1, beta_2, epsilon):
    """Keras 3.15.1's `Adam.update_step` (amsgrad off) on NumPy float32 arrays: updates
    `m` and `v` in place and returns what to subtract from the weight. `square` is what
    goes into `v` (`grad ** 2`, or an `IndexedSlices` gradient's summed squared slices).
    The same float32 operations in the same order as Keras's, each rounded alike."""
    f32 = np.float32
    if square is None:
        square = np.square(grad)
    m += (grad - m) * f32(1 - beta_1)
    v += (square - v) * f32(1 - beta_2)
    return (m * f32(alpha)) / (np.sqrt(v) + f32(epsilon))


def momentum_step(m, grad, lr, momentum, nesterov):
    """Keras 3.15.1's `SGD.update_step` with momentum on NumPy float32 arrays: updates `m`
    in place and returns what to add to the weight."""
    f32 = np.float32
    m[...] = m * f32(momentum) - grad * f32(lr)
    if nesterov:
        return m * f32(momentum) - grad * f32(lr)
    return m.copy()


class HostSlots:
    """The slots in host memory: `arrays[slot][key]`, float32 NumPy arrays.

    Args:
        names: the slot names (`slot_names`).
        shapes: `{key: shape}` of each array (a weight's shape, or a ZeRO piece's `[S]`).
    """

    def __init__(self, names, shapes):
        self.names = tuple(names)
        self.arrays = {n: {k: np.zeros(s, np.float32) for k, s in shapes.items()}
                       for n in self.names}
        self.pending = {}  # a streamed step's gradients between its two phases

    @property
    def nbytes(self):
        return sum(a.nbytes for per_key in self.arrays.values() for a in per_key.values())

    def deposit(self, key, grad, square=None):
        """Phase 1 of a streamed step (`streamed_update`): keeps a copy of `key`'s summed
        gradient (and Adam's `square`; an empty array: the gradient's square) on the host
        until `update`, and returns its float32 sum (the step's finiteness check)."""
        self.pending[key] = (np.array(grad, np.float32, copy=True),
                             None if square is None or square.size == 0
                             else np.array(square, np.float32, copy=True))
        return np.asarray(np.sum(self.pending[key][0], dtype=np.float32), np.float32)

    def update(self, optimizer, key, skip, finite, scalar):
        """Phase 2: `key`'s host update from its deposited gradient; returns the step."""
        grad, square = self.pending.pop(key)
        return self.step(optimizer, [key], skip, finite, scalar, grad,
                         *([np.zeros([0], np.float32) if square is None else square]
                           if "velocity" in self.arrays else []))[0]

    def step(self, optimizer, keys, skip, finite, scalar, *tensors):
        """The host update of the arrays `keys` (NumPy in, NumPy out; run by
        `tf.numpy_function`): `tensors` are the gradients of `keys` then, for Adam, what
        goes into `v` of each (an empty array: the gradient's square). Returns the steps.
        With `skip` and a non-finite gradient the slots stay and every step is 0."""
        n = len(keys)
        grads, squares = tensors[:n], (tensors[n:] or [None] * n)
        if skip and not finite:
            return [np.zeros_like(g) for g in grads]
        # No lock: each call updates its own keys (ZeRO's replicas their own pieces, in
        # parallel where NumPy releases the GIL).
        out = []
        for key, grad, square in zip(keys, grads, squares):
            if square is not None and square.size == 0:
                square = None
            if "velocity" in self.arrays:
                out.append(adam_step(self.arrays["momentum"][key], self.arrays["velocity"][key],
                                     grad, square, scalar, optimizer.beta_1, optimizer.beta_2,
                                     optimizer.epsilon))
            else:
                out.append(momentum_step(self.arrays["momentum"][key], grad, scalar,
                                         optimizer.momentum, optimizer.nesterov))
        return [np.asarray(o, np.float32) for o in out]


def _key(variable):
    if not isinstance(variable, tf.Variable) and hasattr(variable, "value"):
        variable = variable.value
    return variable.ref()


def _scalar(optimizer, learning_rate):
    """Adam's `alpha` (Keras's formula, on the device) or SGD's learning rate, float32."""
    lr = tf.cast(learning_rate, tf.float32)
    if not isinstance(optimizer, keras.optimizers.Adam):
        return lr
    local_step = tf.cast(optimizer.iterations + 1, tf.float32)
    beta_1_power = tf.pow(tf.cast(optimizer.beta_1, tf.float32), local_step)
    beta_2_power = tf.pow(tf.cast(optimizer.beta_2, tf.float32), local_step)
    return lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)


def _slice_squares(grad):
    """An `IndexedSlices` gradient's squared slices summed per row, dense."""
    rows = tf.cast(grad.dense_shape[0], grad.indices.dtype)
    return tf.math.unsorted_segment_sum(tf.square(tf.cast(grad.values, tf.float32)),
                                        grad.indices, rows)


def host_update(optimizer, host, keys, grads, squares, scalar, finite):
    """Runs `host.step` on the host through `tf.numpy_function`: `grads` (dense float32
    tensors of `keys`) down, the steps up, each with its gradient's shape."""
    skip = bool(getattr(optimizer, "tfpar_skip_nonfinite", False))
    fn = functools.partial(host.step, optimizer, list(keys), skip)
    extra = ([tf.zeros([0]) if s is None else s for s in squares]
             if isinstance(optimizer, keras.optimizers.Adam) else [])
    steps = tf.numpy_function(fn, [finite, scalar, *grads, *extra],
                              [tf.float32] * len(grads), stateful=True)
    for step, grad in zip(steps, grads):
        step.set_shape(grad.shape)
    return steps


class OffloadMixin:
    """Mixin for a Keras 3 `SGD` (with momentum) or `Adam` on data parallelism: slots in
    host memory, update on the host (module docstring). Expects `tfpar_skip_nonfinite`
    (set by `tfpar.nan_guard.skip_nonfinite_updates`, default off)."""

    def build(self, variables):
        # The base build only (iterations, variable indices): no slots on the devices.
        patches.base_build(self, variables)
        nan_guard.add_counter(self)
        self._tfpar_host_keys = {_key(v): i for i, v in enumerate(variables)}
        self._tfpar_host = HostSlots(slot_names(self), {
            i: tuple(int(d) for d in v.shape) for i, v in enumerate(variables)})
        self._tfpar_copied = {"to_host": 0, "to_device": 0}

    # Keras's file (`model.save`, `save_weights`) holds what the plain optimizer's would:
    # its own variables without tfpar's counter, then the host slots in Keras's order (per
    # weight, as `add_optimizer_variables` interleaves them: momentum, velocity), so stock
    # Keras loads the state and a device-resident run can read the file, and back.
    def _tfpar_file_entries(self):
        counter = getattr(self, "nonfinite_steps", None)
        own = [(lambda v=v: v.numpy(), v.assign) for v in self.variables if v is not counter]
        slots = []
        for i, var in enumerate(patches.built_variables(self)):
            if getattr(var, "overwrite_with_gradient", False):
                continue  # Keras keeps no slot for it either
            for slot in self._tfpar_host.names:
                array = self._tfpar_host.arrays[slot][i]

                def write(value, array=array):
                    array[...] = np.reshape(np.asarray(value, np.float32), array.shape)
                slots.append((lambda array=array: array.copy(), write))
        return own + slots

    def save_own_variables(self, store):
        if getattr(self, "_tfpar_host", None) is None:
            return super().save_own_variables(store)
        for i, (read, _) in enumerate(self._tfpar_file_entries()):
            store[str(i)] = read()

    def load_own_variables(self, store):
        entries = (self._tfpar_file_entries()
                   if getattr(self, "_tfpar_host", None) is not None else [])
        if not entries or len(store.keys()) != len(entries):  # Keras warns and skips
            return super().load_own_variables(store)
        for i, (_, write) in enumerate(entries):
            write(store[str(i)])

    # Keras's private step, overridden: registry entry `optimizer_hooks` of tfpar.patches.
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        variables = [v.value if isinstance(v, keras.Variable) else v
                     for v in trainable_variables]
        pairs = list(zip(grads, variables))
        if isinstance(self._distribution_strategy, tf.distribute.MirroredStrategy):
            # Streamed (`_tfpar_streamed_update`); an embedding's rows go through Keras's
            # all-reduce as on the devices (small, and summed in the same order).
            sparse = self._all_reduce_sum_gradients(
                [(g, v) for g, v in pairs if isinstance(g, tf.IndexedSlices)])
            dense = [(g, v) for g, v in pairs
                     if g is not None and not isinstance(g, tf.IndexedSlices)]
            tf.__internal__.distribute.interim.maybe_merge_call(
                self._tfpar_streamed_update, self._distribution_strategy, sparse, dense,
                learning_rate)
            return
        grads_and_vars = self._all_reduce_sum_gradients(pairs)
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._tfpar_offloaded_update, self._distribution_strategy, grads_and_vars,
            learning_rate)

    def _tfpar_streamed_update(self, distribution, sparse, dense, learning_rate):
        """One process's replicas (`MirroredStrategy`), as ZeRO-Offload streams: each
        weight's gradient is summed on the first replica's device by itself (no buffer of
        every gradient at once) and leaves for the host as soon as the backward pass has
        produced it (phase 1, `HostSlots.deposit`); once all are on the host and the step's
        finiteness is known, the steps come back one weight at a time, each applied to
        every replica's copy before the next is asked for (phase 2, `HostSlots.update`).
        So the devices never hold the whole gradient set summed, nor the whole step."""
        adam = isinstance(self, keras.optimizers.Adam)
        host = self._tfpar_host
        device = distribution.extended.worker_devices[0]
        entries, flags, down = [], [], 0
        # Backward order (the last layers' gradients come first).
        for g, var in reversed(dense):
            summed = distribution.extended.reduce_to(tf.distribute.ReduceOp.SUM, g,
                                                     destinations=device)
            summed = distribution.experimental_local_results(summed)[0]
            entries.append((var, tf.reshape(tf.cast(summed, tf.float32), var.shape), None))
        for g, var in sparse:
            g = distribution.experimental_local_results(g)[0]
            entries.append((var, tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32),
                                            var.shape),
                            tf.reshape(_slice_squares(g), var.shape) if adam else None))
        keys = []
        for var, grad, square in entries:
            key = self._tfpar_host_keys[_key(var)]
            keys.append(key)
            # Not `stateful`: stateful calls run in the order they are made, so a gradient
            # the backward pass had produced waited for those before it (512x7 fit the cap
            # chained, 512x8 not: docs/benchmarks/memory.md). Unordered is safe: each call
            # writes its own key, and the updates read them after `finite`, which needs all.
            with tf.device(device):
                flags.append(tf.numpy_function(
                    functools.partial(host.deposit, key),
                    [grad, tf.zeros([0]) if square is None else square], tf.float32,
                    stateful=False))
            down += 4 * int(grad.shape.num_elements()) * (1 if square is None else 2)
        finite = tf.math.is_finite(tf.add_n(flags))
        scalar = _scalar(self, learning_rate)
        skip = bool(getattr(self, "tfpar_skip_nonfinite", False))

        def apply(var, step):
            step = tf.cast(step, var.dtype)
            return (var.assign_sub(step, read_value=False) if adam
                    else var.assign_add(step, read_value=False))

        done, up = [], 0
        for (var, grad, _), key in zip(reversed(entries), reversed(keys)):
            with tf.control_dependencies(done), tf.device(device):
                step = tf.numpy_function(functools.partial(host.update, self, key, skip),
                                         [finite, scalar], tf.float32, stateful=True)
            step.set_shape(grad.shape)
            done = tf.nest.flatten(distribution.extended.update(var, apply, args=(step,),
                                                                group=True))
            up += 4 * int(grad.shape.num_elements())
        local = len(distribution.extended.worker_devices)
        self._tfpar_copied = {"to_host": down, "to_device": local * up}
        distribution.extended.update(
            self.nonfinite_steps.value,
            lambda count, finite: count.assign_add(1.0 - tf.cast(finite, tf.float32)),
            args=(finite,), group=False)

    def _tfpar_offloaded_update(self, distribution, grads_and_vars, learning_rate):
        # The whole set at once: Keras's all-reduce packs it (multi-worker strategies).
        pairs = [(distribution.experimental_local_results(g)[0], v)
                 for g, v in grads_and_vars if g is not None]
        adam = isinstance(self, keras.optimizers.Adam)
        # Dense, with the weight's static shape (an `IndexedSlices`' dense shape is a tensor).
        grads = [tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32), v.shape)
                 for g, v in pairs]
        squares = [tf.reshape(_slice_squares(g), v.shape)
                   if adam and isinstance(g, tf.IndexedSlices) else None for g, v in pairs]
        finite = tf.math.is_finite(tf.add_n([tf.reduce_sum(g) for g in grads]))
        keys = [self._tfpar_host_keys[_key(v)] for _, v in pairs]
        scalar = _scalar(self, learning_rate)
        steps = host_update(self, self._tfpar_host, keys, grads, squares, scalar, finite)
        local = len(distribution.extended.worker_devices)
        self._tfpar_copied = {
            "to_host": 4 * sum(int(g.shape.num_elements()) for g in grads)
            + 4 * sum(int(s.shape.num_elements()) for s in squares if s is not None),
            "to_device": 4 * local * sum(int(g.shape.num_elements()) for g in grads)}

        def apply(var, step):
            step = tf.cast(step, var.dtype)
            return var.assign_sub(step) if adam else var.assign_add(step)

        for (_, var), step in zip(pairs, steps):
            distribution.extended.update(var, apply, args=(step,), group=False)
        distribution.extended.update(
            self.nonfinite_steps.value,
            lambda count, finite: count.assign_add(1.0 - tf.cast(finite, tf.float32)),
            args=(finite,), group=False)


class OffloadZeroMixin:
    """Mixin in front of `tfpar.zero.sharded.ZeroMixin`: each replica's piece of the slots
    in host memory, its piece's update on the host; the reduce-scatter and the weights'
    all-gather stay ZeRO's."""

    def _tfpar_slot_names(self):
        return ()  # no sharded slots on the devices

    def build(self, variables):
        super().build(variables)
        layout = self._tfpar_layout
        strategy = tf.distribute.get_strategy()
        local = len(strategy.extended.worker_devices)
        self._tfpar_host = HostSlots(slot_names(self),
                                     {r: (layout.piece,) for r in range(local)})
        self._tfpar_copied = {"to_host": 0, "to_device": 0}

    def _tfpar_update(self, param, grad, slots, learning_rate, square=None, finite=None):
        del slots  # on the host
        replica = patches.replica_index()
        finite = tf.constant(True) if finite is None else finite
        adam = isinstance(self, keras.optimizers.Adam)
        step, = host_update(self, self._tfpar_host, [replica], [grad], [square],
                            _scalar(self, learning_rate), finite)
        piece = int(grad.shape.num_elements())
        self._tfpar_copied = {"to_host": 4 * piece * (2 if square is not None else 1),
                              "to_device": 4 * piece}  # per replica
        return (param - step if adam else param + step), {}


def wrap_optimizer(optimizer, mode):
    """Makes `optimizer` keep its state in host memory (`mode` "optimizer"), in place.

    Args:
        optimizer: a Keras 3 `SGD` with momentum or `Adam` (amsgrad off, no EMA, no Keras
            gradient accumulation), not yet built; already wrapped by
            `tfpar.zero.sharded.wrap_optimizer` for ZeRO 1/2.
        mode: one of `MODES`; "none" leaves it as it is.

    Raises:
        ConfigError: another optimizer or option, or a mode not built here.
    """
    if mode == "none":
        return optimizer
    if mode != "optimizer":
        raise ConfigError("offload", mode, "the optimizer state offloads on tf.distribute "
                          "(optimizer); parameters stay on the devices")
    supported = (type(optimizer).__name__ in ("SGD", "Adam")
                 and isinstance(optimizer, (keras.optimizers.SGD, keras.optimizers.Adam))
                 and not getattr(optimizer, "amsgrad", False) and not optimizer.use_ema
                 and not optimizer.gradient_accumulation_steps and slot_names(optimizer))
    if not supported:
        raise ConfigError("offload", mode, f"needs keras SGD with momentum or Adam (no "
                          f"amsgrad, EMA or Keras accumulation), got {type(optimizer).__name__}")
    if optimizer.built:
        raise ConfigError("offload", mode, "wrap the optimizer before it is built")
    zero = hasattr(optimizer, "tfpar_zero_stage")
    patches.mix_in(optimizer, OffloadZeroMixin if zero else OffloadMixin)
    optimizer.tfpar_offload = mode
    return optimizer


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def stats(optimizer):
    """The metrics JSON's `offload` block of a run's optimizer, or None without offload:
    the host state's bytes and the bytes copied per step each way (over the local
    replicas)."""
    optimizer = _inner(optimizer)
    host = getattr(optimizer, "_tfpar_host", None)
    if host is None:
        return None
    copied = dict(optimizer._tfpar_copied)
    if isinstance(optimizer, OffloadZeroMixin):  # counted per replica's piece
        local = len(host.arrays[host.names[0]])
        copied = {k: v * local for k, v in copied.items()}
    return {"mode": optimizer.tfpar_offload, "host_state_bytes": host.nbytes,
            "bytes_to_host_per_step": copied["to_host"],
            "bytes_to_device_per_step": copied["to_device"]}


def slot_entries(optimizer, weights):
    """`[(weight, slot name, (read, write, shape))]` of an offloaded optimizer's host
    slots in `weights`' shapes (empty for any other optimizer), as
    `tfpar.zero.sharded.slot_entries`: `tfpar.state` names them as a device-resident
    optimizer's. `read()` returns a copy (an asynchronous save writes it later)."""
    host = getattr(optimizer, "_tfpar_host", None)
    if host is None:
        return []
    if isinstance(optimizer, OffloadZeroMixin):
        return _piece_entries(optimizer, host, weights)
    out = []
    for w in weights:
        key = optimizer._tfpar_host_keys.get(_key(w))
        if key is None:
            continue
        for slot in host.names:
            array = host.arrays[slot][key]

            def write(value, array=array):
                array[...] = np.reshape(np.asarray(value, np.float32), array.shape)
            out.append((w, slot, (lambda array=array: array.copy(), write, array.shape)))
    return out


def _piece_entries(optimizer, host, weights):
    """ZeRO's host pieces cut back into weights' shapes (re-cut on write for this replica
    count)."""
    layout = optimizer._tfpar_layout
    by_index = {layout.keys[_key(w)]: w for w in weights if _key(w) in layout.keys}
    out = []
    for slot in host.names:
        pieces = host.arrays[slot]

        def flat(pieces=pieces):
            return np.concatenate([pieces[r] for r in sorted(pieces)])

        def write_whole(whole, pieces=pieces):
            for r in sorted(pieces):
                pieces[r][...] = whole[r * layout.piece:(r + 1) * layout.piece]
        parts = sharded.flat_parts(layout, flat, write_whole)
        out += [(by_index[i], slot, parts[i]) for i in range(len(parts)) if i in by_index]
    return out
