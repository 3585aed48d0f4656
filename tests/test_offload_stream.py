"""The offloaded step streams (`tfpar.offload`, `_tfpar_streamed_update`): each weight's
gradient is summed and sent to the host by itself, and the steps come back one weight at a
time, so the devices never hold Keras's all-reduce of the whole gradient set nor a whole
step tensor. That equality with the device-resident run holds is tests/test_offload.py's;
here, what it saves: the allocator's peak of a 2-replica Adam step, in units of one
replica's weights (W, fp32).

The two replicas' weights are 2 W; the whole-set path (the code before streaming) peaked at
6.25 W on this model (the replicas' gradients, 2 W, and the all-reduce's buffers on top),
the streamed one at 3.51 W (one run each, 2026-12-05; docs/benchmarks/memory.md has the
512-wide table). 5 W is between them: a return to whole-set buffers fails it.
"""

import json

from subproc import run_module


def test_offloaded_step_peak_is_below_the_whole_set_all_reduce(tmp_path, report_measured):
    path = tmp_path / "m.json"
    run_module("tfpar.train", "--model=transformer", "--model_width=256", "--model_depth=4",
               "--cpu_devices=2", "--global_batch_size=8", "--steps=2",
               "--steps_per_epoch=2", "--optimizer=adam", "--offload=optimizer",
               "--strategy=mirrored", "--verbose=0", f"--metrics_json={path}",
               env={"TF_CPU_ALLOCATOR_USE_BFC": "true"}, timeout=400)
    metrics = json.loads(path.read_text())
    memory = metrics["memory"]
    assert memory["peak_bytes_scope"] == "process", memory
    weights = memory["param_bytes_per_device"][0]
    peak = memory["peak_bytes_per_device"][0]
    report_measured(f"offload stream: 256x4 transformer, 2 replicas, Adam: process peak "
                    f"{peak / 2 ** 20:.1f} MB = {peak / weights:.2f} x one replica's "
                    f"weights ({weights / 2 ** 20:.1f} MB)")
    assert 2 * weights < peak <= 5 * weights, (peak, weights)
    # The slots are on the host; each weight's summed gradient went down once (and, for the
    # embeddings, Adam's squared slices), its step up to each replica.
    host = metrics["offload"]
    assert memory["optimizer_state_bytes_per_device"][0] <= 64
    assert host["host_state_bytes"] >= 2 * weights - 64
    assert host["bytes_to_device_per_step"] == 2 * weights
    assert weights <= host["bytes_to_host_per_step"] < 1.1 * weights


def test_deposit_then_update_is_the_host_step_and_a_skip_leaves_the_slots():
    import keras
    import numpy as np

    from tfpar import offload

    rng = np.random.default_rng(0)
    grad = rng.normal(size=[4, 3]).astype(np.float32)
    opt = keras.optimizers.Adam()
    streamed = offload.HostSlots(("momentum", "velocity"), {0: (4, 3)})
    whole = offload.HostSlots(("momentum", "velocity"), {0: (4, 3)})
    total = streamed.deposit(0, grad, np.zeros([0], np.float32))
    assert total == np.sum(grad, dtype=np.float32)
    step = streamed.update(opt, 0, False, True, np.float32(0.01))
    expected = whole.step(opt, [0], False, True, np.float32(0.01), grad,
                          np.zeros([0], np.float32))[0]
    np.testing.assert_array_equal(step, expected)
    np.testing.assert_array_equal(streamed.arrays["velocity"][0], whole.arrays["velocity"][0])
    assert not streamed.pending
    # A skipped step: zero step, slots as they were, nothing left pending.
    before = streamed.arrays["momentum"][0].copy()
    streamed.deposit(0, grad * np.float32(np.nan), np.zeros([0], np.float32))
    assert not streamed.update(opt, 0, True, False, np.float32(0.01)).any()
    np.testing.assert_array_equal(streamed.arrays["momentum"][0], before)
    assert not streamed.pending
