"""The metrics JSON's per-step loss: each batch's own loss, as its train step computed it
(`tfpar.metrics.report_step_loss`), not rebuilt from Keras's running mean. One device, in
this process: no strategy is made."""

import keras
import numpy as np
import pytest

from tfpar import accumulation, metrics
from tfpar.errors import TfparError


class RunningMeans(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.means = []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append(float(logs["loss"]))


def _fit_recorded(steps, batch, seed, install=None, callbacks=()):
    """A Dense model fitted at learning rate 0 (the weights stay, so each batch's loss can
    be computed again here) for `steps` batches under `report_step_loss` (after
    `install(model)`): `(the recorder's losses, each batch's own loss)`."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * batch, 8)).astype("float32")
    y = rng.integers(0, 3, size=steps * batch)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if install is not None:
        install(model)
    metrics.report_step_loss(model)
    recorder = metrics.StepRecorder()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[recorder, *callbacks])
    own = np.array([float(model.loss(y[i:i + batch], model(x[i:i + batch])))
                    for i in range(0, steps * batch, batch)])
    return recorder.batch_losses, own


def test_step_loss_is_the_batchs_own_loss_not_the_running_mean():
    steps, running = 200, RunningMeans()
    recorded, own = _fit_recorded(steps, 8, seed=0, callbacks=[running])
    # Equal here (measured 0); 1e-6 leaves room for the step's graph rounding otherwise than
    # these eager calls. Rebuilt from the running mean over 200 steps they were up to
    # 2.3e-5 apart.
    np.testing.assert_allclose(recorded, own, rtol=1e-6)
    # Keras's `loss` stays the epoch's running mean: its meaning is unchanged.
    np.testing.assert_allclose(running.means, np.cumsum(own) / np.arange(1, steps + 1),
                               rtol=1e-4)


def test_step_loss_of_micro_batches_in_a_nested_graph_is_their_mean():
    # Accumulation hands the loss tracker each micro-batch's loss inside its
    # `tf.while_loop`, where the step cannot read them: those go through a `Mean` of the
    # step's own, emptied once read (the values Keras's own step hands over are read
    # directly, with no variable).
    recorded, own = _fit_recorded(6, 8, seed=1,
                                  install=lambda model: accumulation.install(model, 2))
    # Each step's loss: the mean of its two micro-batches' (equal sizes), not a running sum.
    np.testing.assert_allclose(recorded, own, rtol=1e-6)


def test_a_train_step_that_does_not_report_its_loss_is_named():
    recorder = metrics.StepRecorder()
    recorder.on_train_batch_begin(0)
    with pytest.raises(TfparError, match="no 'step_loss'.*report_step_loss"):
        recorder.on_train_batch_end(0, {"loss": 1.0})


def test_a_share_of_weight_zero_reports_zero_as_the_mean_did():
    # Under MirroredStrategy a last batch smaller than the replicas leaves a replica an
    # empty share: Keras hands its tracker that replica's loss with weight 0, which a Mean
    # counts as 0 (v·0 / 0). Read directly, the value itself was reported (a regulariser's
    # term, or a NaN from an empty batch, in the step's loss). One device here: a step that
    # hands weight 0, as such a replica's does.
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")

    def train_step(data):
        x, y = data
        loss = model.compute_loss(x=x, y=y, y_pred=model(x)) + 5.0  # never 0 itself
        model._loss_tracker.update_state(loss, sample_weight=tf.constant(0))
        return {"loss": loss}

    model.train_step = train_step
    metrics.report_step_loss(model)
    recorder = metrics.StepRecorder()
    x = np.ones((8, 4), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[recorder])
    assert recorder.batch_losses == [0.0, 0.0]


def test_a_step_that_hands_its_tracker_nothing_reports_the_loss_it_returns(caplog):
    # A train step of the user's own that computes its loss and returns it, never touching
    # the loss tracker: the step's loss is the `loss` it returns (it was 0, silently: the
    # empty Mean's result). A step returning no scalar `loss` is said in one warning.
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")

    def train_step(data):
        x, y = data
        return {"loss": model.compute_loss(x=x, y=y, y_pred=model(x))}

    model.train_step = train_step
    metrics.report_step_loss(model)
    recorder = metrics.StepRecorder()
    x = np.arange(32, dtype="float32").reshape(8, 4) / 10
    y = np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    own = [float(model.compute_loss(x=x[i:i + 4], y=y[i:i + 4], y_pred=model(x[i:i + 4])))
           for i in (0, 4)]
    assert min(own) > 0.01, own
    np.testing.assert_allclose(recorder.batch_losses, own, rtol=1e-6)

    silent = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="silent")
    silent.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    silent.train_step = lambda data: {"mae": tf.reduce_mean(tf.abs(silent(data[0])))}
    metrics.report_step_loss(silent)
    with caplog.at_level("WARNING"):
        silent.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert "train step of model 'silent' hands its loss tracker no value" in caplog.text
