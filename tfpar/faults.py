"""Fault injection for testing recovery: kill a worker at a chosen step, or hold a
checkpoint save open so that a test can kill a worker inside it.

`TFPAR_INJECT_FAULTS="W:S[,W:S...]"` makes worker W SIGKILL itself right after global step S
(counting steps restored from a checkpoint), once per fault: fault k fires only in the k-th
attempt (`TFPAR_RESTART`, set by `tfpar.launch --max_restarts`), so a restarted job runs on
past it. Used by tests/test_faults.py and tools/bench_faults.py.

`TFPAR_INJECT_SAVE_PAUSE="S:SECONDS[:before_writing][:until_sigterm][,...]"` makes every
worker sleep SECONDS inside its checkpoint save of step S, after the checkpoint's files are
written and before the state file names them (`tfpar.checkpoint`), or with
`:before_writing` after the state is copied and before any file is written; pause k
applies only in attempt k, like the faults. With `:until_sigterm` a SIGTERM ends the pause
early (it still reaches the worker's own handler, which acts on it after the save), for a
test whose launcher stops the paused job: no fixed wait sized for a loaded machine. With
`--checkpoint_async` the pause is in the writer thread and training goes on meanwhile, so a
fault of the same attempt can kill the worker inside the write (`:until_sigterm` is honoured
only by a pause in the main thread, a synchronous save's). Each pause prints a line, so
that a test killing a worker from outside knows it is inside the write.

Both are off unless their variable is set.
"""

import os
import signal
import sys
import threading
import time

import keras

from tfpar.errors import ConfigError

ENV = "TFPAR_INJECT_FAULTS"
SAVE_PAUSE_ENV = "TFPAR_INJECT_SAVE_PAUSE"


def parse_plan(text):
    """`"1:13,0:30"` → `[(1, 13), (0, 30)]`.

    Raises:
        ConfigError: the plan is not comma-separated `worker:step` pairs with rising steps.
    """
    plan = []
    for item in filter(None, text.split(",")):
        try:
            worker, step = (int(v) for v in item.split(":"))
        except ValueError:
            raise ConfigError(ENV, text, "use comma-separated worker:step pairs, e.g. 1:13,0:30")
        plan.append((worker, step))
    if [s for _, s in plan] != sorted(s for _, s in plan):
        raise ConfigError(ENV, text, "faults must be listed in the order of their steps")
    return plan


def injector(start_step, environ=os.environ):
    """The callback that carries out this attempt's fault, or None."""
    plan = parse_plan(environ.get(ENV, ""))
    attempt = int(environ.get("TFPAR_RESTART", "0"))
    if attempt >= len(plan):
        return None
    worker, step = plan[attempt]
    if worker != int(environ.get("TFPAR_WORKER_INDEX", "0")):
        return None
    return _KillAt(start_step, step)


_MOMENTS = {"before_publishing": "files written, not yet named by the state file",
            "before_writing": "state copied, no file written yet"}


def pause_in_save(step, moment="before_publishing", environ=os.environ):
    """Sleeps if this attempt's `TFPAR_INJECT_SAVE_PAUSE` entry names `step` and `moment`
    (`"before_publishing"` or `"before_writing"`); with `until_sigterm`, until a SIGTERM
    too.

    Raises:
        ConfigError: the plan is not comma-separated
            `step:seconds[:before_writing][:until_sigterm]`.
    """
    text = environ.get(SAVE_PAUSE_ENV, "")
    if not text:
        return
    try:
        plan = [(int(s), float(t), words)
                for s, t, *words in (item.split(":") for item in text.split(","))]
        if any(not set(words) <= {*_MOMENTS, "until_sigterm"} or len(set(words)) < len(words)
               or len(set(words) & set(_MOMENTS)) > 1 for _, _, words in plan):
            raise ValueError
    except ValueError:
        raise ConfigError(SAVE_PAUSE_ENV, text,
                          "use comma-separated step:seconds[:before_writing][:until_sigterm], "
                          "e.g. 10:60,20:60:before_writing") from None
    attempt = int(environ.get("TFPAR_RESTART", "0"))
    if attempt >= len(plan):
        return
    at, seconds, words = plan[attempt]
    if at == step and moment == next((w for w in words if w in _MOMENTS),
                                     "before_publishing"):
        until = " or until SIGTERM" if "until_sigterm" in words else ""
        line = (f"tfpar.faults: pausing {seconds:g} s{until} inside the checkpoint save of "
                f"step {step} ({_MOMENTS[moment]})")
        if until:
            _sleep_until_sigterm(seconds, line)
        else:
            print(line, file=sys.stderr, flush=True)
            time.sleep(seconds)


def _sleep_until_sigterm(seconds, line):
    """Prints `line` to stderr, then sleeps `seconds` or until a SIGTERM, which still goes to
    the handler that was set (the default one ends the process once the sleep is over); a
    plain sleep off the main thread, where no handler can be set. The handler is in place
    before the line: a launcher that signals on seeing it is not missed."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is None):  # (None: set outside Python)
        print(line, file=sys.stderr, flush=True)
        time.sleep(seconds)
        return
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *args: received.append(args))
    try:
        print(line, file=sys.stderr, flush=True)
        end = time.monotonic() + seconds
        while not received and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received:
        if callable(previous):
            previous(*received[0])
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)


class _KillAt(keras.callbacks.Callback):
    def __init__(self, start_step, step):
        super().__init__()
        self.done, self.step = start_step, step

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.step:
            print(f"tfpar.faults: killing this worker after step {self.step}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
