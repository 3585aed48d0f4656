"""A checkpoint names each weight by its path (`tfpar.state`): two weights under one path
would leave one of them out of the checkpoint, silently. Keras allows it in a subclassed
model whose layers share a name; tfpar refuses it with one line."""

import keras
import numpy as np
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
    """A checkpoint reader holding the optimizer's iteration (60) only, and with
    `accumulation` the writer's `meta/accumulation` record."""

    def __init__(self, accumulation=None):
        self.accumulation = accumulation

    def get_tensor(self, key):
        import numpy as np
        return np.int64(self.accumulation if key == state.key(state.ACCUMULATION) else 60)

    def has_tensor(self, key):
        return key == state.key(state.ACCUMULATION) and self.accumulation is not None


def _holder(model):
    holder = state.LayoutState.__new__(state.LayoutState)
    holder._model = model
    return holder


def _loaded(kinds, reader=None):
    """Loads a checkpoint holding no codec state into entries of `kinds` (one weight's):
    what each setter was given."""
    given = {}
    entries = {f"codec/model/a/kernel/{kind}": (None, lambda v, k=kind: given.update({k: int(v)}))
               for kind in kinds}
    _holder(keras.Sequential())._codec_moves(
        reader or _Reader(), {"optimizer/iteration": "iteration"}, entries,
        "/checkpoints/ckpt-60", kinds=set())
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
    # No codec: Keras's Adam holds the moments.
    placed = _holder(keras.Sequential())._adam_moves(reader, _SAVED, entries,
                                                     "/checkpoints/ckpt-60")
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


def test_codec_counter_takes_the_writers_update_count():
    # A checkpoint without a codec's counter, written with gradient_accumulation_steps=2
    # (its record), read by a run without accumulation: the 60 micro-batches were 30
    # updates, which the counter counts (before, this run's K: 60).
    assert _loaded(["step"], _Reader(accumulation=2)) == {"step": 30}


class _KerasReader:
    """A checkpoint of Keras's Adam slots (`m` = 0.5, `v` = 4.0) for weight `a/kernel` at
    iteration 60: written by Keras's Adam with `accumulation` K (its `meta/accumulation`),
    or with `front` the record of Adam in front of the codec and its zero moments (2 rows)
    beside them."""

    def __init__(self, accumulation=None, front=None):
        import json

        import numpy as np
        self.tensors = {"iteration": np.int64(60), "m": np.full(3, 0.5), "v": np.full(3, 4.0),
                        "zero": np.zeros((2, 3)), "counter": np.int64(0)}
        if accumulation is not None:
            self.tensors[state.key(state.ACCUMULATION)] = np.int64(accumulation)
        if front is not None:
            self.tensors[state.key(state.ADAM_UNITS)] = json.dumps(front).encode()

    def get_tensor(self, key):
        return self.tensors[key]

    def has_tensor(self, key):
        return key in self.tensors


def _moved_into_front(reader, saved):
    """Loads `reader` (names `saved`) into Adam in front of a codec on 2 replicas that takes
    the steps (each replica's own `v`, warm-up 50): what the front's moments, its counter
    and Keras's slots of `a/kernel` were given."""
    import types
    given = {}
    names = ["codec/a/kernel/adam_m", "codec/a/kernel/adam_v", "codec/a/kernel/step",
             "optimizer/a/kernel/momentum", "optimizer/a/kernel/velocity"]
    entries = {n: (None, lambda v, n=n: given.update({n.rsplit("/", 1)[1]: v}), None)
               for n in names}
    front = types.SimpleNamespace(warm=50, variance="local_debiased", replicas=2,
                                  beta_1=0.9, beta_2=0.999, eps=1e-7, count=None)
    model = types.SimpleNamespace(tfpar_reductions=(front,))
    placed = _holder(model)._adam_moves(reader, saved, entries, "/checkpoints/ckpt-60")
    return given, placed


