"""One rulebook: every combination tfpar refuses is a row of `tfpar.compat`'s table,
checked before TensorFlow starts; the planner offers only what the trainer accepts.

What counts as a combination: a value that is valid on its own (in its setting's range)
refused because of another setting's value, the backend that runs the config, or the
`TF_CONFIG` cluster. Those are raised only by `tfpar/compat.py` (and the degrees against
the devices by `tfpar/dims.py`). Every other `ConfigError(...)` in tfpar is listed below
with the kind of check it is:

- RANGE: one value outside its own range, or not dividing the batch it splits;
- INPUT: an argument, object, file or environment variable a caller gave (a Keras
  distribution, a runtime, a user's model or dataset), not a `ParallelConfig` setting;
- TF_CONFIG: the syntax of `TF_CONFIG` or of the launcher's flags;
- RUNTIME: what is known only once TensorFlow runs (devices, replicas, DTensor's state);
- MODEL: the structure of a model (its layers, cuts, shapes);
- PLANNER: the planner's own flags and pins (not a training setting).

A new `ConfigError` anywhere else fails `test_no_combination_is_refused_outside_the_table`;
put a combination in the table (and call `compat.enforce` where code is reached without a
`ParallelConfig`), or add a site here with its kind.
"""

import ast
import dataclasses
import json
import os
import pathlib
import shlex
import sys

import pytest

from subproc import ROOT, last_json_line, run
from tfpar import ConfigError, ParallelConfig, compat
from tfpar.config import MODELS, PRECISIONS, SCHEDULES
from tfpar.plan import commands, planner, profile
from tfpar.train import check_inputs

RANGE, INPUT, TF_CONFIG, RUNTIME, MODEL, PLANNER = (
    "RANGE", "INPUT", "TF_CONFIG", "RUNTIME", "MODEL", "PLANNER")

