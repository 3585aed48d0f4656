"""A learning-rate schedule across a change of Keras's `gradient_accumulation_steps` K
between a save and its resume (tests/checkpoint_schedule_child.py): Keras evaluates a
schedule at its raw iteration count, micro-batches under K; the resume sets that count to
the saved updates × the new K (`tfpar.state`), so the schedule continues at the update the
run is at, as a run of the new K would have it."""

import sys

import numpy as np

from subproc import ROOT, last_json_line, run

CHILD = f"{ROOT}/tests/checkpoint_schedule_child.py"


def test_a_schedule_continues_at_the_right_update_after_a_change_of_accumulation(tmp_path):
    out = run([sys.executable, CHILD, str(tmp_path)], timeout=300)
    result = last_json_line(out.stdout)
    first, resumed = result["first"], result["resumed"]
    reference, fresh = result["reference"], result["fresh"]
    # Saved after batch 12 of K = 2 (6 updates), resumed there with K = 4: 16 batches,
    # 4 updates, numbered 6 … 9 from the start.
    assert first["initial_step"] == 12 and resumed["start"] == 12
    assert sorted(first["rates"], key=int) == [str(u) for u in range(7)]
    assert sorted(resumed["rates"], key=int) == ["6", "7", "8", "9"]
    assert resumed["updates"] == reference["updates"] == 10
    # Each update's rate is what a run of K = 4 from the start used at that update (not
    # the rate at the old count of micro-batches, 12 + …: ExponentialDecay moves at every
    # micro-batch), and what the run from the same state without a checkpoint used.
    for update in resumed["rates"]:
        assert resumed["rates"][update] == fresh["rates"][update], (update, resumed, fresh)
        assert resumed["rates"][update] == reference["rates"][update], update
    # The same state, the same rates and Adam's bias correction at the same update count:
    # the same weights, bit for bit (one process, the same kernels).
    for got, want in zip(resumed["weights"], reference["weights"]):
        np.testing.assert_array_equal(np.array(got), np.array(want))
