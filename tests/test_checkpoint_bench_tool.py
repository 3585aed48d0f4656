"""tools/bench_checkpoint.py on a tiny transformer, one round: its JSON keeps the keys it had
(ms per step, overhead, blocked per save) and accounts for each save: the process's CPU per
step, every phase of a save with its CPU time, the bytes written, the steps after a save.
Without TensorFlow: `Checkpointer.costs` (`tfpar.checkpoint_writer.Costs`) gives a segment's
saves past its cap of records, and only complete ones; the bytes written are unknown on
tmpfs, not 0."""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading

import pytest

from subproc import ROOT, run
from tfpar.checkpoint_writer import Costs, Writer
from tfpar.errors import TfparError


def _bench():
    spec = importlib.util.spec_from_file_location("bench_checkpoint",
                                                  f"{ROOT}/tools/bench_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _save(costs, step):
    record = costs.new(step)
    Costs.timed(record, "save", lambda: None)
    costs.done(record)


def test_a_segments_saves_are_found_after_the_records_are_full():
    # As the bench reads them: the count before a segment, its saves after. 40 segments of
    # 2 saves: past 32 segments the old slice `list(records)[len(records) before:]` gave none.
    costs, step = Costs(), 0
    for _ in range(40):
        first = costs.count
        for _ in range(2):
            step += 100
            _save(costs, step)
        assert [r["step"] for r in costs.since(first)] == [step - 100, step]
    assert len(costs.records) == Costs.MAX and costs.count == 80
    assert costs.since(costs.count) == []
    # A segment of more saves than the records keep: refused, not cut short.
    first = costs.count
    for _ in range(Costs.MAX + 1):
        step += 100
        _save(costs, step)
    with pytest.raises(TfparError, match=f"{Costs.MAX + 1} saves since count 80"):
        costs.since(first)


def test_the_bench_refuses_a_segment_of_more_saves_than_the_records_keep():
    proc = subprocess.run([sys.executable, f"{ROOT}/tools/bench_checkpoint.py",
                           f"--segment={(Costs.MAX + 1) * 100}"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2
    assert (f"--segment={(Costs.MAX + 1) * 100}: {Costs.MAX + 1} saves a segment, "
            f"Checkpointer.costs keeps {Costs.MAX}; use at most {Costs.MAX * 100}"
            in proc.stderr.splitlines()[-1]), proc.stderr


def test_an_async_saves_record_appears_complete_when_its_write_ends():
    # As `Checkpointer.save` does it: the record filled in the writer thread, appended at
    # its end; a reader meanwhile sees no half record.
    costs, writer, go = Costs(), Writer(), threading.Event()
    record = costs.new(100)
    Costs.timed(record, "snapshot", lambda: None)

    def write_and_account():
        Costs.timed(record, "writer", Costs.timed, record, "write", go.wait)
        costs.done(record)
    writer.submit(100, write_and_account)
    assert list(costs.records) == [] and costs.count == 0
    go.set()
    writer.wait()
    (done,) = costs.records
    assert set(done) == {"step", "snapshot_cpu_ms", "snapshot_ms", "write_cpu_ms", "write_ms",
                         "writer_cpu_ms", "writer_ms"}
    # A failed write leaves no record.
    failed = costs.new(200)

    def fail():
        Costs.timed(failed, "write", lambda: 1 / 0)
        costs.done(failed)
    writer.submit(200, fail)
    with pytest.raises(TfparError, match="write of step 200 failed"):
        writer.wait()
    assert [r["step"] for r in costs.records] == [100] and costs.count == 1


def test_the_bytes_written_are_unknown_on_tmpfs():
    bench = _bench()
    if not os.path.isdir("/dev/shm") or bench.file_system("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    folder = tempfile.mkdtemp(dir="/dev/shm")
    try:
        assert bench.file_system(folder) == "tmpfs"
        assert bench.written_bytes(folder) is None
    finally:
        os.rmdir(folder)
    if os.path.exists("/proc/self/io"):  # a disk's: known
        assert bench.file_system(ROOT) not in bench.MEMORY_FS
        assert bench.written_bytes(ROOT) is not None

ASYNC_PHASES = ("snapshot", "write", "manifest", "publish", "writer")


def test_the_bench_accounts_for_each_save(tmp_path):
    out = tmp_path / "bench.json"
    # With --nice, a fourth side: async with its writer thread at nice 19.
    proc = run([sys.executable, f"{ROOT}/tools/bench_checkpoint.py", "--rounds=1",
                "--width=32", "--depth=1", "--nice=19", f"--out={out}"], timeout=500)
    result = json.loads(out.read_text())
    (row,) = result["rounds"]
    bench = _bench()
    mib = result["checkpoint_bytes"] / 2 ** 20
    assert sorted(row["order"]) == ["async", "async_nice", "none", "sync"]
    for side in ("sync", "async", "async_nice"):
        s = row[side]
        assert {"ms_per_step", "overhead", "overhead_min", "overhead_max", "blocked_ms",
                "blocked_ms_min", "blocked_ms_max"} <= set(result["summary"][side])
        assert {"ms_per_step", "blocked_ms", "overhead"} <= set(s)
        # Two saves a segment (at its steps 50 and 150: the side's steps 100 apart), each
        # accounted for.
        assert len(s["blocked_ms"]) == len(s["save_cpu_ms"]) == len(s["costs"]) == 2
        first, second = (c["step"] for c in s["costs"])
        assert first % 100 == 0 and second == first + 100
        for key in ("lost_after_ms", "lost_after_cpu_ms"):
            assert len(s[key]) == 2 and set(s[key][0]) == {"1-10", "11-40"}
        # Unknown (None) only where the bench's temporary directory is in memory.
        in_memory = bench.file_system(tempfile.gettempdir()) in bench.MEMORY_FS
        if os.path.exists("/proc/self/io"):
            assert (s["written_mib"] is None) == in_memory, (s["written_mib"], in_memory)
        if s["written_mib"] is not None:  # /proc/self/io: both saves' files, at least
            assert s["written_mib"] >= 2 * mib * 0.99, (s["written_mib"], mib)
        for cost in s["costs"]:
            phases = ASYNC_PHASES if side != "sync" else ("save", "manifest")
            assert all(cost[f"{p}_cpu_ms"] >= 0 and cost[f"{p}_ms"] > 0 for p in phases), cost
    for cost in row["async"]["costs"] + row["async_nice"]["costs"]:
        # After the warm-up round's saves, every save reads the variables in one call: the
        # call is not traced again (a save whose objects looked new would read one by one).
        assert cost["batched_reads"] is True, cost
        # The writer thread's whole work holds its phases; the step blocked for the snapshot.
        assert cost["writer_ms"] >= cost["write_ms"] + cost["manifest_ms"] + cost["publish_ms"]
        assert "save_ms" not in cost
    for cost in row["sync"]["costs"]:
        assert cost["save_ms"] >= cost["manifest_ms"] and "writer_ms" not in cost
    # The control: no save, no checkpoint bytes; its steps at the saves' positions.
    assert row["none"]["costs"] == [] and len(row["none"]["lost_after_ms"]) == 2
    summary = result["summary"]
    assert summary["async"]["phases"]["writer_cpu_ms"]["median"] > 0
    assert summary["none"]["cpu_ms_per_step"] > 0
    assert "CPU time (all the process's threads)" in proc.stdout
