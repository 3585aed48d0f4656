"""Pipeline executor and PipelineModel against the single-device model.

Each child process splits the CPU into K logical devices first, then runs many checks and
prints one JSON line; the tests below read it (one TensorFlow start-up per K).
"""

import pytest

from subproc import last_json_line, outcome, run_concurrently, run_python

PRELUDE = """
import json, sys
from tfpar.devices import split_cpu
split_cpu(K)
import keras, numpy as np, tensorflow as tf
from tfpar.errors import ConfigError, TfparError
from tfpar.pipeline.model import PipelineModel
from tfpar.pipeline.partition import partition

def mlp(layers=8, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,))]
                            + [keras.layers.Dense(16, activation="tanh") for _ in range(layers)]
                            + [keras.layers.Dense(3)], name="mlp")

def residual(seed=0):  # a functional chain whose residual branch must stay in one stage
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
    return np.concatenate([w.ravel() for m in models for w in m.get_weights()])

REFERENCES = {}

def reference(build, opt, steps=3):
    # The single-device model's weights after `steps` steps, trained once per (model,
    # optimizer): every schedule starts from the same seed and batch.
    key = (build.__name__, opt, steps)
    if key not in REFERENCES:
        ref = build()
        ref.compile(optimizer=OPTS[opt](), loss="mse", jit_compile=False)
        for _ in range(steps):
            ref.train_on_batch(x, y)
        REFERENCES[key] = flat([ref])
    return REFERENCES[key]

def max_diff(build, opt, schedule, M=4, recompute=False, steps=3):
    pm = PipelineModel.split(build(), K, schedule, M, virtual_stages=2, recompute=recompute)
    pm.compile(optimizer=OPTS[opt](), loss="mse")
    for _ in range(steps):
        pm.train_on_batch(x, y)
    slots = [sorted({v.value.device[-5:] for v in o.variables}) for o in pm.stage_optimizers]
    assert slots == [[f"CPU:{s}"] for s in range(K)], slots  # Adam's slots sit on their stage
    return float(np.abs(flat(pm.stages) - reference(build, opt, steps)).max())

def error(fn):
    try:
        fn()
    except TfparError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
"""

NUMERICS = """
out = {}
for opt in ("sgd", "adam"):
    for schedule in ("gpipe", "1f1b", "interleaved", "zb_h1"):
        out[f"{opt}/{schedule}"] = max_diff(mlp, opt, schedule)
"""


def _run(K, body, timeout=150):
    code = f"K = {K}\n" + PRELUDE + body + "\nprint(json.dumps(out))\n"
    return last_json_line(run_python(code, timeout=timeout).stdout)


@pytest.fixture(scope="module")
def children():
    """The K=2 and K=4 children at the same time: [K=2's out, K=4's out], each the
    AssertionError its child failed with if it failed."""
    return run_concurrently([lambda: _run(2, K2), lambda: _run(4, NUMERICS)],
                            keep_failures=True)


@pytest.fixture(scope="module")
def k2(children):
    return outcome(children[0])


@pytest.fixture(scope="module")
def k4(children):
    return outcome(children[1])


