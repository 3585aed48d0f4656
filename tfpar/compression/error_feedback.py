"""Error feedback: what compression drops this step is added back to the next step's gradient.

With residual `r`, a replica sends `C(g + r)` and keeps `r' = (g + r) - D(C(g + r))`, so the
sum of everything transmitted plus the final residual equals the sum of the gradients: no
gradient information is lost, only delayed. That is what lets top-k and PowerSGD reach the
loss of uncompressed training.

`accumulate` and `subtract_scaled` are the same two steps done in place on the residual
variable (one pass each, no new buffers), for an aggregator that forms the residual from
what it decodes anyway (PowerSGD: against the summed approximation, as PyTorch's hook does).
"""

import tensorflow as tf


def corrected(grad, residual):
    """The gradient to compress this step: this step's gradient plus what was left over."""
    return grad if residual is None else grad + residual


def next_residual(corrected_grad, transmitted):
    """What compression dropped: `corrected_grad - transmitted` (the decoded message)."""
    return corrected_grad - transmitted


def accumulate(residual, grad):
    """In place: the residual variable becomes `grad + residual`, the gradient to compress
    this step, which is returned.

    Args:
        residual: the residual's variable (this replica's, in replica context).
        grad: this step's gradient (same shape).
    """
    residual.assign_add(grad)
    return residual.read_value()


def subtract_scaled(residual, value, scale):
    """In place and in one pass: `residual -= scale * value`.

    After `accumulate`, with `value` what the replicas' messages decode to together and
    `scale` this replica's share of it, the residual becomes what this replica's correction
    kept back. TensorFlow copies the buffer first if the value `accumulate` returned is
    still in use, so the order of reads and this update never changes the result.
    """
    tf.raw_ops.ResourceApplyGradientDescent(
        var=residual.handle, alpha=tf.constant(scale, residual.dtype), delta=value)


def compress_with_feedback(grad, residual, roundtrip):
    """One error-feedback step for a single replica.

    Args:
        grad: this step's gradient.
        residual: the residual carried from the previous step (same shape) or `None`.
        roundtrip: `x -> D(C(x))`, what the receiver decodes from the message for `x`.

    Returns:
        `(transmitted, new_residual)`.
    """
    x = corrected(grad, residual)
    sent = roundtrip(x)
    return sent, next_residual(x, sent)
