"""tfpar's patches of Keras/TensorFlow internals still find the code they were written for.

If an upgrade moves or rewrites a patched function, these tests fail before users do.
The behaviour the patches enable (plain `fit` under MultiWorkerMirroredStrategy, several
logical CPUs per worker) is tested end to end in test_train.py.
"""

import os
import sys

import keras
import pytest
import tensorflow as tf

from tfpar import patches
from tfpar.errors import ConfigError


def test_pinned_versions_are_installed():
    from tfpar.patches.versions import installed
    assert keras.__version__ == patches.WRITTEN_FOR["keras"]
    assert tf.__version__ == patches.WRITTEN_FOR["tensorflow"]
    for library, version in patches.WRITTEN_FOR.items():
        assert installed(library) == version, library


def test_every_patch_target_is_unchanged():
    assert patches.check_targets() == []


def test_apply_replaces_every_target_and_is_idempotent():
    patches.apply()
    patches.apply()
    assert patches.is_applied()


def test_the_registry_checks_every_patch_and_would_notice_a_change(monkeypatch):
    from tfpar.patches import keras_mesh, keras_model, keras_optimizer
    from tfpar.patches import multi_worker, tensorflow_runtime
    assert {"multi_worker_fit", "multi_worker_cpu_devices", "mesh_variables", "mesh_loops",
            "mesh_output_layouts", "graph_control_input", "function_nodes", "function_loss",
            "dtensor_started", "layer_tree", "function_constant_folding", "fused_momentum",
            "onednn_enabled", "coordination_barrier",
            "collective_gather_lowering"} <= set(patches.REGISTRY)
    assert patches.check_targets(list(patches.REGISTRY)) == []
    monkeypatch.setitem(keras_mesh.MESH_LOOP_ARGS, "predict_on_batch", ["self", "x", "new"])
    monkeypatch.setattr(keras_mesh, "_EXPECTED_INITIALIZE", "not Keras's code")
    monkeypatch.setitem(tensorflow_runtime._EXPECTED_CONTROL_INPUT, "signature",
                        "(self: object, arg0: object, arg1: int) -> None")
    monkeypatch.setattr(keras_model, "_EXPECTED_FUNCTION_NODES", "not Keras's code")
    monkeypatch.setattr(keras_model, "_EXPECTED_FUNCTION_LOSS", "(self, fn)")
    monkeypatch.setattr(tensorflow_runtime, "_EXPECTED_DTENSOR_SINGLETON",
                        "not TensorFlow's code")
    monkeypatch.setattr(keras_mesh, "_EXPECTED_FLATTEN_LAYERS", "(self)")
    monkeypatch.setattr(tensorflow_runtime, "_EXPECTED_CONTEXT_CONFIG", "not TensorFlow's code")
    monkeypatch.setattr(keras_optimizer, "_EXPECTED_SGD_UPDATE", ("not Keras's code",))
    monkeypatch.setattr(tensorflow_runtime, "_ONEDNN_READER", "IsOneDnnOn")
    monkeypatch.setattr(multi_worker, "_EXPECTED_BARRIER", {"wait_at_barrier": "not TF's code"})
    problems = patches.check_targets(["mesh_loops", "mesh_variables", "graph_control_input",
                                      "function_nodes", "function_loss", "dtensor_started",
                                      "layer_tree", "function_constant_folding",
                                      "fused_momentum", "onednn_enabled",
                                      "coordination_barrier"])
    assert len(problems) == 11, problems
    assert any("wait_at_barrier" in p for p in problems), problems
    assert any("IsOneDnnOn" in p for p in problems), problems
    assert any("SGD.update_step" in p for p in problems), problems
    assert any("_flatten_layers" in p for p in problems), problems
    assert any("Context's _config" in p for p in problems), problems
    assert any("_dtensor_singleton" in p for p in problems), problems
    assert any("_nodes_by_depth" in p for p in problems), problems
    assert any("LossFunctionWrapper" in p for p in problems), problems
    assert any("predict_on_batch" in p for p in problems), problems
    assert any("Variable._initialize" in p for p in problems), problems
    assert any("_add_control_input" in p for p in problems), problems