K2 = NUMERICS + """
out["residual/adam/1f1b"] = max_diff(residual, "adam", "1f1b")
out["recompute/adam/1f1b"] = max_diff(mlp, "adam", "1f1b", recompute=True)
# Zero-bubble on a stage that is not a chain of layers: W repeats the stage's backward.
out["residual/adam/zb_h1"] = max_diff(residual, "adam", "zb_h1")
out["zb_recompute_error"] = error(lambda: PipelineModel.split(
    mlp(), 2, "zb_h1", 4, recompute=True).compile(optimizer="sgd", loss="mse"))

# Partition: devices, balance, what cannot be cut.
parts = partition(mlp(3), 2, devices=["/device:CPU:0", "/device:CPU:1"])
out["stage_layers"] = [len(p.layers) - 1 for p in parts]
out["stage_devices"] = [sorted({v.value.device[-5:] for v in p.weights}) for p in parts]
out["branch_error"] = error(lambda: partition(residual(), 6))
out["too_many_stages"] = error(lambda: PipelineModel.split(mlp(2), 4, devices=["/device:CPU:0", "/device:CPU:1"] * 2))

# fit / evaluate / predict / save / load.
rng = np.random.default_rng(1)
xs = rng.normal(size=(512, 8)).astype("float32")
ys = np.stack([xs[:, 0] * xs[:, 1], np.sin(xs[:, 2]), xs[:, 3]], 1).astype("float32")
pm = PipelineModel.split(mlp(4), 2, "1f1b", microbatches=4)
pm.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse", metrics=["mae"])
out["fit_loss"] = pm.fit(xs, ys, batch_size=32, epochs=4, verbose=0).history["loss"]
out["evaluate"] = pm.evaluate(xs, ys, batch_size=64, verbose=0)
pred = pm.predict(xs, batch_size=64, verbose=0)
out["iterations"] = int(pm.optimizer.iterations)
import os, tempfile
saved = tempfile.mkdtemp(prefix="tfpar-pipeline-")  # not a fixed /tmp name: runs may overlap
pm.save_weights(os.path.join(saved, "pipeline.weights.h5"))
fresh = PipelineModel.from_config(json.loads(json.dumps(pm.get_config())))
fresh.load_weights(os.path.join(saved, "pipeline.weights.h5"))
out["reload_diff"] = float(np.abs(fresh.predict(xs, batch_size=64, verbose=0) - pred).max())
out["reload_devices"] = [sorted({v.value.device[-5:] for v in s.weights}) for s in fresh.stages]
pm.save(os.path.join(saved, "pipeline.keras"))
loaded = keras.models.load_model(os.path.join(saved, "pipeline.keras"))
out["keras_file_diff"] = float(np.abs(loaded.predict(xs, batch_size=64, verbose=0) - pred).max())
loaded.fit(xs[:64], ys[:64], batch_size=32, verbose=0)  # compiled again from the file

# Batches that do not split into micro-batches.
out["fit_batch_error"] = error(lambda: pm.fit(xs[:42], ys[:42], batch_size=16, verbose=0))
out["static_batch_error"] = error(lambda: pm._executor.check_batch(tf.zeros((10, 8))))
ds = tf.data.Dataset.from_tensor_slices((xs[:30], ys[:30])).batch(30)
try:
    pm.fit(ds, verbose=0)
    out["dataset_batch_error"] = "no error"
except tf.errors.InvalidArgumentError as err:
    out["dataset_batch_error"] = err.message
from tfpar.config import ParallelConfig
cfg = ParallelConfig(pipeline_stages=2, microbatches=4, schedule="interleaved", virtual_stages=2,
                     global_batch_size=16)
pc = PipelineModel.from_parallel_config(mlp(), cfg)
out["from_config"] = [len(pc.stages), pc.schedule_name, pc.microbatches, pc.virtual_stages]
out["interleaved_error"] = error(lambda: PipelineModel.split(mlp(), 2, "interleaved", 3, 2))

# Overlap in the traced graph: with GPipe, stage 0's forward of micro-batch 1 and stage 1's
# forward of micro-batch 0 must not depend on each other (no serialising op or control
# dependency); in the serialised variant one waits for the other.
from tfpar.pipeline.executor import PipelineExecutor
from tfpar.pipeline.schedule import make_schedule
def depends(serialize):
    stages = partition(mlp(3), 2, devices=["/device:CPU:0", "/device:CPU:1"])
    ex = PipelineExecutor(stages, ["/device:CPU:0", "/device:CPU:1"], make_schedule("gpipe", 2, 2),
                          keras.losses.MeanSquaredError(), serialize=serialize)
    ex.build_optimizers(keras.optimizers.Adam())
    graph = tf.function(ex.train_step).get_concrete_function(x, y).graph
    group = lambda scope: [op for op in graph.get_operations() if op.name.startswith(scope + "/")]
    def ancestors(ops):
        seen, todo = set(), list(ops)
        while todo:
            op = todo.pop()
            for p in [t.op for t in op.inputs] + list(op.control_inputs):
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen
    a, b = group("s0_F1_c0"), group("s1_F0_c0")
    assert a and b
    return bool(set(a) & ancestors(b)) or bool(set(b) & ancestors(a))
out["overlap_dependency"] = [depends(False), depends(True)]
stateful = {op.type for op in tf.function(pm._executor.train_step).get_concrete_function(
    x[:8], y[:8]).graph.get_operations() if op._is_stateful and "Variable" not in op.type}
out["stateful_ops"] = sorted(stateful)

# One op at a time per stage (edges added with tfpar.patches.add_control_input): the same
# weights as one device, and the graph really has the extra edges.
def one_op(schedule, chained):
    devs = ["/device:CPU:0", "/device:CPU:1"]
    ex = PipelineExecutor(partition(mlp(), 2, devices=devs), devs, make_schedule(schedule, 2, 4),
                          keras.losses.MeanSquaredError(), one_op_at_a_time=chained)
    ex.build_optimizers(OPTS["sgd"]())
    step = tf.function(ex.train_step, jit_compile=False)
    for _ in range(3):
        step(tf.constant(x), tf.constant(y))
    edges = sum(len(op.control_inputs) for op in step.get_concrete_function(
        tf.constant(x), tf.constant(y)).graph.get_operations())
    return float(np.abs(flat(ex.stages) - reference(mlp, "sgd")).max()), edges
out["one_op"] = {s: one_op(s, True) for s in ("1f1b", "zb_h1")}
out["one_op_edges_without"] = one_op("1f1b", False)[1]
"""


