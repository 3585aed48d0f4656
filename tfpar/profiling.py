"""TensorFlow profiler traces read back: every event of the `*.xplane.pb` files a profiler
session wrote, as `(name, start_us, end_us)`.

The one reader of such traces: the pipeline's measured timeline (`tfpar.pipeline.timeline`,
`probe`), `tools/profile_zero3.py`'s CPU time per op type, the tests' op counts. A host op
event is named `name:Type` (`op_type` reads the type).

Examples:
    >>> tf.profiler.experimental.start(logdir); step(); tf.profiler.experimental.stop()
    >>> ops = read_events(logdir, keep=lambda name: op_type(name) is not None)
"""

import glob
import os


def trace_files(logdir):
    """Every trace file under `logdir` (the profiler writes one per host and session, under
    `plugins/profile/<run>/`), sorted."""
    return sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))


def read_events(logdir, keep=None, skip=()):
    """`(name, start_us, end_us)` of every event of every trace file under `logdir`, in
    microseconds from the start of the earliest trace line read (as epoch microseconds a
    float would round every time to 0.25 us; from there a duration keeps its picoseconds).

    Args:
        logdir: the directory the profiler wrote to.
        keep: `name -> bool`, the events to return (default all).
        skip: trace files to leave out (e.g. those there before the session started).
    Raises:
        RuntimeError: no trace file to read (the profiler wrote none).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    skip = set(skip)
    paths = [p for p in trace_files(logdir) if p not in skip]
    if not paths:
        raise RuntimeError(f"the profiler wrote no trace under {logdir}")
    raw = []  # (name, line's start ns, offset ps, duration ps)
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = plane.event_metadata
            for line in plane.lines:
                for event in line.events:
                    name = names[event.metadata_id].name
                    if keep is None or keep(name):
                        raw.append((name, line.timestamp_ns, event.offset_ps,
                                    event.duration_ps))
    origin = min((ns for _, ns, _, _ in raw), default=0)
    events = []
    for name, ns, offset_ps, duration_ps in raw:
        start_ps = (ns - origin) * 1000 + offset_ps
        events.append((name, start_ps / 1e6, (start_ps + duration_ps) / 1e6))
    return events


def op_type(name):
    """The op type of a host op event's name (`scope/op:MatMul` -> `MatMul`), else None."""
    if ":" not in name or "::" in name:
        return None
    kind = name.rsplit(":", 1)[-1]
    return kind if kind[:1].isupper() and kind.isidentifier() else None

