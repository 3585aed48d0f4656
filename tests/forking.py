"""Runs calls in processes forked from a child that has imported TensorFlow once.

Importing TensorFlow costs ~5 CPU seconds per process. A test child (tests/cli_child.py,
tests/doc_child.py) imports it once, starts no TensorFlow runtime (no op, no device, no
strategy: those would be shared with the forks), and forks one process per call: each
starts its own runtime, strategies included (one per process, as TensorFlow requires).
"""

import os
import signal
import sys
import time
import traceback


def exit_status(call):
    """Calls `call()` and returns the exit status the interpreter would give its script: 0,
    `sys.exit`'s number, 1 (`sys.exit("message")` prints the message; an uncaught exception
    prints its traceback), or -SIGINT for an uncaught KeyboardInterrupt (the interpreter
    then ends by that signal; `exit_with` does)."""
    try:
        call()
        return 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # noqa: B036 - what the interpreter does with an uncaught one
        traceback.print_exc()
        return 1


def exit_with(code):
    """Ends this process as the interpreter would with `exit_status`'s `code`: a negative
    one by that signal (its default action), else `os._exit(code & 0xFF)`."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 1  # not reached for a signal whose default ends the process
    os._exit(code & 0xFF)


def _in_fork(call, out_path, err_path):
    """In the forked process: `call()` with stdout and stderr in files, then `os._exit`
    with its exit status (`exit_status`)."""
    code = 1
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        code = exit_status(call)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        exit_with(code)


def run_forked(calls, folder, at_once=2):
    """Runs each of `calls` (functions of no arguments) in a forked process, `at_once` at a
    time; returns per call, in order, `{"returncode", "stdout", "stderr", "seconds"}`
    (returncode negative for a signal, as subprocess gives it; seconds from its fork to its
    exit). Output files go to `folder`."""
    paths = [(os.path.join(folder, f"fork{i}.out"), os.path.join(folder, f"fork{i}.err"))
             for i in range(len(calls))]
    results, running, pending = [None] * len(calls), {}, list(range(len(calls)))
    while pending or running:
        while pending and len(running) < at_once:
            i = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _in_fork(calls[i], *paths[i])
            running[pid] = (i, time.monotonic())
        pid, status = os.wait()
        i, began = running.pop(pid)
        with open(paths[i][0]) as out, open(paths[i][1]) as err:
            results[i] = {"returncode": os.waitstatus_to_exitcode(status),
                          "stdout": out.read(), "stderr": err.read(),
                          "seconds": time.monotonic() - began}
    return results