_KERAS = {"optimizer/iteration": "iteration", "optimizer/a/kernel/momentum": "m",
          "optimizer/a/kernel/velocity": "v"}


def _expected_front(steps):
    """The front's `(m, v)` from Keras's slots (0.5, 4.0) at `steps` updates."""
    from tfpar.compression import adam_front
    units = adam_front.moment_units("local_debiased", 50, 0, steps, (0.9, 0.999, 1e-7))
    return adam_front.front_moments(np.full(3, 0.5), np.full(3, 4.0), units, steps)


def test_keras_moments_move_into_the_front_at_the_writers_update_count():
    # Keras's Adam with gradient_accumulation_steps=2 wrote iteration 60 (30 updates); the
    # front past its warm-up takes its slots at 30 (m in the scaled units at 30 steps of
    # `v`) and counts 30 (before, this run's K, 1: 60, another bias correction).
    given, _ = _moved_into_front(_KerasReader(accumulation=2), _KERAS)
    assert int(given["step"]) == 30
    m, v = _expected_front(30)
    np.testing.assert_allclose(given["adam_m"][0], m, rtol=1e-6)
    np.testing.assert_allclose(given["adam_v"][0], v, rtol=1e-6)
    assert not np.any(given["momentum"]) and not np.any(given["velocity"])


def test_fronts_that_never_stepped_take_keras_moments():
    # Written on one replica with Adam in front of the codec configured: Keras's Adam took
    # the 60 steps (its slots), the front's moments and counter are zero, and its record
    # says it did not step. Resumed where the front steps (2 replicas), the front takes
    # Keras's slots and counts 60 (before: its zero moments and a counter of 0).
    from tfpar.compression import adam_front
    saved = {**_KERAS, "codec/a/kernel/adam_m": "zero", "codec/a/kernel/adam_v": "zero",
             "codec/a/kernel/step": "counter"}
    units = adam_front.moment_units("local_debiased", 50, 0, 0, (0.9, 0.999, 1e-7))
    for record in ({**units, "takes_steps": False}, units):  # an older record: 0 steps
        given, placed = _moved_into_front(_KerasReader(front=record), saved)
        assert int(given["step"]) == 60, record
        m, v = _expected_front(60)
        np.testing.assert_allclose(given["adam_m"][0], m, rtol=1e-6)
        np.testing.assert_allclose(given["adam_v"][0], v, rtol=1e-6)
        assert {"codec/a/kernel/adam_m", "codec/a/kernel/step"} <= placed


def _adam_run(accumulation, gradients, tmp_path=None, load=None):
    """A Dense(1)'s weights after Keras's real Adam (gradient_accumulation_steps
    `accumulation`, 1: none) applied `gradients` (each weight's, one per update, given to
    every micro-batch of it: the update's mean is that gradient); with `load`, from that
    checkpoint first; with `tmp_path`, written there after: (weights, checkpoint path)."""
    import tensorflow as tf
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")],
                             name="m")
    adam = keras.optimizers.Adam(0.1, gradient_accumulation_steps=accumulation if
                                 accumulation > 1 else None)
    model.compile(optimizer=adam, loss="mse")
    adam.build(model.trainable_variables)
    if load is not None:
        state.LayoutState(model).load(load)
    for gradient in gradients:
        for _ in range(accumulation):
            adam.apply_gradients(zip([tf.constant(g, tf.float32) for g in gradient],
                                     model.trainable_variables))
    path = None
    if tmp_path is not None:
        path = tf.train.Checkpoint(state=state.LayoutState(model)).write(
            str(tmp_path / f"k{accumulation}"))
    return [w.numpy() for w in model.trainable_variables], path


def _gradients(n):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(2, 1)), rng.normal(size=(1,))) for _ in range(n)]


