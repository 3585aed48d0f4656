"""Gradient accumulation that works under every `tf.distribute` strategy.

Keras 3's own `gradient_accumulation_steps` puts the optimizer update, and with it the
gradient all-reduce, inside a `cond`; under `MirroredStrategy` that fails ("`merge_call`
called while defining a new graph"). tfpar accumulates inside one training step instead:
each replica's share of the batch is cut into `steps` micro-batches that run one after the
other in a `tf.while_loop` (so only one micro-batch's activations are alive at a time),
their gradients are averaged, and the all-reduce and update happen once per step.
"""

import keras
import tensorflow as tf
from keras import tree

from tfpar import patches
from tfpar.errors import ConfigError


def install(model, steps):
    """Makes `model.fit` accumulate gradients over `steps` micro-batches per step.

    Args:
        model: a compiled Keras model (TensorFlow backend).
        steps: micro-batches per step; every replica's batch must divide by it.
    """
    if steps > 1:
        model.train_step = accumulating_train_step(model, steps)


def accumulating_train_step(model, steps):
    """A `train_step` for `model` equal to Keras's, but over `steps` micro-batches."""
    unpack = keras.utils.unpack_x_y_sample_weight

    def train_step(data):
        x, y, sample_weight = unpack(data)
        batch = tf.shape(next(t for t in tree.flatten(x) if t is not None))[0]
        static = next(t for t in tree.flatten(x) if t is not None).shape[0]
        if static is not None and static % steps:
            raise ConfigError("grad_accum_steps", steps,
                              f"must divide the per-replica batch of {static}")
        micro = batch // steps
        weights = model.trainable_weights

        def part(structure, i):
            return tree.map_structure(
                lambda t: None if t is None else t[i * micro:(i + 1) * micro], structure)

        def body(i, accumulated):
            xi, yi, wi = part(x, i), part(y, i), part(sample_weight, i)
            with tf.GradientTape() as tape:
                # Keras's own forward pass and loss (registry entry `train_step_loss`).
                y_pred, _, scaled = patches.forward_loss(model, xi, yi, wi, micro)
            grads = tape.gradient(scaled, weights)
            model.compute_metrics(xi, yi, y_pred, sample_weight=wi)
            return i + 1, [a + (tf.zeros_like(a) if g is None else tf.convert_to_tensor(g))
                           for a, g in zip(accumulated, grads)]

        zeros = [tf.zeros(w.shape, w.dtype) for w in weights]
        _, summed = tf.while_loop(lambda i, _: i < steps, body, (tf.constant(0), zeros))
        model.optimizer.apply_gradients(zip([g / steps for g in summed], weights))
        return model.get_metrics_result()

    return train_step
