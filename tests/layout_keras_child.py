"""Child process for tests/test_layout_keras.py: trains with Keras's own
`keras.distribution` API (after `tfpar.layout.enable()`), with mixed precision and with
gradient accumulation on 4 logical CPUs, next to the single-device run, and prints one
JSON line of weight differences, histories, errors and per-device sizes.

Usage: python tests/layout_keras_child.py CASE[,CASE...] [FP16_SCALE_EXPONENT]
(CASE: keras_api, bf16, fp16, accum; the cases run in turn in this process and the JSON line
maps each to its result)
"""

import json
import sys

import cases
from tfpar import devices

devices.split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar import models  # noqa: E402
from tfpar import ParallelConfig, data, layout  # noqa: E402
from tfpar.errors import TfparError  # noqa: E402

STEPS = 5
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1),
              "adam": lambda: keras.optimizers.Adam(1e-3)}


def task_for(name):
    if name == "transformer":
        task = data.reverse_task(0, vocab=19)  # 20 classes: the vocabulary splits over 4
        # One block: every layer kind and every rule of USER_LAYOUTS["transformer"] (the
        # block rules match block_0); a second block would trace the same layouts again.
        return task, lambda: models.transformer(task.input_shape, task.num_classes, width=32,
                                                depth=1)
    task = data.teacher_task(0)
    return task, lambda: user_mlp(task.input_shape, task.num_classes)


def user_mlp(input_shape, classes):
    """A user's own model: names tfpar's presets do not know."""
    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(64, name="up"),
                             keras.layers.Activation("relu"),
                             keras.layers.Dense(32, name="down"),
                             keras.layers.Dense(classes, name="head")], name="user_mlp")


USER_LAYOUTS = {
    "mlp": {"user_mlp/up/kernel": (None, "model"), "user_mlp/up/bias": ("model",),
            "user_mlp/down/kernel": ("model", None)},
    "transformer": {
        r"block_\d+/mlp_fc/kernel": (None, "model"), r"block_\d+/mlp_fc/bias": ("model",),
        r"block_\d+/mlp_proj/kernel": ("model", None),
        r"block_\d+/attn/(query|key|value)/kernel": (None, "model", None),
        r"block_\d+/attn/(query|key|value)/bias": ("model", None),
        r"block_\d+/attn/attention_output/kernel": ("model", None, None),
        "embed/token/embeddings": ("model", None),
        "lm_head/kernel": (None, "model"), "lm_head/bias": ("model",)},
}


def arrays(task, name, batch, steps=STEPS):
    batches = data.global_batches(ParallelConfig(model=name, global_batch_size=batch),
                                  task, 0, steps)
    columns = [np.concatenate(column) for column in zip(*batches)]
    return columns[0], columns[1], (columns[2] if len(columns) > 2 else None), batches


def seeded(fn):
    keras.utils.set_random_seed(0)
    return fn()


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference(build_model, make_optimizer, batches):
    """Single device, dense gradients (see tests/test_layout_exact.py for why not
    train_on_batch), with the loss scaled when the optimizer is a LossScaleOptimizer."""
    model, opt = seeded(build_model), make_optimizer()

    @tf.function
    def step(x, y, w=None):
        with tf.GradientTape() as tape:
            value = LOSS(y, model(x, training=True), w)
            scaled = opt.scale_loss(value)
        grads = [tf.convert_to_tensor(g)
                 for g in tape.gradient(scaled, model.trainable_variables)]
        opt.apply(grads, model.trainable_variables)
        return value

    losses = [float(step(*b)) for b in batches]
    return {v.path: v.numpy() for v in model.weights}, losses, opt


_REFERENCES = {}


def reference_once(key, build_model, make_optimizer, batches):
    """`reference`, computed once per `key` in this process: several mesh runs compare
    against the same single-device run (same model, optimizer, policy and batches)."""
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(build_model, make_optimizer, batches)
    return _REFERENCES[key]


def diffs(model, ref):
    return {v.path: float(np.max(np.abs(np.asarray(layout.to_host(v.value), "float64")
                                        - ref[v.path])))
            for v in model.weights}


def sizes(model, optimizer):
    return {"params_per_device": layout.shard_sizes(model.weights),
            "optimizer_per_device": layout.shard_sizes(optimizer.variables),
            "params_total": int(sum(np.prod(v.shape) for v in model.weights)),
            "optimizer_total": int(sum(np.prod(v.shape) for v in optimizer.variables))}


