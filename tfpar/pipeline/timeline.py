"""The measured pipeline timeline: which stage ran which action when, from the profiler.

Timers inside the step would serialise the pipeline (see `executor`), so the step runs
under the TensorFlow profiler instead and every op event is mapped back to its action by
the name scope the executor gives it (`s<stage>_<F|B|W><microbatch>_c<chunk>/...`; backward
ops carry their forward's scope under `gradient_tape/`). Each action becomes the span from
its first op's start to its last op's end; a stage is busy while any of its ops runs.

Examples:
    >>> tl = profile(lambda: step(x, y), "/tmp/profile")
    >>> tl.bubble, tl.busy_fraction()
    >>> print(draw(tl)); write_chrome_trace(tl, "/tmp/pipeline_trace.json")
"""

import dataclasses
import json
import re
import shutil
import tempfile

from tfpar import profiling

_ACTION_RE = re.compile(r"(gradient_tape/)?s(\d+)_([FBW])(\d+)_c(\d+)/")


@dataclasses.dataclass
class MeasuredTimeline:
    """Per stage, the actions' spans and the busy intervals, in microseconds from the
    first action's start.

    actions: per stage, sorted list of (label, start_us, end_us); label like 'F3' or 'B0.1'.
    busy: per stage, merged list of (start_us, end_us) during which an op of it ran.
    makespan_us: from the first action op's start to the last one's end.
    """
    actions: list
    busy: list
    makespan_us: float

    @property
    def bubble(self):
        """Idle fraction over all stages: 1 - busy / (K * makespan)."""
        K = len(self.busy)
        total = sum(e - b for row in self.busy for b, e in row)
        return 1.0 - total / (K * self.makespan_us) if self.makespan_us else 0.0

    def busy_fraction(self):
        """Per stage, the fraction of the makespan it was busy."""
        return [sum(e - b for b, e in row) / self.makespan_us for row in self.busy]


def to_dict(timeline):
    """The timeline as JSON-ready data (what a metrics JSON's `pipeline.timeline` holds)."""
    return {"actions": [[list(a) for a in row] for row in timeline.actions],
            "busy": [[list(b) for b in row] for row in timeline.busy],
            "makespan_us": timeline.makespan_us, "bubble": timeline.bubble}


def from_dict(data):
    """The inverse of `to_dict`."""
    return MeasuredTimeline([[tuple(a) for a in row] for row in data["actions"]],
                            [[tuple(b) for b in row] for row in data["busy"]],
                            float(data["makespan_us"]))


def _merge(intervals):
    merged = []
    for b, e in sorted(intervals):
        if merged and b <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([b, e])
    return [tuple(i) for i in merged]


def from_events(events, num_stages):
    """A `MeasuredTimeline` from (op name, start_us, end_us) events; ops outside any
    action's name scope (optimizer, split, concat) are left out."""
    spans, ops = {}, [[] for _ in range(num_stages)]
    for name, start, end in events:
        match = _ACTION_RE.search(name)
        if not match:
            continue
        grad, s, kind, m, c = match.groups()
        s, kind = int(s), "B" if grad else kind
        if s >= num_stages:
            continue
        ops[s].append((start, end))
        if kind == "W":
            # TensorFlow names every gradient op after its forward (`gradient_tape/<F's
            # scope>`), so a zero-bubble W's own work shows under its micro-batch's B; only
            # its accumulation runs in the W scope. It counts as busy time, not as a span.
            continue
        key = (s, kind, int(m), int(c))
        b, e = spans.get(key, (start, end))
        spans[key] = (min(b, start), max(e, end))
    if not spans:
        return MeasuredTimeline([[] for _ in range(num_stages)],
                                [[] for _ in range(num_stages)], 0.0)
    t0 = min(b for b, _ in spans.values())
    t1 = max(e for _, e in spans.values())
    actions = [[] for _ in range(num_stages)]
    for (s, kind, m, c), (b, e) in spans.items():
        actions[s].append((f"{kind}{m}" + (f".{c}" if c else ""), b - t0, e - t0))
    for row in actions:
        row.sort(key=lambda a: a[1])
    busy = [[(b - t0, e - t0) for b, e in _merge(row)] for row in ops]
    return MeasuredTimeline(actions, busy, t1 - t0)


