"""Fork server for test children: `python tests/zygote.py SOCKET_PATH`.

A child that imports TensorFlow spends ~6 CPU seconds on the import alone (120 such children,
about 30 % of a suite run's CPU time, measured on 2026-12-04). This process imports TensorFlow and Keras once (their runtime is not
started: no device, context or strategy exists here) and forks one process per request,
which runs the requested `python SCRIPT ARGS`, `python -m MODULE ARGS` or `python -c CODE
ARGS` as a fresh interpreter would, with the request's environment, working directory and
`sys.path`, in a session of its own (`os.setsid`, so `os.killpg(pid, ...)` ends it and its
children), its stdout and stderr on the file descriptors the request passed. It is a
separate process as an exec'd child is: one TensorFlow runtime, one strategy per process.

`tests/subproc.py` starts one per pytest process (`subproc.run` and `subproc.popen` go
through `popen_class`), and one run by another interpreter named by
`subproc.fork_server_for` (a virtual environment's), and sends each only requests of its
interpreter whose environment matches, in every variable read while TensorFlow loads
(`IMPORT_TIME`), the one it imported TensorFlow with; the rest (and tests that check what a fresh interpreter has
imported, `run(..., fresh=True)`) are exec'd as before.

A forked child's `subprocess.Popen` of `[sys.executable, ...]` in a new session (what
`tfpar.launch` starts its workers with) goes to the same server when the environment allows
(`route_python_children`): the launched workers of a test skip the import too. Its
`/proc/PID/cmdline` and `/proc/PID/environ` (what `psutil` reads, and the tests' checks for
workers and orphans by command line and `TFPAR_WORKER_INDEX`) are rewritten to the
request's, in room the server was started with (`ROOM_ARG`, `ROOM_ENV`).

Protocol, one connection per child (the client is `popen_class`'s Popen): the client
sends one byte with three file descriptors (stdin, stdout, stderr) attached, then one JSON
line `{"argv", "env", "cwd"}`; the server answers `{"pid": P}` (or `{"error": [errno,
message, cwd]}` for a working directory that does not exist) and, when P has ended,
`{"returncode": R, "status": S}` (R negative: killed by signal -R; S the raw wait status),
then reaps P once the client closes. The server ends when its parent does, or on SIGTERM.
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
               "TF_NUM_INTRAOP_THREADS", "PYTHONHASHSEED", "PYTHONWARNINGS",
               "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH", "PYTHONHOME",
               # the standard streams' encoding, which a child keeps from the server
               "PYTHONIOENCODING", "PYTHONUTF8", "LANG", "LC_ALL", "LC_CTYPE")


# PYTHONUNBUFFERED is not among them: it sets how sys.stdout and sys.stderr buffer, which a
# child sets up again (`_stdio`). `tfpar.launch` sets it for every worker.

# Room for a child's command line and environment in /proc (`_retitle`): the server is
# started with an argument and a variable this long, which its children's own overwrite.
ROOM_ARG, ROOM_ENV = 64 << 10, 96 << 10
ROOM_NAME = "TFPAR_ZYGOTE_ROOM"


def server_command(path):
    """The server's argv after the interpreter, with room for its children's argv."""
    return [os.path.abspath(__file__), path, "-" * ROOM_ARG]


def server_environment(env):
    """`env` with room for its children's environments."""
    return {**env, ROOM_NAME: "-" * ROOM_ENV}


def loaded_environment(environ):
    """The environment the server imports TensorFlow with: `environ`, and oneDNN on unless
    it is set (what tfpar's `--cpu_kernels=auto` sets before it imports TensorFlow)."""
    env = dict(environ)
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    return env


def accepts(server_env, cmd, env, python=None):
    """Whether `cmd` (`[python, ...]`; `python` is `sys.executable` unless given: the
    interpreter the server runs) with `env` runs in a fork as it would in a fresh
    interpreter (and TFPAR_TEST_FORK=0 does not turn forking off)."""
    python = sys.executable if python is None else python
    if len(cmd) < 2 or cmd[0] != python or env.get("TFPAR_TEST_FORK") == "0":
        return False
    if cmd[1].startswith("-") and cmd[1] not in ("-c", "-m"):
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


