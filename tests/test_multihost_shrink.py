"""A whole host lost at once shrinks an elastic job like a lost worker.

Two network namespaces stand in for two hosts (the fixtures of
`tests/test_multihost_netns.py`: a veth pair, a fork server in each), 2 worker slots on
each. `tfpar.launch --min_workers=2 --lost_after=2`, run on host 0 (inside its namespace,
as a user runs it on one of the machines), runs a 4-worker `--strategy=multi_worker` job
(Adam, global batch 32: 8 per replica, a checkpoint every 10 steps,
`--collective_timeout_s=30 --heartbeat_timeout_s=3 --startup_timeout_s=40`: the cut is
found by the 3 s heartbeat); once the first checkpoint is published, host 1's link is cut
(`ip link set down`) and stays down until the job ends. Every worker then fails in a
collective (the first to exit is as likely on host 0); host 0's workers name host 1's
workers as unhealthy, both or only one (TensorFlow names at most 3 stale tasks a check,
each on its own clock); the launcher's probe of the workers' ports finds host 1
unreachable where the names do not settle it, and the attempt counts against both of host
1's slots. The retried 4-worker attempt fails at start-up (host 1 still down, naming no
task): the probe again, the second attempt in a row, and host 1 is dropped with both slots
in one line naming it. The two survivors resume from the last published checkpoint with the
same global batch (16/16).

Checked: the job exits 0 on host 0's two workers after two restarts (world size 4 -> 2);
the survivors resumed at the step the checkpoint directory had published when the loss was
declared (copied then, before they started); their per-step losses equal the uninterrupted
run's on 2 replicas (one process, `mirrored` over 2 logical CPUs) resumed from that copy,
within 1e-5 (relative; Adam), and so do their final weights; both ranks end with the same
step count, losses, weights and Adam state, to the bit; no process of the job is left. The
namespaces are deleted afterwards (the fixture asserts it). Needs root and `ip`: skips
saying so otherwise; under `CI=true` as root that is a failure.

The launcher's rule itself, without namespaces or TensorFlow: `tfpar.host_loss.lost_host` on
its cases (named whole, in part, not at all; the probe's answers), `named_worker`,
`answered` on a connect's errors, `probe_hosts` on loopback (a full listen queue: no reply)
and on a fake network (`socket.getaddrinfo` and `socket.socket` replaced: dual-stack names,
mixed answers, hung connects and lookups against one deadline), and whole jobs of
`tests/host_cut_child.py` on two loopback addresses with a fake probe (and the real one, to
which a loopback host answers: the named worker lost, not the host; a host dead at launch
lost whole; signals before the start and while a failed attempt stops), `--probe_timeout`'s
and `--discovery_interval`'s refusals, `--discovery` holding a silent host's slots.
"""

import errno
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from subproc import ROOT, child_env, published_step, rank_line, run
from tfpar import host_loss, launch as tfpar_launch
from tfpar.errors import ConfigError
from subproc import max_diff as _gap, saved_arrays as _arrays
from test_multihost_netns import _orphans, hosts, servers  # noqa: F401 (fixtures)

CHILD = os.path.join(ROOT, "tests", "train_configs_child.py")
CUT_CHILD = os.path.join(ROOT, "tests", "host_cut_child.py")
LAUNCHER = os.path.join(ROOT, "tests", "netns_launch.py")
PORT = 23756
CFG = {"model": "mlp", "optimizer": "adam", "strategy": "multi_worker", "steps": 80,
       "steps_per_epoch": 10, "checkpoint_every": 10, "global_batch_size": 32,
       "verbose": 0, "collective_timeout_s": 30, "heartbeat_timeout_s": 3,
       "startup_timeout_s": 40, "checkpoint_async": False}