def user_distribution(name, dp, tp, keys=None):
    mesh = keras.distribution.DeviceMesh((dp, tp), ["batch", "model"],
                                         devices=keras.distribution.list_devices()[:dp * tp])
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in (keys or USER_LAYOUTS[name]).items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def keras_api():
    layout.enable()
    out = {"runs": [], "errors": {}}
    # Keras's fit/evaluate/predict with both optimizers on the mlp (2×2 and 1×4) and the
    # transformer's layout map (Adam: slots laid out like its weights) on 2×2.
    for name, opt_name, dp, tp in [("mlp", "sgd", 2, 2), ("mlp", "adam", 1, 4),
                                   ("transformer", "adam", 2, 2)]:
        task, build = task_for(name)
        x, y, w, batches = arrays(task, name, 8)
        ref, ref_losses, ref_opt = reference_once((name, opt_name, 8), build,
                                                  OPTIMIZERS[opt_name], batches)
        keras.distribution.set_distribution(user_distribution(name, dp, tp))
        model = seeded(build)
        model.compile(optimizer=OPTIMIZERS[opt_name](), loss=LOSS, metrics=["accuracy"])
        history = model.fit(x, y, sample_weight=w, batch_size=8, epochs=1, shuffle=False,
                            verbose=0)
        keras.distribution.set_distribution(None)
        out["runs"].append({
            "model": name, "optimizer": opt_name, "mesh": [dp, tp], "diffs": diffs(model, ref),
            "history_type": type(history).__name__, "history": history.history,
            "ref_mean_loss": float(np.mean(ref_losses)),
            "iterations": int(layout.to_host(model.optimizer.iterations.value)),
            "sharded": {v.path: list(v.value.layout.sharding_specs) for v in model.weights},
            "evaluate": model.evaluate(x[:16], y[:16], batch_size=8, verbose=0,
                                       return_dict=True, sample_weight=w[:16] if w is not None else None),
            "predict_shape": list(model.predict(x[:8], batch_size=4, verbose=0).shape),
            **sizes(model, model.optimizer)})

    # DataParallel: every weight whole, the batch split over 4 devices.
    task, build = task_for("mlp")
    x, y, w, batches = arrays(task, "mlp", 8)
    ref, _, _ = reference_once(("mlp", "adam", 8), build, OPTIMIZERS["adam"], batches)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=keras.distribution.list_devices()))
    model = seeded(build)
    model.compile(optimizer="adam", loss=LOSS)
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    out["data_parallel"] = {"diffs": diffs(model, ref), "history": history.history,
                            **sizes(model, model.optimizer)}
    keras.distribution.set_distribution(None)

    # Keras's key for a layer's output: the output relaid out inside the mesh step (the
    # relayouts counted as they are traced), the weights as without it.
    relaid, relayout_value = [], layout.activations.relayout_value
    layout.activations.relayout_value = lambda value, to: (
        relaid.append(list(to.sharding_specs)) or relayout_value(value, to))
    keras.distribution.set_distribution(user_distribution(
        "mlp", 2, 2, {**USER_LAYOUTS["mlp"], "user_mlp/up/output": ("batch", "model")}))
    model = seeded(build)
    model.compile(optimizer=OPTIMIZERS["adam"](), loss=LOSS)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    out["output_layout"] = {"diffs": diffs(model, ref), "relaid": relaid}
    layout.activations.relayout_value = relayout_value
    keras.distribution.set_distribution(None)

    # What is refused, each with one line.
    def error(label, fn):
        try:
            fn()
            out["errors"][label] = None
        except (TfparError, ValueError) as err:
            out["errors"][label] = f"{type(err).__name__}: {err}"

    def typo():
        keras.distribution.set_distribution(user_distribution(
            "mlp", 2, 2, {**USER_LAYOUTS["mlp"], "user_mlp/dwn/kernel": ("model", None)}))
        model = seeded(build)
        model.compile(optimizer="sgd", loss=LOSS)
        model.fit(x, y, batch_size=8, verbose=0)

    def built_before():
        keras.distribution.set_distribution(None)
        model = seeded(build)
        keras.distribution.set_distribution(user_distribution("mlp", 2, 2))
        model.compile(optimizer="sgd", loss=LOSS)
        model.fit(x, y, batch_size=8, verbose=0)

    def output_layout():  # a layer's output, but of a rank the output does not have
        keras.distribution.set_distribution(user_distribution(
            "mlp", 2, 2, {**USER_LAYOUTS["mlp"], "user_mlp/up/output": ("batch", None, "model")}))
        model = seeded(build)
        model.compile(optimizer="sgd", loss=LOSS)
        model.fit(x, y, batch_size=8, verbose=0)

    for label, fn in [("typo", typo), ("built_before", built_before),
                      ("output_layout", output_layout)]:
        error(label, fn)
        keras.distribution.set_distribution(None)
    return out


def on_mesh(name, make_optimizer, batches, dp=2, tp=2, grad_accum_steps=1):
    """tfpar's own entry (`build_on_mesh`) with the user's layout rules; 5 exact steps."""
    task, build = task_for(name)
    mesh = layout.make_mesh(dp, tp, devices.compute_devices()[:dp * tp])
    model, trainer = layout.build_on_mesh(mesh, list(USER_LAYOUTS[name].items()),
                                          lambda: seeded(build), make_optimizer, LOSS,
                                          grad_accum_steps=grad_accum_steps)
    losses = [trainer.train_on_batch(*b)["loss"] for b in batches]
    return model, trainer, losses


