"""tools/bench_checkpoint.py on a tiny transformer, one round: its JSON keeps the keys it had
(ms per step, overhead, blocked per save) and accounts for each save: the process's CPU per
step, every phase of a save with its CPU time, the bytes written, the steps after a save."""

import json
import sys

from subproc import ROOT, run

ASYNC_PHASES = ("snapshot", "write", "manifest", "publish", "writer")


def test_the_bench_accounts_for_each_save(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, f"{ROOT}/tools/bench_checkpoint.py", "--rounds=1",
                "--width=32", "--depth=1", f"--out={out}"], timeout=500)
    result = json.loads(out.read_text())
    (row,) = result["rounds"]
    mib = result["checkpoint_bytes"] / 2 ** 20
    for side in ("sync", "async"):
        s = row[side]
        assert {"ms_per_step", "blocked_ms", "overhead"} <= set(result["summary"][side]) | set(s)
        # Two saves a segment (at its steps 50 and 150: the side's steps 100 apart), each
        # accounted for.
        assert len(s["blocked_ms"]) == len(s["save_cpu_ms"]) == len(s["costs"]) == 2
        first, second = (c["step"] for c in s["costs"])
        assert first % 100 == 0 and second == first + 100
        for key in ("lost_after_ms", "lost_after_cpu_ms"):
            assert len(s[key]) == 2 and set(s[key][0]) == {"1-10", "11-40"}
        if s["written_mib"] is not None:  # /proc/self/io: both saves' files, at least
            assert s["written_mib"] >= 2 * mib * 0.99, (s["written_mib"], mib)
        for cost in s["costs"]:
            phases = ASYNC_PHASES if side == "async" else ("save", "manifest")
            assert all(cost[f"{p}_cpu_ms"] >= 0 and cost[f"{p}_ms"] > 0 for p in phases), cost
    for cost in row["async"]["costs"]:
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
