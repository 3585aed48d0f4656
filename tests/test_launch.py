"""`python -m tfpar.launch`: workers get their own TF_CONFIG; one failure stops all; nothing is
left behind. Workers here are tiny scripts (tests/launch_child.py, or a one-line `python -c`),
not TensorFlow, so the file runs fast."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tfpar import launch as tfpar_launch
from subproc import ROOT, child_env, run_module


CHILD = os.path.join(ROOT, "tests", "launch_child.py")


def worker(code):
    return ["--", sys.executable, "-c", code]


def child(case, *args):
    """The worker command of tests/launch_child.py's CASE."""
    return ["--", sys.executable, CHILD, case, *map(str, args)]


def launch(*args, timeout=30):
    # A new interpreter: the launcher never imports TensorFlow, and its error lines are
    # checked whole (a fork of the TensorFlow-importing server may log CUDA's absence).
    return run_module("tfpar.launch", *args, timeout=timeout, check=False, fresh=True)


def reports(stdout, index):
    """The JSON objects worker `index` printed (its lines carry the `[worker i] ` prefix)."""
    prefix = f"[worker {index}] "
    return [json.loads(line[len(prefix):]) for line in stdout.splitlines()
            if line.startswith(prefix + "{")]


def gone(pid, wait_s=3.0):
    """True once `pid` no longer runs (a zombie awaiting its reaper counts as gone)."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_each_worker_gets_its_own_tf_config_and_prefixed_output():
    result = launch("--workers=2", *child("report_env"))
    assert result.returncode == 0, result.stderr
    configs = []
    for i in range(2):
        (env,) = reports(result.stdout, i)
        assert (env["TFPAR_WORKER_INDEX"], env["TFPAR_NUM_WORKERS"], env["TFPAR_RESTART"]) == (
            str(i), "2", "0")
        configs.append(json.loads(env["TF_CONFIG"]))
        assert configs[-1]["task"] == {"type": "worker", "index": i}
        assert f"[worker {i}] to stderr" in result.stdout  # stderr merged into the worker's lines
    addresses = configs[0]["cluster"]["worker"]
    assert configs[1]["cluster"]["worker"] == addresses
    ports = {int(a.rsplit(":", 1)[1]) for a in addresses}
    assert len(ports) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert all(line.startswith(("[worker 0] ", "[worker 1] "))
               for line in result.stdout.splitlines())
    assert "all 2 workers exited 0" in result.stderr


def test_one_failure_stops_the_others_and_their_children(tmp_path):
    flag = tmp_path / "worker1_started"
    start = time.monotonic()
    result = launch("--workers=2", "--grace=2", *child("fail_once_started", flag))
    assert time.monotonic() - start < 15
    assert result.returncode == 1
    summary = result.stderr.strip().splitlines()[-1]
    assert summary == "tfpar.launch: failed: worker 0 exited with code 3"
    (pids,) = reports(result.stdout, 1)
    assert gone(pids["pid"]) and gone(pids["child"])


def test_a_worker_killed_by_a_signal_is_named():
    result = launch("--workers=2", *child("killed"))
    assert result.returncode == 1
    assert "worker 1 was killed by signal SIGKILL" in result.stderr


def test_timeout_stops_a_hung_job():
    start = time.monotonic()
    result = launch("--workers=2", "--timeout=1", "--grace=1",
                    *worker("import time; time.sleep(60)"))
    assert time.monotonic() - start < 15
    assert result.returncode == 1
    assert "--timeout=1s expired" in result.stderr


def test_start_timeout_names_the_worker_that_never_got_ready():
    start = time.monotonic()
    result = launch("--workers=2", "--start_timeout=2", "--grace=1", *child("ready_on_zero"))
    assert time.monotonic() - start < 15
    assert result.returncode == 1
    assert "--start_timeout=2s expired: worker(s) 1 never printed TFPAR_READY" in result.stderr


def test_start_timeout_is_met_by_ready_workers():
    code = "import time; print('TFPAR_READY'); time.sleep(3)"  # runs past the start timeout
    result = launch("--workers=2", "--start_timeout=2", *worker(code))
    assert result.returncode == 0, result.stderr


def test_restart_after_a_failed_attempt(tmp_path):
    flag = tmp_path / "worker1_started"
    result = launch("--workers=2", "--max_restarts=1", "--grace=1", *child("restart", flag))
    assert result.returncode == 0, result.stderr
    assert "attempt 0: worker 0 exited with code 3; restarting" in result.stderr
    assert "all 2 workers exited 0 (2 attempt(s), 1 restart)" in result.stderr
    assert reports(result.stdout, 1) == [{"attempt": 0}, {"attempt": 1}]


def test_restarts_run_out():
    result = launch("--workers=1", "--max_restarts=2", *worker("import sys; sys.exit(4)"))
    assert result.returncode == 1
    assert ("failed: worker 0 exited with code 4 (3 attempt(s), 2 restarts)"
            in result.stderr)


def test_log_dir_keeps_each_workers_output(tmp_path):
    result = launch("--workers=2", f"--log_dir={tmp_path}",
                    *worker("import os; print('hello from', os.environ['TFPAR_WORKER_INDEX'])"))
    assert result.returncode == 0, result.stderr
    for i in range(2):
        assert (tmp_path / f"worker_{i}.log").read_text() == f"hello from {i}\n"


def test_sigterm_to_the_launcher_reaches_every_worker():
    code = "import os, time; print('{\"pid\": %d}' % os.getpid()); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-m", "tfpar.launch", "--workers=2", "--grace=2",
                             *worker(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(), cwd=ROOT, start_new_session=True)
    guard = threading.Timer(30, os.killpg, (proc.pid, signal.SIGKILL))  # never hang the test
    guard.start()
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        pids = [json.loads(line.split("] ", 1)[1])["pid"] for line in lines]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        guard.cancel()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "the launcher received SIGTERM" in err
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize("args,message", [
    (["--workers=0", "--", "true"], "--workers=0"),
    (["--", "true"], "--workers (or --hosts) is required"),
    (["--hosts=a:0", "--", "true"], "hosts='a:0' is invalid"),
    (["--hosts=a:2,a:1", "--", "true"], "name each host once"),
    (["--hosts=127.0.0.1:2", "--workers=3", "--runner=local", "--", "true"],
     "must equal the slots of --hosts (2)"),
    (["--workers=2", "--min_workers=3", "--", "true"], "min_workers=3 is invalid"),
    (["--workers=2", "--max_workers=1", "--", "true"], "max_workers=1 is invalid"),
    (["--workers=2", "--lost_after=0", "--", "true"], "--lost_after=0"),
    (["--workers=2"], "no worker command"),
    (["--workers=2", "--"], "no worker command"),
    (["--workers=2", "--bogus", "--", "true"], "bogus"),
    (["--workers=2", "python", "x.py"], "before '--'"),
    (["--workers=2", "--timeout=-1", "--", "true"], "--timeout=-1"),
    (["--workers=2", "--", "/no/such/program"], "cannot start the worker command"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = launch(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tfpar.launch: error: ") and message in line


def test_python_api():
    out, err = io.StringIO(), io.StringIO()
    result = tfpar_launch.launch([sys.executable, "-c", "print('hi')"], workers=2, out=out,
                                 err=err, env=child_env())
    assert (result.returncode, result.restarts) == (0, 0)
    assert result.attempts == (tfpar_launch.Attempt((0, 0), "", (0, 1)),)
    assert sorted(out.getvalue().splitlines()) == ["[worker 0] hi", "[worker 1] hi"]
    assert err.getvalue() == f"tfpar.launch: {result.summary}\n"
    with pytest.raises(tfpar_launch.ConfigError, match="workers"):
        tfpar_launch.launch(["true"], workers=0)


def test_a_configuration_error_stops_the_job_at_once():
    # Worker 1 says what `tfpar.train` says of a setting it refuses and exits 2 (after
    # worker 0 has started): the launcher stops with that line, restarts unspent.
    code = ("import sys, time, os; print('TFPAR_READY', flush=True); time.sleep(0.5)\n"
            "if os.environ['TFPAR_WORKER_INDEX'] == '1':\n"
            "    print('tfpar: error: global_batch_size=31 is invalid: must be divisible by "
            "the 2 replicas (a pipeline cuts equal per-replica batches into micro-batches); "
            "try 30 or 32', file=sys.stderr); sys.exit(2)\n"
            "time.sleep(30)")
    started = time.monotonic()
    result = launch("--workers=2", "--min_workers=1", "--max_restarts=3", "--lost_after=1",
                    "--grace=1", *worker(code))
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 15, result.stderr  # not 4 attempts
    assert "restarting" not in result.stderr and "is lost" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == ("tfpar.launch: failed: worker 1 exited with code 2, a configuration "
                    "error a restart would repeat (not retried): tfpar: error: "
                    "global_batch_size=31 is invalid: must be divisible by the 2 replicas (a "
                    "pipeline cuts equal per-replica batches into micro-batches); try 30 or "
                    "32 (1 attempt(s), 0 restarts)"), result.stderr


def test_free_ports_are_distinct():
    ports = tfpar_launch.free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


def test_elastic_job_drops_a_lost_worker_and_goes_on():
    result = launch("--workers=3", "--min_workers=2", "--max_restarts=3", "--lost_after=2",
                    *child("lost_slot"))
    assert result.returncode == 0, result.stderr
    assert "worker slot 2 is lost (failed 2 attempts in a row): continuing with 2 workers" \
        in result.stderr
    assert "training resumed at step 7 on 2 workers" in result.stderr
    assert "world size 3 -> 2" in result.stderr
    survivors = reports(result.stdout, 0) + reports(result.stdout, 1)
    assert sorted((r["slot"], r["index"], r["workers"], r["attempt"]) for r in survivors) == [
        ("0", "0", "2", 2), ("1", "1", "2", 2)]


def test_an_elastic_job_without_max_restarts_still_shrinks():
    # The issue's own command: --min_workers alone. With restarts defaulting to 0 its first
    # lost worker ended the job ("failed: worker 2 exited with code 3").
    result = launch("--workers=3", "--min_workers=2", *child("lost_slot"))
    assert result.returncode == 0, result.stderr
    assert "worker slot 2 is lost (failed 2 attempts in a row): continuing with 2 workers" \
        in result.stderr
    assert "(restart 2 of 4)" in result.stderr


def test_restarts_too_few_to_shrink_are_said_and_the_job_ends_at_its_lost_worker():
    # --max_restarts=1 with --lost_after=2: slot 2 can never count as lost. Not refused (a
    # job may be elastic only to grow), said in one line before the workers start.
    result = launch("--workers=3", "--min_workers=2", "--max_restarts=1", *child("lost_slot"))
    assert result.returncode == 1, result.stderr
    said = [line for line in result.stderr.splitlines() if "cannot shrink" in line]
    assert len(said) == 1 and "--max_restarts=1 with --min_workers=2" in said[0], said
    assert "worker slot 2 is lost" not in result.stderr
    assert "failed: worker 2 exited with code 3 (2 attempt(s), 1 restart" in result.stderr


def test_a_worker_named_as_silent_is_the_one_lost():
    # A pipeline's chief that gave up on a frozen stage worker names it: that slot is lost,
    # not the chief's, though the chief is the one that exited.
    result = launch("--workers=3", "--min_workers=2", "--max_restarts=1", "--lost_after=1",
                    "--grace=1", *child("names_a_silent_worker"))
    assert result.returncode == 0, result.stderr
    assert ("worker 0 exited with code 1; it named worker 2, which stopped answering; "
            "worker slot 2 is lost") in result.stderr
    assert "world size 3 -> 2" in result.stderr


def test_elastic_job_stops_below_min_workers():
    result = launch("--workers=3", "--min_workers=3", "--max_restarts=2", *child("lost_slot"))
    assert result.returncode == 1
    assert "is lost" not in result.stderr
    assert "failed: worker 2 exited with code 3 (3 attempt(s), 2 restarts)" in result.stderr


def test_python_api_reports_the_world_size_changes():
    result = tfpar_launch.launch([sys.executable, CHILD, "lost_slot"], 3,
                                 min_workers=1, max_restarts=4, lost_after=1,
                                 out=io.StringIO(), err=io.StringIO())
    assert result.returncode == 0
    assert result.elastic == ({"attempt": 1, "workers": 2},)
    assert [a.slots for a in result.attempts] == [(0, 1, 2), (0, 1)]


def test_hosts_with_the_local_runner_place_workers_and_build_tf_configs():
    # Two "hosts" on loopback addresses, 2 slots and 1: worker i listens on its host.
    result = launch("--hosts=127.0.0.1:2,127.0.0.2:1", "--runner=local", *child("report_env"))
    assert result.returncode == 0, result.stderr
    configs = [json.loads(reports(result.stdout, i)[0]["TF_CONFIG"]) for i in range(3)]
    cluster = configs[0]["cluster"]["worker"]
    assert [a.rsplit(":", 1)[0] for a in cluster] == ["127.0.0.1", "127.0.0.1", "127.0.0.2"]
    assert len(set(cluster)) == 3
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    assert all(c["cluster"]["worker"] == cluster for c in configs)


def test_hosts_with_base_port_use_fixed_ports_per_host():
    result = launch("--hosts=127.0.0.1:2,127.0.0.2:2", "--runner=local", "--base_port=23456",
                    *child("report_env"))
    assert result.returncode == 0, result.stderr
    cluster = json.loads(reports(result.stdout, 0)[0]["TF_CONFIG"])["cluster"]["worker"]
    assert cluster == ["127.0.0.1:23456", "127.0.0.1:23457", "127.0.0.2:23456",
                       "127.0.0.2:23457"]


def test_sigterm_to_a_multi_host_launcher_ends_every_worker(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tfpar.launch",
                             "--hosts=127.0.0.1:2,127.0.0.2:1", "--runner=local", "--grace=2",
                             *child("note_pid", tmp_path)], cwd=ROOT, env=child_env(),
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        end = time.monotonic() + 20
        while len(os.listdir(tmp_path)) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        pids = [int(name) for name in os.listdir(tmp_path)]
        assert len(pids) == 3
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 128 + signal.SIGTERM
    assert all(gone(pid) for pid in pids)


def test_ssh_command_carries_the_workers_environment():
    env = {"TF_CONFIG": '{"a": 1}', "TFPAR_WORKER_INDEX": "1", "HOME": "/secret/home",
           "PYTHONUNBUFFERED": "1", "TF_ENABLE_ONEDNN_OPTS": "0"}
    cmd = tfpar_launch.ssh_command("node2", ["python", "-m", "tfpar.train", "--x=a b"], env,
                                   cwd="/srv/job dir")
    assert cmd[:5] == ["ssh", "-tt", "-o", "BatchMode=yes", "node2"]
    remote = cmd[5]
    assert remote.startswith("cd '/srv/job dir' && exec env ")
    assert """TF_CONFIG='{"a": 1}'""" in remote and "TFPAR_WORKER_INDEX=1" in remote
    assert "HOME" not in remote  # only the launcher's variables travel
    assert "TF_ENABLE_ONEDNN_OPTS=0" in remote  # --cpu_kernels=auto: the user's choice
    assert remote.endswith("python -m tfpar.train '--x=a b'")


@pytest.mark.parametrize("keep", [False, True])
def test_workers_temporary_directory_loses_only_autograph_sources(tmp_path, keep):
    result = run_module("tfpar.launch", "--workers=2",
                        *child("leaves_temp_files", *(["keep"] if keep else [])),
                        timeout=30, check=False, fresh=True,
                        env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    folders = {r["tmp"] for i in (0, 1) for r in reports(result.stdout, i)}
    assert len(folders) == 1, folders  # one directory per launch, inside the launcher's
    folder = folders.pop()
    assert os.path.dirname(folder) == str(tmp_path), folder
    left = sorted(os.path.relpath(os.path.join(d, f), tmp_path)
                  for d, _, files in os.walk(tmp_path) for f in files)
    assert left == ([os.path.join(os.path.basename(folder), "notes.txt")] if keep else []), left


def test_a_killed_workers_autograph_sources_are_removed(tmp_path):
    result = run_module("tfpar.launch", "--workers=1", "--", sys.executable,
                        os.path.join(ROOT, "tests", "autograph_killed_child.py"),
                        timeout=120, check=False, fresh=True, env={"TMPDIR": str(tmp_path)})
    assert "killed by signal SIGKILL" in result.stderr, result.stderr[-2000:]
    assert reports(result.stdout, 0)[0]["written"], result.stdout  # there was something to remove
    left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert not left, left