# bf16: the distance to one device depends on the model, the optimizer and where the mesh
# splits the sums: each model with each optimizer, and both meshes (2×2: batch and model
# splits; 1×4: model splits only). fp16: the loss scale's skip decision, one for the whole
# mesh (it reduces over every shard whatever the model): each model, optimizer and mesh
# once. (fp16 on the mesh also runs in tests/test_layout_compose.py, tp=2, and
# tests/test_layout_pipeline.py, dp × tp × pp with a stage's infinite gradient.)
BF16_RUNS = [("mlp", "adam", 2, 2), ("transformer", "sgd", 2, 2),
             ("mlp", "sgd", 1, 4), ("transformer", "adam", 1, 4)]
FP16_RUNS = [("mlp", "adam", 2, 2), ("transformer", "sgd", 1, 4)]


def precision(policy, runs):
    """Mixed precision on a 2×2 mesh (and 1×4) next to the single-device run under the same
    policy."""
    out = {"runs": []}
    for name, opt_name, dp, tp in runs:
        task, build = task_for(name)
        _, _, _, batches = arrays(task, name, 8)
        make = OPTIMIZERS[opt_name]
        if policy == "mixed_float16":  # what compile does under this policy
            make = lambda make=make: keras.optimizers.LossScaleOptimizer(  # noqa: E731
                make(), initial_scale=2.0 ** float(sys.argv[2] if len(sys.argv) > 2 else 15))
        keras.mixed_precision.set_global_policy(policy)
        ref, ref_losses, ref_opt = reference_once((name, opt_name, 8, policy), build, make,
                                                  batches)
        model, trainer, losses = on_mesh(name, make, batches, dp, tp)
        run = {"model": name, "optimizer": opt_name, "mesh": [dp, tp],
               "diffs": diffs(model, ref),
               "losses": losses, "ref_losses": ref_losses,
               "compute_dtype": model.layers[1].compute_dtype,
               "variable_dtype": model.weights[0].dtype, **sizes(model, trainer.optimizer)}
        if policy == "mixed_float16":
            run["scale"] = float(layout.to_host(trainer.optimizer.dynamic_scale.value))
            run["ref_scale"] = float(ref_opt.dynamic_scale.numpy())
            run["updates"] = int(layout.to_host(
                trainer.optimizer.inner_optimizer.iterations.value))
            run["ref_updates"] = int(ref_opt.inner_optimizer.iterations.numpy())
        out["runs"].append(run)
    keras.mixed_precision.set_global_policy("float32")
    return out


def accum():
    """k micro-batches per step on a 2×2 mesh = one single-device step on the k× batch."""
    out = {"runs": []}
    # Adam with k=2 on the transformer, k=4 on the mlp, SGD with k=2 on the mlp (the
    # micro-batch loop is the same for every k, optimizer and model: the transformer once).
    for name, opt_name, k in [("mlp", "sgd", 2), ("mlp", "adam", 4),
                              ("transformer", "adam", 2)]:
        task, build = task_for(name)
        _, _, _, batches = arrays(task, name, 16)
        ref, ref_losses, ref_opt = reference_once((name, opt_name, 16), build,
                                                  OPTIMIZERS[opt_name], batches)
        model, trainer, losses = on_mesh(name, OPTIMIZERS[opt_name], batches,
                                         grad_accum_steps=k)
        out["runs"].append({
            "model": name, "optimizer": opt_name, "k": k, "diffs": diffs(model, ref),
            "losses": losses, "ref_losses": ref_losses,
            "iterations": int(layout.to_host(trainer.optimizer.iterations.value)),
            **sizes(model, trainer.optimizer)})
    try:
        trainer.train_on_batch(batches[0][0][:6], batches[0][1][:6])
        out["indivisible"] = None
    except TfparError as err:
        out["indivisible"] = str(err)
    return out


CASES = {"keras_api": keras_api, "bf16": lambda: precision("mixed_bfloat16", BF16_RUNS),
         "fp16": lambda: precision("mixed_float16", FP16_RUNS), "accum": accum}


def run_cases(names):
    """Each case in turn in this process (a DTensor mesh can be rebuilt; one TensorFlow start
    for all). `keras_api` switches `layout.enable()` on for the rest of the process: put it
    last."""
    def reset():
        keras.distribution.set_distribution(None)
        keras.mixed_precision.set_global_policy("float32")

    return cases.run_cases(CASES, names, after=reset)


if __name__ == "__main__":
    print(json.dumps(run_cases(sys.argv[1].split(","))))
