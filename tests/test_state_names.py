"""A checkpoint names each weight by its path (`tfpar.state`): two weights under one path
would leave one of them out of the checkpoint, silently. Keras allows it in a subclassed
model whose layers share a name; tfpar refuses it with one line."""

import keras
import pytest

from tfpar import state
from tfpar.errors import TfparError


class TwoLayersOneName(keras.Model):
    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(2, name="dense")
        self.second = keras.layers.Dense(2, name="dense")

    def call(self, x):
        return self.second(self.first(x))


def test_two_weights_under_one_path_are_refused():
    model = TwoLayersOneName()
    model(keras.ops.ones((1, 3)))
    paths = [w.path for w in model.weights]
    assert len(set(paths)) < len(paths)  # Keras gives them one path
    with pytest.raises(TfparError, match="two weights of the model are named"):
        state.LayoutState(model, {}).entries()


def test_distinct_paths_give_one_entry_per_weight():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="b")(
        keras.layers.Dense(2, name="a")(inputs)))
    entries = state.LayoutState(model, {}).entries()
    assert sorted(entries) == ["model/a/bias", "model/a/kernel", "model/b/bias",
                               "model/b/kernel"]


class _Reader:
    """A checkpoint reader holding the optimizer's iteration only."""

    def get_tensor(self, key):
        import numpy as np
        return np.int64(60)


def _loaded(kinds):
    """Loads a checkpoint holding no codec state into entries of `kinds` (one weight's):
    what each setter was given."""
    given = {}
    entries = {f"codec/model/a/kernel/{kind}": (None, lambda v, k=kind: given.update({k: int(v)}))
               for kind in kinds}
    state.LayoutState._codec_moves(None, _Reader(), {"optimizer/iteration": "iteration"},
                                   entries, "/checkpoints/ckpt-60", kinds=set())
    return given


def test_adam_in_front_resumed_without_its_moments_redoes_the_warm_up(caplog):
    # Written with Adam behind the codec (no adam_m/adam_v), resumed with Adam in front:
    # the counter stays at 0 (the exact warm-up builds the moments again) instead of the
    # iteration, past the warm-up with zero moments.
    with caplog.at_level("WARNING"):
        assert _loaded(["step", "adam_m", "adam_v"]) == {}
    assert any("warm-up runs again" in r.getMessage() for r in caplog.records)
    # A codec without Adam in front: its counter follows the optimizer's iteration.
    assert _loaded(["step"]) == {"step": 60}


class _FrontReader:
    """A checkpoint reader of Adam in front of a codec's moments (2 rows) for weight
    `a/kernel` and Keras's zero slots, at iteration 60; with `units`, their record."""

    def __init__(self, units=None):
        import numpy as np
        self.tensors = {"iteration": np.int64(60), "m": np.full((2, 3), 0.5),
                        "v": np.full((2, 3), 4.0), "zero": np.zeros(3)}
        if units is not None:
            import json
            self.tensors[state.key(state.ADAM_UNITS)] = json.dumps(units).encode()

    def get_tensor(self, key):
        return self.tensors[key]

    def has_tensor(self, key):
        return key in self.tensors


_SAVED = {"optimizer/iteration": "iteration", "codec/a/kernel/adam_m": "m",
          "codec/a/kernel/adam_v": "v", "optimizer/a/kernel/momentum": "zero",
          "optimizer/a/kernel/velocity": "zero"}


def _moved_into_keras(reader):
    """Loads `reader`'s moments into Keras's Adam slots of `a/kernel`: what each slot's
    setter was given, and the names placed."""
    given = {}
    entries = {f"optimizer/a/kernel/{slot}": (None, lambda v, s=slot: given.update({s: v}))
               for slot in ("momentum", "velocity")}
    holder = state.LayoutState.__new__(state.LayoutState)
    holder._model = keras.Sequential()  # no codec: Keras's Adam holds the moments
    placed = holder._adam_moves(reader, _SAVED, entries, "/checkpoints/ckpt-60")
    return given, placed


def test_adam_front_moments_without_their_units_keep_todays_slots(caplog):
    with caplog.at_level("WARNING"):
        given, placed = _moved_into_keras(_FrontReader())
    assert given == {} and placed == set()
    assert [r.getMessage() for r in caplog.records if "record of their units" in
            r.getMessage()]


def test_adam_front_moments_carried_into_keras_units():
    import numpy as np
    from tfpar.compression import adam_front
    adam = (0.9, 0.999, 1e-7)
    # Frozen v after a 50-step warm-up, 60 steps on: v̂ = v / (1 - β₂⁵⁰) kept at t = 60.
    units = adam_front.moment_units("frozen", 50, 0, 60, adam)
    assert (units["m"], units["v_steps"]) == ("gradient", 50)
    given, placed = _moved_into_keras(_FrontReader(units))
    assert placed == {"codec/a/kernel/adam_m", "codec/a/kernel/adam_v"}
    np.testing.assert_allclose(given["momentum"], 0.5)
    np.testing.assert_allclose(given["velocity"] / (1 - 0.999 ** 60), 4.0 / (1 - 0.999 ** 50),
                               rtol=1e-6)
    # Each replica's own v: m in Adam's scaled units after the warm-up, m / (√v̂ + ε).
    units = adam_front.moment_units("local_debiased", 50, 0, 60, adam)
    assert (units["m"], units["v_steps"]) == ("scaled", 60)
    given, _ = _moved_into_keras(_FrontReader(units))
    v_hat = 4.0 / (1 - 0.999 ** 60)
    np.testing.assert_allclose(given["momentum"], 0.5 * (np.sqrt(v_hat) + 1e-7), rtol=1e-6)
    # The front's own conversion at its first compressed step (`scaled_momentum`: m over
    # `denominator`) undone, and `front_moments` inverting `keras_slots`.
    m, v = np.array([[0.3, -2.0]]), np.array([[0.04, 9.0]])
    at_warm = adam_front.moment_units("local", 50, 0, 50, adam)
    scaled = m / adam_front.denominator(v.astype(np.float32), 1 - 0.999 ** 50, 1e-7).numpy()
    later = adam_front.moment_units("local", 50, 0, 51, adam)
    assert at_warm["m"] == "gradient" and later["m"] == "scaled"
    back = adam_front.keras_slots(scaled, v, {**later, "v_steps": 50, "steps": 50}, 50)
    np.testing.assert_allclose(back[0], m[0], rtol=1e-6)
    for units in (later, adam_front.moment_units("frozen", 50, 10, 75, adam)):
        again = adam_front.front_moments(*adam_front.keras_slots(m, v, units, 75), units, 75)
        np.testing.assert_allclose(again[0], m[0], rtol=1e-6)
        np.testing.assert_allclose(again[1], v[0], rtol=1e-6)


def test_moments_move_at_the_update_count_not_keras_micro_batch_count():
    # Keras's `optimizer/iteration` counts micro-batches under gradient_accumulation_steps;
    # Adam's bias correction (and a codec's step counter) counts updates: 28 micro-batches
    # of K=4 are 7 updates (with a loss-scale wrapper too).
    import types

    import keras

    from tfpar import state
    adam = keras.optimizers.Adam(gradient_accumulation_steps=4)
    for optimizer in (adam, keras.optimizers.LossScaleOptimizer(adam)):
        assert state._update_steps(types.SimpleNamespace(optimizer=optimizer), 28) == 7
    plain = types.SimpleNamespace(optimizer=keras.optimizers.Adam())
    assert state._update_steps(plain, 28) == 28
