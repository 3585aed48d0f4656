"""A whole host lost at once shrinks an elastic job like a lost worker.

Two network namespaces stand in for two hosts (the fixtures of
`tests/test_multihost_netns.py`: a veth pair, a fork server in each): 2 worker slots on
host 0, 1 on host 1. `tfpar.launch --min_workers=1 --lost_after=1` runs a 3-worker
`--strategy=multi_worker` job (Adam, global batch 32: 11/11/10 per replica, a checkpoint
every 10 steps, `--collective_timeout_s=30 --heartbeat_timeout_s=3`: the cut is found by
the 3 s heartbeat, and a loaded machine's late worker does not fail the end-of-training
barrier); once the first
checkpoint is published, host 1's link is cut (`ip link set down`). Every worker then fails
in a collective (the first to exit is as likely on host 0); host 0's workers name host 1's
worker as unhealthy (TensorFlow's error: "stopped sending heartbeats", here in a traceback:
the workers run `tests/train_configs_child.py`, not the trainer's one-line error), and
the launcher drops every slot of host 1 at once, in one line naming the host, and the two
survivors resume from the last published checkpoint with the same global batch (16/16).

Checked: the job exits 0 on host 0's two workers after one restart; the survivors resumed
at the step the checkpoint directory had published when the loss was declared (copied
then, before they started); their per-step losses equal the uninterrupted run's on 2
replicas (one process, `mirrored` over 2 logical CPUs) resumed from that copy, within 1e-5
(relative; Adam), and so do their final weights; both ranks end with the same step count,
losses, weights and Adam state, to the bit; no process of the job is left. The namespaces
are deleted afterwards (the fixture asserts it). Needs root and `ip`: skips saying so
otherwise; under `CI=true` as root that is a failure.

The launcher's rule itself, without namespaces or TensorFlow (`tests/host_cut_child.py`
on two loopback addresses): a host is lost as a unit only when the other hosts' workers
named all of its workers and only those; a host named in part loses no host.
"""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

from subproc import ROOT, child_env, published_step, rank_line, run
from tfpar import launch as tfpar_launch
from subproc import max_diff as _gap, saved_arrays as _arrays
from test_multihost_netns import _orphans, hosts, servers  # noqa: F401 (fixtures)

CHILD = os.path.join(ROOT, "tests", "train_configs_child.py")
CUT_CHILD = os.path.join(ROOT, "tests", "host_cut_child.py")
LAUNCHER = os.path.join(ROOT, "tests", "netns_launch.py")
PORT = 23756
CFG = {"model": "mlp", "optimizer": "adam", "strategy": "multi_worker", "steps": 80,
       "steps_per_epoch": 10, "checkpoint_every": 10, "global_batch_size": 32,
       "verbose": 0, "collective_timeout_s": 30, "heartbeat_timeout_s": 3,
       "startup_timeout_s": 60, "checkpoint_async": False}