def _proc_areas():
    """This process's argv and environment areas, as /proc/self/stat gives them (fields
    48-51: arg_start, arg_end, env_start, env_end)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return [int(fields[n - 3]) for n in (48, 49, 50, 51)]


def _overwrite(start, end, items):
    """Writes NUL-terminated `items` into [start, end), as many whole items as fit, the rest
    NULs (/proc/PID/environ ends at the first empty item; /proc/PID/cmdline shows the
    trailing NULs as empty arguments). Returns how many items fit."""
    import ctypes
    blob, fitted = b"", 0
    for item in items:
        encoded = os.fsencode(item) + b"\0"
        if len(blob) + len(encoded) > end - start:
            break
        blob, fitted = blob + encoded, fitted + 1
    blob += b"\0" * (end - start - len(blob))
    ctypes.memmove(start, blob, len(blob))
    return fitted


def _retitle(argv, env):
    """Makes /proc/self/cmdline and /proc/self/environ say `argv` and `env`, as they would
    for an exec'd child (libc's environment no longer points into the area: os.environ was
    cleared before). Only inside the room the server was started with."""
    arg_start, arg_end, env_start, env_end = _proc_areas()
    items = [f"{k}={v}" for k, v in env.items()]
    shown = (_overwrite(arg_start, arg_end, argv), _overwrite(env_start, env_end, items))
    if shown != (len(argv), len(items)):  # a check by command line would miss this child
        sys.stderr.write(f"zygote: /proc shows {shown[0]} of {len(argv)} arguments and "
                         f"{shown[1]} of {len(items)} variables of process {os.getpid()}\n")
    sys.orig_argv = list(argv)


def _env_flag(value):
    """CPython's reading of a flag variable such as PYTHONUNBUFFERED: unset or empty 0, a
    non-negative integer itself, anything else 1."""
    if not value:
        return 0
    try:
        number = int(value)
    except ValueError:
        return 1
    return number if number >= 0 else 1


def _stdio(env):
    """sys.stdout and sys.stderr made again on file descriptors 1 and 2 as CPython's
    `create_stdio` makes them for `env` (PYTHONUNBUFFERED: unbuffered, write-through;
    otherwise buffered, line-buffered on a terminal and for stderr), with the server's
    encodings (the variables that choose them are in IMPORT_TIME)."""
    import io
    unbuffered = _env_flag(env.get("PYTHONUNBUFFERED")) > 0
    streams = []
    for fd, old, name in ((1, sys.stdout, "<stdout>"), (2, sys.stderr, "<stderr>")):
        raw = io.FileIO(fd, "w", closefd=False)
        raw.name = name
        buffer = raw if unbuffered else io.BufferedWriter(raw)
        line = not unbuffered and (fd == 2 or os.isatty(fd))
        streams.append(io.TextIOWrapper(buffer, encoding=old.encoding, errors=old.errors,
                                        newline="\n", line_buffering=line,
                                        write_through=unbuffered))
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__ = streams


def route_python_children(path, server_env):
    """In a forked child: its `subprocess.Popen([sys.executable, ...],
    start_new_session=True)` children are forked by the server at `path` too (`_routed`'s
    conditions); the rest are exec'd."""
    import subprocess
    popen = subprocess.Popen
    for name, method in _routed(path, server_env, popen).items():
        setattr(popen, name, method)


def popen_class(path, server_env, python=None):
    """A `subprocess.Popen` whose `[python, ...]` children in a new session are forked by
    the server at `path`, which runs `python` (`sys.executable` unless given; `_routed`'s
    conditions); the rest are exec'd."""
    import subprocess
    return type("ForkServerPopen", (subprocess.Popen,),
                _routed(path, server_env, subprocess.Popen, python))


