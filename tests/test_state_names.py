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