def test_a_host_cut_off_is_lost_as_a_unit_and_the_survivors_resume(  # noqa: F811
        hosts, servers, tmp_path, report_measured):
    spec_servers, _ = servers
    lost_host = hosts.address(1)
    ckpt, copy = tmp_path / "ckpt", tmp_path / "at_loss"
    spec = {"namespaces": dict(zip([hosts.address(0), lost_host], hosts.namespaces)),
            "hosts": [[hosts.address(0), 2], [lost_host, 1]],
            "launch": {"base_port": PORT, "max_restarts": 2, "grace": 2, "timeout": 150,
                       "min_workers": 1, "lost_after": 1}, **spec_servers}
    cfg = {**CFG, "checkpoint_dir": str(ckpt)}
    cmd = [sys.executable, LAUNCHER, json.dumps(spec), "--", sys.executable, CHILD,
           json.dumps([cfg]), str(tmp_path / "elastic")]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lines, seen = [], {}
    whole = {**CFG, "strategy": "mirrored", "cpu_devices": 2, "checkpoint_dir": str(copy)}

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "is lost with its worker slot(s)" in line:  # all stopped, none restarted yet
                seen["at_loss"] = published_step(ckpt)
                shutil.copytree(ckpt, copy)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while published_step(ckpt) is None and proc.poll() is None:
            time.sleep(0.05)
        seen["at_cut"] = published_step(ckpt)
        hosts.set_link(1, up=False)
        proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        hosts.set_link(1, up=True)
    reader.join(timeout=10)
    seconds = time.monotonic() - began
    output = "".join(lines)
    context = f"{seen}\n{output[-5000:]}"
    assert proc.returncode == 0, context
    assert seen["at_cut"] is not None, context  # cut after a checkpoint, during training
    assert "stopped sending heartbeats" in output, context  # TensorFlow named the lost
    # One line names the host and its slot; no other slot was lost; one restart.
    assert re.search(rf"tfpar\.launch: attempt 0: .*host {re.escape(lost_host)} is lost "
                     r"with its worker slot\(s\) 2 \(failed 1 attempts in a row\): "
                     r"continuing with 2 workers", output), context
    assert output.count(" is lost") == 1, context
    assert re.search(r"all 2 workers exited 0 \(2 attempt\(s\), 1 restart\); world size "
                     r"3 -> 2", output), context
    ranks = [rank_line(output, i) for i in range(2)]
    # The reference runs after the job, not beside its survivors on the 2 cores.
    result = run([sys.executable, CHILD, json.dumps([whole]), str(tmp_path / "whole")],
                 timeout=180)
    same = next(json.loads(line) for line in reversed(result.stdout.splitlines())
                if line.startswith("[{"))[0]
    for rank in ranks:  # resumed from what was published when the host was declared lost
        assert (rank["workers"], rank["replicas"]) == (2, 2), context
        assert rank["resumed_from_step"] == seen["at_loss"], context
        assert rank["steps"] == CFG["steps"] - seen["at_loss"], context
    assert same["resumed_from_step"] == seen["at_loss"]
    assert ranks[0]["loss_history"] == ranks[1]["loss_history"], context
    losses, expected = np.array(ranks[0]["loss_history"]), np.array(same["loss_history"])
    assert losses.shape == expected.shape, context
    gaps = np.abs(losses - expected) / expected
    weights = [_arrays(tmp_path / f"elastic.0.worker{i}.npz") for i in range(2)]
    slots = [_arrays(tmp_path / f"elastic.0.worker{i}.optimizer.npz") for i in range(2)]
    gap = _gap(weights[0], _arrays(tmp_path / "whole.0.npz"))
    report_measured(f"multi-host shrink (2+1 namespace workers, host 1's link cut after "
                    f"step {seen['at_cut']}'s checkpoint): resumed at step {seen['at_loss']} "
                    f"on 2 workers; largest relative loss gap to the one-process 2-replica "
                    f"run from the same checkpoint {gaps.max():.1e}, final weights' gap "
                    f"{gap:.1e}; job {seconds:.1f} s")
    assert gaps.max() <= 1e-5, f"{gaps}\n{context}"
    assert gap <= 1e-5, context
    # Every rank's step and optimizer state agree after the resize.
    assert _gap(weights[0], weights[1]) == 0 and _gap(slots[0], slots[1]) == 0, context
    assert int(slots[0][0]) == int(slots[1][0]) == CFG["steps"], context  # Adam's count
    assert not _orphans(tmp_path), context


def _cut_job(named, layout=(("127.0.0.1", 2), ("127.0.0.2", 2))):
    """The launcher over `layout`'s hosts (loopback addresses, local workers); in attempt 0
    the last host is cut off and the other hosts' workers name the tasks `named`."""
    err = io.StringIO()
    cut = layout[-1][0]
    result = tfpar_launch.launch(
        [sys.executable, CUT_CHILD, cut, ",".join(map(str, named))],
        sum(n for _, n in layout), hosts=list(layout), min_workers=1, lost_after=1,
        max_restarts=3, grace=1, out=io.StringIO(), err=err, env=child_env())
    return result, err.getvalue()


def test_a_host_named_whole_by_the_others_is_lost_as_a_unit():
    result, said = _cut_job([2, 3])
    assert result.returncode == 0, said
    # Both slots of the cut host at once, in one attempt; host 0's slots kept.
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1)], said
    assert result.elastic == ({"attempt": 1, "workers": 2},), said
    assert ("host 127.0.0.2 is lost with its worker slot(s) 2, 3 (failed 1 attempts in a "
            "row): continuing with 2 workers") in said, said
    assert "named every worker of host 127.0.0.2 (2, 3) as unhealthy" in said, said


def test_a_host_named_in_part_is_not_lost_as_a_unit():
    # Only one of host 1's two workers named: the loss is a worker's (the old rule), not
    # the host's.
    result, said = _cut_job([2])
    assert result.returncode == 0, said
    assert " is lost with its worker slot(s)" not in said, said
    assert [len(a.slots) for a in result.attempts] == [4, 3], said
    # A worker of the healthy host named a task of its own host too: no host is cut off.
    result, said = _cut_job([1, 2, 3])
    assert " is lost with its worker slot(s)" not in said, said


def test_a_workers_one_line_error_keeps_every_task_the_heartbeat_error_names():
    # The trainer's one line (`tfpar.train._cause`) is what the launcher reads of a
    # worker: a host of two workers is lost as a unit only if both names reach it.
    from tfpar.train import _cause

    class Stale(Exception):
        message = (f"Graph execution error:\n\n{tfpar_launch.UNHEALTHY}\n"
                   "/job:worker/replica:0/task:2\n/job:worker/replica:0/task:3\n"
                   "The tasks have crashed.")
    line = _cause(Stale())
    assert tfpar_launch._Unhealthy().read(line).tasks == {2, 3}, line
    assert "\n" not in line, line
