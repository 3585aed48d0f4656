"""How a checkpoint reaches the disk, and how a damaged one is recognised.

A save is published in three moves: the checkpoint's files (`ckpt-S.index`,
`ckpt-S.data-*`), then its manifest `ckpt-S.manifest.json` (each file's size and CRC32),
then the `checkpoint` state file naming `ckpt-S` (an atomic rename). A save cut short at
any point leaves the previous published one as the latest; a published one whose files
were damaged since (a truncated copy, a bad disk) fails `damage()` and is skipped on
restore (`tfpar.checkpoint`).

`Writer` runs the writing beside training (`--checkpoint_async`): the step blocks while the
state is read into host memory (`tfpar.patches.tensorflow_checkpoint.snapshot`), a thread
writes and publishes it. At most one write is in flight: the next save first waits for
it. The thread is not a daemon: a process that ends (the last save, a preemption save, an
error) exits only once the write in flight is published.
"""

import collections
import json
import os
import re
import sys
import threading
import time
import zlib

from absl import logging

from tfpar.errors import ConfigError, TfparError

MANIFEST = ".manifest.json"
_CHUNK = 1 << 22


def _files_of(prefix):
    """The files TensorFlow wrote for checkpoint `prefix`: its index and data shards."""
    folder, name = os.path.split(prefix)
    shard = re.compile(re.escape(name) + r"\.data-\d+-of-\d+$")
    return sorted([name + ".index"] + [f for f in os.listdir(folder) if shard.match(f)])


def _crc32(path):
    # Read into one buffer, unbuffered: no new bytes object and no second copy per chunk.
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            crc = zlib.crc32(view[:size], crc)
    return crc


def write_manifest(prefix):
    """Records each file of checkpoint `prefix` with its size and CRC32 in
    `prefix.manifest.json` (written whole, then renamed into place)."""
    folder = os.path.dirname(prefix)
    files = {name: {"size": os.path.getsize(os.path.join(folder, name)),
                    "crc32": _crc32(os.path.join(folder, name))} for name in _files_of(prefix)}
    tmp = prefix + MANIFEST + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
    os.replace(tmp, prefix + MANIFEST)


def damage(prefix):
    """What is wrong with checkpoint `prefix`'s files, in a few words, or None when they
    match its manifest. A checkpoint without a manifest (an older tfpar's) is not checked
    here: reading it is the check."""
    folder, name = os.path.split(prefix)
    try:
        with open(prefix + MANIFEST) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        if not os.path.exists(prefix + ".index"):
            return f"{name}.index is missing"
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its manifest {name}{MANIFEST} is unreadable ({type(err).__name__})"
    for file, want in sorted(files.items()):
        path = os.path.join(folder, file)
        if not os.path.exists(path):
            return f"{file} is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{file} has {size} bytes, {want['size']} were written"
        if _crc32(path) != want["crc32"]:
            return f"{file} fails its CRC32 check (its bytes changed since it was written)"
    return None


class Costs:
    """What the saves cost, per phase: `records` holds the newest saves' (`MAX` of them)
    `{"step", "<phase>_cpu_ms", "<phase>_ms"}`, each phase's CPU time in the thread that
    ran it (`time.thread_time`) and its wall time (an async save's also `batched_reads`:
    its variables read in one call). `tools/bench_checkpoint.py` reads them.

    A record is complete when it is in `records`: `done` appends it once its save is
    published (a synchronous save's on return, an asynchronous one's at the end of the
    writer thread, so after `Checkpointer.wait()`); a save that failed leaves none.
    `count` is the number of records ever appended: `since(count)` gives the ones
    appended after it, or refuses if older ones were dropped to keep `MAX`."""

    MAX = 64

    def __init__(self):
        self.records = collections.deque(maxlen=self.MAX)
        self.count = 0
        self._lock = threading.Lock()  # the writer thread appends, training reads

    @staticmethod
    def new(step):
        """A record for step `step`'s save, filled by `timed`, not in `records` until
        `done`."""
        return {"step": step}

    def done(self, record):
        """Appends `record`, complete: its save is published."""
        with self._lock:
            self.records.append(record)
            self.count += 1

    def since(self, count):
        """The records appended after `count` were (`count` read from `self.count`
        before), oldest first.

        Raises:
            TfparError: more were appended since than `MAX` keeps.
        """
        with self._lock:
            new = self.count - count
            if new > len(self.records):
                raise TfparError(f"{new} saves since count {count}, only the newest "
                                 f"{self.MAX} are kept: read them every {self.MAX} saves "
                                 "at most")
            return list(self.records)[len(self.records) - new:]

    @staticmethod
    def timed(record, phase, function, *args):
        """`function(*args)`, its CPU and wall time added to `record` under `phase`."""
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return function(*args)
        finally:
            record[f"{phase}_cpu_ms"] = (record.get(f"{phase}_cpu_ms", 0)
                                         + 1000 * (time.thread_time() - cpu))
            record[f"{phase}_ms"] = (record.get(f"{phase}_ms", 0)
                                     + 1000 * (time.perf_counter() - wall))


class Writer:
    """One background write at a time; its error is raised by the next `wait`.

    Args:
        nice: how much the writer thread's nice value is raised above that of the thread
            calling `submit` (Linux sets it per thread; at most 19, the lowest priority,
            lets training's threads take the cores first); 0 leaves it as training's. An
            integer from 0 to 19 (a negative one would put the writer ahead of training).
    """

    def __init__(self, nice=0):
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ConfigError("writer_nice", nice, "must be an integer from 0 (the writer at "
                              "training's priority) to 19 (the lowest)")
        self._thread = None
        self._error = None
        self.nice = nice

    def submit(self, step, write):
        """Runs `write()` (the writing of step `step`'s save) in a new thread, after the
        previous one finished."""
        self.wait()

        def run():
            try:
                if self.nice:
                    _lower_priority(self.nice)
                write()
            except BaseException as err:  # noqa: BLE001 -- raised again by `wait`
                self._error = (step, err)
                logging.error("tfpar: the checkpoint write of step %d failed: %s", step, err)
        self._thread = threading.Thread(target=run, name=f"tfpar-checkpoint-{step}")
        self._thread.start()

    @property
    def busy(self):
        return self._thread is not None and self._thread.is_alive()

    def wait(self):
        """Waits for the write in flight, if any.

        Raises:
            TfparError: that write failed (the previous published save stays the latest).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            (step, err), self._error = self._error, None
            raise TfparError(f"the checkpoint write of step {step} failed "
                             f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                             "the previous checkpoint is still the latest") from err


def _lower_priority(nice):
    """Raises the calling thread's nice value by `nice` (on Linux a thread's own; a
    system without per-thread priorities, or one that refuses, leaves it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread,
                       min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))
    except OSError as err:
        logging.info("tfpar: the checkpoint writer's priority stays (%s)", err)