# (file, function, the setting the error names) -> (raise sites, kind).
ALLOWED = {
    ("tfpar/accumulation.py", "accumulating_train_step.train_step", "grad_accum_steps"): (1, RANGE),
    ("tfpar/api.py", "make_strategy", "name"): (1, INPUT),
    ("tfpar/api.py", "make_strategy", "kind"): (1, RANGE),
    ("tfpar/api.py", "make_strategy", "cpu_devices"): (1, RANGE),
    ("tfpar/api.py", "_aggregator", "name"): (2, INPUT),
    ("tfpar/api.py", "_aggregator", "compression"): (2, RANGE),
    ("tfpar/api.py", "DistributedOptimizer", "on_nan"): (1, RANGE),
    ("tfpar/api.py", "DistributedOptimizer", "offload"): (1, RANGE),
    ("tfpar/callbacks.py", "BackupAndRestore.__init__", "backup_dir"): (1, INPUT),
    ("tfpar/callbacks.py", "BackupAndRestore.__init__", "save_freq"): (1, RANGE),
    ("tfpar/callbacks.py", "BackupAndRestore.__init__", "keep"): (1, RANGE),
    ("tfpar/checkpoint.py", "Checkpointer.restore", "checkpoint_dir"): (1, INPUT),
    ("tfpar/checkpoint_writer.py", "Writer.__init__", "writer_nice"): (1, RANGE),
    ("tfpar/checkpoint.py", "Checkpointer._read", "checkpoint_dir"): (1, INPUT),
    ("tfpar/checkpoint.py", "published", "checkpoint_dir"): (1, INPUT),
    ("tfpar/checkpoint.py", "check_directory", "checkpoint_dir"): (2, INPUT),
    ("tfpar/checkpoint_tool.py", "resolve", "checkpoint"): (1, INPUT),
    ("tfpar/checkpoint_tool.py", "export", "to"): (2, INPUT),
    ("tfpar/checkpoint_tool.py", "export", "checkpoint"): (2, INPUT),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "zero_stage"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "dataset"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "name"): (2, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "topk_ratio"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "topk_momentum_carry"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "threshold"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "lowbit_bits"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "auto_budget_ms"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "bucket_mb"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "zero_keep_last_layers"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.__post_init__", "microbatches"): (1, RANGE),
    ("tfpar/config.py", "ParallelConfig.per_replica_batch", "global_batch_size"): (1, RANGE),
    ("tfpar/config.py", "_one_of", "name"): (1, RANGE),
    ("tfpar/config.py", "_at_least", "name"): (1, RANGE),
    ("tfpar/cpu_kernels.py", "wanted", "cpu_kernels"): (1, RANGE),
    ("tfpar/cpu_kernels.py", "wanted", "ENV"): (1, INPUT),
    ("tfpar/cpu_kernels.py", "apply", "cpu_kernels"): (2, RUNTIME),
    ("tfpar/data.py", "make_task", "dataset"): (1, INPUT),
    ("tfpar/data.py", "make_task", "num_classes"): (1, INPUT),
    ("tfpar/data.py", "make_task", "validation_steps"): (1, INPUT),
    ("tfpar/data.py", "_user_spec.refuse", "setting"): (1, INPUT),
    ("tfpar/devices.py", "check_device_count", "setting"): (1, RUNTIME),
    ("tfpar/faults.py", "parse_plan", "ENV"): (2, INPUT),
    ("tfpar/faults.py", "pause_in_save", "SAVE_PAUSE_ENV"): (1, INPUT),
    ("tfpar/flags.py", "config_from_flags", "f'--{err.setting}'"): (1, RANGE),
    ("tfpar/launch.py", "_checked_layout", "workers"): (2, TF_CONFIG),
    ("tfpar/launch.py", "_checked_layout", "command"): (1, TF_CONFIG),
    ("tfpar/launch.py", "_checked_layout", "name"): (1, TF_CONFIG),
    ("tfpar/launch.py", "_checked_layout", "min_workers"): (1, TF_CONFIG),
    ("tfpar/launch.py", "_checked_layout", "max_workers"): (1, TF_CONFIG),
    ("tfpar/launch.py", "_checked_layout", "lost_after"): (1, TF_CONFIG),
    ("tfpar/launch.py", "_checked_layout", "probe_timeout"): (1, TF_CONFIG),
    ("tfpar/launch.py", "_checked_layout", "discovery_interval"): (1, TF_CONFIG),
    ("tfpar/launch.py", "free_ports", "host"): (1, TF_CONFIG),
    ("tfpar/launch.py", "parse_hosts", "hosts"): (3, TF_CONFIG),
    ("tfpar/layout/activations.py", "apply", "layout rule"): (2, INPUT),
    ("tfpar/layout/activations.py", "_relayout.fit", "layout rule"): (1, MODEL),
    ("tfpar/layout/activations.py", "_relayout.relaid_call", "layout rule"): (1, MODEL),
    ("tfpar/layout/keras_distribution.py", "check_distribution", "distribution"): (1, INPUT),
    ("tfpar/layout/keras_distribution.py", "check_distribution", "batch_dim_name"): (1, INPUT),
    ("tfpar/layout/mesh.py", "_distributed", "DeviceMesh.devices"): (1, INPUT),
    ("tfpar/layout/multi_client.py", "keras_initialize", "job_addresses"): (1, INPUT),
    ("tfpar/layout/keras_distribution.py", "distribute_tensor", "layout_map"): (3, INPUT),
    ("tfpar/layout/keras_distribution.py", "check_layout_map", "layout_map"): (1, INPUT),
    ("tfpar/layout/keras_distribution.py", "_stateless_on_mesh",
     "gradient_accumulation_steps"): (1, INPUT),
    ("tfpar/layout/keras_distribution.py", "_check_layers", "f'{layer.name}.unroll'"): (1, MODEL),
    ("tfpar/layout/keras_distribution.py", "_fit", "steps_per_epoch"): (1, INPUT),
    ("tfpar/layout/keras_distribution.py", "_unpack", "validation_data"): (1, INPUT),
    ("tfpar/layout/mesh.py", "no_all_reduce_combining", "setting"): (1, RUNTIME),
    ("tfpar/layout/keras_fsdp.py", "FullyShardedDataParallel.__init__", "device_mesh"): (1, INPUT),
    ("tfpar/layout/keras_fsdp.py", "FullyShardedDataParallel.__init__", "layout_map"): (1, INPUT),
    ("tfpar/layout/keras_fsdp.py", "FullyShardedDataParallel.__init__", "weight_gather"): (1, RANGE),
    ("tfpar/layout/keras_pipeline.py", "settings", "DeviceMesh.axis_names"): (1, INPUT),
    ("tfpar/layout/keras_pipeline.py", "settings", "microbatches"): (1, RANGE),
    ("tfpar/layout/keras_pipeline.py", "_check_model", "setting"): (1, INPUT),
    ("tfpar/layout/keras_pipeline.py", "_check_model", "gradient_accumulation_steps"): (1, INPUT),
    ("tfpar/layout/keras_pipeline.py", "_rules", "layout_map"): (1, INPUT),
    ("tfpar/layout/keras_pipeline.py", "_loss", "loss"): (1, INPUT),
    ("tfpar/layout/keras_pipeline.py", "_accuracy", "metrics"): (1, INPUT),
    ("tfpar/layout/keras_pipeline.py", "KerasPipelineTrainer.check_batches", "microbatches"): (1, RANGE),
    ("tfpar/layout/keras_pipeline.py", "KerasPipelineTrainer.__init__", "layer"): (1, INPUT),
    ("tfpar/layout/keras_pipeline.py", "UserCallbacks.__init__", "callbacks"): (1, INPUT),
    ("tfpar/layout/pipeline.py", "_cut", "pipeline_stages"): (2, MODEL),
    ("tfpar/layout/pipeline.py", "MeshPipelineTrainer.__init__", "pipeline_stages"): (1, INPUT),
    ("tfpar/layout/pipeline.py", "MeshPipelineTrainer._on_mesh", "batch"): (1, INPUT),
    ("tfpar/layout/pipeline.py", "MeshPipelineTrainer._on_mesh", "microbatches"): (1, RANGE),
    ("tfpar/layout/pipeline.py", "MeshPipelineTrainer.predict", "predict"): (1, INPUT),
    ("tfpar/layout/presets.py", "preset_rules", "preset"): (1, RANGE),
    ("tfpar/layout/trainer.py", "MeshTrainer.__init__", "grad_accum_steps"): (1, RANGE),
    ("tfpar/layout/values.py", "_batch_arrays", "global_batch_size"): (1, RANGE),
    ("tfpar/layout/values.py", "micro_batches_to_mesh", "grad_accum_steps"): (1, RANGE),
    ("tfpar/layout/values.py", "micro_replica_batches_to_mesh", "grad_accum_steps"): (1, RANGE),
    ("tfpar/layout/variables.py", "layout_for", "layout"): (1, MODEL),
    ("tfpar/legacy/options.py", "check", "keras"): (1, RANGE),
    ("tfpar/legacy/options.py", "check", "prune_sparsity"): (1, RANGE),
    # The pruning schedule's steps inside the run: ranges given by its own steps.
    ("tfpar/legacy/options.py", "_check_schedule", "prune_frequency"): (1, RANGE),
    ("tfpar/legacy/options.py", "_check_schedule", "prune_initial_sparsity"): (1, RANGE),
    ("tfpar/legacy/options.py", "_check_schedule", "prune_begin_step"): (1, RANGE),
    ("tfpar/legacy/options.py", "_check_schedule", "prune_end_step"): (2, RANGE),
    ("tfpar/legacy/quantization.py", "quantize", "qat"): (1, MODEL),
    ("tfpar/pipeline/executor.py", "PipelineExecutor.__init__", "stages"): (1, INPUT),
    ("tfpar/pipeline/executor.py", "PipelineExecutor.__init__", "devices"): (1, INPUT),
    ("tfpar/pipeline/executor.py", "PipelineExecutor.check_batch", "microbatches"): (1, RANGE),
    ("tfpar/pipeline/model.py", "PipelineModel.__init__", "virtual_stages"): (1, INPUT),
    ("tfpar/pipeline/model.py", "PipelineModel.__init__", "stages"): (1, INPUT),
    ("tfpar/pipeline/model.py", "PipelineModel.__init__", "grad_accum_steps"): (1, RANGE),
    ("tfpar/pipeline/model.py", "PipelineModel.fit", "microbatches"): (1, RANGE),
    ("tfpar/pipeline/partition.py", "partition", "setting"): (1, MODEL),
    ("tfpar/pipeline/partition.py", "partition", "costs"): (1, INPUT),
    ("tfpar/pipeline/partition.py", "partition", "devices"): (1, INPUT),
    ("tfpar/pipeline/placement.py", "variables_on", "devices"): (2, INPUT),
    ("tfpar/pipeline/placement.py", "variables_on", "strategy"): (1, INPUT),
    ("tfpar/pipeline/placement.py", "current_device", "devices"): (1, INPUT),
    ("tfpar/pipeline/remote.py", "_cluster", "workers"): (2, TF_CONFIG),
    ("tfpar/pipeline/remote.py", "serve", "task"): (1, TF_CONFIG),
    ("tfpar/pipeline/schedule.py", "_check_sizes", "name"): (1, RANGE),
    ("tfpar/pipeline/schedule.py", "make_schedule", "schedule"): (1, RANGE),
    # A runtime a Python caller handed in (`for_training(model, config, runtime)`).
    ("tfpar/pipeline/training.py", "for_training", "strategy"): (1, INPUT),
    ("tfpar/pipeline/training.py", "for_training", "microbatches"): (1, RANGE),
    ("tfpar/plan/__main__.py", "main", "compression"): (1, PLANNER),
    ("tfpar/plan/__main__.py", "main", "calibrate"): (1, PLANNER),
    ("tfpar/plan/planner.py", "hardware_from", "devices"): (1, PLANNER),
    ("tfpar/plan/planner.py", "plan", "pipeline_stages"): (1, PLANNER),
    ("tfpar/plan/planner.py", "plan", "tensor_parallel"): (1, PLANNER),
    ("tfpar/plan/symbolic.py", "load", "model"): (2, MODEL),
    ("tfpar/plan/symbolic.py", "trace_profile", "model"): (2, MODEL),
    ("tfpar/plan/symbolic.py", "_placeholders", "model"): (2, MODEL),
    # An elastic pipeline's new stage count refused by a row of the table: that row's
    # error, passed on with the world that asked for the count.
    ("tfpar/relayout.py", "_pipeline_for", "refused.setting"): (1, RUNTIME),
    ("tfpar/strategy.py", "choose_collective", "collective"): (1, RUNTIME),
    # multi_worker's replicas (workers × local devices) are counted once TensorFlow runs;
    # one_device's are a row of the table (compat.ONE_DEVICE_REPLICAS).
    ("tfpar/strategy.py", "make_runtime", "data_parallel"): (1, RUNTIME),
    ("tfpar/strategy.py", "wait_for_workers", "name"): (1, INPUT),
    ("tfpar/strategy.py", "wait_for_workers", "timeout_s"): (1, RANGE),
    ("tfpar/tf_config.py", "parse", "TF_CONFIG"): (2, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_cluster", "TF_CONFIG.cluster"): (4, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_cluster", "setting"): (3, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_cluster", "where"): (1, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_cluster", "TF_CONFIG.cluster.chief"): (1, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_address", "setting"): (1, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_task", "TF_CONFIG.task"): (2, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_task", "TF_CONFIG.task.type"): (4, TF_CONFIG),
    ("tfpar/tf_config.py", "_check_task", "TF_CONFIG.task.index"): (2, TF_CONFIG),
    ("tfpar/zero/sharded.py", "wrap_optimizer", "zero_stage"): (3, INPUT),
    ("tfpar/zero/sharded.py", "wrap_optimizer", "compression"): (1, INPUT),
    ("tfpar/offload.py", "wrap_optimizer", "offload"): (3, INPUT),
}
# The rulebook itself: the table (compat) and the degrees against the devices (dims).
RULEBOOK = {"tfpar/compat.py", "tfpar/dims.py", "tfpar/errors.py"}


def config_error_sites():
    """(file, function, setting) -> how many `ConfigError(...)` calls name it there."""
    sites = {}
    for path in sorted(pathlib.Path(ROOT, "tfpar").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in RULEBOOK:
            continue

        def walk(node, scope):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, scope + [child.name])
                    continue
                func = getattr(child, "func", None)
                if isinstance(child, ast.Call) and "ConfigError" in (
                        getattr(func, "id", None), getattr(func, "attr", None)):
                    arg = child.args[0] if child.args else None
                    setting = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
                    key = (rel, ".".join(scope) or "<module>", setting)
                    sites[key] = sites.get(key, 0) + 1
                walk(child, scope)
        walk(ast.parse(path.read_text()), [])
    return sites


def test_no_combination_is_refused_outside_the_table():
    sites = config_error_sites()
    new = {k: n for k, n in sites.items() if ALLOWED.get(k, (0,))[0] != n}
    assert not new, (
        "ConfigError raised outside tfpar.compat at sites not listed in this test (or "
        f"more often): {new}. A combination belongs in tfpar.compat's table; a range or "
        "input check goes in ALLOWED with its kind.")
    gone = sorted(set(ALLOWED) - set(sites))
    assert not gone, f"listed sites that no longer raise; remove them from ALLOWED: {gone}"


def test_a_pipeline_refusal_fails_before_tensorflow_with_the_trainers_line():
    with pytest.raises(ConfigError) as info:
        ParallelConfig(pipeline_stages=2, measure_comm=True)
    assert info.value.setting == "measure_comm"
    # The command line gives the same line, before TensorFlow is imported (no device line).
    out = run([sys.executable, os.path.join(ROOT, "tests", "train_before_tf_child.py"),
               "--pipeline_stages=2", "--measure_comm", "--cpu_devices=2"],
              timeout=60, fresh=True)
    assert last_json_line(out.stdout) == {"code": 2, "tensorflow": False}
    # (The command line names the flag: `--measure_comm`.)
    assert out.stderr.strip().splitlines()[-1] == f"tfpar: error: --{info.value}"
    assert "devices:" not in out.stdout + out.stderr


def test_cluster_rows_are_checked_before_tensorflow():
    two = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                    "task": {"type": "worker", "index": 0}})}
    pipeline = ParallelConfig(pipeline_stages=2, microbatches=4, global_batch_size=16)
    check_inputs(pipeline, two)  # one stage per worker
    check_inputs(pipeline.replace(checkpoint_dir="ckpt"), two)  # tfpar.state
    # Each worker runs its stage of every replica, one a logical CPU, compressed or not.
    check_inputs(pipeline.replace(cpu_devices=2, compression="int8"), two)
    check_inputs(pipeline.replace(cpu_devices=2, data_parallel=2), two)
    for changes, setting in (({"pipeline_stages": 3, "microbatches": 3,
                               "global_batch_size": 15}, "pipeline_stages"),
                             ({"data_parallel": 2}, "data_parallel"),
                             ({"strategy": "mirrored"}, "strategy")):
        with pytest.raises(ConfigError) as info:
            check_inputs(pipeline.replace(**changes), two)
        assert info.value.setting == setting
    evaluator = {"TF_CONFIG": json.dumps({
        "cluster": {"worker": ["localhost:1", "localhost:2"], "evaluator": ["localhost:3"]},
        "task": {"type": "evaluator", "index": 0}})}
    with pytest.raises(ConfigError, match="TF_CONFIG='evaluator'"):
        check_inputs(pipeline, evaluator)
    with pytest.raises(ConfigError, match="a DTensor mesh spans training processes only"):
        check_inputs(ParallelConfig(tensor_parallel=2), evaluator)
    with pytest.raises(ConfigError, match="TF_CONFIG is not set"):
        check_inputs(ParallelConfig(strategy="multi_worker"), {})


