"""Child process for tests/test_layout_models.py: users' Keras models of every shape
under `keras.distribution.ModelParallel` on a 2×2 mesh of logical CPUs (after
`tfpar.layout.enable()`), each next to the same Keras calls on one device (same seed, same
data), and prints one JSON line: per case, the largest weight difference, both histories,
evaluate and predict on both.

Usage: python tests/layout_models_child.py CASE[,CASE...]
(CASE: structures, sequence, custom_step, hub; the cases run in turn in this process)
"""

import json
import sys
import tempfile

import cases
import graph_optimizer
from tfpar import devices

devices.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import layout  # noqa: E402

BATCH, STEPS = 8, 4


def seeded(fn):
    keras.utils.set_random_seed(0)
    return fn()


def distribution(keys=None, layout_map=None):
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         devices=keras.distribution.list_devices())
    if layout_map is None:
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in (keys or {}).items():
            layout_map[key] = axes
    elif callable(layout_map):
        layout_map = layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def host(value):
    return np.asarray(layout.to_host(value.value) if layout.is_dvariable(value) else value,
                      "float64")


def compare(build, compile_kwargs, fit_kwargs, dist, evaluate=None, predict=None):
    """The same Keras calls on one device and under `dist`: the largest weight difference
    and both sides' histories, evaluate results and predictions."""
    out = {}
    for side in ("single", "mesh"):
        keras.distribution.set_distribution(dist if side == "mesh" else None)
        try:
            model = seeded(build)
            model.compile(**compile_kwargs())
            history = model.fit(**fit_kwargs, batch_size=BATCH, shuffle=False, verbose=0)
            weights = {v.path: host(v) for v in model.weights}
            result = {"history": history.history}
            if evaluate is not None:
                result["evaluate"] = model.evaluate(**evaluate, batch_size=BATCH, verbose=0,
                                                    return_dict=True)
            if predict is not None:
                result["predict"] = keras.tree.map_structure(
                    np.asarray, model.predict(predict, batch_size=BATCH, verbose=0))
            out[side] = (result, weights, model)
        finally:
            keras.distribution.set_distribution(None)
    (single, ref, _), (mesh, got, model) = out["single"], out["mesh"]
    # each weight's largest difference, relative to its largest magnitude when above 1
    weight_diffs = {p: float(np.max(np.abs(got[p] - ref[p])) / max(1.0, np.max(np.abs(ref[p]))))
                    for p in ref}
    worst = max(weight_diffs, key=weight_diffs.get)
    diffs = {"weights": weight_diffs[worst]}
    for what in ("history", "evaluate", "predict"):
        if what in mesh:
            diffs[what] = _max_diff(mesh[what], single[what])
    return {"diffs": diffs, "worst": worst, "scale": float(np.max(np.abs(ref[worst]))),
            "history": mesh["history"], "keys": sorted(mesh["history"]),
            "single_keys": sorted(single["history"]),
            "evaluate_keys": sorted(mesh.get("evaluate", {})),
            "predict_structure": keras.tree.map_structure(
                lambda a: list(np.shape(a)), mesh["predict"]) if "predict" in mesh else None,
            "paths": sorted(got),
            "on_mesh": all(layout.is_dvariable(v) for v in model.weights),
            "sharded": sorted(v.path for v in model.weights
                              if any(s != "unsharded" for s in v.value.layout.sharding_specs)),
            }, model


def _max_diff(a, b):
    """The largest |a - b| over two equal structures of numbers (inf if they differ)."""
    if isinstance(a, dict):
        if sorted(a) != sorted(b):
            return float("inf")
        return max([_max_diff(a[k], b[k]) for k in a] or [0.0])
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")


class Agreement(keras.metrics.Metric):
    """A user's own metric: the weighted share of rows whose argmax is the label."""

    def __init__(self, name="agreement", **kwargs):
        super().__init__(name=name, **kwargs)
        self.hits = self.add_variable((), initializer="zeros", name="hits")
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = keras.ops.reshape(keras.ops.cast(y_true, "int32"), (-1,))
        hit = keras.ops.cast(keras.ops.argmax(y_pred, axis=-1) == y_true, "float32")
        weight = (keras.ops.ones_like(hit) if sample_weight is None
                  else keras.ops.reshape(keras.ops.cast(sample_weight, "float32"), (-1,)))
        self.hits.assign_add(keras.ops.sum(hit * weight))
        self.total.assign_add(keras.ops.sum(weight))

    def result(self):
        return self.hits / keras.ops.maximum(self.total, 1.0)