def test_a_host_cut_off_is_lost_as_a_unit_and_the_survivors_resume(  # noqa: F811
        hosts, servers, tmp_path, report_measured):
    spec_servers, _ = servers
    lost_host = hosts.address(1)
    ckpt, copy = tmp_path / "ckpt", tmp_path / "at_loss"
    spec = {"namespaces": dict(zip([hosts.address(0), lost_host], hosts.namespaces)),
            "hosts": [[hosts.address(0), 2], [lost_host, 2]],
            "launch": {"base_port": PORT, "max_restarts": 3, "grace": 2, "timeout": 300,
                       "min_workers": 2, "lost_after": 2}, **spec_servers}
    cfg = {**CFG, "checkpoint_dir": str(ckpt)}
    # The launcher on host 0: its probe reaches host 1 over the link the test cuts.
    cmd = ["ip", "netns", "exec", hosts.namespaces[0], sys.executable, LAUNCHER,
           json.dumps(spec), "--", sys.executable, CHILD, json.dumps([cfg]),
           str(tmp_path / "elastic")]
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
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        hosts.set_link(1, up=True)
    reader.join(timeout=10)
    seconds = time.monotonic() - began
    output = "".join(lines)
    context = f"{seen}\n{output[-6000:]}"
    assert proc.returncode == 0, context
    assert seen["at_cut"] is not None, context  # cut after a checkpoint, during training
    assert "stopped sending heartbeats" in output, context  # TensorFlow named the lost
    # Attempt 0 (the cut) and attempt 1 (start-up, host 1 still down) count against both
    # of host 1's slots; none of host 0's is ever blamed.
    restarted = re.search(r"tfpar\.launch: attempt 0: (.*); restarting all 4 workers", output)
    assert restarted, context
    assert (f"named every worker of host {lost_host} (2, 3)" in restarted.group(1)
            or f"host {lost_host} did not answer the launcher's probe" in restarted.group(1)
            ), context
    assert re.search(rf"tfpar\.launch: attempt 1: .*; host {re.escape(lost_host)} did not "
                     r"answer the launcher's probe .*; "
                     rf"host {re.escape(lost_host)} is lost with its worker slot\(s\) 2, 3 "
                     r"\(failed 2 attempts in a row\): continuing with 2 workers", output
                     ), context
    assert output.count(" is lost") == 1, context
    assert re.search(r"all 2 workers exited 0 \(3 attempt\(s\), 2 restarts\); world size "
                     r"4 -> 2", output), context
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
    how = "named whole" if "named every worker" in restarted.group(1) else "probed"
    report_measured(f"multi-host shrink (2+2 namespace workers, host 1's link cut after "
                    f"step {seen['at_cut']}'s checkpoint and kept down, --lost_after=2; "
                    f"attempt 0's host {how}): resumed at step {seen['at_loss']} on 2 "
                    f"workers; largest relative loss gap to the one-process 2-replica run "
                    f"from the same checkpoint {gaps.max():.1e}, final weights' gap "
                    f"{gap:.1e}; job {seconds:.1f} s")
    assert gaps.max() <= 1e-5, f"{gaps}\n{context}"
    assert gap <= 1e-5, context
    # Every rank's step and optimizer state agree after the resize.
    assert _gap(weights[0], weights[1]) == 0 and _gap(slots[0], slots[1]) == 0, context
    assert int(slots[0][0]) == int(slots[1][0]) == CFG["steps"], context  # Adam's count
    assert not _orphans(tmp_path), context


def _cut_job(named, probe=None, down=1, lost_after=1, min_workers=1, mode=(), **kwargs):
    """The launcher over two loopback hosts of 2 workers each (local workers); host
    127.0.0.2 is cut off for the first `down` attempts, and in attempt 0 the other host's
    workers name the tasks `named` (`tests/host_cut_child.py`; `mode`: its last
    arguments)."""
    err = io.StringIO()
    layout = [("127.0.0.1", 2), ("127.0.0.2", 2)]
    with tempfile.TemporaryDirectory() as ready:
        result = tfpar_launch.launch(
            [sys.executable, CUT_CHILD, "127.0.0.2", ",".join(map(str, named)), str(down),
             *mode],
            4, hosts=layout, min_workers=min_workers, lost_after=lost_after,
            max_restarts=3, grace=1, out=io.StringIO(), err=err,
            env=child_env({"HOST_CUT_READY": ready}), probe=probe, **kwargs)
    return result, err.getvalue()


def _hosts_of(addresses):
    return sorted(a.rsplit(":", 1)[0] for a in addresses)


class FakeProbe:
    """The launcher's probe: its first call (before the workers start, the hosts' ports
    closed) answers `before` (default: every host answers), later ones `answers` ({host:
    True, False or None}); records the addresses of each call."""

    def __init__(self, answers, before=None):
        self.answers, self.before, self.calls = answers, before, []

    def __call__(self, addresses):
        self.calls.append(list(addresses))
        if len(self.calls) == 1:
            return (dict.fromkeys(_hosts_of(addresses), True) if self.before is None
                    else dict(self.before))
        return dict(self.answers)


