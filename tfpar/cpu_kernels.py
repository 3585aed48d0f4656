"""`--cpu_kernels`: TensorFlow's CPU kernels (oneDNN's or Eigen's), chosen by the run, not
by the CPU it lands on.

TensorFlow reads `TF_ENABLE_ONEDNN_OPTS` once, when it is imported. Unset, its own rule
depends on the processor: this TensorFlow 2.21 build turned oneDNN on for one x86 machine
of ours and left it off on another, where its default Eigen matmuls were slower
(docs/benchmarks/data_parallel.md). So the same command ran different kernels, with different
rounding and speed, from one machine to the next. tfpar decides instead:

- `auto` (default): oneDNN, unless `TF_ENABLE_ONEDNN_OPTS` is already set (yours wins);
- `onednn` / `eigen`: that one, whatever the environment says.

Nothing here imports TensorFlow: `select` must run before it starts (`python -m
tfpar.train` does so once the command line has passed its checks; a Python caller of
`tfpar.train.train` that has not imported TensorFlow yet gets it from `train`).
`active()` reads, once TensorFlow runs, which kernels it really uses (the metrics JSON's
`cpu_kernels`).
"""

import os
import sys

from tfpar.errors import ConfigError

CHOICES = ("auto", "onednn", "eigen")
ENV = "TF_ENABLE_ONEDNN_OPTS"
_READS = {"0": "eigen", "false": "eigen", "1": "onednn", "true": "onednn"}  # TensorFlow's


def _from_env(environ):
    """What `TF_ENABLE_ONEDNN_OPTS` in `environ` asks for: "onednn", "eigen", None (unset)
    or "unreadable" (a value TensorFlow ignores)."""
    value = environ.get(ENV)
    return None if value is None else _READS.get(value.lower(), "unreadable")


def wanted(choice, environ=None):
    """The kernels `choice` asks for under `environ` (default `os.environ`): "onednn" or
    "eigen".

    Raises:
        ConfigError: `choice` is not one of `CHOICES`, or (with `auto`)
            `TF_ENABLE_ONEDNN_OPTS` holds a value TensorFlow does not read (it takes 0, 1,
            false, true in any case and ignores anything else).
    """
    environ = os.environ if environ is None else environ
    if choice not in CHOICES:
        raise ConfigError("cpu_kernels", choice, f"choose one of {', '.join(CHOICES)}")
    if choice != "auto":
        return choice
    asked = _from_env(environ)
    if asked == "unreadable":
        raise ConfigError(ENV, environ[ENV], "use 1 or true (oneDNN), 0 or false (Eigen), or "
                          "unset it (TensorFlow ignores other values)")
    return asked or "onednn"


def select(choice, environ=None):
    """Sets `TF_ENABLE_ONEDNN_OPTS` in `environ` (default `os.environ`) for `choice`; call
    before TensorFlow is imported. Returns the kernels asked for.

    >>> env = {}
    >>> select("auto", env), env
    ('onednn', {'TF_ENABLE_ONEDNN_OPTS': '1'})
    >>> select("auto", {"TF_ENABLE_ONEDNN_OPTS": "0"})
    'eigen'
    """
    environ = os.environ if environ is None else environ
    kernels = wanted(choice, environ)
    environ[ENV] = "1" if kernels == "onednn" else "0"
    return kernels


def apply(choice, environ=None):
    """`select` if TensorFlow has not started in this process; then checks that the kernels
    it runs are the ones an explicit `choice` asks for (`auto` takes what runs). Returns the
    kernels TensorFlow runs (imports TensorFlow).

    Raises:
        ConfigError: `cpu_kernels` asked for kernels TensorFlow does not run: it was
            imported before tfpar with another `TF_ENABLE_ONEDNN_OPTS`, or this build of
            TensorFlow has no oneDNN for this processor.
    """
    environ = os.environ if environ is None else environ
    if "tensorflow" not in sys.modules:
        select(choice, environ)
    else:
        wanted(choice, environ)  # a bad choice or variable is refused either way
    running = active()
    if choice not in ("auto", running):
        if _from_env(environ) == choice:
            raise ConfigError("cpu_kernels", choice,
                              f"this TensorFlow runs {running} kernels although {ENV}="
                              f"{environ[ENV]}: pass cpu_kernels='auto' (or '{running}')")
        raise ConfigError(
            "cpu_kernels", choice,
            f"TensorFlow was imported before tfpar with {running} kernels: set "
            f"{ENV}={'1' if choice == 'onednn' else '0'} before importing tensorflow, or pass cpu_kernels='auto' "
            f"(or '{running}')")
    return running


def active():
    """Which CPU kernels the TensorFlow of this process runs: "onednn" or "eigen"
    (imports TensorFlow; registry entry `onednn_enabled`)."""
    from tfpar import patches
    return "onednn" if patches.onednn_enabled() else "eigen"
