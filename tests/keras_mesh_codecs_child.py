"""Child process for tests/test_keras_mesh_codecs.py, on 4 logical CPUs: a user's own
functional Keras model (dict inputs, an embedding) under `keras.distribution.ModelParallel`
on a 2×2 mesh (`batch` × `model`), trained with `model.fit` and
`tfpar.DistributedOptimizer(keras.optimizers.Adam(...), compression=...)`; prints one JSON
line mapping each case to its result.

Usage: python tests/keras_mesh_codecs_child.py CASE[,CASE...]
- `codecs`: the uncompressed run (plain Adam: DTensor sums over `batch`), then
  `compression="none"`, PowerSGD at full rank and top-k at ratio 1 (both exact: every
  tensor goes whole), int8 and PowerSGD at rank 1, the same batches: each run's weight
  difference to the uncompressed run (the exact ones also to `compression="none"`'s),
  losses (and over more steps), bytes and codec state; over Adam, PowerSGD and top-k run
  Adam in front of them (all 4 steps its exact warm-up; PowerSGD rank 1 5 exact steps).
- `fp16`: the same under the `mixed_float16` policy, Adam behind Keras's
  `LossScaleOptimizer` (`compile` adds it), uncompressed and with PowerSGD at rank 1.
- `save`: PowerSGD at rank 1 for some steps, then `model.save`/`load_model` (the codec
  named in the file) and tfpar's `BackupAndRestore`: what each file holds of the codec.
- `nan`: an infinite input with `on_nan="skip_step"` (the step skipped and counted, the
  codec's state kept) and with tfpar's `NaNGuard` ("stop": one line).
- `data_parallel`: `keras.distribution.DataParallel` on 4 replicas: top-k at ratio 1
  against plain Adam, PowerSGD rank 1's bytes.
- `adam_front`: Adam in front of lowbit (under tfpar's `BackupAndRestore` saving after
  every step) and of top-k at ratio 0.05, 2 exact and 3 compressed steps of `model.fit` on
  a model of one input (`flat_model`), and the CLI's mesh trainer (`build_on_mesh`, its
  options from `ParallelConfig`) from the same weights on the same batches: weights and
  moments apart, the rule for `v`, the counter, the residuals, the bytes; then one more
  step by `train_on_batch` (the same reduction, its counter on).
- `keras_files`: a codec's state in Keras's files (`keras_codec_files.run`: top-k,
  PowerSGD, Adam in front of PowerSGD; `BackupAndRestore` and `load_weights` against two
  epochs uninterrupted; files of another codec, and of codecs with the same entries).
- `keras_nested`: the same files of top-k's state on two nested models' Dense "proj"
  (`keras_codec_files.run_nested`: `proj/kernel`, `proj/kernel#2`).
- `keras_fp16`: top-k under `mixed_float16`, `model.save` → `load_model` → one more
  epoch, the loss scale with it (`keras_codec_files.run_fp16`).
- `refusals`: a model's own `train_step` with a compressing optimizer; `auto`; Adam in
  front with `adam_variance="live"` or `adam_refresh_every`.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cases  # noqa: E402
import graph_optimizer  # noqa: E402
from tfpar import devices  # noqa: E402

devices.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfpar  # noqa: E402
import keras_codec_files  # noqa: E402  (after the CPU split)
from tfpar import layout  # noqa: E402

BATCH, STEPS, FAR_STEPS = 8, 4, 40
VOCAB, TOKENS, FEATURES, CLASSES = 32, 6, 16, 10
LAYOUTS = {"up/kernel": (None, "model"), "up/bias": ("model",),
           "down/kernel": ("model", None), "embed/embeddings": (None, "model")}


def user_model():
    """A user's functional model: dict inputs, an embedding, names of its own."""
    tokens = keras.Input((TOKENS,), dtype="int32", name="tokens")
    features = keras.Input((FEATURES,), name="features")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 8, name="embed")(tokens))
    h = keras.layers.Concatenate()([embedded, features])
    h = keras.layers.Dense(32, activation="relu", name="up")(h)
    h = keras.layers.Dense(16, activation="relu", name="down")(h)
    out = keras.layers.Dense(CLASSES, name="head")(h)
    return keras.Model({"tokens": tokens, "features": features}, out, name="user")