CUT_OFF = {"127.0.0.1": True, "127.0.0.2": False}  # the probe's answers: host 1 cut off


def test_lost_host_decides_from_the_names_then_the_probe():
    lost_host = host_loss.lost_host
    on = ["a", "a", "b", "b"]
    cut_b, up = {"a": True, "b": False}, {"a": True, "b": True}
    # Named whole by the other host: enough, probe or not.
    assert lost_host(on, [{2, 3}, {2, 3}, set(), set()]) == ("b", "named")
    assert lost_host(on, [{2}, {3}, set(), set()], up) == ("b", "named")
    # Named in part, or not at all: the probe decides.
    assert lost_host(on, [{2}, set(), set(), set()]) == (None, "")
    assert lost_host(on, [{2}, set(), set(), set()], cut_b) == ("b", "probe")
    assert lost_host(on, [set()] * 4, cut_b) == ("b", "probe")
    assert lost_host(on, [{1, 2}, set(), set(), set()], cut_b) == ("b", "probe")
    # A host that answers (a refusal) is up: a lost worker, not a lost host.
    assert lost_host(on, [{2}, set(), set(), set()], up) == (None, "")
    assert lost_host(on, [set()] * 4, {"a": True, "b": None}) == (None, "")
    # Nobody answered (the launcher's own link?), or two hosts unreachable: no host.
    assert lost_host(on, [{2}, set(), set(), set()], {"a": False, "b": False}) == (None, "")
    assert lost_host(on, [set()] * 4, {"a": None, "b": False}) == (None, "")
    three = ["a", "b", "c"]
    assert lost_host(three, [set()] * 3, {"a": True, "b": False, "c": False}) == (None, "")
    assert lost_host(three, [set()] * 3, {"a": True, "b": False, "c": True}) == ("b", "probe")
    assert lost_host(["a", "a"], [set(), {0}], {"a": False}) == (None, "")  # one host


def test_a_connects_error_says_whether_the_host_answered():
    answered = host_loss.answered
    assert answered(None) is True  # connected
    assert answered(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) is True
    assert answered(ConnectionResetError(errno.ECONNRESET, "reset")) is True
    assert answered(TimeoutError("timed out")) is False
    assert answered(OSError(errno.EHOSTUNREACH, "No route to host")) is False
    assert answered(OSError(errno.ENETUNREACH, "Network is unreachable")) is False
    assert answered(socket.gaierror(socket.EAI_NONAME, "Name or service not known")) is None


def test_the_probe_finds_a_host_that_refuses_or_accepts_answering():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.2", 0))  # bound, not listening: a connect is refused
        addresses = [f"127.0.0.1:{listening.getsockname()[1]}",
                     f"127.0.0.2:{closed.getsockname()[1]}"]
        answers = host_loss.probe_hosts(addresses, timeout=5)
    assert answers == {"127.0.0.1": True, "127.0.0.2": True}, answers


def test_a_host_named_whole_by_the_others_is_lost_as_a_unit():
    probe = FakeProbe({})
    result, said = _cut_job([2, 3], probe=probe)
    assert result.returncode == 0, said
    # Both slots of the cut host at once, in one attempt; host 0's slots kept.
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1)], said
    assert result.elastic == ({"attempt": 1, "workers": 2},), said
    assert ("host 127.0.0.2 is lost with its worker slot(s) 2, 3 (failed 1 attempts in a "
            "row): continuing with 2 workers") in said, said
    assert "named every worker of host 127.0.0.2 (2, 3) as unhealthy" in said, said
    assert len(probe.calls) == 1, said  # before the start only: the names settled it


def test_a_host_named_in_part_and_unreachable_is_lost_as_a_unit():
    # Only one of host 1's two workers named (TensorFlow's staleness checks): the probe
    # finds the host unreachable, and both its slots go at once.
    probe = FakeProbe(CUT_OFF)
    result, said = _cut_job([2], probe=probe)
    assert result.returncode == 0, said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1)], said
    assert ("host 127.0.0.2 did not answer the launcher's probe of its workers' ports (no "
            "route or no reply), host(s) 127.0.0.1 did; host 127.0.0.2 is lost with its "
            "worker slot(s) 2, 3 (failed 1 attempts in a row)") in said, said
    assert [_hosts_of(call) for call in probe.calls] == [
        ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]] * 2, said  # before, after


