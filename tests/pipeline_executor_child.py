"""Child process for tests/test_pipeline_executor.py: `python tests/pipeline_executor_child.py
K`.

Splits the CPU into K logical devices, then checks the pipeline executor and
`PipelineModel` against the single-device model: every schedule's weights after 3 steps
with Adam (and SGD with K=2); with K=2 also residual models, recompute, partitioning, fit / evaluate /
predict / save / load, batches that do not split, the traced graph's overlap and one op at
a time. Prints one JSON line.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # pipeline_models; tfpar

K = int(sys.argv[1])

from tfpar.devices import split_cpu  # noqa: E402

split_cpu(K)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.pipeline.model import PipelineModel  # noqa: E402
from tfpar.pipeline.partition import partition  # noqa: E402

from pipeline_models import OPTS, error, flat, mlp, reference, residual, x, y  # noqa: E402
from graph_walk import ancestors  # noqa: E402


def max_diff(build, opt, schedule, M=4, recompute=False, steps=3):
    pm = PipelineModel.split(build(), K, schedule, M, virtual_stages=2, recompute=recompute)
    pm.compile(optimizer=OPTS[opt](), loss="mse")
    for _ in range(steps):
        pm.train_on_batch(x, y)
    slots = [sorted({v.value.device[-5:] for v in o.variables}) for o in pm.stage_optimizers]
    assert slots == [[f"CPU:{s}"] for s in range(K)], slots  # Adam's slots sit on their stage
    return float(np.abs(flat(pm.stages) - reference(build, opt, steps)[0]).max())

def numerics(out):
    # SGD with K=2 only: the executor hands each stage optimizer its gradients whatever it
    # is, and Adam (slots on their stage, steps normalised) runs with every K.
    for opt in ("sgd", "adam") if K == 2 else ("adam",):
        for schedule in ("gpipe", "1f1b", "interleaved", "zb_h1"):
            out[f"{opt}/{schedule}"] = max_diff(mlp, opt, schedule)


def two_stage_checks(out):
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
        a, b = group("s0_F1_c0"), group("s1_F0_c0")
        assert a and b
        return bool(set(a) & ancestors(*b)) or bool(set(b) & ancestors(*a))
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
        return float(np.abs(flat(ex.stages) - reference(mlp, "sgd")[0]).max()), edges
    out["one_op"] = {s: one_op(s, True) for s in ("1f1b", "zb_h1")}
    out["one_op_edges_without"] = one_op("1f1b", False)[1]


out = {}
numerics(out)
if K == 2:
    two_stage_checks(out)
print(json.dumps(out))