def data(steps):
    """The first `steps` batches of one stream: a shorter run's batches are a longer one's
    first (plain Adam's 40-step run is also the 4-step runs' reference)."""
    rng = np.random.default_rng(0)
    n = BATCH * max(steps, FAR_STEPS)
    x = {"tokens": rng.integers(0, VOCAB, (n, TOKENS)).astype("int32"),
         "features": rng.normal(size=(n, FEATURES)).astype("float32")}
    y = (x["features"][:, :CLASSES] + (x["tokens"][:, :1] == np.arange(CLASSES))).argmax(1)
    n = BATCH * steps
    return {k: v[:n] for k, v in x.items()}, y[:n].astype("int32")


def distribution(layouts=LAYOUTS):
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in layouts.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def fit(optimizer, steps=STEPS, callbacks=(), epochs=1, model=None):
    """`model.fit` of the user's model (built seeded unless given) with `optimizer`
    (a function making it): the model and its losses per step."""
    if model is None:
        keras.utils.set_random_seed(0)
        model = user_model()
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=["accuracy"])
    x, y = data(steps)
    losses = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(float(logs["loss"])))
    seen = []
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[losses, *callbacks])
    return model, seen


def host(model):
    return {v.path: np.asarray(layout.to_host(v.value), "float64") for v in model.weights}


def codec_state(model):
    """The mesh's codec state: its names, largest magnitude, and bytes per step."""
    reductions = getattr(model, "tfpar_reductions", ())
    if not reductions:
        return {"names": [], "max_abs": 0.0, "bytes": None}
    reduction = reductions[0]
    state = reduction.named_state()
    return {"names": sorted(state), "reduction": type(reduction).__name__,
            "max_abs": max([float(np.max(np.abs(layout.to_host(v))))
                            for v, _ in state.values()], default=0.0),
            "bytes": reduction.comm_stats()}


def adam():
    return keras.optimizers.Adam(1e-2)


def sgd():
    return keras.optimizers.SGD(0.1)


def distributed(compression, **options):
    return lambda: tfpar.DistributedOptimizer(adam(), compression=compression, **options)


# Adam in front of the codec (the default over Adam) runs its first `adam_warmup_steps`
# exactly (50 by default: every step of the 4-step runs); the lossy runs compress after 5.
WARM = 5
RUNS = {"plain": adam, "none": distributed("none"),
        "powersgd_full_rank": distributed("powersgd", rank=32),
        "topk_ratio_1": distributed("topk", ratio=1.0),
        "int8": distributed("int8"),
        "powersgd_rank_1": distributed("powersgd", rank=1, adam_warmup_steps=WARM)}


class WeightsAfter(keras.callbacks.Callback):
    """`weights`: the model's (`host`) after its `step`-th step of `fit`."""

    def __init__(self, step):
        super().__init__()
        self.step, self.weights = step, None

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.step:
            self.weights = host(self.model)


def codecs():
    """Exact runs: 4 steps against plain Adam's weights; lossy runs: 40 steps against plain
    Adam's 40 (weights and the mean of the last 5 losses). Plain Adam runs once, 40 steps,
    its weights and losses after 4 read on the way."""
    out, plain = {}, {}
    for name, make in RUNS.items():
        lossy = name in ("int8", "powersgd_rank_1")
        steps = FAR_STEPS if lossy else STEPS
        if name == "plain":
            after = WeightsAfter(STEPS)
            model, far = fit(make, steps=FAR_STEPS, callbacks=[after])
            plain[FAR_STEPS], plain_far = host(model), float(np.mean(far[-5:]))
            weights, losses = after.weights, far[:STEPS]
            plain[STEPS] = weights
        else:
            model, losses = fit(make, steps=steps)
            weights = host(model)
        if name == "none":  # the uncompressed mesh fit (each replica's gradient, fp32)
            plain["none"] = weights
        out[name] = {"diff": max(float(np.max(np.abs(weights[k] - plain[steps][k])))
                                 for k in weights),
                     "losses": losses, "state": codec_state(model),
                     "optimizer": type(model.optimizer).__name__}
        if not lossy and name != "plain":  # against the uncompressed mesh fit
            out[name]["none_diff"] = max(float(np.max(np.abs(weights[k] - plain["none"][k])))
                                         for k in weights)
        out[name]["far_loss"] = float(np.mean(losses[-5:])) if lossy else plain_far
    return out


def sgd_codec():
    """The cheapest codec fit: SGD (no Adam in front) with top-k at ratio 1, 4 steps, against
    plain SGD's fit; what the test runs with TensorFlow's default graph optimizer."""
    plain = host(fit(sgd)[0])
    model = fit(lambda: tfpar.DistributedOptimizer(sgd(), compression="topk", ratio=1.0))[0]
    weights = host(model)
    return {"diff": max(float(np.max(np.abs(weights[k] - plain[k]))) for k in plain),
            "state": codec_state(model)}