@pytest.mark.parametrize("writer,reader", [(2, 1), (1, 2), (2, 3)])
def test_keras_adam_resumed_with_another_accumulation_steps_as_uninterrupted(
        tmp_path, writer, reader, caplog):
    # 30 updates under the writer's gradient_accumulation_steps, the 31st under the
    # reader's: the step Keras's Adam takes is the uninterrupted run's (before: its raw
    # count loaded as saved, Keras's Adam bias-corrected at 60 // 1 or 30 // 2 updates).
    gradients = _gradients(31)
    _, path = _adam_run(writer, gradients[:30], tmp_path)
    with caplog.at_level("WARNING"):
        resumed, _ = _adam_run(reader, gradients[30:], load=path)
    uninterrupted, _ = _adam_run(1, gradients)
    before, _ = _adam_run(1, gradients[:30])
    for w, u, b in zip(resumed, uninterrupted, before):
        np.testing.assert_allclose(w - b, u - b, rtol=1e-4, atol=1e-7)
    assert any("gradient_accumulation_steps" in r.getMessage() for r in caplog.records)


def test_loaded_debt_of_a_weight_without_a_gradient_stays_owed():
    # One replica's debt loaded from more (`debt_owed`) for two weights; the first applied
    # step has no gradient of the second (Keras drops None gradients, as for an unused
    # layer of a subclassed model): it pays the first, and the flag stays set until a step
    # with the second's gradient pays it (before: cleared, the second never paid).
    import types

    import tensorflow as tf

    from tfpar.compression import keras_hook
    weights = [tf.Variable(tf.zeros(2)), tf.Variable(tf.zeros(3))]
    residuals = {"0": tf.Variable([1.0, 2.0]), "1": tf.Variable([3.0, 4.0, 5.0])}
    aggregator = types.SimpleNamespace(
        debt_owed=tf.Variable(True), residuals=residuals,
        position_of=lambda v: next(i for i, w in enumerate(weights) if w is v))
    first = keras_hook.pay_debt(aggregator, [(tf.ones(2), weights[0])])
    np.testing.assert_allclose(first[0][0], [2.0, 3.0])
    assert bool(aggregator.debt_owed.numpy())
    np.testing.assert_allclose(residuals["0"].numpy(), 0.0)
    np.testing.assert_allclose(residuals["1"].numpy(), [3.0, 4.0, 5.0])
    second = keras_hook.pay_debt(aggregator, [(tf.ones(2), weights[0]),
                                              (tf.ones(3), weights[1])])
    np.testing.assert_allclose(second[0][0], [1.0, 1.0])
    np.testing.assert_allclose(second[1][0], [4.0, 5.0, 6.0])
    assert not bool(aggregator.debt_owed.numpy())
    third = keras_hook.pay_debt(aggregator, [(tf.ones(3), weights[1])])
    np.testing.assert_allclose(third[0][0], 1.0)


@pytest.mark.parametrize("variance,iteration", [("local_debiased", 53), ("local", 53),
                                                ("frozen", 53), ("local", 60)])
def test_keras_slots_hold_the_fronts_estimates(variance, iteration):
    # Independent of `front_moments` (a factor wrong in both would cancel in a round trip):
    # Keras's slots at `iteration` give the front's own estimates, from the formulas of the
    # front's step (`adam_front.denominator`: a step is m̂ / (√v̂ + ε), m̂ = m / (1 − β₁ᵗ)
    # in the gradient's units, m / s scaled): the same v̂, the same m̂, the same step.
    from tfpar.compression import adam_front
    b1, b2, eps = 0.9, 0.999, 1e-7
    units = adam_front.moment_units(variance, 50, 0, 53, (b1, b2, eps))
    m, v = np.array([[0.3, -2.0, 1e-4]]), np.array([[0.04, 9.0, 1e-9]])
    v_hat = v[0] / (1 - b2 ** units["v_steps"])
    m_hat = m[0] / (1 - b1 ** 53)
    if units["m"] == "scaled":  # the front's step is m̂ itself, in the scaled units
        step, m_hat = m_hat, m_hat * (np.sqrt(v_hat) + eps)
    else:
        step = m_hat / (np.sqrt(v_hat) + eps)
    momentum, velocity = adam_front.keras_slots(m, v, units, iteration)
    keras_v_hat = velocity / (1 - b2 ** iteration)
    keras_m_hat = momentum / (1 - b1 ** iteration)
    np.testing.assert_allclose(keras_v_hat, v_hat, rtol=1e-9)
    np.testing.assert_allclose(keras_m_hat, m_hat, rtol=1e-9)
    np.testing.assert_allclose(keras_m_hat / (np.sqrt(keras_v_hat) + eps), step, rtol=1e-9)