def structures():
    """Dict inputs, two named outputs with their own losses, loss weights and metrics,
    per-output sample weights, an activity regularizer (add_loss) and a kernel one; then a
    one-output model with class_weight; Adam."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    x = {"numbers": rng.normal(size=(n, 12)).astype("float32"),
         "extra": rng.normal(size=(n, 4)).astype("float32")}
    y = {"label": rng.integers(0, 4, size=(n,)), "score": rng.normal(size=(n, 1))}
    weights = {"label": rng.uniform(0.5, 1.5, size=(n,)), "score": np.ones((n,))}

    def build():
        numbers = keras.Input((12,), name="numbers")
        extra = keras.Input((4,), name="extra")
        h = keras.layers.Dense(16, activation="relu", name="up",
                               kernel_regularizer=keras.regularizers.L2(1e-3))(numbers)
        # Concatenate into mix's kernel split on its rows: DTensor alone is off by 8e-2
        # after 4 steps here (tfpar.layout.concat_axis)
        h = keras.layers.Concatenate()([h, keras.layers.Dense(16, name="side")(extra)])
        h = keras.layers.Dense(16, activation="tanh", name="mix",
                               activity_regularizer=keras.regularizers.L2(1e-3))(h)
        label = keras.layers.Dense(4, activation="softmax", name="label")(h)
        score = keras.layers.Dense(1, name="score")(h)
        return keras.Model({"numbers": numbers, "extra": extra},
                           {"label": label, "score": score}, name="two_heads")

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.Adam(1e-2),
                    loss={"label": "sparse_categorical_crossentropy", "score": "mse"},
                    loss_weights={"label": 1.0, "score": 0.5},
                    metrics={"label": ["accuracy", Agreement()],
                             "score": ["mae", keras.metrics.RootMeanSquaredError()]})

    keys = {"up/kernel": (None, "model"), "up/bias": ("model",),
            "mix/kernel": ("model", None)}
    run, _ = compare(build, compile_kwargs, dict(x=x, y=y, sample_weight=weights, epochs=2),
                     distribution(keys), evaluate=dict(x=x, y=y), predict=x)

    # one output, class_weight (Keras turns it into sample weights), a list of metrics
    labels = y["label"]

    def build_one():
        return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, name="up"),
                                 keras.layers.Dense(4, name="head")], name="one")

    def compile_one():
        return dict(optimizer=keras.optimizers.SGD(0.1),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=[keras.metrics.SparseTopKCategoricalAccuracy(k=2), Agreement()])

    weighted, _ = compare(build_one, compile_one,
                          dict(x=x["numbers"], y=labels, class_weight={0: 1.0, 1: 2.0,
                                                                       2: 0.5, 3: 1.0}),
                          distribution({"one/up/kernel": (None, "model")}))
    return {"two_heads": run, "class_weight": weighted}


def sequence():
    """Embedding(mask_zero=True) (padded sequences, masked in LSTM, GRU and the loss), a
    list of two inputs; SGD (see the test module for why not Adam on an embedding)."""
    rng = np.random.default_rng(1)
    n = BATCH * STEPS
    tokens = rng.integers(1, 20, size=(n, 6))
    tokens[:, 4:] = 0  # padding, masked
    tokens[::3, 2:] = 0
    side = rng.normal(size=(n, 3)).astype("float32")
    labels = rng.integers(0, 3, size=(n,))

    def build():
        ids = keras.Input((6,), dtype="int32", name="ids")
        feats = keras.Input((3,), name="feats")
        h = keras.layers.Embedding(20, 8, mask_zero=True, name="embed")(ids)
        h = keras.layers.LSTM(8, return_sequences=True, unroll=True, name="lstm")(h)
        h = keras.layers.GRU(8, unroll=True, name="gru")(h)
        h = keras.layers.Concatenate()([h, feats])
        return keras.Model([ids, feats], keras.layers.Dense(3, name="head")(h), name="seq")

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.SGD(0.5),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])

    keys = {"embed/embeddings": (None, "model"), "head/kernel": ("model", None)}
    run, _ = compare(build, compile_kwargs, dict(x=[tokens, side], y=labels),
                     distribution(keys), evaluate=dict(x=[tokens, side], y=labels),
                     predict=[tokens, side])
    # an RNN that loops with tf.while_loop (Keras's default): refused in one line
    keras.distribution.set_distribution(distribution())
    try:
        model = keras.Sequential([keras.Input((6,)), keras.layers.Embedding(20, 8),
                                  keras.layers.LSTM(8, name="lstm"), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.fit(tokens, labels, batch_size=BATCH, verbose=0)
        refused = None
    except Exception as err:  # noqa: BLE001 - the test reads the line
        refused = f"{type(err).__name__}: {err}"
    finally:
        keras.distribution.set_distribution(None)
    return {"lstm_gru": run, "while_loop_rnn": refused}


class OwnStep(keras.Model):
    """A user's model with the train_step of Keras's "Customizing fit()" guide: its own
    tape, compute_loss, optimizer.apply, and a metric it tracks itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(16, activation="relu", name="up")
        self.head = keras.layers.Dense(4, name="head")
        self.loss_mean = keras.metrics.Mean(name="own_loss")

    def call(self, x):
        return self.head(self.up(x))

    def train_step(self, data):
        import tensorflow as tf
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.loss_mean.update_state(loss)
        for metric in self.metrics:
            if metric.name not in ("loss", "own_loss"):
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_step():
    rng = np.random.default_rng(2)
    n = BATCH * STEPS
    x = rng.normal(size=(n, 12)).astype("float32")
    y = rng.integers(0, 4, size=(n,))

    def build():
        return OwnStep(name="own")  # built by fit, from the first batch

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.Adam(1e-2),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])

    run, _ = compare(build, compile_kwargs, dict(x=x, y=y, epochs=2),
                     distribution({"own/up/kernel": (None, "model"),
                                   "own/head/kernel": ("model", None)}),
                     evaluate=dict(x=x, y=y))
    # its own train_step with fp16 loss scaling: refused in one line (compat's
    # CUSTOM_TRAIN_STEP_LOSS_SCALE: the LossScaleOptimizer writes inside a tf.cond)
    keras.distribution.set_distribution(distribution())
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = build()
        model.compile(**compile_kwargs())
        model.fit(x, y, batch_size=BATCH, verbose=0)
        refused = None
    except Exception as err:  # noqa: BLE001 - the test reads the line
        refused = f"{type(err).__name__}: {err}"
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.distribution.set_distribution(None)
    return {"own_train_step": run, "own_train_step_fp16": refused}


