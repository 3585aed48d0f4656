"""Momentum SGD through TensorFlow's fused kernel (`tfpar.optimizers.FusedMomentumMixin`)
against Keras's own update.

The two compute the same formula with different kernels: an FMA contraction may round
differently on another CPU, so weights are compared within a tolerance, never bit for bit.
Tolerance 1e-6 after 5 steps (weights of order 1): one rounding of `m*momentum - lr*g` per
step, below the all-reduce re-association test_train.py allows.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpar import ParallelConfig, optimizers
from test_train import max_diff, train_runs, weights

TOLERANCE = 1e-6


def _variables(seed):
    rng = np.random.RandomState(seed)
    return [keras.Variable(rng.randn(40, 30).astype("float32")),
            keras.Variable(rng.randn(30).astype("float32")),
            keras.Variable(rng.randn(50, 8).astype("float32"))]  # an embedding table


def _train(fused, steps=5):
    variables = _variables(0)
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    if fused:
        optimizers.fuse_momentum(optimizer)
    optimizer.build(variables)

    @tf.function
    def step(i):
        scale = tf.cast(i + 1, tf.float32)
        grads = [tf.sin(v.value * scale) for v in variables[:2]]
        # The embedding's gradient is sparse: the kernel does not apply (Keras's update
        # decays the momentum of every row), so it falls back.
        grads.append(tf.IndexedSlices(tf.cos(tf.gather(variables[2].value, [3, 7]) * scale),
                                      tf.constant([3, 7]), tf.constant([50, 8])))
        optimizer.apply(grads, variables)

    for i in range(steps):
        step(tf.constant(i))
    return ([v.numpy() for v in variables] + [m.numpy() for m in optimizer.momentums],
            optimizer)


def test_fused_update_matches_keras_and_falls_back_on_sparse_gradients():
    keras_state, plain = _train(fused=False)
    fused_state, fused = _train(fused=True)
    # Traced once: the two dense variables through the kernel, the sparse one not.
    assert fused.tfpar_fused_traced == 2 and not hasattr(plain, "tfpar_fused_traced")
    assert max_diff(keras_state, fused_state) < TOLERANCE
    # The updates did something the comparison could miss.
    assert max_diff(keras_state[:3], [v.numpy() for v in _variables(0)]) > 0.1
    config = {k: v for k, v in fused.get_config().items() if k != "name"}
    assert type(fused).__name__ == "SGD" and config == {
        k: v for k, v in plain.get_config().items() if k != "name"}


def test_make_optimizer_fuses_momentum_sgd_only():
    def fused(**settings):
        return isinstance(optimizers.make_optimizer(ParallelConfig(**settings)),
                          optimizers.FusedMomentumMixin)
    assert fused(optimizer="momentum", fused_update=True)
    assert not fused(optimizer="momentum")  # off by default
    assert not fused(optimizer="sgd", fused_update=True)
    assert not fused(optimizer="adam", fused_update=True)


def test_checkpoint_of_keras_update_restores_into_fused(tmp_path):
    """Same slots under the same names: a checkpoint written by Keras's update (before
    the fused one existed) restores into the fused optimizer, which then trains on as
    Keras's would."""
    _, plain = _train(fused=False, steps=3)
    variables = _variables(0)
    path = tf.train.Checkpoint(optimizer=plain).write(str(tmp_path / "ckpt"))
    fused = optimizers.fuse_momentum(keras.optimizers.SGD(0.05, momentum=0.9))
    fused.build(variables)
    tf.train.Checkpoint(optimizer=fused).read(path).assert_consumed()
    assert max_diff([m.numpy() for m in plain.momentums],
                    [m.numpy() for m in fused.momentums]) == 0
    assert int(fused.iterations.numpy()) == 3


RUNS = {"model": "mlp", "optimizer": "momentum", "learning_rate": 0.05}
MIRRORED = {"strategy": "mirrored", "cpu_devices": 2}
CASES = {  # name -> settings; each trained with fused_update on and off
    # Keras's all-reduce, then Keras's LossScaleOptimizer (tfpar's consistent variant).
    "fp16": {**RUNS, **MIRRORED, "mixed_precision": "fp16"},
    # tfpar's aggregator in front (`tfpar.compression.keras_hook`).
    "powersgd": {**RUNS, **MIRRORED, "compression": "powersgd", "powersgd_rank": 2},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused")
    return train_runs(folder, [[f"{name}_{on}", {**settings, "fused_update": on}]
                               for name, settings in CASES.items() for on in (True, False)])


@pytest.mark.parametrize("case", list(CASES))
def test_fused_update_trains_as_keras_update(runs, case, report_measured):
    """2 mirrored replicas, with fp16 loss scaling or PowerSGD's aggregator in front: the
    same weights after 5 steps as Keras's own update (one device: the first test)."""
    summaries, prefix = runs
    on, off = summaries[f"{case}_True"], summaries[f"{case}_False"]
    # The mlp's 6 variables (3 kernels, 3 biases) through the kernel, on both replicas.
    assert on["fused_updates"] == 6 * 2 and off["fused_updates"] == 0
    diff = max_diff(weights(f"{prefix}_{case}_True"), weights(f"{prefix}_{case}_False"))
    report_measured(f"fused vs Keras momentum update, {case}: max |Δw| {diff:.2e} after 5 steps")
    assert diff < TOLERANCE, (case, diff)
    assert abs(on["final_loss"] - off["final_loss"]) < 1e-5
    assert json.dumps(on["loss_history"][:1]) == json.dumps(off["loss_history"][:1])