def test_an_older_record_guessed_to_have_stepped_short_of_the_update_count_is_said(caplog):
    # A record of before `takes_steps` is guessed from its steps (> 0: the fronts stepped);
    # 53 of 60 updates says so in one line; all 60, nothing to say.
    from tfpar.compression import adam_front
    for steps, said in ((53, True), (60, False)):
        caplog.clear()
        units = adam_front.moment_units("local", 50, 0, steps, (0.9, 0.999, 1e-7))
        with caplog.at_level("WARNING"):
            _, placed = _moved_into_keras(_FrontReader(units))
        assert "codec/a/kernel/adam_m" in placed
        assert any("predates takes_steps" in r.getMessage() and "53 steps" in r.getMessage()
                   for r in caplog.records) == said


class _WithFront:
    """Checkpoint reader `inner` (Keras's Adam's) as a run with Adam in front of its codec
    (local `v`, warm-up 10, past it) would have written it: each weight's moments as the
    front's rows (`front_moments` of Keras's slots), their record, Keras's slots zero."""

    def __init__(self, inner, steps):
        import json

        from tfpar.compression import adam_front
        self.inner, self.extra, self.zero = inner, {}, set()
        units = adam_front.moment_units("local", 10, 0, steps, (0.9, 0.999, 1e-7))
        self.extra[state.key(state.ADAM_UNITS)] = json.dumps(
            {**units, "takes_steps": True}).encode()
        for path in ("m/d/kernel", "m/d/bias"):
            slots = [inner.get_tensor(state.key(f"optimizer/{path}/{s}"))
                     for s in ("momentum", "velocity")]
            for k, value in zip("mv", adam_front.front_moments(*slots, units, steps)):
                self.extra[state.key(f"codec/{path}/adam_{k}")] = value[None]
            self.zero |= {state.key(f"optimizer/{path}/{s}") for s in ("momentum", "velocity")}

    def get_variable_to_shape_map(self):
        return {**self.inner.get_variable_to_shape_map(),
                **{k: np.shape(v) for k, v in self.extra.items()}}

    def get_tensor(self, key):
        if key in self.extra:
            return self.extra[key]
        value = self.inner.get_tensor(key)
        return np.zeros_like(value) if key in self.zero else value

    def has_tensor(self, key):
        return key in self.extra or self.inner.has_tensor(key)


def test_front_moments_into_keras_adam_of_another_accumulation_steps(tmp_path, monkeypatch):
    # Adam in front's moments after 30 updates of gradient_accumulation_steps 2 (60
    # micro-batches), into Keras's Adam without accumulation: the slots at 30 updates and
    # Keras's raw count 30, so its 31st step is the uninterrupted run's (before: raw 60).
    import tensorflow as tf
    gradients = _gradients(31)
    _, path = _adam_run(2, gradients[:30], tmp_path)
    real = tf.train.load_checkpoint(path)
    monkeypatch.setattr(tf.train, "load_checkpoint", lambda p: _WithFront(real, 30))
    resumed, _ = _adam_run(1, gradients[30:], load=path)
    uninterrupted, _ = _adam_run(1, gradients)
    before, _ = _adam_run(1, gradients[:30])
    for w, u, b in zip(resumed, uninterrupted, before):
        np.testing.assert_allclose(w - b, u - b, rtol=1e-4, atol=1e-7)
