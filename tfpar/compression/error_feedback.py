"""Error feedback: what compression drops this step is added back to the next step's gradient.

With residual `r`, a replica sends `C(g + r)` and keeps `r' = (g + r) - D(C(g + r))`, so the
sum of everything transmitted plus the final residual equals the sum of the gradients: no
gradient information is lost, only delayed. That is what lets top-k and PowerSGD reach the
loss of uncompressed training.
"""


def corrected(grad, residual):
    """The gradient to compress this step: this step's gradient plus what was left over."""
    return grad if residual is None else grad + residual


def next_residual(corrected_grad, transmitted):
    """What compression dropped: `corrected_grad - transmitted` (the decoded message)."""
    return corrected_grad - transmitted


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
