"""Preemption: on SIGTERM, finish the step, write a checkpoint, stop — on every worker alike.

A preempted job loses no work: a scheduler (Kubernetes, Slurm, `tfpar.launch`) sends
SIGTERM and waits a grace period before SIGKILL. Workers of a synchronous job must stop at
the same step, or the ones still training would wait in a collective for the ones that
left; so every `check_every` steps the workers agree (a one-number all-reduce) whether any
of them was signalled, and all save and stop together. A tf_keras run (`keras=2`) feeds
the same guard through `tfpar.legacy.trainer.Preemption`; a DTensor mesh run
(`tfpar.backends.dtensor`) gives it its mesh, over which the number is summed instead
(`tfpar.layout.values.sum_over_devices`: every process of a multi-client mesh takes part).
"""

import signal
import threading

import keras
import numpy as np
import tensorflow as tf


# A SIGTERM that came before the run's PreemptionGuard existed (`hold_sigterm`).
_EARLY = threading.Event()


def hold_sigterm(hold):
    """What SIGTERM does from now on in a worker, until a `PreemptionGuard` takes over.

    Building `MultiWorkerMirroredStrategy` installs a SIGTERM handler of TensorFlow's own
    (its preemption notifier) that keeps the process alive and tells no one, so a SIGTERM
    between the strategy and the run's guard was lost. With `hold` (the run saves
    checkpoints), the signal is recorded and the guard built later saves and stops at the
    first agreed step; otherwise SIGTERM ends the process, as it does without TensorFlow's
    handler. Main thread only (elsewhere nothing changes)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM,
                      (lambda *_: _EARLY.set()) if hold else signal.SIG_DFL)


class PreemptionGuard(keras.callbacks.Callback):
    """Saves a checkpoint and stops training after SIGTERM (handled from construction on;
    `restore_handler` puts the previous handler back).

    Args:
        checkpointer: the run's `tfpar.checkpoint.Checkpointer`.
        strategy: the run's strategy, or its Keras `DeviceMesh` on DTensor (used to agree
            across workers).
        workers: the number of training processes.
        check_every: steps between agreements when there are several workers (a single
            process checks every step: it needs no collective).
    """

    def __init__(self, checkpointer, strategy, workers, check_every=5):
        super().__init__()
        self.checkpointer, self.strategy = checkpointer, strategy
        self.check_every = check_every if workers > 1 else 1
        self.workers = workers
        self.preempted = False
        self._signalled = threading.Event()
        self._steps = 0
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._signalled.set())
        if _EARLY.is_set():  # signalled while the run was being built (`hold_sigterm`)
            self._signalled.set()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._steps % self.check_every:
            return
        if self._agreed_signal():
            self.preempted = True
            self.checkpointer.save()
            self.checkpointer.wait()  # published before the line says so
            self.model.stop_training = True
            # What `tfpar.launch` reads to tell a stop it asked for from a finished job.
            print(f"tfpar: stopping at step {self.checkpointer.saved_step} on SIGTERM: "
                  "checkpoint saved", flush=True)

    def restore_handler(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _agreed_signal(self):
        local = 1.0 if self._signalled.is_set() else 0.0
        if self.workers == 1:
            return bool(local)
        if hasattr(self.strategy, "backend_mesh"):  # a DTensor mesh spanning the workers
            from tfpar.layout.values import sum_over_devices
            return sum_over_devices(local, self.strategy) > 0
        values = self.strategy.experimental_distribute_values_from_function(
            lambda _: tf.constant(local))
        return float(np.asarray(self.strategy.reduce("SUM", values, axis=None))) > 0
