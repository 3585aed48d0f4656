"""The pipeline under the trainer: `tfpar.train` with --pipeline_stages, alone and with
data-parallel replicas, against the single-device run.

Each run is a child process (one strategy per process) that trains a `ParallelConfig`
and prints one JSON line: losses, final weights, where the stage variables and optimizer
slots live, and the pipeline metrics block.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from subproc import last_json_line, run_python

TRAIN = """
import json
import numpy as np
from tfpar import ParallelConfig
from tfpar import train as T
result, model = T.train(ParallelConfig(**CONFIG))
out = {"loss": result["loss_history"], "replicas": result["replicas"],
       "weights": [np.asarray(w).ravel().tolist() for w in model.weights]}
if hasattr(model, "stages"):
    parts = lambda v: getattr(v.value, "values", [v.value])
    devices = lambda vs: sorted({p.device.split("device:")[-1] for v in vs for p in parts(v)})
    out["stage_devices"] = [devices(s.weights) for s in model.stages]
    out["slot_devices"] = [devices(o.variables) for o in model.stage_optimizers]
    out["pipeline"] = model.pipeline_metrics()
    out["params_per_stage"] = model.params_per_stage()
    aggregators = [getattr(o, "tfpar_aggregator", None) for o in model.stage_optimizers]
    if all(aggregators):
        # tf.Variables (per-replica residuals, Q), not Keras variables.
        out["aggregator_devices"] = [sorted({p.device.split("device:")[-1] for v in a.variables
                                             for p in getattr(v, "values", [v])})
                                     for a in aggregators]
    # Largest difference between the copies of a mirrored variable (replicas in sync: 0).
    out["replica_spread"] = max(
        [float(np.abs(v.value.values[0].numpy() - v.value.values[r].numpy()).max())
         for v in model.weights if hasattr(v.value, "values")
         for r in range(1, len(v.value.values))] or [0.0])
out["comm"] = result.get("comm")
print(json.dumps(out))
"""

SGD = dict(optimizer="sgd", learning_rate=0.1, steps=3, verbose=0, global_batch_size=16)


def _train(**config):
    code = f"CONFIG = {config!r}\n" + TRAIN
    return last_json_line(run_python(code, timeout=180).stdout)


def _max_diff(a, b):
    assert len(a["weights"]) == len(b["weights"])
    return max(float(np.abs(np.array(x) - np.array(y)).max())
               for x, y in zip(a["weights"], b["weights"]))


@pytest.mark.parametrize("model,schedule,V", [("mlp", "1f1b", 1),
                                              ("transformer", "interleaved", 2),
                                              ("mlp", "zb_h1", 1)])
def test_pipeline_times_two_replicas_equals_single_device(model, schedule, V):
    with ThreadPoolExecutor(2) as pool:  # two children at once
        ref = pool.submit(_train, model=model, strategy="one_device", **SGD)
        pp = pool.submit(_train, model=model, pipeline_stages=2, microbatches=4,
                         schedule=schedule, virtual_stages=V, cpu_devices=4,
                         data_parallel=2, **SGD)
        ref, pp = ref.result(), pp.result()
    assert pp["replicas"] == 2
    # Replica r runs stage s on its own device; each stage's variables and optimizer
    # variables are mirrored over its two devices.
    assert pp["stage_devices"][:2] == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]
    assert pp["slot_devices"] == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]
    assert _max_diff(pp, ref) < 1e-6
    assert np.allclose(pp["loss"], ref["loss"], rtol=1e-5)
    assert pp["pipeline"]["stages"] == 2 and pp["pipeline"]["schedule"] == schedule
    # Every run measures its bubble on a sampled step (the profiler, first replica's ops):
    # each stage ran every action of the schedule, and it was idle part of the time. (A
    # zero-bubble W's ops carry its forward's name, so they show under B.)
    block = pp["pipeline"]
    assert 0 < block["bubble_measured"] < 1
    want = sorted(f"{k}{m}" + (f".{c}" if c else "") for k in "FB" for m in range(4)
                  for c in range(V))
    assert [sorted(a[0] for a in row) for row in block["timeline_measured"]["actions"]] \
        == [want, want]


def test_aggregator_composes_with_pipeline_and_replicas():
    # Each stage aggregates its own gradients across the 2 replicas (PowerSGD: lossy, with
    # error feedback and a warm-started Q per stage); both replicas must apply the same
    # update to their copies, and training must follow the plain all-reduce closely.
    common = dict(model="mlp", pipeline_stages=2, microbatches=4, cpu_devices=4,
                  data_parallel=2, **{**SGD, "steps": 12})
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(_train, **common)
        low = pool.submit(_train, compression="powersgd", **common)
        plain, low = plain.result(), low.result()
    assert low["replica_spread"] == 0.0
    assert low["aggregator_devices"] == [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]]
    assert low["comm"]["compression_ratio"] > 5 * plain["comm"]["compression_ratio"]
    assert low["comm"]["bytes_uncompressed_per_step"] == plain["comm"]["bytes_on_wire_per_step"]
    assert np.mean(low["loss"][-4:]) < 0.9 * np.mean(low["loss"][:2])  # it learns
    assert abs(np.mean(low["loss"][-4:]) / np.mean(plain["loss"][-4:]) - 1) < 0.05


CLI = """
import sys
from tfpar import train as T
sys.argv = ["tfpar.train"] + FLAGS
try:
    T.run()
