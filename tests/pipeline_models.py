"""The small models and batch the pipeline children train against one device
(tests/pipeline_executor_child.py, tests/pipeline_chimera_child.py). Import after the
child has split its logical CPUs."""

import keras
import numpy as np

from tfpar.errors import TfparError


def mlp(layers=8, seed=0):
    """Dense layers named by position: a checkpoint names weights by path, as one
    process's trainer would (Keras numbers unnamed ones per build)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,))]
                            + [keras.layers.Dense(16, activation="tanh", name=f"dense_{i}")
                               for i in range(layers)]
                            + [keras.layers.Dense(3, name="head")], name="mlp")


def residual(seed=0):
    """A functional chain whose residual branches must stay inside one stage."""
    keras.utils.set_random_seed(seed)
    x = inp = keras.Input((8,))
    x = keras.layers.Dense(16, activation="tanh")(x)
    for _ in range(3):
        x = keras.layers.Add()([x, keras.layers.Dense(16, activation="tanh")(x)])
    return keras.Model(inp, keras.layers.Dense(3)(x), name="residual")


rng = np.random.default_rng(0)
x = rng.normal(size=(16, 8)).astype("float32")
y = rng.normal(size=(16, 3)).astype("float32")
OPTS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}


def flat(models):
    """Every weight of `models`, in order, as one vector."""
    return np.concatenate([w.ravel() for m in models for w in m.get_weights()])


_REFERENCES = {}


def reference(build, opt, steps=3):
    """The single-device model's flat weights after `steps` steps and its prediction on
    `x`, trained once per (model, optimizer, steps) a child: every case starts from the
    same seed and batch."""
    key = (build.__name__, opt, steps)
    if key not in _REFERENCES:
        ref = build()
        ref.compile(optimizer=OPTS[opt](), loss="mse", jit_compile=False)
        for _ in range(steps):
            ref.train_on_batch(x, y)
        _REFERENCES[key] = flat([ref]), ref.predict(x, verbose=0)
    return _REFERENCES[key]


def error(fn):
    """The `TfparError` `fn()` raises, as text, or "no error"."""
    try:
        fn()
    except TfparError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
