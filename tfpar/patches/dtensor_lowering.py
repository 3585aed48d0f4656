"""DTensor's lowering of a gather, an environment variable its C++ compiler passes read
(tensorflow 2.21.0).

- `collective_gather_lowering`: not a replacement but a setting TensorFlow has no public
  call for. DTensor lowers a relayout that gathers a sharded axis in one of two ways,
  chosen each time a function or op is compiled by whether `COLLECTIVE_GATHER`
  (`LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2`) is set, to any value: unset, a sum over
  the axis of a zero-padded whole tensor (an all-reduce of N pieces' bytes, each device
  adding the zeros); set, a `CollectiveGatherV2`. Measured on TF 2.21, 4 logical CPUs: 8
  gathers of a 1024 x 768 weight 156 -> 28 CPU ms, the same values
  (docs/benchmarks/memory.md). On a mesh with a second axis of size > 1 (tensor
  parallelism) that lowering fails to compile ("'tf.Reshape' op requires 'output' number
  of elements to match", collective_lowering.cc), and a later mesh in the same process
  compiles its gathers with whatever is set then: ZeRO-3 sets it only without tensor
  parallelism (`tfpar.zero.fsdp.collective_gathers`) and every other mesh model takes it
  out again (`fsdp.dtensor_gathers`; tests/test_zero3_prefetch.py has both). Python never
  reads the variable: the check looks for its name in the shared library that holds
  DTensor's passes (`_LIBRARY`, in TensorFlow's package directory); that the gathers are
  then all-gathers is tests/test_zero3_prefetch.py's (counted under the profiler).
"""

import mmap
import os

import tensorflow as tf

from tfpar.patches.versions import WRITTEN_FOR

ENTRIES = {
    "collective_gather_lowering": (
        "TensorFlow's DTensor lowering reads the environment variable "
        "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2 (set and unset, nothing replaced)",
        "tfpar.zero.fsdp (collective_gathers, dtensor_gathers)"),
}
COLLECTIVE_GATHER = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
_LIBRARY = "libtensorflow_cc.so.2"  # TensorFlow 2.21.0's, which reads the variable
_USER_OFF = []  # [True] once this process's `COLLECTIVE_GATHER=0` (the user's) was seen
_SET_HERE = []  # [True] while `set_collective_gathers` holds the variable set


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    if "collective_gather_lowering" not in names:
        return []
    path = os.path.join(os.path.dirname(tf.__file__), _LIBRARY)
    if _mentions(path, COLLECTIVE_GATHER.encode()):
        return []
    return [f"tensorflow {tf.__version__}'s {_LIBRARY} no longer names {COLLECTIVE_GATHER} "
            "(registry entry collective_gather_lowering); tfpar.zero.fsdp was written for "
            f"tensorflow {WRITTEN_FOR['tensorflow']}"]


def library_mentions(text):
    """Whether TensorFlow's `_LIBRARY` holds the bytes `text` (what C++ alone reads or
    writes: `check`, and `multi_worker`'s `heartbeat_error_text`)."""
    return _mentions(os.path.join(os.path.dirname(tf.__file__), _LIBRARY), text)


def _mentions(path, text):
    """Whether the file at `path` holds the bytes `text` (False if it is missing)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(text) >= 0
    except (OSError, ValueError):
        return False


def set_collective_gathers(on, keep_users=False):
    """Makes DTensor lower the gathers this process compiles from now on to all-gathers
    (`on`), or its own way. Registry entry `collective_gather_lowering`.

    Args:
        on: all-gathers; but a process started with `COLLECTIVE_GATHER=0` keeps DTensor's
            own (the variable taken out: TensorFlow reads any value as set).
        keep_users: with `on` False, take out only a value set here or the user's 0; any
            other value the user set stays.
    Returns:
        Whether the variable is set now.
    """
    if os.environ.get(COLLECTIVE_GATHER) == "0":
        _USER_OFF[:] = [True]
    if on and not _USER_OFF:
        os.environ[COLLECTIVE_GATHER] = "1"
        _SET_HERE[:] = [True]
    elif not keep_users or _SET_HERE or os.environ.get(COLLECTIVE_GATHER) == "0":
        os.environ.pop(COLLECTIVE_GATHER, None)
        _SET_HERE.clear()
    return COLLECTIVE_GATHER in os.environ