# Tiny configs, random weights: no preset is downloaded. One layer each: every layout map
# matches its layers by one pattern (`transformer_layer_\d+`, `decoder_block.*`), so a
# second layer traced the same rules again.
HUB_CONFIGS = {
    "gemma": dict(vocabulary_size=96, num_layers=1, num_query_heads=2, num_key_value_heads=2,
                  hidden_dim=16, intermediate_dim=32, head_dim=8),
    "llama": dict(vocabulary_size=96, num_layers=1, num_query_heads=2, num_key_value_heads=2,
                  hidden_dim=16, intermediate_dim=32),
    # their default dropout (0.1): the mesh draws one device's masks (tfpar.layout.rng)
    "gpt2": dict(vocabulary_size=96, num_layers=1, num_heads=2, hidden_dim=16,
                 intermediate_dim=32, max_sequence_length=16),
    "bert": dict(vocabulary_size=96, num_layers=1, num_heads=2, hidden_dim=16,
                 intermediate_dim=32, max_sequence_length=16),
}


def gpt2_layout_map(mesh):
    """GPT2Backbone has no get_layout_map: a user's own, Megatron-style."""
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = ("model", None)
    attention = r"transformer_layer_\d+/self_attention(_layer)?"  # GPT-2's, BERT's
    layout_map[attention + "/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[attention + "/attention_output/kernel"] = ("model", None, None)
    layout_map[r"transformer_layer_\d+/feedforward_intermediate_dense/kernel"] = (
        None, "model")
    layout_map[r"transformer_layer_\d+/feedforward_output_dense/kernel"] = ("model", None)
    return layout_map


def bert_layout_map(mesh):
    layout_map = gpt2_layout_map(mesh)
    layout_map["pooled_dense/kernel"] = (None, "model")
    return layout_map


def hub():
    """KerasHub backbones (their own get_layout_map where they have one) and a task model,
    trained with fit on their dict inputs; a preset saved and loaded back."""
    import keras_hub

    rng = np.random.default_rng(3)
    n, length = BATCH * 3, 8  # 3 steps
    token_ids = rng.integers(1, 96, size=(n, length))
    padding_mask = np.ones((n, length), bool)
    padding_mask[::2, 6:] = False
    inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
    bert_inputs = {**inputs, "segment_ids": (np.arange(length) >= 4).astype("int32")[None]
                   .repeat(n, 0)}
    features = rng.normal(size=(n, 1)).astype("float32")

    backbones = {"gemma": (keras_hub.models.GemmaBackbone,
                           keras_hub.models.GemmaBackbone.get_layout_map, inputs),
                 "llama": (keras_hub.models.LlamaBackbone,
                           keras_hub.models.LlamaBackbone.get_layout_map, inputs),
                 "bert": (keras_hub.models.BertBackbone, bert_layout_map, bert_inputs)}
    out = {}
    for name, (cls, layout_map, x) in backbones.items():
        # a regression head on the backbone's sequence output: fit on its dict inputs
        def build(cls=cls, name=name):
            backbone = cls(**HUB_CONFIGS[name])
            output = backbone.output
            if isinstance(output, dict):  # BERT: its pooled output (pooled_dense)
                pooled = output["pooled_output"]
            else:
                pooled = keras.layers.GlobalAveragePooling1D(name="pool")(output)
            score = keras.layers.Dense(1, name="score")(pooled)
            return keras.Model(backbone.input, score, name=f"{name}_regressor")

        def compile_kwargs():
            return dict(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])

        checks = dict(evaluate=dict(x=x, y=features), predict=x) if name == "gemma" else {}
        out[name], _ = compare(build, compile_kwargs, dict(x=x, y=features),
                               distribution(layout_map=layout_map), **checks)

    # GPT-2 as a task model (its backbone under the user's own layout map, a head, dropout
    # 0.1): GPT2CausalLM on token ids, no preprocessor. (A GPT-2 backbone with a regression
    # head was also run here; it added nothing this one does not check.)
    def build_lm():
        backbone = keras_hub.models.GPT2Backbone(**HUB_CONFIGS["gpt2"])
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    def compile_lm():
        return dict(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    weighted_metrics=["sparse_categorical_accuracy"])

    labels = np.roll(token_ids, -1, axis=1)
    out["gpt2_causal_lm"], _ = compare(
        build_lm, compile_lm, dict(x=inputs, y=labels, sample_weight=padding_mask),
        distribution(layout_map=gpt2_layout_map), evaluate=dict(x=inputs, y=labels))
    out["preset"] = preset(keras_hub, inputs, features)
    return out


