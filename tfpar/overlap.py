"""The share of a step's communication hidden behind its backward pass, from timestamps
taken inside the step (`tfpar.compression.timing` takes them): pure functions over
numbers, no TensorFlow.

A collective moves data once every replica has started it, and ends for the step when the
last replica has its result; the step's computation ends with the last replica's backward.
So every time is taken over the replicas (their clocks are one on one host; across hosts,
their offset enters).
"""

import numpy as np


def busy_intervals(stamps, waits_for_previous):
    """When each collective of one timeline step was busy, from the step's start.

    Args:
        stamps: seconds, one row per replica: `[start, backward end, (inputs ready, end)
            for each collective in program order]`, as the timeline step returns them.
        waits_for_previous: per collective, whether it waits for the one before it (then it
            starts at the later of its inputs and that one's end).

    Returns:
        `(backward end, [(begin, end) per collective])`, seconds after the first start.
    """
    stamps = np.asarray(stamps, dtype=np.float64).reshape(-1, 2 + 2 * len(waits_for_previous))
    start, latest = stamps[:, 0].min(), stamps.max(axis=0) - stamps[:, 0].min()
    intervals, previous_end = [], None
    for k, waits in enumerate(waits_for_previous):
        ready, end = float(latest[2 + 2 * k]), float(latest[3 + 2 * k])
        begin = max(ready, previous_end) if waits and previous_end is not None else ready
        intervals.append((begin, max(begin, end)))
        previous_end = end
    return float(latest[1]), intervals


def hidden_share(backward_end, intervals):
    """The part of the collectives' busy time before backward's end.

    Args:
        backward_end: when backward ended.
        intervals: `(begin, end)` of each collective (they may overlap: their union counts).

    Returns:
        `(hidden / busy, busy)`; `(None, 0.0)` when nothing was busy.
    """
    busy = hidden = 0.0
    reached = -np.inf  # the union, walked in order of start
    for begin, end in sorted(intervals):
        begin = max(begin, reached)
        if end > begin:
            busy += end - begin
            hidden += max(0.0, min(end, backward_end) - begin)
            reached = end
    return (hidden / busy if busy > 0 else None), busy