def _routed(path, server_env, base, python=None):
    """Popen's methods that start, poll and wait for a child, sending `[python, ...]`
    (`sys.executable` unless given) in a new session to the fork server when `accepts` its
    environment and nothing else asks for exec's own work (no preexec_fn, pass_fds, user,
    group, umask, process group; the executable the server's interpreter). The Popen object is the caller's as ever:
    its pid the forked child's, its exit status read from the server (the child's parent)
    instead of waitpid. Written for CPython 3.11's POSIX Popen (`_execute_child`,
    `_internal_poll`, `_try_wait`, `_close_pipe_fds`, `_waitpid_lock`,
    `_handle_exitstatus`); test_subproc checks the behaviour."""
    execute, poll, try_wait = base._execute_child, base._internal_poll, base._try_wait

    def routable(args, executable, preexec_fn, pass_fds, shell, env, gid, gids, uid, umask,
                 start_new_session, process_group):
        if (shell or executable is not None or preexec_fn is not None or pass_fds
                or gid is not None or gids is not None or uid is not None or umask >= 0
                or not start_new_session or process_group not in (None, -1)
                or not isinstance(args, (list, tuple))):
            return None
        try:
            argv = [os.fsdecode(os.fspath(a)) for a in args]
            full_env = {os.fsdecode(k): os.fsdecode(v)
                        for k, v in (os.environ if env is None else env).items()}
        except TypeError:
            return None
        return ((argv[1:], full_env) if accepts(server_env, argv, full_env, python)
                else None)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                       c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                       start_new_session, process_group):
        route = routable(args, executable, preexec_fn, pass_fds, shell, env, gid, gids, uid,
                         umask, start_new_session, process_group)
        conn = _connect(path) if route is not None else None
        if conn is None:  # not for the server, or no server: exec, as without one
            return execute(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                           startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                           c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                           umask, start_new_session, process_group)
        argv, full_env = route
        fds = [fd if fd != -1 else default
               for fd, default in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        try:
            socket.send_fds(conn, [b"x"], fds)
            conn.sendall(json.dumps({"argv": argv, "env": full_env, "cwd": os.path.abspath(
                os.fspath(cwd) if cwd is not None else os.getcwd())}).encode() + b"\n")
            self._zygote, self._zygote_data = conn, b""
            started = _next_message(self, block=True)
            if "error" in started:  # what exec's child reports: e.g. no such cwd
                raise OSError(*started["error"])
            if "pid" not in started:
                raise OSError(f"the fork server did not start {argv!r}")
            self.pid, self._child_created = started["pid"], True
        except BaseException:
            conn.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags):
        if getattr(self, "_zygote", None) is None:
            return try_wait(self, wait_flags)
        message = _next_message(self, block=not wait_flags & os.WNOHANG)
        if message is None:
            return 0, 0
        return self.pid, message["status"]

    def _internal_poll(self, _deadstate=None, **kwargs):
        if getattr(self, "_zygote", None) is None:
            return poll(self, _deadstate, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = _try_wait(self, os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode

    return {"_execute_child": _execute_child, "_try_wait": _try_wait,
            "_internal_poll": _internal_poll}


def _connect(path):
    """A connection to the server at `path`, or None when it does not answer."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        return conn
    except OSError:
        conn.close()
        return None


def _next_message(proc, block):
    """The server's next JSON line about `proc`'s child, or None (not `block`ing and none
    has arrived). The server gone without a word: reported as a SIGKILL (it kills its
    children when it ends on SIGTERM, as `subproc` ends it)."""
    while b"\n" not in proc._zygote_data:
        if not block and not select.select([proc._zygote], [], [], 0)[0]:
            return None
        chunk = proc._zygote.recv(1 << 12)
        if not chunk:
            proc._zygote.close()
            return {"status": signal.SIGKILL}
        proc._zygote_data += chunk
    line, _, proc._zygote_data = proc._zygote_data.partition(b"\n")
    message = json.loads(line)
    if "status" in message:
        proc._zygote.close()
    return message


def _run_child(request, base, path, server_env):
    """In the forked process: becomes the requested interpreter run; never returns."""
    import atexit
    import importlib
    import runpy
    import threading
    import types

    from forking import exit_status, exit_with

    argv, env, cwd = request["argv"], request["env"], request["cwd"]
    os.environ.clear()
    os.environ.update(env)
    _retitle([sys.executable, *argv], env)
    _stdio(env)
    os.chdir(cwd)
    sys.path[:] = _child_path(argv, env, cwd, base)
    importlib.invalidate_caches()
    route_python_children(path, server_env)
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
        exit_with(code)


def _spawn(conn, base, open_conns, listener, path, server_env):
    """Reads one request from `conn` and forks its child; returns the pid, or None (a bad
    request, or a working directory that does not exist: answered as exec's child would
    fail, with its errno)."""
    msg, fds, _, _ = socket.recv_fds(conn, 1, 3)
    try:
        if not msg or len(fds) != 3:
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
        try:
            os.stat(request["cwd"])
        except OSError as e:
            conn.sendall(json.dumps({"error": [e.errno, e.strerror, request["cwd"]]}).encode()
                         + b"\n")
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            try:
                listener.close()
                for other in open_conns.values():
                    other.close()
                conn.close()
                os.setsid()
                for sig in (signal.SIGCHLD, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                # The passed descriptors are 3 or above: the server's own 0, 1, 2 are open.
                for fd, target in zip(fds, (0, 1, 2)):
                    os.dup2(fd, target)
                    os.close(fd)
                _run_child(request, base, path, server_env)  # never returns
            except BaseException:  # noqa: B036 - never back into the server's loop
                try:
                    import traceback
                    traceback.print_exc()
                finally:
                    os._exit(70)
    finally:
        for fd in fds:
            os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _exit_status(info):
    """The wait status `os.waitid`'s result stands for."""
    if info.si_code == os.CLD_EXITED:
        return info.si_status << 8
    return info.si_status | (0x80 if info.si_code == os.CLD_DUMPED else 0)


def serve(path):
    """Answers requests until its parent ends or SIGTERM, then SIGKILLs its children's
    groups. A child that ended stays a zombie, as an exec'd one does until its parent waits,
    until the client closes its connection after reading the status: its pid (and group) is
    not reused while the client may still signal it."""
    parent = os.getppid()
    server_env = {k: v for k, v in os.environ.items() if k != ROOM_NAME}
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in own]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: ready
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    children, ended = {}, {}  # pid -> connection: running; ended, status sent
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([listener, *ended.values()], [], [], 0.05)
            for conn in ready:
                if conn is listener:
                    accepted, _ = listener.accept()
                    try:
                        pid = _spawn(accepted, base, {**children, **ended}, listener, path,
                                     server_env)
                    except Exception:  # noqa: BLE001 - one bad request, not the server
                        accepted.close()
                        pid = None
                    if pid is not None:
                        children[pid] = accepted
                else:  # the client closed (or wrote): reap the zombie now
                    pid = next(p for p, c in ended.items() if c is conn)
                    del ended[pid]
                    conn.close()
                    os.waitpid(pid, 0)
            for pid in list(children):
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is None:
                    continue
                conn = ended[pid] = children.pop(pid)
                status = _exit_status(info)
                try:
                    conn.sendall(json.dumps(
                        {"returncode": os.waitstatus_to_exitcode(status), "status": status}
                    ).encode() + b"\n")
                except OSError:
                    pass  # the client is gone: its connection reads as closed next round
    finally:
        for pid in [*children, *ended]:  # the tests are gone: so are their children
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    os.environ.update(loaded_environment(os.environ))
    import tensorflow  # noqa: F401,E402
    import keras  # noqa: F401,E402
    try:
        serve(sys.argv[1])
    except SystemExit:  # SIGTERM: its children are killed
        pass
    # Without the interpreter's teardown of TensorFlow's modules: seconds on a loaded
    # machine (3 s measured, 2026-12-05), which every test process waited for at its end.
    os._exit(0)