def test_code_reached_without_a_config_applies_the_same_row():
    from tfpar.pipeline import schedule
    with pytest.raises(ConfigError) as direct:
        schedule.make_schedule("interleaved", 2, 3, 2)
    with pytest.raises(ConfigError) as configured:
        ParallelConfig(pipeline_stages=2, schedule="interleaved", virtual_stages=2,
                       microbatches=3, global_batch_size=63)
    assert str(direct.value) == str(configured.value)
    from tfpar.layout import presets
    assert tuple(presets.MODEL_PRESETS) == compat.TENSOR_PARALLEL_MODELS
    assert tuple(presets.SEQUENCE_PRESETS) == compat.SEQUENCE_PARALLEL_MODELS
    with pytest.raises(ConfigError) as direct:
        presets.model_presets("convnet")
    with pytest.raises(ConfigError) as configured:
        ParallelConfig(model="convnet", tensor_parallel=2)
    assert str(direct.value) == str(configured.value)


def parse_command(text):
    """The `ParallelConfig` keyword arguments of a printed `python -m tfpar.train` line."""
    words = shlex.split(text.split("#")[0])
    assert words[:3] == ["python", "-m", "tfpar.train"], text
    types = {f.name: type(f.default) for f in dataclasses.fields(ParallelConfig)}
    settings = {}
    for word in words[3:]:
        name, _, value = word[2:].partition("=")
        kind = types[name]
        settings[name] = (value.lower() in ("1", "true") if kind is bool else kind(value))
    return settings