def test_a_host_still_down_at_start_up_counts_toward_its_loss():
    # --lost_after=2: attempt 0 names one task of host 1, attempt 1 fails at start-up
    # naming none; both count against host 1's two slots, which are lost together after
    # the second.
    probe = FakeProbe(CUT_OFF)
    result, said = _cut_job([2], probe=probe, down=2, lost_after=2)
    assert result.returncode == 0, said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1, 2, 3), (0, 1)], said
    assert re.search(r"attempt 1: worker \d was killed by signal SIGKILL; host 127\.0\.0\.2 "
                     r"did not answer the launcher.s probe", said), said
    assert ("host 127.0.0.2 is lost with its worker slot(s) 2, 3 (failed 2 attempts in a "
            "row): continuing with 2 workers") in said, said
    # Before attempt 0, then after each failed attempt; never again before a start.
    assert len(probe.calls) == 3 and said.count(" is lost") == 1, said


def test_a_host_named_in_part_that_answers_loses_the_named_worker():
    # The real probe: host 127.0.0.2 refuses on its (now closed) worker ports, so it is
    # up, and the loss is the named worker's (slot 2), not the host's, nor that of the
    # first worker to exit (as likely on host 127.0.0.1).
    result, said = _cut_job([2])
    assert result.returncode == 0, said
    assert " is lost with its worker slot(s)" not in said, said
    assert "did not answer the launcher's probe" not in said, said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1, 3)], said
    # (the line names the named worker when another exited first; which exits first is
    # the scheduler's choice, the slot lost is not)
    assert first_exit_was(said, 2) or (
        "worker 2 was named as unhealthy, host 127.0.0.2 answered the launcher's probe: "
        "a lost worker, not a lost host; worker slot 2 is lost") in said, said
    # Without a probe (--probe_timeout=0) a host named in part is a lost worker too: the
    # one named.
    result, said = _cut_job([2], probe_timeout=0)
    assert " is lost with its worker slot(s)" not in said, said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1, 3)], said
    assert first_exit_was(said, 2) or (
        "worker 2 was named as unhealthy: a lost worker" in said), said


def first_exit_was(said, worker):
    """Whether attempt 0's line blames `worker` as the first to exit."""
    return f"attempt 0: worker {worker} exited" in said
    # A worker of the healthy host named a task of its own host too, and every host
    # answers: no host is cut off, and the names point at no one host (the first worker
    # to exit is blamed, as before).
    result, said = _cut_job([1, 2, 3])
    assert " is lost with its worker slot(s)" not in said, said
    assert "was named as unhealthy" not in said, said
    assert [len(a.slots) for a in result.attempts] == [4, 3], said


def test_a_workers_one_line_error_keeps_every_task_the_heartbeat_error_names():
    # The trainer's one line (`tfpar.train._cause`) is what the launcher reads of a
    # worker: a host of two workers is lost as a unit only if both names reach it.
    from tfpar.train import _cause

    class Stale(Exception):
        message = (f"Graph execution error:\n\n{host_loss.UNHEALTHY}\n"
                   "/job:worker/replica:0/task:2\n/job:worker/replica:0/task:3\n"
                   "The tasks have crashed.")
    line = _cause(Stale())
    assert host_loss.Unhealthy().read(line).tasks == {2, 3}, line
    assert "\n" not in line, line


def test_the_names_point_at_a_worker_only_when_all_on_one_host():
    on = ["a", "a", "b", "b"]
    assert host_loss.named_worker(on, [{2}, set(), set(), set()]) == 2
    assert host_loss.named_worker(on, [{3}, {2, 3}, set(), set()]) == 2  # the lowest
    assert host_loss.named_worker(on, [{1, 2}, set(), set(), set()]) is None  # two hosts
    assert host_loss.named_worker(on, [set()] * 4) is None
    assert host_loss.named_worker(on, [{0}, set(), set(), set()]) is None  # itself only
    assert host_loss.named_worker(on, [{0}, set(), {0}, set()]) == 0


