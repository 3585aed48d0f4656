"""The data-parallel gradient reduction of a mesh step, optionally compressed.

On a mesh DTensor sums the gradients over the `batch` axis implicitly, inside the backward
pass, in fp32. To compress that sum, the step instead forms each data-parallel replica's
own gradient: `tf.vectorized_map` over the batch reshaped to `[data_parallel, m, ...]`
(split on `batch`) gives gradients `[data_parallel, *shape]` laid out
`(batch, *the variable's layout)` — no sum over `batch` has happened yet, while the
collectives inside the `model` axis (tensor parallelism's own) ran exactly as before.
`BatchAxisReduction.mean` then sums over the `batch` axis through the codec:

- `none`: an fp32 mean (the reference; equal to the implicit sum up to re-association),
- `fp16` / `bf16`: the replicas' values cast to 16 bits and summed in 16 bits: the
  all-reduce over `batch` moves half the bytes,
- `int8`: one scale per replica and tensor (its max over the `model` shards is an exact
  max-reduce), the int8 codes all-gathered over `batch` (a quarter of fp32) and summed
  after decoding on every device.

Error feedback (`error_feedback=True`, lossy codecs): each replica keeps what its message
dropped, a DVariable `[data_parallel, *shape]` sharded like its gradient, and adds it to the
next step's gradient (`tfpar.compression.error_feedback`).
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import compat
from tfpar.compression import codecs, error_feedback
from tfpar.layout import values
from tfpar.layout.mesh import BATCH, axis_size

CODECS = ("none", "fp16", "bf16", "int8")
_CAST = {"fp16": tf.float16, "bf16": tf.bfloat16}


class BatchAxisReduction:
    """Averages per-replica gradients over the mesh's `batch` axis through a codec.

    Args:
        mesh: the `keras.distribution.DeviceMesh`.
        variables: the trainable Keras variables (DVariables) the gradients belong to.
        codec: one of `CODECS`.
        error_feedback: keep each replica's dropped part for the next step (lossy codecs).

    Raises:
        ConfigError: an unknown codec.
    """

    def __init__(self, mesh, variables, codec="none", error_feedback=True):
        compat.enforce_honoured("compression", compat.view(compression=codec), "dtensor")
        self.mesh, self.codec = mesh, codec
        self.replicas = axis_size(mesh, BATCH)
        self.sizes = [int(np.prod(v.shape)) for v in variables]
        # Layouts are taken here, eagerly: inside the traced step DTensor cannot fetch one
        # (`fetch_layout` must be called eagerly). Per variable: its gradient stacked over
        # replicas `(batch, *layout)`, and the same gathered over `batch`.
        self.stacked, self.gathered = [], []
        for variable in variables:
            layout = dtensor.fetch_layout(variable.value)
            specs = list(layout.sharding_specs)
            self.stacked.append(dtensor.Layout([BATCH] + specs, layout.mesh))
            self.gathered.append(dtensor.Layout([dtensor.UNSHARDED] + specs, layout.mesh))
        self.residuals = []
        if codec != "none" and error_feedback:
            for variable, stacked in zip(variables, self.stacked):
                zeros = values.to_mesh(
                    tf.zeros((self.replicas,) + tuple(variable.shape), tf.float32), stacked)
                self.residuals.append(dtensor.DVariable(zeros, trainable=False))

    def comm_stats(self):
        """Bytes one replica (a position on `batch`, all its `model` shards together) hands
        to the `batch` axis's collectives per step, against fp32: fp16/bf16 2 per entry,
        int8 1 per entry and a 4-byte scale per tensor, `none` 4 per entry. Static: the
        message sizes do not change from step to step.

        Returns:
            `{"bytes_on_wire_per_step": int, "bytes_uncompressed_per_step": int,
            "compression_ratio": float}`, as `tfpar.compression.Aggregator.comm_stats`.
        """
        raw = 4 * sum(self.sizes)
        if self.codec == "int8":
            wire = sum(self.sizes) + 4 * len(self.sizes)
        else:
            wire = sum(self.sizes) * (2 if self.codec in _CAST else 4)
        return {"bytes_on_wire_per_step": wire, "bytes_uncompressed_per_step": raw,
                "compression_ratio": raw / wire}

    @property
    def variables(self):
        """The residual DVariables (empty without error feedback)."""
        return list(self.residuals)

    def read(self):
        return [r.read_value() for r in self.residuals]

    def mean(self, grads, residuals):
        """`(means, new_residuals)`: the mean over replicas of `grads` (each
        `[replicas, *shape]`, split on `batch`) through the codec; `residuals` are the
        values `read()` gave (or [])."""
        if len(grads) != len(self.stacked):
            raise ValueError(f"{len(grads)} gradients for {len(self.stacked)} variables")
        means, kept = [], []
        for i, g in enumerate(grads):
            # Pin each replica's gradient to its own shard (a no-op when DTensor already
            # placed it so): nothing over `batch` is summed before the codec.
            x = dtensor.relayout(tf.cast(g, tf.float32), self.stacked[i])
            if residuals:
                x = error_feedback.corrected(x, residuals[i])
            total, sent = self._sum(x, i)
            means.append(tf.cast(total / self.replicas, g.dtype))
            if residuals:
                kept.append(error_feedback.next_residual(x, sent))
        return means, kept

    def _sum(self, x, index):
        """`(sum over axis 0, what each replica's message decodes to)` for the gradient
        of variable `index`."""
        if self.codec == "none":
            return tf.reduce_sum(x, 0), x
        if self.codec in _CAST:
            sent = tf.cast(x, _CAST[self.codec])
            return tf.cast(tf.reduce_sum(sent, 0), tf.float32), tf.cast(sent, tf.float32)
        # int8: one scale per replica, codes gathered over `batch`, summed after decoding.
        dims = list(range(1, x.shape.rank))
        amax = tf.reduce_max(tf.abs(x), axis=dims, keepdims=True)
        scale = tf.where(amax > 0, amax / codecs.INT8_MAX, tf.ones_like(amax))
        codes = tf.cast(tf.clip_by_value(tf.round(x / scale), -codecs.INT8_MAX,
                                         codecs.INT8_MAX), tf.int8)
        gathered = dtensor.relayout(codes, self.gathered[index])
        scales = dtensor.relayout(scale, dtensor.Layout.replicated(
            self.mesh.backend_mesh, scale.shape.rank))
        decoded = tf.cast(gathered, tf.float32) * scales
        summed = tf.add_n(tf.unstack(decoded, num=self.replicas))
        return summed, tf.cast(codes, tf.float32) * scale
