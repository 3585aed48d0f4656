"""Run TensorFlow code in a child process: one strategy per process, bounded by a timeout.

TensorFlow allows one distribution strategy per process, and a hung collective must fail a
test rather than hang it, so every test that needs a strategy or several workers goes
through `run_python` / `run_module`, which kill the child's whole process group on timeout.
Children are forked from a server that imported TensorFlow once (tests/zygote.py) unless
their environment or `fresh=True` asks for a new interpreter.
"""

import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("TF_CONFIG", None)
    # A test's choice of graph optimizer (tests/graph_optimizer.py), never the shell's:
    # the children of files that keep grappler on must get it on.
    env.pop("TFPAR_TEST_GRAPPLER", None)
    for name, value in (extra or {}).items():  # None: the child runs without it
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run(cmd, timeout=240, env=None, cwd=None, check=True, fresh=False):
    """Runs `cmd` in its own process group; kills the group on timeout.

    Returns the CompletedProcess (stdout and stderr as text). With `check`, a non-zero exit
    raises AssertionError carrying the tail of both streams. `python ...` commands whose
    environment TensorFlow's import does not read differently are forked from this pytest
    process's fork server (tests/zygote.py), which imported TensorFlow once; `fresh` (or
    TFPAR_TEST_FORK=0) execs a new interpreter, for tests of what one imports.
    """
    proc = popen(cmd, env=env, cwd=cwd, fresh=fresh, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd}\n--- stdout\n{out[-3000:]}\n"
                             f"--- stderr\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return _completed(cmd, proc.returncode, out, err, check)


def popen(cmd, env=None, cwd=None, fresh=False, **kwargs):
    """`subprocess.Popen(cmd, ...)` in a session of its own, for a test that reads a child's
    output as it comes or signals it: forked from the fork server as `run`'s children are
    (unless `fresh`, TFPAR_TEST_FORK=0 or an import-time variable says otherwise), with the
    same Popen interface (pid, pipes, poll, wait, send_signal). A forked child's parent is
    the fork server: find its processes by command line or environment, not by parent."""
    full_env = child_env(env)
    kind = subprocess.Popen
    if not fresh and os.environ.get("TFPAR_TEST_FORK", "1") != "0":
        import zygote
        python = cmd[0] if isinstance(cmd, (list, tuple)) and cmd else None
        if zygote.accepts(_server_env(), list(cmd), full_env):
            kind = zygote.popen_class(_zygote_path(), _server_env())
        elif python in _OTHER_ENV and zygote.accepts(_OTHER_ENV[python], list(cmd), full_env,
                                                     python):
            kind = zygote.popen_class(_zygote_path(python), _OTHER_ENV[python], python)
    return kind(cmd, env=full_env, cwd=cwd or ROOT, start_new_session=True, **kwargs)


# Other interpreters with a fork server of their own: {interpreter: its server's environment}.
_OTHER_ENV = {}


def fork_server_for(python, env=None):
    """`[python, ...]` children (`python` another interpreter than this one: a virtual
    environment's, which sees this one's TensorFlow) whose environment is `child_env(env)`
    in every import-time variable are forked from a server that `python` runs, started on
    the first such child, as `sys.executable`'s are from this process's server. TensorFlow
    and Keras are imported there once; nothing else (the child imports tfpar from
    `python`'s own site-packages as a fresh interpreter would)."""
    import zygote
    with _ZYGOTE_LOCK:
        _OTHER_ENV[os.fspath(python)] = zygote.loaded_environment(child_env(env))


def processes_with(name, value):
    """`(psutil.Process, its environment)` of every live process (zombies left out) whose
    environment has `name=value`: a job's workers, whatever their parent (a forked child's
    is the fork server), by a variable the test gave the job."""
    import psutil
    found = []
    for process in psutil.process_iter():
        try:
            env = process.environ()
            if env.get(name) == value and process.status() != psutil.STATUS_ZOMBIE:
                found.append((process, env))
        except psutil.Error:
            continue
    return found


def _completed(cmd, returncode, out, err, check):
    result = subprocess.CompletedProcess(cmd, returncode, out, err)
    if check and returncode != 0:
        raise AssertionError(f"exit {returncode}: {cmd}\n--- stdout\n{out[-3000:]}\n"
                             f"--- stderr\n{err[-5000:]}")
    return result


_ZYGOTE = {}
_OTHER = {}  # another interpreter's server: {interpreter: {"pid", "path", "proc", "folder"}}
_ZYGOTE_LOCK = threading.Lock()


