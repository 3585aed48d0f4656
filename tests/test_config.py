"""ParallelConfig validation, flags and recipes: every bad value names its setting."""

import glob
import os

import pytest
from absl import flags

from subproc import ROOT
from tfpar import ParallelConfig
from tfpar import flags as tfpar_flags
from tfpar.errors import ConfigError


@pytest.mark.parametrize("changes,setting,hint", [
    ({"model": "resnet152"}, "model", "mlp"),
    ({"global_batch_size": 0}, "global_batch_size", ">= 1"),
    ({"grad_accum_steps": 1.5}, "grad_accum_steps", "integer"),
    ({"learning_rate": -1.0}, "learning_rate", "> 0"),
    ({"topk_ratio": 2.0}, "topk_ratio", "(0, 1]"),
    ({"dataset": "no colon"}, "dataset", "module:function"),
    ({"mixed_precision": "fp8"}, "mixed_precision", "bf16"),
    ({"global_batch_size": 30, "microbatches": 4}, "microbatches", "divide"),
    ({"pipeline_stages": 2, "schedule": "interleaved"}, "virtual_stages", ">= 2"),
    ({"zero_gather": "int8"}, "zero_gather", "--zero_stage=3"),
    ({"zero_stage": 2, "compression": "auto"}, "compression", "lowbit, topk"),
    ({"zero_stage": 3, "compression": "powersgd"}, "compression", "fp16, bf16 or int8"),
    ({"zero_stage": 3, "compression": "int8", "recompute": "blocks"}, "recompute",
     "--recompute=none"),
    ({"zero_stage": 3, "compression": "int8", "model": "convnet"}, "model", "convolution"),
    ({"zero_stage": 3, "cpu_devices": 8, "data_parallel": 2, "tensor_parallel": 2,
      "pipeline_stages": 2}, "zero_stage", "--pipeline_stages>1"),
])
def test_bad_values_name_the_setting(changes, setting, hint):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**changes)
    assert err.value.setting == setting
    assert hint in str(err.value)
    assert repr(changes.get(setting, err.value.value)) in str(err.value)


MESH_3D = {"cpu_devices": 8, "data_parallel": 2, "tensor_parallel": 2, "pipeline_stages": 2,
           "microbatches": 4}


def test_dp_tp_pp_takes_every_schedule_and_setting():
    # tests/test_layout_pipeline.py trains the accepted ones against one device, and
    # tests/test_mesh_codec_compose.py a codec with fp16 against the uncompressed run.
    for changes in ({"schedule": "interleaved", "virtual_stages": 2}, {"schedule": "zb_h1"},
                    {"schedule": "gpipe", "grad_accum_steps": 2},
                    {"mixed_precision": "bf16"}, {"mixed_precision": "fp16"},
                    {"compression": "int8", "grad_accum_steps": 2},
                    {"compression": "powersgd", "mixed_precision": "fp16"},
                    {"recompute": "blocks"},
                    {"recompute": "full"}):
        ParallelConfig(**MESH_3D, **changes)
    ParallelConfig(**MESH_3D, checkpoint_dir="ckpt")  # tfpar.state: any layout


def test_batch_must_split_over_replicas():
    cfg = ParallelConfig(global_batch_size=30)
    assert cfg.per_replica_batch(3) == 10
    with pytest.raises(ConfigError, match="divisible by the 4 replicas; try 28"):
        cfg.per_replica_batch(4)


def test_linear_scaling_rule_uses_the_effective_batch():
    cfg = ParallelConfig(learning_rate=0.1, base_batch_size=64, global_batch_size=128,
                         grad_accum_steps=2, scale_lr=True)
    assert cfg.effective_batch_size == 256
    assert cfg.scaled_learning_rate == pytest.approx(0.4)
    assert cfg.replace(scale_lr=False).scaled_learning_rate == pytest.approx(0.1)


def test_warmup_schedule_ramps_to_the_scaled_rate():
    from tfpar.train import learning_rate
    schedule = learning_rate(ParallelConfig(learning_rate=0.1, base_batch_size=32,
                                            global_batch_size=64, scale_lr=True,
                                            warmup_steps=4))
    values = [float(schedule(step)) for step in range(6)]
    assert values == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2, 0.2])


def test_fit_segments_cover_every_step_once():
    from tfpar.train import fit_segments
    for start in range(0, 11):
        covered = []
        for initial, epochs, steps, first in fit_segments(start, 11, 4):
            assert first == start + len(covered)
            covered += list(range(first, first + (epochs - initial) * steps))
        assert covered == list(range(start, 11))


def parse(*argv):
    values = flags.FlagValues()
    tfpar_flags.define_flags(values)
    values(["tfpar.train", *argv])
    return tfpar_flags.config_from_flags(values)


def test_flags_map_onto_the_config():
    cfg = parse("--model=transformer", "--grad_accum_steps=4", "--noerror_feedback",
                "--learning_rate=0.5")
    assert (cfg.model, cfg.grad_accum_steps, cfg.error_feedback) == ("transformer", 4, False)
    assert cfg.learning_rate == 0.5
    with pytest.raises(ConfigError, match=r"--steps_per_epoch=0 is invalid"):
        parse("--steps_per_epoch=0")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.cfg"))))
def test_every_recipe_is_valid_and_says_how_to_run_it(path):
    text = open(path).read()
    assert text.startswith("#") and "python -m tfpar" in text.split("\n--")[0]
    parse(f"--flagfile={path}")


def test_tfjob_manifest_has_what_the_training_operator_needs():
    import yaml
    job = yaml.safe_load(open(os.path.join(ROOT, "configs", "tfjob.yaml")))
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    workers = job["spec"]["tfReplicaSpecs"]["Worker"]
    assert workers["replicas"] >= 2
    container = workers["template"]["spec"]["containers"][0]
    assert container["name"] == "tensorflow"  # the operator looks for this name
    command = " ".join(container["command"] + container.get("args", []))
    assert "tfpar.train" in command and "--strategy=multi_worker" in command
    assert "--checkpoint_dir" in command  # restarted pods must resume, not start over


def test_zero3_without_resharding_refuses_recompute_in_one_line():
    # Without resharding ZeRO-3 keeps each layer's gathered weights and activations; the
    # layers it wraps are not recomputed, so --recompute would be dropped silently.
    base = {"zero_stage": 3, "cpu_devices": 4, "zero_reshard_after_forward": False}
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**base, recompute="full")
    assert info.value.setting == "recompute" and "\n" not in str(info.value)
    assert "--nozero_reshard_after_forward" in str(info.value)
    ParallelConfig(**base)  # without --recompute: accepted
    ParallelConfig(**{**base, "zero_reshard_after_forward": True}, recompute="full")


def test_zero3_layers_kept_whole_are_checked_in_one_line():
    base = {"zero_stage": 3, "cpu_devices": 4}
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**base, zero_keep_last_layers=-2)
    assert info.value.setting == "zero_keep_last_layers" and "-1" in str(info.value)
    # Without resharding every layer is kept: a count would be silently moot.
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**base, zero_keep_last_layers=2, zero_reshard_after_forward=False)
    assert info.value.setting == "zero_keep_last_layers" and "\n" not in str(info.value)
    ParallelConfig(**base, zero_reshard_after_forward=False)  # the default (0): accepted
    ParallelConfig(**base, zero_keep_last_layers=-1, zero_reshard_after_forward=False)
    ParallelConfig(**base, zero_keep_last_layers=2)
