"""The one line `python -m tfpar.train` prints at its end (`tfpar.metrics.summary_line`)."""

from tfpar import metrics


def _result(ratio):
    return {"strategy": "dtensor", "replicas": 4, "workers": 1, "steps": 2,
            "loss_history": [1.0, 0.5], "final_loss": 0.5,
            "comm": {"bytes_on_wire_per_step": 2e6, "compression_ratio": ratio}}


def test_the_wire_against_fp32_says_smaller_only_when_it_is():
    assert "2.000 MB/step on the wire (x4.0 smaller)" in metrics.summary_line(_result(4.0))
    # A plain ZeRO-3 run sends twice an fp32 all-reduce's bytes (its gathers and
    # reduce-scatter): it said "x0.5 smaller".
    line = metrics.summary_line(_result(0.5))
    assert "smaller" not in line and "(x2.0 an fp32 all-reduce's)" in line, line
