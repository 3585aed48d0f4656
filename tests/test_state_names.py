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