class FakeSocket:
    """`socket.socket` for the probe's unit tests (`_fake_network` makes one class a test,
    so no thread of another test's probe writes to its records): a connect to `(ip, port)`
    does what `plan[(ip, port)]` says ("refuse", "accept", "unreachable", "timeout": waits
    out its timeout, "timeout now": times out at once, "hang": ignores its timeout until
    `release` is set); `connects` records them."""

    plan, connects, release = {}, [], None

    def __init__(self, family=socket.AF_INET, type=socket.SOCK_STREAM, proto=0, *args):
        self.family, self.timeout = family, None

    def settimeout(self, timeout):
        self.timeout = timeout

    def connect(self, sockaddr):
        self.connects.append(sockaddr[:2])
        what = self.plan[sockaddr[:2]]
        if what == "refuse":
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        if what == "unreachable":
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        if what == "timeout":
            time.sleep(self.timeout)
            raise TimeoutError("timed out")
        if what == "timeout now":
            raise TimeoutError("timed out")
        if what == "hang":
            self.release.wait(30)
            raise TimeoutError("timed out")

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fake_network(monkeypatch, names, plan):
    """Names resolve as `names` ({name: [ip, ...]}, IPv6 with a ':'; a name missing fails,
    one mapped to "slow" resolves only once `net.release` is set, one mapped to
    (seconds, [ip, ...]) after that long), connects go as `plan`; returns `net`, this
    test's `FakeSocket` class (`net.connects`, `net.release`, `net.looked_up`: the names
    each lookup asked for)."""
    net = type("Net", (FakeSocket,), {"plan": plan, "connects": [], "looked_up": [],
                                       "release": threading.Event()})

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        net.looked_up.append(host)
        if names.get(host) == "slow":
            net.release.wait(30)
        if isinstance(names.get(host), tuple):
            time.sleep(names[host][0])
            names[host] = names[host][1]
        if not isinstance(names.get(host), list):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port or 0, 0, 0))
                if ":" in ip else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port or 0))
                for ip in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "socket", net)
    return net


def test_a_dual_stack_host_answers_if_any_of_its_addresses_refuses(monkeypatch):
    # Its IPv6 address has no route, its IPv4 address refuses: the host is up. (A connect
    # that tried the addresses in turn and kept the last error said "unreachable".)
    net = _fake_network(monkeypatch, {"node2": ["192.0.2.7", "2001:db8::7"]},
                  {("192.0.2.7", 5000): "refuse", ("2001:db8::7", 5000): "unreachable"})
    assert host_loss.probe_hosts(["node2:5000"], timeout=1) == {"node2": True}
    assert sorted(net.connects) == [("192.0.2.7", 5000), ("2001:db8::7", 5000)]


def test_the_probe_combines_each_hosts_answers(monkeypatch):
    net = _fake_network(
        monkeypatch, {"up": ["192.0.2.1"], "cut": ["192.0.2.2", "2001:db8::2"]},
        {("192.0.2.1", 1): "timeout", ("192.0.2.1", 2): "refuse",
         ("192.0.2.2", 1): "timeout", ("192.0.2.2", 2): "unreachable",
         ("2001:db8::2", 1): "unreachable", ("2001:db8::2", 2): "unreachable"})
    addresses = ["up:1", "up:2", "up:3", "up:4", "cut:1", "cut:2", "unknown.invalid:1"]
    answers = host_loss.probe_hosts(addresses, timeout=0.5)
    # One refusal is an answer; a timeout and no route are none; a name that does not
    # resolve says nothing.
    assert answers == {"up": True, "cut": False, "unknown.invalid": None}, answers
    assert sorted(net.looked_up) == ["cut", "unknown.invalid", "up"]  # one lookup a host
    assert sorted(p for ip, p in net.connects if ip == "192.0.2.1") == [1, 2]


def test_the_probe_keeps_one_deadline(monkeypatch):
    # A connect that ignores its timeout and a name lookup that hangs: the probe still
    # ends at its deadline; the one gives no reply (unreachable), the other is unknown.
    net = _fake_network(monkeypatch, {"hung": ["192.0.2.3"], "slow": "slow"},
                  {("192.0.2.3", port): "hang" for port in (1, 2, 3)})
    try:
        began = time.monotonic()
        answers = host_loss.probe_hosts(["hung:1", "hung:2", "hung:3", "slow:1"], timeout=1)
        took = time.monotonic() - began
    finally:
        net.release.set()
    assert answers == {"hung": False, "slow": None}, answers
    assert took < 2.5, took  # one deadline of 1 s (not a wait per thread, 6 s each)
    assert len(net.connects) == host_loss.PORTS_PER_HOST


