"""`--compression=auto` on the DTensor mesh (`tfpar.layout.auto`), dp2×tp2, the mlp, each
run against its uncompressed run on the same seed:

- Adam, 40 steps, as on a 10 Mbit/s link (`--auto_link_mbps`): final loss within the
  mesh codecs' band (tests/test_layout_mesh.py, 2 %) and keeping at least 40 % of the
  uncompressed run's drop (tests/test_compression_nan_free.py's criterion for tf.distribute's
  `auto`); its mean bytes per step below fp32's, its ranks in the metrics JSON;
- on a link fast enough for fp32 it sends everything exactly: the uncompressed run's
  weights (up to re-association);
- stopped at step 25 (mid-window: the window's sums, the ranks and `Q`s are in the
  checkpoint under `codec/<path>/…`) and resumed to 40: the uninterrupted run's weights
  exactly;
- with `--mixed_precision=fp16` and with `--grad_accum_steps=2`, near their uncompressed
  runs and finite; an fp16 step skipped for overflowing gradients (one replica's batch
  1000 times larger, tests/user_data.py) sent its collectives, which its bytes count;
- in a pipeline, `comm.auto` gives each stage's budget rank (`mesh_comm_stats` on given
  reductions).

Two children at once (tests/train_configs_child.py), each its runs on one mesh; the
resume in the child of the run it must equal. Both run with grappler off
(tests/graph_optimizer.py), the uncompressed runs too; a third child, with TensorFlow's
default optimizer (grappler on, as users run; no other file trains `auto` on the mesh
with it), runs Adam and `auto` 20 steps (the exact start and one compressed window):
near each other, fewer bytes.
"""

import math

import numpy as np
import pytest

import subproc
from graph_optimizer import OFF as GRAPPLER_OFF

from test_layout_compose import train_configs
from test_train import max_diff, weights
from tfpar.compression.auto import RANKS

MESH = {"model": "mlp", "verbose": 0, "global_batch_size": 32, "tensor_parallel": 2,
        "data_parallel": 2, "cpu_devices": 4}
ADAM = {**MESH, "optimizer": "adam", "learning_rate": 1e-3, "steps": 40,
        "steps_per_epoch": 40}