def _server_env():
    """The environment this process's fork server imports TensorFlow with, fixed when first
    asked (a later change to os.environ reaches the children, not the server)."""
    import zygote
    with _ZYGOTE_LOCK:
        if _ZYGOTE.get("env_pid") != os.getpid():
            _ZYGOTE.update(env_pid=os.getpid(), env=zygote.loaded_environment(child_env()))
        return _ZYGOTE["env"]


def _zygote_path(python=None):
    """The socket of this process's fork server (of `python`'s, `fork_server_for`, when
    given), started on first use (it imports TensorFlow: ~7 s) and ended with this process
    (it exits when its parent does)."""
    env = _server_env() if python is None else _OTHER_ENV[python]
    with _ZYGOTE_LOCK:
        state = _ZYGOTE if python is None else _OTHER.setdefault(python, {})
        # A server that has died (whatever ended it) is started again: without one every
        # child would be exec'd, silently slower (seen once in a full run: test_subproc's
        # checks that children are forked failed after an earlier test in that worker).
        if state.get("pid") != os.getpid() or state["proc"].poll() is not None:
            proc, path, folder = _start_server([python or sys.executable], env)
            state.update(pid=os.getpid(), path=path, proc=proc, folder=folder)
        return state["path"]


def _start_server(prefix, env):
    """A fork server started as `[*prefix, zygote.py, SOCKET]` with `env` (import-time
    variables as its children must have them), once its socket exists: `(Popen, socket
    path, its folder)`, what `_end_zygote` ends. Ended with this process."""
    import zygote
    folder = tempfile.mkdtemp(prefix="tfpar-zygote-")
    path = os.path.join(folder, "socket")
    log = open(os.path.join(folder, "log"), "w+b")
    proc = subprocess.Popen([*prefix, *zygote.server_command(path)],
                            env=zygote.server_environment(env), cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    end = time.monotonic() + 180
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            log.seek(0)
            raise AssertionError("the fork server did not start:\n"
                                 + log.read().decode(errors="replace")[-3000:])
        time.sleep(0.05)
    atexit.register(_end_zygote, proc, folder)
    return proc, path, folder


def fork_server_under(prefix):
    """A fork server of this interpreter started under `prefix` (`["ip", "netns", "exec",
    NS]`: it and every child it forks run in that network namespace), with the environment
    of this process's own server. For a child that starts workers through
    `zygote.popen_class(path, env)` (tests/netns_launch.py): they skip TensorFlow's import.
    Returns `(socket path, the server's import-time variables, stop)`; `stop()` ends the
    server and its children (this process's end does too)."""
    import zygote
    env = _server_env()
    proc, path, folder = _start_server([*prefix, sys.executable], env)
    stop = functools.partial(_end_zygote, proc, folder)
    return path, {k: env[k] for k in zygote.IMPORT_TIME if k in env}, stop


def restart_fork_server():
    """Ends this process's fork server and forgets the environment it was started with,
    so the next child starts one with the environment as it is now. For the tests of the
    fork server itself, which must not depend on what earlier tests in the same pytest
    worker left in `os.environ` (a child whose import-time variables differ from the
    server's is exec'd, by design)."""
    with _ZYGOTE_LOCK:
        ours = _ZYGOTE.get("pid") == os.getpid()
        proc, folder = _ZYGOTE.pop("proc", None), _ZYGOTE.pop("folder", None)
        _ZYGOTE.pop("pid", None)
        _ZYGOTE.pop("env_pid", None)
    if ours and proc is not None:
        _end_zygote(proc, folder)


def _end_zygote(proc, folder):
    """Ends a fork server (and what it forked) and removes its socket's folder; a second
    call, or one after the server ended, does nothing more (Popen signals no reaped child)."""
    proc.terminate()  # the server SIGKILLs what it forked, then ends
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def run_python(code, timeout=240, env=None, check=True, fresh=False):
    """Runs a dedented Python snippet in a child interpreter (see `run` for `fresh`)."""
    return run([sys.executable, "-c", textwrap.dedent(code)], timeout=timeout, env=env,
               check=check, fresh=fresh)


def run_module(module, *args, timeout=240, env=None, check=True, fresh=False):
    return run([sys.executable, "-m", module, *args], timeout=timeout, env=env, check=check,
               fresh=fresh)


def run_cli_cases(cases, timeout=240, env=None):
    """`python -m tfpar.train ARGV` with `env` added, for each `(argv, env or None)` of
    `cases`, through tests/cli_child.py: one TensorFlow import for all, a forked process
    per case (two at a time; `env` here is the child's, e.g. a PYTHONPATH every case
    needs). Returns per case a CompletedProcess (`args` its argv) with `.seconds`, the
    case's own wall time."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="tfpar-cli-") as folder:
        out = run([sys.executable, os.path.join(ROOT, "tests", "cli_child.py"),
                   json.dumps([{"argv": list(argv), "env": env or {}} for argv, env in cases]),
                   folder], timeout=timeout, env=env)
    results = []
    for (argv, _), case in zip(cases, last_json_line(out.stdout)["cases"], strict=True):
        result = subprocess.CompletedProcess(list(argv), case["returncode"], case["stdout"],
                                             case["stderr"])
        result.seconds = case["seconds"]
        results.append(result)
    return results



def saved_arrays(path):
    """The arrays of an `.npz` a child wrote (`w_0`, `w_1`, ...), in their index's order."""
    import numpy as np
    data = np.load(path)
    return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def run_children(script, children, prefix, timeout=600):
    """Runs `script` once per child spec of `children` (JSON, then `prefix`), one after
    another; returns the merge of their last JSON lines and their stderr joined."""
    out, stderr = {}, ""
    for child in children:
        done = run([sys.executable, script, json.dumps(child), prefix], timeout=timeout)
        out.update(last_json_line(done.stdout))
        stderr += done.stderr
    return out, stderr


def published_step(ckpt):
    """The step of the checkpoint a checkpoint directory's state file names as latest (the
    published one), or None."""
    try:
        text = open(os.path.join(ckpt, "checkpoint")).read()
        return int(text.split('model_checkpoint_path: "ckpt-')[1].split('"')[0])
    except (FileNotFoundError, IndexError):
        return None


def rank_line(output, i):
    """Worker i's last result line in a launcher's output (`[worker i] [{...}]`: the JSON
    list tests/train_configs_child.py prints), its first entry."""
    lines = [line.split("] ", 1)[1] for line in output.splitlines()
             if line.startswith(f"[worker {i}] [{{")]
    return json.loads(lines[-1])[0]


def max_diff(a, b):
    """The largest absolute difference between two equally long lists of arrays."""
    import numpy as np
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def last_json_line(text):
    """The last line of `text` that parses as a JSON object (how child scripts report)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON line in output:\n{text[-3000:]}")


def run_concurrently(jobs, workers=2, keep_failures=False):
    """Calls each of `jobs` (functions of no arguments that start children) two at a time and
    returns their results in order; the first exception is raised.

    With `keep_failures`, a job that fails with AssertionError (a failed child) gives that
    error in its place instead, so that each test reading a shared fixture fails alone
    (`outcome`).

    A child spends most of its time starting TensorFlow and tracing (one core); two at once
    keep the machine's two cores busy. Only for children that check no timing.
    """
    from concurrent.futures import ThreadPoolExecutor

    def call(job):
        try:
            return job()
        except AssertionError as failed:
            if not keep_failures:
                raise
            return failed

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(call, job) for job in jobs]
        return [future.result() for future in futures]


def outcome(result):
    """A result of `run_concurrently(..., keep_failures=True)`: raises it when it is the
    AssertionError its child failed with, else returns it."""
    if isinstance(result, AssertionError):
        raise result
    return result


def in_background(job):
    """Starts `job` (a function of no arguments that starts children) on a thread; returns
    its future (`.result()` waits, and raises what the job raised). For a child whose result
    is needed only after other children ran."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(job)
    pool.shutdown(wait=False)
    return future


def run_tf_config_workers(argv_of, n=2, timeout=180, addresses=None):
    """`argv_of(i)` started as worker `i` of `n` of one `TF_CONFIG` cluster on localhost, as
    a user starts them by hand (no launcher): each worker's last JSON line. Every worker's
    process group is killed at the end: a hung collective fails the test, never hangs it.
    `addresses(ports)`: the workers' "host:port" from `n` free ports (default localhost)."""
    from tfpar.launch import free_ports
    ports = free_ports(n, "localhost")
    hosts = addresses(ports) if addresses else [f"localhost:{p}" for p in ports]
    procs = []
    for i in range(n):
        env = {"TF_CONFIG": json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})}
        procs.append(popen(argv_of(i), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-4000:]}"
            outs.append(last_json_line(out))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return outs


def sigterm_when_ready(cmd, workers=2, timeout=200, env=None):
    """Start `cmd` (a `tfpar.launch` of `workers` workers), send it SIGTERM as soon as every
    worker has printed TFPAR_READY (their strategies built), and return all it printed
    (stdout and stderr) once it ends within `timeout`; its process group is killed if not."""
    proc = popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if sum("TFPAR_READY" in seen for seen in lines) == workers:
                proc.send_signal(signal.SIGTERM)
                break
        return "".join(lines) + proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
