"""The measured bubble of a pipelined `fit`: one sampled step under the profiler.

`PipelineModel.fit` adds a `BubbleProbe`: at the step it samples (by default the third of
the run, once the step is traced and warm) it starts the TensorFlow profiler, stops it when
the step ends, and maps every op to its stage and action (`tfpar.pipeline.timeline`). One
profiled step costs a few tens of milliseconds of parsing; the other steps run untouched.
Under pipeline x data parallelism the first replica's ops are read (every replica runs the
same schedule on its own devices).

Examples:
    >>> pm.fit(x, y, batch_size=32, epochs=1)
    >>> pm.bubble_measured, pm.measured_timeline.actions[0][:3]
"""

import re
import shutil
import tempfile

import keras
from absl import logging

from tfpar import profiling
from tfpar.pipeline import timeline as timeline_lib

_OTHER_REPLICA = re.compile(r"(^|/)replica_[1-9]\d*/")


class BubbleProbe(keras.callbacks.Callback):
    """Profiles training step `sample_step` (counted from the start of the run, over all
    `fit` calls) and stores what it measured on the model: `model.measured_timeline` (a
    `MeasuredTimeline`) and `model.bubble_measured` (its idle fraction).

    Args:
        num_stages: K, the pipeline's stages.
        sample_step: which step to profile (0-based; the first two trace and warm up).
    """

    def __init__(self, num_stages, sample_step=2):
        super().__init__()
        self.num_stages, self.sample_step = num_stages, sample_step
        self.steps_seen, self._logdir = 0, None

    def on_train_batch_begin(self, batch, logs=None):
        if self.steps_seen != self.sample_step or self._logdir is not None:
            return
        import tensorflow as tf
        self._logdir = tempfile.mkdtemp(prefix="tfpar_bubble_")
        try:
            tf.profiler.experimental.start(self._logdir)
        except Exception as err:  # another profiler runs (e.g. TensorBoard's): skip
            logging.warning("pipeline bubble not measured: the profiler is busy (%s)", err)
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = ""

    def on_train_batch_end(self, batch, logs=None):
        self.steps_seen += 1
        if not self._logdir:
            return
        import tensorflow as tf
        logdir, self._logdir = self._logdir, ""
        try:
            tf.profiler.experimental.stop()
            events = profiling.read_events(
                logdir, keep=lambda name: not _OTHER_REPLICA.search(name))
            measured = timeline_lib.from_events(events, self.num_stages)
            if measured.makespan_us:
                self.model.measured_timeline = measured
                self.model.bubble_measured = measured.bubble
        finally:
            shutil.rmtree(logdir, ignore_errors=True)


def timeline_block(measured):
    """The measured timeline as JSON for the metrics' `pipeline.timeline_measured`:
    per stage `[label, start_us, end_us]` triples, and the makespan."""
    return {"actions": [[[label, round(b, 1), round(e, 1)] for label, b, e in row]
                        for row in measured.actions],
            "makespan_us": round(measured.makespan_us, 1)}
