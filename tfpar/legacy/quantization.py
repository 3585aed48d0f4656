"""Quantization-aware training with tfmot under a strategy, and the TFLite int8 export.

`quantize(model)` wraps a `tf_keras` model with tfmot's default 8-bit scheme (fake-quant
of weights and activations, ranges learnt during training). Call it under the strategy
scope, before `compile`.

One repair for data parallelism: the model's input range is kept by an
`AllValuesQuantizer` (running min/max of every input seen), and tfmot updates it with a
plain assign, which under `MirroredStrategy` / `MultiWorkerMirroredStrategy` writes only the
replica's own copy: each replica keeps the range of its own shard and the copies drift
apart (measured: 0.6 after 20 steps on 4 replicas), and the export takes replica 0's. Here
each step first takes the min/max over all replicas (one 8-byte all-gather per input), so
every copy holds the range of the whole global batch, as on one device. The other ranges
are moving averages, which tfmot already averages over replicas.
"""

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot

from tfpar import patches
from tfpar.errors import ConfigError


class _ReplicaSyncedAllValues:
    """Mixin for tfmot's `AllValuesQuantizer`: the running min/max over all replicas."""

    def __call__(self, inputs, training, weights, **kwargs):
        ctx = tf.distribute.get_replica_context()
        if training is True and ctx is not None and ctx.num_replicas_in_sync > 1:
            local = tf.stack([tf.reduce_min(inputs), -tf.reduce_max(inputs)])
            lowest = tf.reduce_min(ctx.all_gather(local[None], axis=0), axis=0)
            low, high = weights["min_var"], weights["max_var"]
            # Every replica writes the same global value into its own copy; tfmot's own
            # update that follows then changes nothing (its batch is inside this range).
            updates = [low.assign(tf.minimum(low, lowest[0])),
                       high.assign(tf.maximum(high, -lowest[1]))]
            with tf.control_dependencies(updates):
                inputs = tf.identity(inputs)
        return super().__call__(inputs, training, weights, **kwargs)


def quantize(model):
    """`model` wrapped for 8-bit quantization-aware training.

    Args:
        model: a `tf_keras` model whose layers tfmot's default 8-bit scheme supports.

    Returns:
        the QAT model (call under the strategy scope, then `compile`).

    Raises:
        ConfigError: tfmot cannot quantize a layer of `model`.
    """
    try:
        qat = tfmot.quantization.keras.quantize_model(model)
    except (RuntimeError, ValueError) as err:
        raise ConfigError("qat", True, f"tfmot cannot quantize model {model.name!r}: "
                          f"{str(err).splitlines()[0][:300]}") from None
    for _, quantizer in patches.input_quantizers(qat):
        if (type(quantizer) is tfmot.quantization.keras.quantizers.AllValuesQuantizer
                and not quantizer.symmetric):
            # Same name and module: serialisation sees tfmot's quantizer.
            patches.mix_in(quantizer, _ReplicaSyncedAllValues)
    return qat


def copy_to_float(qat_model, float_model):
    """Copies the trained weights of `qat_model` into `float_model` (the model it was made
    from, or one like it), which then computes the same function without fake-quant.

    Returns:
        `float_model`.
    """
    # tfmot's wrappers keep the wrapped layer's variables under their original names.
    trained = {w.name: w for w in qat_model.weights}
    for weight in float_model.weights:
        weight.assign(trained[weight.name].numpy())
    return float_model


def to_tflite(qat_model):
    """The TFLite flatbuffer of `qat_model` with int8 weights and activations (float input
    and output), from the ranges learnt during training; needs no representative data."""
    converter = tf.lite.TFLiteConverter.from_keras_model(qat_model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    return converter.convert()


def run_tflite(flatbuffer, x):
    """Outputs of the TFLite model `flatbuffer` on the batch `x` (numpy)."""
    interpreter = tf.lite.Interpreter(model_content=flatbuffer)
    detail = interpreter.get_input_details()[0]
    interpreter.resize_tensor_input(detail["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(detail["index"], x.astype(detail["dtype"]))
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def compare(float_model, flatbuffer, x):
    """How far the int8 model's outputs are from the float model's on `x`.

    Returns:
        `{"mean_abs_diff", "max_abs_diff", "output_range" (max - min of the float outputs),
        "relative_mean_diff", "relative_max_diff" (diffs / range), "argmax_agreement",
        "tflite_bytes"}`.
    """
    ref = float_model.predict(x, verbose=0)
    got = run_tflite(flatbuffer, x)
    diff = np.abs(ref - got)
    span = float(np.max(ref) - np.min(ref)) or 1.0
    return {"mean_abs_diff": float(np.mean(diff)), "max_abs_diff": float(np.max(diff)),
            "output_range": span, "relative_mean_diff": float(np.mean(diff)) / span,
            "relative_max_diff": float(np.max(diff)) / span,
            "argmax_agreement": float(np.mean(np.argmax(ref, -1) == np.argmax(got, -1))),
            "tflite_bytes": len(flatbuffer)}