def test_no_reply_after_a_slow_lookup_says_nothing(monkeypatch):
    # The name took 0.7 s of the probe's 1 s: its connects' 0.3 s without a reply are no
    # evidence the host is cut off (a timeout, or still waiting at the deadline).
    net = _fake_network(monkeypatch, {"late": (0.7, ["192.0.2.4"])},
                        {("192.0.2.4", 1): "timeout now", ("192.0.2.4", 2): "hang"})
    try:
        answers = host_loss.probe_hosts(["late:1", "late:2"], timeout=1)
    finally:
        net.release.set()
    assert answers == {"late": None}, answers
    assert sorted(net.connects) == [("192.0.2.4", 1), ("192.0.2.4", 2)]  # both were tried
    # The same timeout with the whole time to run is no reply: the host is unreachable.
    net = _fake_network(monkeypatch, {"prompt": ["192.0.2.5"]},
                        {("192.0.2.5", 1): "timeout now", ("192.0.2.5", 2): "refuse"})
    assert host_loss.probe_hosts(["prompt:1"], timeout=1) == {"prompt": False}


def test_a_full_listen_queue_gives_no_reply():
    # A real "unreachable" without root: a port whose listen queue is full drops new
    # connects (no refusal), so a host with only such a port does not answer in time;
    # with one refusing port besides, it does.
    with socket.socket() as full, socket.socket() as closed:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        try:
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
            time.sleep(0.2)
            closed.bind(("127.0.0.1", 0))
            assert host_loss.probe_hosts([f"127.0.0.1:{port}"], timeout=1) == {
                "127.0.0.1": False}
            assert host_loss.probe_hosts(
                [f"127.0.0.1:{port}", f"127.0.0.1:{closed.getsockname()[1]}"],
                timeout=1) == {"127.0.0.1": True}
        finally:
            for filler in fillers:
                filler.close()


def test_a_host_dead_at_launch_is_lost_as_a_unit():
    # Host 127.0.0.2 gives no reply before attempt 0 and stays down; no worker names a
    # task. Silent before the start and again after each failure while host 127.0.0.1
    # answers: it is checked again before attempt 1 and lost whole after --lost_after=2
    # attempts (the launcher before blamed worker slot 0 on host 127.0.0.1, keeping the
    # dead host).
    probe = FakeProbe(CUT_OFF, before=CUT_OFF)
    result, said = _cut_job([], probe=probe, down=2, lost_after=2)
    assert result.returncode == 0, said
    assert ("host 127.0.0.2 did not answer the launcher's probe of its closed worker ports "
            "before its workers started (no reply or no route): it is checked again") in said
    assert said.count("before its workers started") == 1, said  # said once
    assert ("host 127.0.0.2 is lost with its worker slot(s) 2, 3 (failed 2 attempts in a "
            "row): continuing with 2 workers") in said, said
    assert "worker slot 0 is lost" not in said, said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1, 2, 3), (0, 1)], said
    both = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
    # Before attempt 0; after it; the silent host again before attempt 1; after it.
    assert [_hosts_of(call) for call in probe.calls] == [
        both, both, ["127.0.0.2", "127.0.0.2"], both], said


def test_a_host_that_answers_before_a_later_start_is_trusted():
    # Silent before attempt 0 and, after it failed, no evidence (None): not lost; then
    # refusing before attempt 1 (up, its ports closed): trusted, never checked again.
    replies = [{"a": True, "b": False}, {"a": True, "b": None}, {"b": True}]
    calls = []

    def probe(addresses):
        calls.append(list(addresses))
        return replies[len(calls) - 1]

    hosts_probe = tfpar_launch._HostProbe(probe, io.StringIO())
    hosts_probe.baseline(["a", "b"], ["a:1", "b:1"])
    assert hosts_probe.trusted == {"a"} and hosts_probe.silent == {"b"}
    assert hosts_probe.after(["a", "b"], ["a:1", "b:1"]) == {"a": True, "b": None}
    hosts_probe.baseline(["a", "b"], ["a:2", "b:2"])
    assert calls[-1] == ["b:2"]  # only the untrusted host checked again
    assert hosts_probe.trusted == {"a", "b"} and not hosts_probe.silent
    hosts_probe.baseline(["a", "b"], ["a:3", "b:3"])
    assert len(calls) == 3  # every host trusted: no check
    hosts_probe.trusted.discard("b")  # one host trusted, none silent: no probe after
    assert hosts_probe.after(["a", "b"], ["a:3", "b:3"]) == {"a": None, "b": None}
    assert len(calls) == 3


