"""Adam's moments moving between Adam in front of a codec and Keras's Adam (`tfpar.state`,
`tfpar.zero.sharded`), on ZeRO-2 with lowbit (2 replicas, mlp, Adam, warm-up 2 of 5):

- resumed with Adam behind the codec (`--nocompress_adam_step`): error feedback's
  residuals, in Adam steps' units in front and in the gradient's behind, are not loaded
  (zero, one line says so); Keras's m and v after the next step against the uninterrupted
  behind run's (tests/reshard_child.py);
- resumed on one replica, where Keras's Adam takes the steps though the aggregator holds
  moments: Keras's slots after loading are the converted moments (those the 2-replica
  behind resume loaded), not zero;
- the metrics JSON counts the aggregator's whole moments beside ZeRO's slots
  (tests/zero_child.py).
"""

import json
import sys

import numpy as np
import pytest

from subproc import ROOT, last_json_line, run

BASE = {"model": "mlp", "optimizer": "adam", "learning_rate": 1e-3, "global_batch_size": 32,
        "verbose": 0, "compression": "lowbit", "adam_warmup_steps": 2}
Z2 = {**BASE, "cpu_devices": 2, "data_parallel": 2, "strategy": "mirrored", "zero_stage": 2}
BEHIND = {**Z2, "compress_adam_step": False}
ONE = {**Z2, "data_parallel": 1}
LINE = "in the other's units"


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front_moves")

    def resume(name, settings, steps):
        return [name, {**settings, "steps": steps, "checkpoint_dir": str(tmp / name)},
                {"from": str(tmp / "front"), "at": 5}]
    runs = [["front", {**Z2, "steps": 5, "checkpoint_dir": str(tmp / "front")}, {}],
            ["ref_behind", {**BEHIND, "steps": 6}, {}],
            resume("behind_loaded", BEHIND, 5), resume("behind_next", BEHIND, 6),
            resume("one_loaded", ONE, 5)]
    prefix = str(tmp / "s")
    out = run([sys.executable, f"{ROOT}/tests/reshard_child.py",
               json.dumps({"cpu_devices": 2, "runs": runs}), prefix], timeout=600)

    def state(name):
        with np.load(f"{prefix}_{name}.npz") as f:
            return {k.replace("|", "/"): f[k] for k in f.files}
    return {n: state(n) for n, _, _ in runs}, out.stderr


def _slots(state, slot):
    return {k: v for k, v in state.items()
            if k.startswith("optimizer/") and k.endswith(f"/{slot}")}


def test_front_residual_not_loaded_behind(moved, report_measured):
    states, stderr = moved
    front, loaded = states["front"], states["behind_loaded"]
    saved = [k for k in front if k.endswith("/residual")]
    assert saved and any(np.abs(front[k]).max() > 0 for k in saved)  # a debt was written
    held = [k for k in loaded if k.endswith("/residual")]
    assert held and all(not loaded[k].any() for k in held), held
    assert LINE in stderr
    # Keras's m and v one step after the resume against the uninterrupted behind run's
    # (6 steps each): the norms over every weight's slot, their ratio. With the Adam-step
    # residuals loaded as gradients a review's probe (5 steps in front, 5 behind) measured
    # 7x (m) and 80x (v).
    for slot in ("momentum", "velocity"):
        norm = {n: np.sqrt(sum(float(np.sum(np.square(v)))
                               for v in _slots(states[n], slot).values()))
                for n in ("behind_next", "ref_behind")}
        ratio = norm["behind_next"] / norm["ref_behind"]
        report_measured(f"front -> behind resume: Keras's {slot} norm / uninterrupted "
                        f"behind run's = {ratio:.3f}")
        assert 0.5 < ratio < 2.0, (slot, ratio)


def test_front_moments_reach_keras_on_one_replica(moved):
    states, _ = moved
    one, two = _slots(states["one_loaded"], "momentum"), _slots(states["behind_loaded"],
                                                                "momentum")
    one |= _slots(states["one_loaded"], "velocity")
    two |= _slots(states["behind_loaded"], "velocity")
    assert sorted(one) == sorted(two) and one
    for k in one:
        assert np.abs(two[k]).max() > 0, k  # the converted moments
        np.testing.assert_allclose(one[k], two[k], rtol=1e-6, atol=1e-12, err_msg=k)


def test_front_optimizer_state_bytes_count_whole_moments(tmp_path):
    # ZeRO-2 with Adam in front: each replica holds Adam's m and v whole (and a residual)
    # beside ZeRO's 1/N slots, so at least twice the parameters' bytes per device.
    case = {"name": "front", **Z2, "steps": 1}
    out = run([sys.executable, f"{ROOT}/tests/zero_child.py", json.dumps([case]),
               str(tmp_path / "w")], timeout=300)
    r = last_json_line(out.stdout)["front"]
    for state, params in zip(r["optimizer_state_bytes_per_device"],
                             r["param_bytes_per_device"], strict=True):
        assert state >= 2 * params, (state, params)


def test_front_zero_topk_takes_its_warmup():
    # With Adam in front ZeRO 1/2 runs data parallelism's top-k aggregator, whose warm-up
    # is built; with Adam behind the codec it is refused in one line.
    from tfpar import ParallelConfig
    from tfpar.errors import ConfigError
    assert ParallelConfig(zero_stage=2, compression="topk", topk_warmup_steps=10)
    for behind in ({"compress_adam_step": False}, {"optimizer": "momentum"}):
        with pytest.raises(ConfigError, match="^topk_warmup_steps=10.*Adam behind"):
            ParallelConfig(zero_stage=2, compression="topk", topk_warmup_steps=10, **behind)