def _fragment_entries():
    from tfpar.patches import (dtensor_readers, keras_mesh, keras_model, keras_optimizer,
                               keras_variables, model_optimization, multi_worker,
                               tensorflow_runtime)
    return [(module, name) for module in (keras_mesh, keras_model, keras_optimizer,
                                          keras_variables, model_optimization, multi_worker,
                                          tensorflow_runtime, dtensor_readers)
            for name in module.FRAGMENTS]


def test_every_patch_module_checks_its_entries_and_nothing_else():
    from tfpar.patches import _MODULES
    names = [name for module in _MODULES for name in module.ENTRIES]
    assert len(names) == len(set(names)) == len(patches.REGISTRY)
    for module in _MODULES:
        assert set(getattr(module, "FRAGMENTS", {})) <= set(module.ENTRIES), module.__name__
    with pytest.raises(KeyError):
        patches.check_targets(["no_such_entry"])


@pytest.mark.parametrize("module_entry", _fragment_entries(),
                         ids=lambda m: m[1] if isinstance(m, tuple) else str(m))
def test_each_source_fragment_would_notice_a_change(monkeypatch, module_entry):
    """Each fragment an entry checks, changed alone, makes `check_targets` name the entry
    (a signature fragment is compared whole, a source fragment looked for)."""
    module, name = module_entry
    fragments = module.FRAGMENTS[name]
    for i, (what, getter, fragment) in enumerate(fragments):
        changed = list(fragments)
        changed[i] = (what, getter, fragment + " not the library's code")
        monkeypatch.setitem(module.FRAGMENTS, name, changed)
        problems = patches.check_targets([name])
        assert len(problems) == 1 and f"registry entry {name}" in problems[0], (what, problems)
        assert what in problems[0] and "\n" not in problems[0]
    monkeypatch.setitem(module.FRAGMENTS, name, fragments)
    assert patches.check_targets([name]) == []


def test_every_registered_override_exists_and_overrides_a_checked_private_method():
    import importlib
    for (module, cls, method), entry in patches.OVERRIDES.items():
        assert entry in patches.REGISTRY
        owner = getattr(importlib.import_module(module), cls)
        assert method in vars(owner), (module, cls, method)
        assert method in patches.REGISTRY[entry][0], (method, entry)


def test_layout_enable_changes_only_what_the_registry_lists():
    from keras.src.backend.tensorflow import core, distribution_lib, trainer
    from tfpar.layout import keras_distribution

    def snapshot():
        return {**{f"TensorFlowTrainer.{n}": trainer.TensorFlowTrainer.__dict__.get(n)
                   for n in dir(trainer.TensorFlowTrainer)},
                **{f"Variable.{n}": core.Variable.__dict__.get(n) for n in dir(core.Variable)},
                **{f"distribution_lib.{n}": getattr(distribution_lib, n)
                   for n in dir(distribution_lib)}}

    before = snapshot()
    keras_distribution.enable()
    try:
        after = snapshot()
    finally:
        keras_distribution.disable()
    changed = {k for k in set(before) | set(after) if before.get(k) is not after.get(k)}
    listed = " ".join(target for target, _ in patches.REGISTRY.values())
    assert changed and all(k.split(".")[-1] in listed for k in changed), changed
    assert snapshot() == before


def test_all_reduce_combining_is_turned_off_or_refused_once_dtensor_started(monkeypatch):
    """DTensor reads its combining setting once, when it starts: before that the setting is
    turned off; after it, with combining on, the run is refused in one line (a mesh
    pipeline could hang, ZeRO-3 would hold every gradient)."""
    from tfpar.layout import mesh
    monkeypatch.setenv(mesh.COMBINE_ALL_REDUCES, "1")  # restored after the test
    monkeypatch.setattr(patches, "dtensor_started", lambda: True)
    with pytest.raises(ConfigError) as err:
        mesh.no_all_reduce_combining("zero_stage", 3, "why")
    assert err.value.setting == "zero_stage" and "\n" not in str(err.value)
    assert f"{mesh.COMBINE_ALL_REDUCES}=0" in str(err.value)
    monkeypatch.setattr(patches, "dtensor_started", lambda: False)
    mesh.no_all_reduce_combining("zero_stage", 3, "why")
    assert os.environ[mesh.COMBINE_ALL_REDUCES] == "0"
    monkeypatch.setattr(patches, "dtensor_started", lambda: True)
    mesh.no_all_reduce_combining("pipeline_stages", 2, "why")  # already off: nothing to refuse