except SystemExit as exit:
    assert not exit.code, exit.code
"""


def test_trainer_cli_runs_the_pipeline(tmp_path):
    metrics = tmp_path / "metrics.json"
    flags = ["--pipeline_stages=2", "--microbatches=4", "--schedule=1f1b", "--cpu_devices=2",
             "--model=mlp", "--steps=40", "--steps_per_epoch=20",
             "--learning_rate=3e-3", "--verbose=0", f"--metrics_json={metrics}"]
    out = run_python(f"FLAGS = {flags!r}\n" + CLI, timeout=180).stdout
    summary = [line for line in out.splitlines() if line.startswith("tfpar: ")][-1]
    result = json.loads(metrics.read_text())
    assert result["steps"] == 40 and result["replicas"] == 1
    losses = result["loss_history"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), summary


ERRORS = """
import json
from tfpar import models
import tfpar.pipeline
from tfpar import ParallelConfig, devices, strategy
from tfpar.errors import TfparError
devices.split_cpu(4)
base = ParallelConfig(model="mlp", pipeline_stages=2, microbatches=4, cpu_devices=4,
                      data_parallel=2, global_batch_size=16)
runtime = strategy.make_runtime(base)
out = {}
def error(**changes):
    config = base.replace(**changes)
    with runtime.strategy.scope():
        try:
            tfpar.pipeline.for_training(models.build("mlp", (32,), 10), config, runtime)
        except TfparError as err:
            return f"{type(err).__name__}: {err}"
    return "no error"
out["accum"] = error(grad_accum_steps=2)
out["per_replica"] = error(microbatches=16)
out["devices"] = error(pipeline_stages=3, microbatches=2)
out["fp16"] = error(mixed_precision="fp16")
print(json.dumps(out))
"""


def test_settings_that_do_not_combine_give_clear_errors():
    out = last_json_line(run_python(ERRORS, timeout=120).stdout)
    assert out["accum"].startswith("ConfigError: grad_accum_steps=2 is invalid")
    assert "already accumulates" in out["accum"]
    assert out["per_replica"].startswith("ConfigError: microbatches=16 is invalid")
    assert "per-replica batch of 8" in out["per_replica"]
    assert out["devices"].startswith("ConfigError: pipeline_stages=3 is invalid")
    assert "need 6 devices, but 4 exist; use --data_parallel=1" in out["devices"]
    assert out["fp16"].startswith("ConfigError: mixed_precision='fp16' is invalid")
