"""Fault injection for testing recovery: kill a worker at a chosen step, or hold a
checkpoint save open so that a test can kill a worker inside it.

`TFPAR_INJECT_FAULTS="W:S[,W:S...]"` makes worker W SIGKILL itself right after global step S
(counting steps restored from a checkpoint), once per fault: fault k fires only in the k-th
attempt (`TFPAR_RESTART`, set by `tfpar.launch --max_restarts`), so a restarted job runs on
past it. Used by tests/test_faults.py and tools/bench_faults.py.

`TFPAR_INJECT_SAVE_PAUSE="S:SECONDS[:before_writing][,...]"` makes every worker sleep
SECONDS inside its checkpoint save of step S, after the checkpoint's files are written and
before the state file names them (`tfpar.checkpoint`), or with `:before_writing` after the
state is copied and before any file is written; pause k applies only in attempt k, like
the faults. With `--checkpoint_async` the pause is in the writer thread and training goes
on meanwhile, so a fault of the same attempt can kill the worker inside the write. Each
pause prints a line, so that a test killing a worker from outside knows it is inside the
write.

Both are off unless their variable is set.
"""

import os
import signal
import sys
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
    (`"before_publishing"` or `"before_writing"`).

    Raises:
        ConfigError: the plan is not comma-separated `step:seconds[:before_writing]`.
    """
    text = environ.get(SAVE_PAUSE_ENV, "")
    if not text:
        return
    try:
        plan = [(int(s), float(t), (where or ["before_publishing"])[0])
                for s, t, *where in (item.split(":") for item in text.split(","))]
        if any(where not in _MOMENTS for _, _, where in plan):
            raise ValueError
    except ValueError:
        raise ConfigError(SAVE_PAUSE_ENV, text,
                          "use comma-separated step:seconds[:before_writing], e.g. "
                          "10:60,20:60:before_writing") from None
    attempt = int(environ.get("TFPAR_RESTART", "0"))
    if attempt < len(plan) and plan[attempt][0] == step and plan[attempt][2] == moment:
        seconds = plan[attempt][1]
        print(f"tfpar.faults: pausing {seconds:g} s inside the checkpoint save of step {step} "
              f"({_MOMENTS[moment]})", file=sys.stderr, flush=True)
        time.sleep(seconds)


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