def test_a_host_whose_name_did_not_resolve_before_the_start_is_not_probed_after():
    # Host 127.0.0.2's pre-start answer was None (no answer in time, or its name did not
    # resolve): untrusted, it is checked again before the next attempt but not probed
    # after a failure (one host left to probe: no probe at all), so "unreachable" then
    # says nothing and the worker the names point at is lost, not the host.
    probe = FakeProbe(CUT_OFF, before={"127.0.0.1": True, "127.0.0.2": None})
    result, said = _cut_job([2], probe=probe)
    assert result.returncode == 0, said
    assert ("host 127.0.0.2 did not answer the launcher's probe of its closed worker ports "
            "before its workers started (no answer in time or its name did not resolve)"
            ) in said, said
    assert " is lost with its worker slot(s)" not in said, said
    assert "worker 2 was named as unhealthy: a lost worker, not a lost host" in said, said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1, 3)], said
    assert [_hosts_of(call) for call in probe.calls] == [
        ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"], ["127.0.0.2"]], said


def test_no_probe_when_min_workers_forbids_losing_a_host():
    # 2 + 2 slots, --min_workers=3: losing either host leaves 2, so no host is worth
    # probing (the rule: at least --min_workers slots on the other hosts).
    probe = FakeProbe(CUT_OFF)
    result, said = _cut_job([2], probe=probe, min_workers=3)
    assert probe.calls == [], said
    assert " is lost with its worker slot(s)" not in said, said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1, 3)], said
    world = tfpar_launch._World(4, 2, 4, 1, io.StringIO())
    assert world.can_lose_a_host(["a", "a", "b", "b"])  # 2 left on the other host
    world.min_workers = 3
    assert not world.can_lose_a_host(["a", "a", "b", "b"])
    assert world.can_lose_a_host(["a", "a", "a", "b"])  # losing b leaves 3
    world.slots = [0, 1, 2]
    assert not world.can_lose_a_host(["a", "a", "a", "b"])  # one host left


def test_the_default_probe_is_probe_hosts_with_probe_timeout(monkeypatch):
    calls = []

    def probe_hosts(addresses, timeout):
        calls.append((_hosts_of(addresses), timeout))
        return {h: h != "127.0.0.2" or len(calls) == 1 for h in _hosts_of(addresses)}

    monkeypatch.setattr(tfpar_launch, "probe_hosts", probe_hosts)
    result, said = _cut_job([2], probe_timeout=1.5)
    both = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
    assert calls == [(both, 1.5), (both, 1.5)], said
    assert [a.slots for a in result.attempts] == [(0, 1, 2, 3), (0, 1)], said
    calls.clear()
    _cut_job([2], probe_timeout=0)
    assert calls == []


class SignalledProbe(FakeProbe):
    """A probe whose call number `at` sends the launcher SIGTERM (1: the check before the
    start; 2: the probe after the attempt failed)."""

    def __init__(self, answers, at):
        super().__init__(answers)
        self.at = at

    def __call__(self, addresses):
        answers = super().__call__(addresses)
        if len(self.calls) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return answers


def test_a_signal_during_the_probe_stops_the_job_without_a_restart():
    assert threading.current_thread() is threading.main_thread()  # the handler's thread
    probe = SignalledProbe(CUT_OFF, at=2)
    result, said = _cut_job([2], probe=probe)
    assert result.returncode == 128 + signal.SIGTERM, said
    assert len(result.attempts) == 1, said
    assert "restarting" not in said and " is lost" not in said, said


def test_a_signal_during_the_check_before_the_start_starts_no_worker():
    probe = SignalledProbe(CUT_OFF, at=1)
    result, said = _cut_job([2], probe=probe)
    assert result.returncode == 128 + signal.SIGTERM, said
    assert [a.exit_codes for a in result.attempts] == [()], said  # no worker was started
    assert "failed: the launcher received SIGTERM before the workers started" in said, said
    assert len(probe.calls) == 1, said


def test_a_signal_while_a_failed_attempt_stops_skips_the_probe():
    # Host 1's workers pass the launcher's SIGTERM (stopping the failed attempt) back to
    # it: the job ends, without probing the hosts first.
    probe = FakeProbe(CUT_OFF)
    result, said = _cut_job([2], probe=probe, mode=("signal",))
    assert result.returncode == 128 + signal.SIGTERM, said
    assert len(result.attempts) == 1, said
    assert len(probe.calls) == 1, said  # the check before the start only
    assert "restarting" not in said and " is lost" not in said, said