def fp16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        out = {}
        for name, make in (("plain", adam), ("powersgd", distributed("powersgd", rank=1,
                                                                      adam_warmup_steps=WARM))):
            model, losses = fit(make, steps=FAR_STEPS)
            out[name] = {"losses": losses, "state": codec_state(model),
                         "optimizer": type(model.optimizer).__name__,
                         "scale": float(layout.to_host(model.optimizer.dynamic_scale.value)),
                         "finite": bool(all(np.isfinite(w).all()
                                            for w in host(model).values()))}
        return out
    finally:
        keras.mixed_precision.set_global_policy("float32")


def save():
    import tempfile
    folder = tempfile.mkdtemp()
    # tfpar's BackupAndRestore: its checkpoint holds `codec/...` as the mesh trainer's. The
    # second fit below resumes after the finished epoch: no step runs, the state is the
    # file's.
    backup = os.path.join(folder, "backup")
    model, _ = fit(distributed("powersgd", rank=1), callbacks=[
        tfpar.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    first = {k: np.asarray(layout.to_host(v)) for k, (v, _) in
             model.tfpar_reductions[0].named_state().items()}
    # Keras's own file of the same model
    path = os.path.join(folder, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    out = {"state_names": sorted(first),
           "loaded_optimizer": type(loaded.optimizer).__name__,
           "loaded_codec": type(tfpar.compression.aggregator_of(loaded.optimizer)).__name__,
           "loaded_reductions": len(getattr(loaded, "tfpar_reductions", ()))}
    keras.utils.set_random_seed(0)
    fresh = user_model()
    fresh.compile(optimizer=distributed("powersgd", rank=1)(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    _, steps = fit(None, model=fresh, epochs=1, callbacks=[
        tfpar.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    restored = {k: np.asarray(layout.to_host(v)) for k, (v, _) in
                fresh.tfpar_reductions[0].named_state().items()}
    out["resumed_steps"] = len(steps)
    out["iterations"] = int(layout.to_host(fresh.optimizer.iterations.value))
    out["first_max_abs"] = max(float(np.max(np.abs(v))) for v in first.values())
    out["restored_names"] = sorted(restored)
    out["restored_diff"] = max(float(np.max(np.abs(restored[k] - first[k]))) for k in first)
    return out


def nan():
    """A batch with an infinite input on replica 0: with `on_nan="skip_step"` the update
    and the codec's state are skipped and counted; with "stop" tfpar's `NaNGuard` ends
    `fit` with one line."""
    from tfpar.errors import TfparError
    model, _ = fit(lambda: tfpar.DistributedOptimizer(adam(), compression="int8",
                                                      on_nan="skip_step"))
    reduction = model.tfpar_reductions[0]
    before = [host(model), [np.asarray(layout.to_host(v)) for v in reduction.variables]]
    x, y = data(1)
    x["features"][0, 0] = np.inf
    model.train_on_batch(x, y)
    after = [host(model), [np.asarray(layout.to_host(v)) for v in reduction.variables]]
    out = {"weights_moved": max(float(np.max(np.abs(after[0][k] - before[0][k])))
                                for k in before[0]),
           "state_moved": max(float(np.max(np.abs(a - b)))
                              for a, b in zip(after[1], before[1])),
           "state_max_abs": max(float(np.max(np.abs(b))) for b in before[1]),
           "skipped": float(layout.to_host(model.optimizer.nonfinite_steps.value))}
    model.train_on_batch(*data(1))  # and trains on
    out["moved_after"] = max(float(np.max(np.abs(host(model)[k] - after[0][k])))
                             for k in after[0])
    keras.utils.set_random_seed(0)
    model = user_model()
    model.compile(optimizer=tfpar.DistributedOptimizer(adam(), compression="int8"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    xs, ys = data(3)
    xs["features"][2 * BATCH, 0] = np.inf  # the third step
    try:
        model.fit(xs, ys, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[tfpar.callbacks.NaNGuard()])
        out["stop"] = None
    except TfparError as err:
        out["stop"] = str(err)
    return out


def data_parallel():
    """The same under `keras.distribution.DataParallel` (4 replicas, one mesh axis): top-k
    at ratio 1 against plain SGD, and PowerSGD rank 1's bytes and state."""
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()))
    try:
        # SGD, whose step is proportional to the gradient (Adam's hides a mean off by a
        # constant factor, e.g. a wrong division by the replicas)
        plain = host(fit(sgd)[0])
        exact = fit(lambda: tfpar.DistributedOptimizer(sgd(), compression="topk",
                                                       ratio=1.0))[0]
        lossy, losses = fit(distributed("powersgd", rank=1, adam_warmup_steps=2))
        return {"diff": max(float(np.max(np.abs(host(exact)[k] - plain[k]))) for k in plain),
                "replicas": exact.tfpar_reductions[0].replicas,
                "state": codec_state(lossy), "losses": losses}
    finally:
        keras.distribution.set_distribution(distribution())


# The CLI's mesh trainer takes one array each for x and y (a loss given): a model of one
# input, its kernels above top-k's dense size (1024 entries), laid out as the user's.
FLAT_LAYOUTS = {k: LAYOUTS[k] for k in ("up/kernel", "up/bias", "down/kernel")}


def flat_model():
    features = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(96, activation="relu", name="up")(features)
    h = keras.layers.Dense(16, activation="relu", name="down")(h)
    return keras.Model(features, keras.layers.Dense(CLASSES, name="head")(h), name="flat")


def cli_mesh(config, initial, x, y):
    """The CLI's mesh trainer (`tfpar.layout.build_on_mesh`, its codec options from
    `ParallelConfig` as `python -m tfpar.train` takes them) on `flat_model` from the
    weights `initial`, one step per `BATCH` rows of `x`, `y`: the model, its losses and
    its reduction."""
    from tfpar import ParallelConfig
    from tfpar.layout import reduction, values
    config = ParallelConfig(**config)
    model, trainer = layout.build_on_mesh(
        layout.make_mesh(2, 2), list(FLAT_LAYOUTS.items()), flat_model, adam,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        compression=config.compression, codec_options=reduction.codec_options(config))
    for variable in model.weights:
        values.assign(variable, initial[variable.path])
    losses = [float(trainer.train_on_batch(x[i:i + BATCH], y[i:i + BATCH])["loss"])
              for i in range(0, len(x), BATCH)]
    return model, losses, trainer.reduction


def adam_front():
    """Adam in front of the codec in `model.fit` (the default of a `DistributedOptimizer`
    over Adam), 2 exact steps then 3 compressed, against the CLI's mesh trainer from the
    same weights on the same batches (`flat_model`): lowbit (each replica's own `v`) under
    tfpar's `BackupAndRestore` saving after every step, top-k at ratio 0.05 (`v` frozen,
    then raised, each replica's own momentum)."""
    import tempfile
    steps, warm, out = 5, 2, {}
    x, y = data(steps)
    x = x["features"]
    keras.distribution.set_distribution(distribution(FLAT_LAYOUTS))
    try:
        for codec, options in (("lowbit", {}), ("topk", {"ratio": 0.05})):
            keras.utils.set_random_seed(0)
            model = flat_model()
            model.compile(optimizer=distributed(codec, adam_warmup_steps=warm, **options)(),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            initial = host(model)
            callbacks = []
            if codec == "lowbit":  # each save names the state, as a load would
                callbacks = [tfpar.callbacks.BackupAndRestore(tempfile.mkdtemp(),
                                                              save_freq=1)]
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
            config = {"compression": codec, "optimizer": "adam", "adam_warmup_steps": warm,
                      **({"topk_ratio": options["ratio"]} if "ratio" in options else {})}
            cli, cli_losses, cli_reduction = cli_mesh(config, initial, x, y)
            reduction = model.tfpar_reductions[0]
            weights, cli_weights = host(model), host(cli)
            out[codec] = {
                "diff": max(float(np.max(np.abs(weights[k] - cli_weights[k])))
                            for k in weights),
                "moved": max(float(np.max(np.abs(weights[k] - initial[k]))) for k in weights),
                "reductions": [type(reduction).__name__, type(cli_reduction).__name__],
                "variance": reduction.variance, "cli_variance": cli_reduction.variance,
                "counter": int(layout.to_host(reduction.count)),
                "residual_max_abs": max(float(np.max(np.abs(layout.to_host(r))))
                                        for r in reduction.residuals),
                "state_diff": max(
                    float(np.max(np.abs(layout.to_host(a) - layout.to_host(b))))
                    for a, b in zip(reduction.m + reduction.v,
                                    cli_reduction.m + cli_reduction.v)),
                "bytes": reduction.comm_stats(), "cli_losses": cli_losses}
            # One more step through Keras's API: the same optimizer, reduction and counter
            # (a rebuilt optimizer or a new reduction would restart the warm-up).
            model.train_on_batch(x[:BATCH], y[:BATCH])
            out[codec]["after_one_more"] = [model.tfpar_reductions[0] is reduction,
                                            int(layout.to_host(reduction.count))]
    finally:
        keras.distribution.set_distribution(distribution())
    return out


def refusals():
    from tfpar.errors import ConfigError

    class Own(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    out = {}
    # Adam in front of the mesh's codec: tf.distribute's live `v` and refresh steps
    for name, build, compression, options in (
            ("train_step", Own, "powersgd", {}), ("auto", None, "auto", {}),
            ("live", None, "lowbit", {"adam_variance": "live"}),
            ("refresh", None, "powersgd", {"adam_refresh_every": 10})):
        keras.utils.set_random_seed(0)
        model = user_model()
        if build is not None:
            model = build(model.inputs, model.outputs)
        model.compile(optimizer=tfpar.DistributedOptimizer(adam(), compression=compression,
                                                           **options),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        try:
            fit(None, model=model)
            out[name] = {"raised": None}
        except ConfigError as err:
            out[name] = {"raised": "ConfigError", "lines": len(str(err).splitlines()),
                         "line": str(err).splitlines()[0]}
    return out


def _diff(a, b):
    """The largest difference of two weight lists."""
    return max(float(np.max(np.abs(np.asarray(p, "float64") - np.asarray(q, "float64"))))
               for p, q in zip(a, b))


def _compiled(optimizer):
    """The user's model, seeded, compiled with `optimizer` (under the global policy)."""
    keras.utils.set_random_seed(0)
    model = user_model()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    return model


def _fit(model, epochs=1, callbacks=()):
    """`model.fit` on `STEPS` batches an epoch: the epochs' losses."""
    x, y = data(STEPS)
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks)).history["loss"]


def keras_files():
    """`keras_codec_files.run` on this mesh: each codec's state through Keras's
    `BackupAndRestore` and `model.save` → `load_weights`, against two epochs
    uninterrupted (the user's model, seeded, `STEPS` batches an epoch)."""
    return keras_codec_files.run(_fit, _compiled, _diff)


def keras_fp16():
    """`keras_codec_files.run_fp16` on this mesh: top-k under `mixed_float16` through
    `model.save` → `load_model`, the loss scale with it."""
    return keras_codec_files.run_fp16(_fit, _compiled, _diff)


# Two nested models, each with a Dense "proj" (both kernels' Keras path `proj/kernel`),
# their kernels above top-k's dense size.
PROJ = 96
NESTED_LAYOUTS = {"proj/kernel": (None, "model"), "proj/bias": ("model",)}


def nested_model():
    def block(name, width):
        x = keras.Input((width,))
        return keras.Model(x, keras.layers.Dense(PROJ, activation="relu", name="proj")(x),
                           name=name)

    features = keras.Input((FEATURES,), name="features")
    first, second = block("first", FEATURES), block("second", PROJ)
    h = second(first(features))
    return keras.Model(features, keras.layers.Dense(CLASSES, name="head")(h), name="nested")


def keras_nested():
    """`keras_codec_files.run_nested` on this mesh: top-k's state of `nested_model`'s two
    "proj" through Keras's files, against two epochs uninterrupted."""
    def compiled(optimizer):
        keras.utils.set_random_seed(0)
        model = nested_model()
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        return model

    def fit_(model, epochs=1, callbacks=()):
        x, y = data(STEPS)
        return model.fit(x["features"], y, batch_size=BATCH, epochs=epochs, shuffle=False,
                         verbose=0, callbacks=list(callbacks)).history["loss"]

    keras.distribution.set_distribution(distribution(NESTED_LAYOUTS))
    try:
        return keras_codec_files.run_nested(fit_, compiled, _diff)
    finally:
        keras.distribution.set_distribution(distribution())


CASES = {"codecs": codecs, "fp16": fp16, "save": save, "nan": nan,
         "data_parallel": data_parallel, "adam_front": adam_front, "refusals": refusals,
         "keras_files": keras_files, "keras_nested": keras_nested, "keras_fp16": keras_fp16,
         "sgd_codec": sgd_codec}

if __name__ == "__main__":
    graph_optimizer.apply()  # the test's choice (tests/graph_optimizer.py)
    layout.enable()
    keras.distribution.set_distribution(distribution())
    out = cases.run_cases(CASES, sys.argv[1].split(","))
    out["grappler"] = graph_optimizer.setting()  # what the cases ran with
    print(json.dumps(out), flush=True)
