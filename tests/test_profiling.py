"""`tfpar.profiling`: profiler traces read back, on trace files written here (TensorFlow's
XSpace protobuf, no profiler run): every file, the name filter, the files skipped, and
durations exact at epoch timestamps. Real traces are read in tests/test_pipeline_timeline.py
and tests/test_zero3_prefetch.py."""

import os

import pytest

from tfpar import profiling

EPOCH_NS = 1_764_892_800_000_000_000  # 2025-12-05 in ns: epoch microseconds ~1.8e15


def _write(path, line_ns, events):
    """One plane, one line starting at `line_ns`, events `(name, offset_ps, duration_ps)`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    plane = space.planes.add()
    line = plane.lines.add()
    line.timestamp_ns = line_ns
    for i, (name, offset_ps, duration_ps) in enumerate(events, start=1):
        plane.event_metadata[i].id = i
        plane.event_metadata[i].name = name
        event = line.events.add()
        event.metadata_id, event.offset_ps, event.duration_ps = i, offset_ps, duration_ps
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(space.SerializeToString())


def test_every_file_is_read_with_its_filter_and_exact_durations(tmp_path):
    first = str(tmp_path / "plugins" / "profile" / "run1" / "host.xplane.pb")
    second = str(tmp_path / "plugins" / "profile" / "run2" / "host.xplane.pb")
    _write(first, EPOCH_NS, [("dense/MatMul:MatMul", 1_000_000, 1_234_567),
                             ("ThreadpoolListener::Record", 0, 5)])
    _write(second, EPOCH_NS + 2_000, [("s0_F0_c0/add:AddV2", 7, 3)])
    assert profiling.trace_files(str(tmp_path)) == [first, second]
    events = profiling.read_events(str(tmp_path))
    assert sorted(name for name, _, _ in events) == [
        "ThreadpoolListener::Record", "dense/MatMul:MatMul", "s0_F0_c0/add:AddV2"]
    ops = {name: (start, end) for name, start, end in profiling.read_events(
        str(tmp_path), keep=lambda n: profiling.op_type(n) is not None)}
    assert sorted(ops) == ["dense/MatMul:MatMul", "s0_F0_c0/add:AddV2"]
    # From the earliest line, in microseconds: 1.234567 us stays 1.234567 us (as epoch
    # microseconds, 1.76e15, a float would keep it only to 0.25 us).
    start, end = ops["dense/MatMul:MatMul"]
    assert start == 1.0 and end - start == pytest.approx(1.234567, abs=1e-9)
    start, end = ops["s0_F0_c0/add:AddV2"]
    assert start == pytest.approx(2.000007, abs=1e-9)
    assert end - start == pytest.approx(3e-6, abs=1e-9)
    # The files of an earlier session left out.
    assert [n for n, _, _ in profiling.read_events(str(tmp_path), skip=[first])] == [
        "s0_F0_c0/add:AddV2"]
    with pytest.raises(RuntimeError, match="no trace"):
        profiling.read_events(str(tmp_path), skip=[first, second])


def test_op_type_reads_host_op_events_only():
    assert profiling.op_type("gradient_tape/dense/MatMul:MatMul") == "MatMul"
    assert profiling.op_type("CollectiveGatherV2:CollectiveGatherV2") == "CollectiveGatherV2"
    assert profiling.op_type("ThreadpoolListener::Record") is None  # C++ scopes
    assert profiling.op_type("EagerExecute: MatMul") is None
    assert profiling.op_type("dense/MatMul") is None