@pytest.mark.parametrize("model", MODELS)
def test_every_command_the_planner_prints_is_accepted(model):
    # Every layout the planner ranks for 8 logical CPUs, at every precision and schedule
    # (the config's, and the planner's own `auto`, its default, which ranks 1F1B and
    # Chimera): a runnable one's command passes ParallelConfig and check_inputs, the
    # others' reasons are exactly what building their command raises.
    hw = planner.hardware_from(8, 16, 10, 100, 10)
    prof = profile.builtin_profile(model)
    checked = refused = 0
    for precision in PRECISIONS:
        for schedule in tuple(SCHEDULES) + ("auto",):
            req = planner.Request(model=model, schedule=schedule, mixed_precision=precision,
                                  simulated_cpu=True, recompute="auto", zero=(0, 1, 2, 3))
            for row in planner.plan(prof, hw, req)["ranked"]:
                line = commands.command(row, req, hw)
                try:
                    check_inputs(ParallelConfig(**parse_command(line)), environ={})
                    error = None
                except ConfigError as err:
                    error = str(err)
                assert error == row["runnable"], (line, row["runnable"])
                checked += 1
                refused += error is not None
    assert checked > 100 and 0 < refused < checked


def test_the_doctor_fails_with_the_tables_line_before_starting_a_strategy():
    from tfpar import doctor
    config = ParallelConfig(strategy="multi_worker")
    with pytest.raises(ConfigError) as info:
        check_inputs(config, environ={})
    checks = doctor.diagnose(config, environ={})
    assert (checks[-1].name, checks[-1].status, checks[-1].detail) == (
        "settings", "FAIL", str(info.value))