def test_mesh_pipeline_refuses_stage_models_that_do_not_match_the_schedule():
    from tfpar.layout.pipeline import MeshPipelineTrainer, StagedModel
    from tfpar.pipeline.schedule import make_schedule
    model = StagedModel([keras.layers.Identity()] * 3, num_meshes=2)
    with pytest.raises(ConfigError) as err:
        MeshPipelineTrainer([None, None], model, [], make_schedule("1f1b", 2, 4), None)
    assert "2 stages × 1 chunks for 3 stage models on 2 meshes" in str(err.value)


def test_the_gather_lowering_check_reads_tensorflows_library(monkeypatch):
    # DTensor reads the variable in C++ only: its name must be in TensorFlow's library.
    from tfpar.patches import dtensor_lowering
    assert patches.check_targets(["collective_gather_lowering"]) == []
    for attribute, changed in (("COLLECTIVE_GATHER", "LOWER_DTENSOR_GATHER_TO_ALL_GATHER"),
                               ("_LIBRARY", "libtensorflow_not_there.so")):
        with monkeypatch.context() as m:
            m.setattr(dtensor_lowering, attribute, changed)
            problems = patches.check_targets(["collective_gather_lowering"])
        assert len(problems) == 1 and "registry entry collective_gather_lowering" in \
            problems[0] and "\n" not in problems[0], problems


def test_the_gather_lowering_is_set_and_taken_out_as_the_user_asked(monkeypatch):
    from tfpar.patches import dtensor_lowering as lowering
    name = lowering.COLLECTIVE_GATHER
    monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(lowering, "_USER_OFF", [])
    monkeypatch.setattr(lowering, "_SET_HERE", [])
    assert lowering.set_collective_gathers(True) and os.environ[name] == "1"  # ZeRO-3, dp
    assert not lowering.set_collective_gathers(False, keep_users=True)  # a later mesh: ours out
    assert name not in os.environ
    monkeypatch.setenv(name, "yes")  # the user's own value stays for a later mesh ...
    assert lowering.set_collective_gathers(False, keep_users=True) and os.environ[name] == "yes"
    assert not lowering.set_collective_gathers(False)  # ... not on a tensor-parallel one
    monkeypatch.setenv(name, "0")  # the user's "DTensor's own" (TensorFlow reads it as set)
    assert not lowering.set_collective_gathers(True) and name not in os.environ
    assert not lowering.set_collective_gathers(True)  # remembered once taken out


def test_the_heartbeat_error_check_reads_tensorflows_library(monkeypatch):
    # The launcher reads TensorFlow's heartbeat error in workers' output (a lost host);
    # TensorFlow writes it in C++: its words must be in TensorFlow's library.
    from tfpar import host_loss
    assert patches.check_targets(["heartbeat_error_text"]) == []
    monkeypatch.setattr(host_loss, "UNHEALTHY", "The following tasks are gone:")
    problems = patches.check_targets(["heartbeat_error_text"])
    assert len(problems) == 1 and "registry entry heartbeat_error_text" in problems[0] \
        and "\n" not in problems[0], problems


def test_per_device_iterator_reads_each_devices_rows_of_a_host_file_at_each_next():
    # tests/host_reader_child.py: 2 devices, a 4 x 3 host file read twice in a DTensor
    # function, rewritten by the host, read again: each read is the file as it is then.
    from subproc import ROOT, last_json_line, run
    out = run([sys.executable, os.path.join(ROOT, "tests", "host_reader_child.py")])
    result = last_json_line(out.stdout)
    assert result["layout"] == result["expected_layout"]
    assert result["expected"][0] != result["expected"][1]  # the host did change the file
    for reads, expected in zip(result["calls"], result["expected"], strict=True):
        assert reads == [expected, expected], (reads, expected)