def preset(keras_hub, inputs, features):
    """LlamaBackbone saved with save_to_preset (one device) and loaded with from_preset
    under the distribution: the same weights, laid out by the layout map."""
    directory = tempfile.mkdtemp()
    backbone = seeded(lambda: keras_hub.models.LlamaBackbone(**HUB_CONFIGS["llama"]))
    backbone.save_to_preset(directory)
    saved = {v.path: host(v) for v in backbone.weights}
    result = {}
    dist = distribution(layout_map=keras_hub.models.LlamaBackbone.get_layout_map)
    keras.distribution.set_distribution(dist)
    try:
        loaded = keras_hub.models.LlamaBackbone.from_preset(directory)
        result["on_mesh"] = all(layout.is_dvariable(v) for v in loaded.weights)
        result["load_diff"] = max(float(np.max(np.abs(host(v) - saved[v.path])))
                                  for v in loaded.weights)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    finally:
        keras.distribution.set_distribution(None)
    # the same directory on one device: the preset itself is sound
    plain = keras_hub.models.LlamaBackbone.from_preset(directory)
    result["plain_load_diff"] = max(float(np.max(np.abs(host(v) - saved[v.path])))
                                    for v in plain.weights)
    return result


CASES = {"structures": structures, "sequence": sequence, "custom_step": custom_step,
         "hub": hub}


def run_cases(names):
    layout.enable()
    return cases.run_cases(CASES, names,
                           after=lambda: keras.distribution.set_distribution(None))


if __name__ == "__main__":
    graph_optimizer.apply()  # the test's choice (tests/graph_optimizer.py)
    tempfile.tempdir = tempfile.gettempdir()
    out = run_cases(sys.argv[1].split(","))
    out["grappler"] = graph_optimizer.setting()  # what the cases ran with
    print(json.dumps(out))