def profile(fn, num_stages, logdir=None):
    """Runs `fn()` (one traced pipeline step, already warmed up) under the TensorFlow
    profiler and returns its `MeasuredTimeline`.

    Args:
        fn: runs one step and blocks until it is done (e.g. returns a numpy value).
        num_stages: K.
        logdir: where the profiler writes; default a temporary directory, removed after.
    """
    return from_events(profiled_events(fn, logdir), num_stages)


def profiled_events(fn, logdir=None):
    """Runs `fn()` under the TensorFlow profiler; returns its events as
    `(name, start_us, end_us)` (`logdir` as for `profile`; only this session's trace files
    are read, `tfpar.profiling.read_events`)."""
    import tensorflow as tf
    own = logdir is None
    logdir = logdir or tempfile.mkdtemp(prefix="tfpar_profile_")
    try:
        earlier = profiling.trace_files(logdir)  # a logdir given may hold older sessions
        tf.profiler.experimental.start(logdir)
        try:
            fn()
        finally:
            tf.profiler.experimental.stop()
        return profiling.read_events(logdir, skip=earlier)
    finally:
        if own:
            shutil.rmtree(logdir, ignore_errors=True)


def draw(timeline, columns=100):
    """The measured timeline as text: one row per stage, `columns` characters wide; each
    action is drawn over its span (forwards `F<mb>`, backwards `B<mb>` and weight passes
    `W<mb>` then `=`), idle as dots."""
    scale = columns / timeline.makespan_us if timeline.makespan_us else 0
    rows = []
    for s, row in enumerate(timeline.actions):
        cells = ["."] * columns
        for label, b, e in row:
            lo = min(int(b * scale), columns - 1)
            hi = min(max(lo + 1, int(e * scale)), columns)
            cells[lo:hi] = (label + ("=" if label[0] != "F" else " ") * columns)[:hi - lo]
        rows.append(f"stage {s}: {''.join(cells)}")
    rows.append(f"makespan {timeline.makespan_us / 1e3:.2f} ms, busy "
                + ", ".join(f"{f:.2f}" for f in timeline.busy_fraction())
                + f", bubble {timeline.bubble:.3f}")
    return "\n".join(rows)


def chrome_trace(timeline, title="pipeline"):
    """The timeline in Chrome's trace-event format (open in chrome://tracing or
    https://ui.perfetto.dev): one row per stage, one slice per action."""
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s,
               "args": {"name": f"stage {s}"}} for s in range(len(timeline.actions))]
    for s, row in enumerate(timeline.actions):
        for label, b, e in row:
            events.append({"name": label, "cat": "forward" if label[0] == "F" else "backward",
                           "ph": "X", "pid": 0, "tid": s, "ts": b, "dur": e - b})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_chrome_trace(timeline, path, title="pipeline"):
    with open(path, "w") as f:
        json.dump(chrome_trace(timeline, title), f)


def plot(timeline, path, title="pipeline"):
    """Draws the timeline as a PNG with matplotlib. Returns False (and writes nothing) if
    matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    K = len(timeline.actions)
    fig, ax = plt.subplots(figsize=(12, 0.6 * K + 1.2))
    for s, row in enumerate(timeline.actions):
        for label, b, e in row:
            ax.barh(K - 1 - s, (e - b) / 1e3, left=b / 1e3, height=0.8,
                    color={"F": "tab:blue", "B": "tab:orange"}.get(label[0], "tab:green"),
                    edgecolor="white")
            ax.text((b + e) / 2e3, K - 1 - s, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(K), [f"stage {s}" for s in reversed(range(K))])
    ax.set_xlabel("ms")
    ax.set_title(f"{title} (bubble {timeline.bubble:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
