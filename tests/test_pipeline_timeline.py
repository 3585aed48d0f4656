"""The measured timeline: profiler op events mapped to stages and actions (no TensorFlow)."""

import json

import pytest

from tfpar.pipeline.timeline import chrome_trace, draw, from_events


def test_events_become_actions_busy_time_and_bubble():
    events = [  # (op name, start us, end us), as the profiler reports them
        ("s0_F0_c0/stage_0/dense/MatMul:MatMul", 100, 110),
        ("s0_F0_c0/stage_0/dense/Relu:Relu", 108, 120),        # overlaps the MatMul
        ("s1_F0_c0/stage_1/dense/MatMul:MatMul", 120, 140),
        ("gradient_tape/s1_F0_c0/stage_1/dense/MatMul:MatMul", 140, 160),  # B0 of stage 1
        ("s1_B0_c0/add:AddV2", 160, 162),
        ("gradient_tape/s0_F0_c0/stage_0/dense/MatMul:MatMul", 162, 180),
        ("replica_1/s0_F1_c1/x:Relu", 180, 182),                # replica scope, chunk 1
        ("SGD/update:ResourceApplyGradientDescent", 182, 200),  # not an action
        ("ThreadpoolListener", 0, 500),
    ]
    tl = from_events(events, 2)
    assert tl.makespan_us == 82
    assert tl.actions[0] == [("F0", 0, 20), ("B0", 62, 80), ("F1.1", 80, 82)]
    assert tl.actions[1] == [("F0", 20, 40), ("B0", 40, 62)]
    assert tl.busy[0] == [(0, 20), (62, 82)]
    assert tl.busy_fraction() == pytest.approx([40 / 82, 42 / 82])
    assert tl.bubble == pytest.approx(1 - 82 / 164)
    text = draw(tl, columns=41)
    assert text.splitlines()[1] == "stage 1: " + "." * 10 + "F0" + " " * 8 + "B0" + "=" * 9 + "." * 10
    trace = json.loads(json.dumps(chrome_trace(tl)))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 5 and {e["tid"] for e in slices} == {0, 1}