# 10 Mbit/s: a 20 ms step's budget (22.5 kB) is below fp32's 307 kB, so every matrix is
# compressed after the exact start (10 steps), its rank adapting by window (10 steps).
AUTO = {"compression": "auto", "auto_link_mbps": 10}
FAST = {"compression": "auto", "auto_link_mbps": 1e6}  # fp32 fits the budget
SHORT = {"steps": 20, "steps_per_epoch": 20}  # the exact start and one compressed window
FP16 = {**MESH, **SHORT, "optimizer": "sgd", "learning_rate": 0.1, "mixed_precision": "fp16"}
ACCUM = {**MESH, **SHORT, "optimizer": "adam", "learning_rate": 1e-3, "grad_accum_steps": 2}
BAND = 0.02  # tests/test_layout_mesh.py's DEFAULTS_BAND for codecs without their own
STOP = 25
# 12 steps on tests/user_data.py's task (8 features, 2 classes), replica 0's batch of step 3
# overflowing fp16's scaled gradients: skipped, inside the exact start (10 steps taken).
SKIP = {**MESH, "optimizer": "sgd", "learning_rate": 0.1, "mixed_precision": "fp16",
        "steps": 12, "steps_per_epoch": 12, "num_classes": 2,
        "dataset": "user_data:sign_of_sum_fp16_overflow_at_step_3", **AUTO}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two children at once, each on its own mesh; `name -> metrics + "weights"`."""
    folder = tmp_path_factory.mktemp("mesh_auto")
    ckpt = str(folder / "ckpt")
    groups = [[{**ADAM, **AUTO},
               {**ADAM, **AUTO, "steps": STOP, "checkpoint_dir": ckpt,
                "checkpoint_every": STOP},
               {**ADAM, **AUTO, "checkpoint_dir": ckpt, "checkpoint_every": 1000},
               {**SKIP, "checkpoint_dir": str(folder / "skip"), "checkpoint_every": 12}],
              [ADAM, {**ADAM, **FAST}, FP16, {**FP16, **AUTO}, ACCUM, {**ACCUM, **AUTO}]]
    names = [["auto", "stop", "resume", "skip"],
             ["plain", "fast", "fp16", "fp16_auto", "accum", "accum_auto"]]
    # The third group with grappler on (TensorFlow's default).
    groups.append([{**ADAM, **SHORT}, {**ADAM, **SHORT, **AUTO}])
    names.append(["default_plain", "default_auto"])
    outs = subproc.run_concurrently([
        lambda i=i, g=g: train_configs(str(folder / f"g{i}"), g,
                                       env=GRAPPLER_OFF if i < 2 else None)
        for i, g in enumerate(groups)])
    results = {}
    for i, (group, out) in enumerate(zip(names, outs)):
        for j, name in enumerate(group):
            results[name] = {**out[None][j], "weights": str(folder / f"g{i}.{j}")}
            # each run with the optimizer its test asked for
            assert results[name]["grappler"] == ("off" if i < 2 else "default"), name
    return folder, results


def _gap(r, plain):
    return r["final_loss"] / plain["final_loss"] - 1


def test_auto_on_the_mesh_ends_near_uncompressed_with_fewer_bytes(runs, report_measured):
    folder, r = runs
    plain, auto = r["plain"], r["auto"]
    gap = _gap(auto, plain)
    comm = auto["comm"]
    report_measured(f"mesh auto (dp2×tp2 mlp, Adam, 40 steps, 10 Mbit/s link): final loss "
                    f"{gap:+.2%} vs uncompressed, {comm['compression_ratio']:.2f}× fewer "
                    f"bytes than fp32 over the run, ranks {comm['auto']['ranks']}")
    assert math.isfinite(auto["final_loss"]) and abs(gap) < BAND, (gap, auto, plain)
    drop = plain["loss_history"][0] - plain["final_loss"]
    assert auto["loss_history"][0] - auto["final_loss"] > 0.4 * drop, (auto, plain)
    # It ran: below fp32's bytes, every matrix at a rank, the run not the uncompressed one.
    assert comm["bytes_on_wire_per_step"] < comm["bytes_uncompressed_per_step"], comm
    assert comm["auto"]["r_budget"] is not None, comm
    ranks = comm["auto"]["ranks"]
    assert set(ranks) == {"dense_0/kernel", "dense_1/kernel", "logits/kernel"}, ranks
    # Each a rank of auto's ladder whose factors are smaller than its matrix (the kernels in
    # the model's order, which is also their names' order here).
    kernels = [w.shape for w in weights(auto["weights"]) if w.ndim == 2]
    for (name, k), (m, n) in zip(sorted(ranks.items()), kernels):
        assert k in RANKS and (m + n) * k < m * n, (name, k, (m, n))
    assert max_diff(weights(plain["weights"]), weights(auto["weights"])) > 1e-4


def test_auto_on_the_mesh_with_tensorflows_default_optimizer(runs, report_measured):
    # Grappler on: its fusions and its dependency optimizer (which edits the control edges
    # around the collectives) meet `auto`'s exact start and a compressed window.
    folder, r = runs
    plain, auto = r["default_plain"], r["default_auto"]
    gap = _gap(auto, plain)
    comm = auto["comm"]
    report_measured(f"mesh auto, grappler on (dp2×tp2 mlp, Adam, 20 steps, 10 Mbit/s): "
                    f"final loss {gap:+.2%} vs uncompressed, ranks {comm['auto']['ranks']}")
    assert math.isfinite(auto["final_loss"]) and abs(gap) < BAND, (gap, auto, plain)
    assert comm["bytes_on_wire_per_step"] < comm["bytes_uncompressed_per_step"], comm
    assert max_diff(weights(plain["weights"]), weights(auto["weights"])) > 1e-6


def test_auto_on_a_fast_link_sends_fp32_exactly(runs):
    folder, r = runs
    comm = r["fast"]["comm"]
    assert comm["auto"]["r_budget"] is None and comm["compression_ratio"] == 1.0, comm
    assert max_diff(weights(r["plain"]["weights"]), weights(r["fast"]["weights"])) < 1e-5


def test_auto_on_the_mesh_resumes_exactly_with_its_ranks(runs):
    folder, r = runs
    from tfpar import state
    assert r["stop"]["steps"] == STOP
    saved = state.tensors_of(str(folder / "ckpt" / f"ckpt-{STOP}"))
    codec = {k for k in saved if k.startswith("codec/")}
    for path in ("dense_0/kernel", "dense_1/kernel", "logits/kernel"):
        for kind in ("powersgd_q", "auto_rank", "auto_norm_sum", "auto_norm_prev",
                     "auto_beyond_sum", "residual"):
            assert f"codec/{path}/{kind}" in codec, (path, kind, sorted(codec))
    assert saved["codec/dense_0/kernel/residual"].shape[0] == 2  # one row per replica
    assert int(saved["codec/dense_0/kernel/auto_step"]) == STOP
    # Mid-window: the window's sums are saved, not zero.
    assert float(saved["codec/dense_0/kernel/auto_norm_sum"]) > 0
    resumed, whole = r["resume"], r["auto"]
    assert resumed["comm"]["auto"]["ranks"] == whole["comm"]["auto"]["ranks"]
    assert max_diff(weights(whole["weights"]), weights(resumed["weights"])) == 0.0


@pytest.mark.parametrize("plain,auto", [("fp16", "fp16_auto"), ("accum", "accum_auto")],
                         ids=["fp16", "accumulation"])
def test_auto_on_the_mesh_with_fp16_and_accumulation(runs, plain, auto):
    folder, r = runs
    gap = _gap(r[auto], r[plain])
    assert math.isfinite(r[auto]["final_loss"]) and abs(gap) < BAND, (gap, r[auto])
    comm = r[auto]["comm"]
    assert comm["bytes_on_wire_per_step"] < comm["bytes_uncompressed_per_step"], comm
    assert all(np.all(np.isfinite(w)) for w in weights(r[auto]["weights"]))


def test_a_skipped_fp16_step_counts_the_bytes_it_sent(runs):
    folder, r = runs
    from tfpar import state
    saved = state.tensors_of(str(folder / "skip" / "ckpt-12"))
    counter = "codec/dense_0/kernel/"
    # One step skipped (the scale halved), the codec's state and step count left as they
    # were; the collectives ran on all 12.
    assert saved["optimizer/loss_scale/dynamic_scale"] == 2.0 ** 14
    assert int(saved[counter + "auto_step"]) == 11 and int(saved[counter + "auto_calls"]) == 12
    comm = r["skip"]["comm"]
    raw, total = comm["bytes_uncompressed_per_step"], int(saved[counter + "auto_bytes_total"])
    # The exact start's 10 steps and the skipped one sent fp32, the 12th its factors.
    assert 11 * raw < total < 12 * raw, (total, raw)
    assert comm["bytes_on_wire_per_step"] == pytest.approx(total / 12), comm


class _Stage:
    """A pipeline stage's `auto` reduction as `mesh_comm_stats` reads it."""

    def __init__(self, r_budget, ranks):
        self.r_budget, self._ranks = r_budget, ranks

    def ranks(self):
        return self._ranks

    def comm_stats(self):
        return {"bytes_on_wire_per_step": 10, "bytes_uncompressed_per_step": 40}


def test_a_pipelines_auto_reports_each_stages_budget():
    from types import SimpleNamespace

    from tfpar.backends.dtensor import mesh_comm_stats
    stages = [_Stage(4, {"dense_0/kernel": 4}), _Stage(None, {"logits/kernel": 0})]
    comm = mesh_comm_stats(SimpleNamespace(reductions=stages))
    assert comm["auto"] == {"r_budget": 4, "r_budget_per_stage": [4, None],
                            "ranks": {"dense_0/kernel": 4, "logits/kernel": 0}}, comm
    assert comm["compression_ratio"] == 4.0
    one = mesh_comm_stats(SimpleNamespace(reductions=stages[:1]))
    assert "r_budget_per_stage" not in one["auto"], one  # one stage: `r_budget` says it
