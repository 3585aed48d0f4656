"""User models for `python -m tfpar.plan --model=user_plan_models:FUNCTION` tests."""

import keras


def wide_mlp():
    """A functional MLP of 4 Dense layers of 4096 (about 50 M parameters); its inputs are
    known, so the function returns the model alone."""
    inputs = keras.Input((1024,), name="features")
    x = inputs
    for i in range(4):
        x = keras.layers.Dense(4096, activation="relu", name=f"dense_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x))


def huge_sequential():
    """An unbuilt Sequential of 4 Dense layers of 65536 (about 13 billion parameters,
    52 GB in fp32) and its input spec: planning it must not allocate the weights."""
    model = keras.Sequential([keras.layers.Dense(65536, activation="relu") for _ in range(3)]
                             + [keras.layers.Dense(10)])
    return model, keras.KerasTensor((None, 65536))


def not_a_model():
    return 42