@pytest.mark.parametrize("setting, value, expected", [
    ("probe_timeout", float("nan"), "a number >= 0"), ("probe_timeout", -1, "a number >= 0"),
    ("probe_timeout", float("inf"), "finite number of seconds >= 1.5"),
    ("probe_timeout", 1.4, "finite number of seconds >= 1.5"),
    ("discovery_interval", float("nan"), "a number >= 0"),
    ("discovery_interval", float("inf"), "finite number of seconds >= 0.1"),
    ("discovery_interval", 0.05, "finite number of seconds >= 0.1"),
    ("timeout", float("nan"), "a number >= 0"), ("grace", float("nan"), "a number >= 0")])
def test_a_probe_timeout_that_cannot_work_is_refused_in_one_line(setting, value, expected):
    with pytest.raises(ConfigError) as raised:
        tfpar_launch.launch(["true"], 2, hosts=[("127.0.0.1", 1), ("127.0.0.2", 1)],
                            min_workers=1, **{setting: value})
    assert raised.value.setting == setting and "\n" not in str(raised.value)
    assert expected in str(raised.value), raised.value
    assert tfpar_launch.launch(["true"], 1, probe_timeout=0, out=io.StringIO(),
                               err=io.StringIO()).returncode == 0


def test_a_lost_host_listed_again_is_offered_only_once_it_answers():
    # Host b was lost with slots 2, 3; --discovery stops listing it, then lists it again:
    # its slots are offered only when the launcher's probe finds it answering.
    err, asked = io.StringIO(), []
    answer = {"b": False}

    def reachable(host, rank):
        asked.append((host, rank))
        return answer[host]

    offers = tfpar_launch._Offers(["a", "a", "b", "b"], 4, "", 5, err, reachable)
    for slot in (2, 3):
        offers.lost(slot)
    offers.update({"a": 2})  # b gone: its slots may come back later
    assert offers.added([0, 1]) == [] and asked == []
    offers.update({"a": 2, "b": 2})
    assert offers.added([0, 1]) == [], err.getvalue()  # listed, but silent
    assert asked == [("b", 0)]
    assert ("--discovery lists host b again, but it did not answer the launcher's probe: "
            "its lost slot(s) 2, 3 are not offered until it does") in err.getvalue()
    offers.update({"a": 2, "b": 2})
    assert err.getvalue().count("lists host b again") == 1  # said once
    answer["b"] = True
    offers.update({"a": 2, "b": 2})
    assert offers.added([0, 1]) == [2, 3]
    # The default: the launcher's own probe, only for a host that answered it before.
    hosts_probe = tfpar_launch._HostProbe(FakeProbe({"b": False}), io.StringIO())
    hosts_probe.baseline(["a", "b"], ["a:1", "b:7000"])
    assert tfpar_launch._answers(hosts_probe, 7000, "b", 1) is False
    assert hosts_probe.probe.calls[-1] == ["b:7001"]
    hosts_probe.trusted.discard("b")
    assert tfpar_launch._answers(hosts_probe, 7000, "b", 1) is None
    assert tfpar_launch._answers(None, 7000, "b", 1) is None


def test_a_host_silent_to_the_probe_gets_no_new_slot():
    # Host b (slots 2, 3 lost) is listed again with a slot more, but does not answer the
    # probe: none of its slots is offered, the new slot 4 neither, until it answers.
    err, asked, answer = io.StringIO(), [], {"b": False}

    def reachable(host, rank):
        asked.append((host, rank))
        return answer[host]

    offers = tfpar_launch._Offers(["a", "a", "b", "b"], 5, "", 5, err, reachable)
    for slot in (2, 3):
        offers.lost(slot)
    offers.update({"a": 2})
    offers.update({"a": 2, "b": 3})
    assert offers.added([0, 1]) == [], err.getvalue()
    assert asked == [("b", 0)]
    answer["b"] = True
    offers.update({"a": 2, "b": 3})
    assert offers.added([0, 1]) == [2, 3, 4]
    # A host with only new slots, silent: held too, in its own words.
    offers = tfpar_launch._Offers(["a", "a", "b", "b"], 5, "", 5, err, reachable)
    answer["b"] = False
    offers.update({"a": 2, "b": 3})
    assert offers.added([0, 1, 2, 3]) == [] and asked[-1] == ("b", 2)
    assert ("--discovery lists more slots on host b, but it did not answer the launcher's "
            "probe: its slots are not offered until it does") in err.getvalue()
    answer["b"] = None  # no evidence (an untrusted host): offered
    offers.update({"a": 2, "b": 3})
    assert offers.added([0, 1, 2, 3]) == [4]