@pytest.mark.parametrize("opt,tol", [("sgd", 1e-6), ("adam", 1e-5)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb_h1"])
@pytest.mark.parametrize("K", [2, 4])
def test_weights_after_3_steps_equal_single_device(k2, k4, K, schedule, opt, tol):
    assert {2: k2, 4: k4}[K][f"{opt}/{schedule}"] < tol


def test_residual_model_and_recompute_match_single_device(k2):
    assert k2["residual/adam/1f1b"] < 1e-5
    assert k2["recompute/adam/1f1b"] < 1e-5
    assert k2["residual/adam/zb_h1"] < 1e-5
    assert k2["zb_recompute_error"].startswith("ConfigError: recompute=True is invalid")


def test_partition_places_and_balances_stages(k2):
    assert k2["stage_layers"] == [2, 2]  # 3 equal Dense + a smaller head: 2 | 2
    assert k2["stage_devices"] == [["CPU:0"], ["CPU:1"]]


def test_models_that_cannot_be_cut_are_named(k2):
    assert k2["branch_error"].startswith("TfparError: model 'residual' can be cut into at most 5 stages, not 6")
    assert "feeds 'add" in k2["branch_error"]
    assert k2["too_many_stages"].startswith("ConfigError: pipeline_stages=4 is invalid: "
                                            "model 'mlp' has 3 layers")


def test_fit_loss_falls_and_weights_round_trip(k2):
    loss = k2["fit_loss"]
    assert loss[-1] < 0.6 * loss[0], loss
    assert k2["evaluate"][0] < loss[0]
    assert k2["iterations"] == 4 * 512 // 32
    assert k2["reload_diff"] == 0.0 and k2["keras_file_diff"] == 0.0
    assert k2["reload_devices"] == [["CPU:0"], ["CPU:1"]]


def test_batches_that_do_not_split_give_clear_errors(k2):
    assert k2["fit_batch_error"].startswith("ConfigError: microbatches=4 is invalid")
    assert "batch_size=16 over 42 examples gives a batch of 10" in k2["fit_batch_error"]
    assert "must divide the batch size 10" in k2["static_batch_error"]
    assert "microbatches=4 must divide the batch size" in k2["dataset_batch_error"]
    assert k2["interleaved_error"].startswith("ConfigError: microbatches=3 is invalid")


def test_stages_overlap_in_the_traced_graph(k2):
    # No path between concurrent actions of different stages; the serialised variant has one.
    assert k2["overlap_dependency"] == [False, True]
    # Only variable ops, the optimizer's and the batch-size Assert are stateful: nothing
    # that automatic control dependencies would chain across stages.
    assert set(k2["stateful_ops"]) <= {"Assert", "Placeholder", "ResourceApplyAdam", "NoOp"}, \
        k2["stateful_ops"]


def test_one_op_at_a_time_is_exact_and_chains_each_stage(k2):
    for schedule, (diff, edges) in k2["one_op"].items():
        assert diff < 1e-6, (schedule, diff)
    assert k2["one_op"]["1f1b"][1] > 2 * k2["one_op_edges_without"], k2


def test_built_from_a_parallel_config(k2):
    assert k2["from_config"] == [4, "interleaved", 4, 2]  # K*V stage models
