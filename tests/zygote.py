"""Fork server for test children: `python tests/zygote.py SOCKET_PATH`.

A child that imports TensorFlow spends ~6 CPU seconds on the import alone (120 such children,
about 30 % of a suite run's CPU time, measured on 2026-12-04). This process imports TensorFlow and Keras once (their runtime is not
started: no device, context or strategy exists here) and forks one process per request,
which runs the requested `python SCRIPT ARGS`, `python -m MODULE ARGS` or `python -c CODE
ARGS` as a fresh interpreter would, with the request's environment, working directory and
`sys.path`, in a session of its own (`os.setsid`, so `os.killpg(pid, ...)` ends it and its
children), its stdout and stderr on the file descriptors the request passed. It is a
separate process as an exec'd child is: one TensorFlow runtime, one strategy per process.

`tests/subproc.py` starts one per pytest process and sends it only requests whose
environment matches, in every variable read while TensorFlow loads (`IMPORT_TIME`), the one
it imported TensorFlow with; the rest (and tests that check what a fresh interpreter has
imported, `run(..., fresh=True)`) are exec'd as before.

Protocol, one connection per child: the client sends one byte with two file descriptors
(stdout, stderr) attached, then one JSON line `{"argv", "env", "cwd"}`; the server answers
`{"pid": P}` and, when P has ended, `{"returncode": R}` (negative: killed by signal -R).
The server ends when its parent does.
"""

import json
import os
import select
import signal
import socket
import sys

# Variables TensorFlow, Keras or Python read once, while loading or at start-up: a child
# that asks for other values than the server loaded with must be exec'd. (The CPU
# allocator's TF_CPU_ALLOCATOR_USE_BFC and TF_CPU_BFC_MEM_LIMIT_IN_MB are read when the
# runtime starts, after the fork: test_memory's capped out-of-memory runs are forked.)
IMPORT_TIME = ("TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL",
               "TF_CPP_VMODULE", "TF_USE_LEGACY_KERAS", "KERAS_BACKEND", "KERAS_HOME",
               "CUDA_VISIBLE_DEVICES", "TF_XLA_FLAGS", "LD_PRELOAD", "LD_LIBRARY_PATH",
               "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTEROP_THREADS",
               "TF_NUM_INTRAOP_THREADS", "PYTHONHASHSEED", "PYTHONUNBUFFERED",
               "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH", "PYTHONHOME")


def loaded_environment(environ):
    """The environment the server imports TensorFlow with: `environ`, and oneDNN on unless
    it is set (what tfpar's `--cpu_kernels=auto` sets before it imports TensorFlow)."""
    env = dict(environ)
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    return env


def accepts(server_env, argv, env):
    """Whether a child of `argv` (after the interpreter) with `env` runs in a fork as it
    would in a fresh interpreter."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-c", "-m")):
        return False  # interpreter options (-u, -X, ...) are not replayed
    for name in IMPORT_TIME:
        want = env.get(name)
        if name == "TF_ENABLE_ONEDNN_OPTS" and want is None:
            continue  # unset: tfpar's auto sets "1", as the server did
        if want != server_env.get(name):
            return False
    return True


def _child_path(argv, env, cwd, base):
    if argv[0] == "-c":
        first = ""
    elif argv[0] == "-m":
        first = cwd
    else:
        first = os.path.dirname(os.path.realpath(os.path.join(cwd, argv[0])))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *base]


def _run_child(request, base):
    """In the forked process: becomes the requested interpreter run; never returns."""
    import atexit
    import importlib
    import runpy
    import threading
    import types

    from forking import exit_status

    argv, env, cwd = request["argv"], request["env"], request["cwd"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = _child_path(argv, env, cwd, base)
    importlib.invalidate_caches()
    main = types.ModuleType("__main__")  # not this server's
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main

    def script():
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")

    code = exit_status(script)
    try:
        threading._shutdown()  # non-daemon threads, as at interpreter exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - closed by the script
                pass
        os._exit(code & 0xFF)


def _spawn(conn, base, open_conns, listener):
    msg, fds, _, _ = socket.recv_fds(conn, 1, 2)
    if not msg or len(fds) != 2:
        conn.close()
        return None
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            conn.close()
            return None
        data += chunk
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            for other in open_conns.values():
                other.close()
            conn.close()
            os.setsid()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in (null, *fds):
                os.close(fd)
        except BaseException:  # noqa: B036
            os._exit(70)
        _run_child(request, base)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def serve(path):
    parent = os.getppid()
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in own]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: ready
    children = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                pid = _spawn(conn, base, children, listener)
            except OSError:
                conn.close()
                pid = None
            if pid is not None:
                children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps(
                        {"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    for pid in children:  # the tests are gone: so are their children
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    os.environ.update(loaded_environment(os.environ))
    import tensorflow  # noqa: F401,E402
    import keras  # noqa: F401,E402
    serve(sys.argv[1])
