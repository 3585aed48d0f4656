"""`tfpar.DistributedOptimizer(opt, offload="optimizer")` in a user's own `model.fit`
(`tfpar.offload`): the weights equal plain Adam's on the same 2 replicas, the devices hold
no slots, `model.save` writes Adam's state so stock Keras loads it, a Keras weights file
loads into the host slots, `on_nan` skips or stops on a NaN step; what it does not run with is refused by `tfpar.compat`'s rows
in one line naming the API's arguments."""

import os
import sys

import keras
import pytest

from subproc import ROOT, last_json_line, run

CHILD = os.path.join(ROOT, "tests", "offload_api_child.py")


def test_offloaded_fit_equals_plain_adam_and_saves_adams_state(tmp_path, report_measured):
    out = last_json_line(run([sys.executable, CHILD, "train", str(tmp_path)], timeout=600).stdout)
    assert out["replicas"] == 2 and out["steps"] == 6
    report_measured(f"DistributedOptimizer(offload='optimizer') vs Adam, 6 steps on 2 "
                    f"replicas: max |dw| = {out['weights_max_diff']:.2e}")
    assert out["weights_max_diff"] <= 1e-6, out
    # On the devices: Keras's step count and learning rate only (Adam's slots: 2 x params).
    assert max(out["offload_optimizer_bytes_per_device"]) <= 64, out
    assert min(out["plain_optimizer_bytes_per_device"]) >= 2 * 4 * out["params"], out
    host = out["offload_stats"]
    assert host["host_state_bytes"] == 2 * 4 * out["params"], out
    assert host["bytes_to_host_per_step"] > 0 and host["bytes_to_device_per_step"] > 0
    # A plain Adam's weights file into host slots: 5 weights x (m, v), equal.
    assert (out["loaded_slots"], out["loaded_iterations"]) == (10, 6), out
    assert out["loaded_slots_max_diff"] == 0.0, out
    # A NaN label in step 2: skipped with the host slots untouched, or fit stops there.
    skip, stop = out["skip_step"], out["stop"]
    assert (skip["skipped"], skip["stopped"], skip["nonfinite_steps"]) == ([2], None, 1.0), out
    assert stop["stopped"].startswith("gradients became non-finite at step 2 (on_nan=stop)")
    assert all(r["finite"] and r["slots_finite"] for r in (skip, stop)), out

    # Stock Keras (no tfpar in the process) loads both files: the same Adam state.
    stock = last_json_line(run([sys.executable, CHILD, "stock", str(tmp_path)], timeout=300,
                               fresh=True).stdout)
    assert stock["classes"] == ["Adam", "Adam"] and stock["variables"] == [12, 12], stock
    assert stock["nonzero_slots"] == 10 and stock["max_diff"] <= 1e-6, stock


@pytest.mark.parametrize("make, kwargs, setting, says", [
    (lambda: keras.optimizers.SGD(0.1), {}, "offload", "SGD(momentum=0.9) or Adam"),
    (lambda: "adam", {"compression": "topk"}, "compression", "use compression='none'"),
    (lambda: "adam", {"compression": "int8"}, "compression", "offload='optimizer'"),
    (lambda: "adam", {"offload": "optimizer+params"}, "offload", "use offload='optimizer'"),
    (lambda: "adam", {"offload": "disk"}, "offload", "choose one of none, optimizer"),
    (lambda: keras.optimizers.AdamW(), {}, "offload", "got AdamW"),
    (lambda: keras.optimizers.Adam(amsgrad=True), {}, "offload", "no amsgrad"),
])
def test_what_offload_does_not_run_with_is_one_line(make, kwargs, setting, says):
    import tfpar
    kwargs = {"offload": "optimizer", **kwargs}
    with pytest.raises(tfpar.ConfigError) as err:
        tfpar.DistributedOptimizer(make(), **kwargs)
    assert err.value.setting == setting and says in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and "--" not in str(err.value)


def test_offload_defaults_to_no_compression_and_saves_as_the_plain_class():
    import tfpar
    from tfpar.compression import aggregator_of
    opt = tfpar.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9, name="a"),
                                     offload="optimizer", on_nan="skip_step")
    assert opt.tfpar_offload == "optimizer" and aggregator_of(opt) is None
    assert (opt.tfpar_on_nan, opt.tfpar_skip_nonfinite) == ("skip_step", True)
    saved = keras.optimizers.serialize(opt)
    plain = keras.optimizers.serialize(keras.optimizers.SGD(0.1, momentum=0.9, name="a"))
    assert saved["class_name"] == "SGD" and saved["config"] == plain["config"]
    # Without offload the default is still PowerSGD.
    assert type(aggregator_of(tfpar.DistributedOptimizer("sgd"))).__name__ == \
        "PowerSGDAggregator"


def test_offload_under_keras_distribution_is_a_row():
    from tfpar import compat
    with pytest.raises(tfpar_error(), match="offload='optimizer'.*keras.distribution"):
        compat.enforce(compat.KERAS_MESH_OFFLOAD, compat.view(
            backend="dtensor", offload="optimizer", keras_distribution=True))


def tfpar_error():
    from tfpar import ConfigError
    return ConfigError
