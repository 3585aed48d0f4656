"""Legacy Keras (`tf_keras`) through tfpar's data-parallel path, with tfmot pruning and QAT.

Each child process (tests/legacy_child.py) trains several configs on one strategy (one per process for
multi-worker) and reports them as one JSON line; weights go to `.npz` files. The two
children run at once; the CLI run is forked from the mirrored one (one TensorFlow import).

What is asserted (seed 0; the measured values of each run are shown in pytest's
"measured" summary, under `-q` too):
- `none` (tf_keras's own all-reduce): weights within 1e-6 of one device after 5 Adam steps
  (float re-association of the sum only); 2 workers bit-identical.
- int8 (lossy, through the tf_keras `aggregate_gradients` hook): more than 3.9× fewer bytes;
  final loss within 0.3 % of one device after 5 steps, weights within 1e-2 (Adam at lr
  1e-3 turns small quantization errors into ±lr steps); 2 workers give the mirrored run's
  numbers exactly (same 4 replicas, same codes).
- pruning to 75 % (PolynomialDecay, masks every 10 steps until step 30, 60 momentum-SGD
  steps): exported kernels 75 % zeros (±0.2 %); mean loss of the last 10 steps within 15 %
  of the unpruned run; 2 workers equal the mirrored run.
- QAT (60 steps): mean loss of the last 10 steps within 3 % of float training; the TFLite
  int8 model against the float model with the same weights on a held-out batch: mean
  |diff| < 1 % of the logits' range, max < 20 % (inputs beyond the learnt input range
  clip), argmax agreement >= 95 %.
- Every variable (weights, masks, quantization ranges) equal on all replicas.
"""

import json
import os
import sys

import numpy as np
import pytest

from subproc import ROOT, last_json_line, outcome, run, run_concurrently, run_module

CHILD = os.path.join(ROOT, "tests", "legacy_child.py")

BASE = {"model": "mlp", "steps": 5, "steps_per_epoch": 5, "global_batch_size": 32,
        "verbose": 0, "optimizer": "adam", "learning_rate": 1e-3}
LONG = {"steps": 60, "steps_per_epoch": 20, "optimizer": "momentum", "learning_rate": 0.05}
PRUNE = {**LONG, "prune_sparsity": 0.75, "prune_frequency": 10, "prune_end_step": 30}


def child(tmp_path, runs, cpus, workers=0, cli=None):
    """The child's reports (a list per worker under `workers`) and the weights' prefix;
    with `cli` (argv of `python -m tfpar.train`) also that command's
    `{"returncode", "stdout", "stderr"}`, run in a process forked from the child."""
    prefix = str(tmp_path / "w")
    cmd = [sys.executable, CHILD, json.dumps(runs), prefix, str(cpus)]
    if cli:
        both = last_json_line(run([*cmd, json.dumps(cli)], timeout=240).stdout)
        runs_done = both["runs"]
        assert runs_done["returncode"] == 0, runs_done["stderr"][-3000:]
        return last_json_line(runs_done["stdout"]), prefix, both["cli"]
    if workers:
        out = run_module("tfpar.launch", f"--workers={workers}", "--timeout=200", "--", *cmd,
                         timeout=240)
        lines = sorted(line for line in out.stdout.splitlines() if "] {" in line)  # "[worker i]"
        assert len(lines) == workers, out.stdout[-3000:]
        return [json.loads(line.split("] ", 1)[1]) for line in lines], prefix
    return last_json_line(run(cmd, timeout=240).stdout), prefix


def weights(prefix, name, worker=None):
    suffix = f".worker{worker}" if worker is not None else ""
    data = np.load(f"{prefix}_{name}{suffix}.npz")
    return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def _mirrored(tmp):
    """One device, then MirroredStrategy over 4 logical CPUs, in one process."""
    mirrored = {**BASE, "strategy": "mirrored", "cpu_devices": 4}
    runs = [
        ["one", {**BASE, "strategy": "one_device"}],
        ["none", mirrored],
        ["int8", {**mirrored, "compression": "int8"}],
        ["zeros", {**mirrored, "optimizer": "sgd", "learning_rate": 0.1, "compression": "int8"}],
        ["long", {**mirrored, **LONG}],
        ["pruned", {**mirrored, **PRUNE, "export_dir": str(tmp / "pruned")}],
        ["qat", {**mirrored, **LONG, "qat": True, "export_dir": str(tmp / "qat")}],
    ]
    # The CLI run: `python -m tfpar.train --keras=2` with an aggregator, forked from the
    # child after its one TensorFlow import.
    cli = ["--keras=2", "--cpu_devices=2", "--compression=int8", "--steps=30", "--verbose=0",
           f"--metrics_json={tmp / 'cli.json'}"]
    out, prefix, cli_done = child(tmp, runs, cpus=4, cli=cli)
    return out, prefix, cli_done, tmp / "cli.json"


def _two_workers(tmp):
    """MultiWorkerMirroredStrategy: 2 workers x 2 logical CPUs = 4 replicas."""
    mw = {**BASE, "strategy": "multi_worker", "cpu_devices": 2}
    runs = [["none", mw], ["int8", {**mw, "compression": "int8"}],
            ["pruned", {**mw, **PRUNE, "export_dir": str(tmp / "pruned")}]]
    return child(tmp, runs, cpus=2, workers=2)


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """The two children of this file at once (`run_concurrently`; neither checks timing); a
    failed child fails only the tests that read it."""
    # Folders first: a fresh xdist worker's first mktemp recreates its base folder, so
    # mktemp must not run in the threads (two first calls at once delete each other's).
    mirrored_dir, workers_dir = (tmp_path_factory.mktemp("mirrored"),
                                 tmp_path_factory.mktemp("workers"))
    mirrored, workers = run_concurrently(
        [lambda: _mirrored(mirrored_dir), lambda: _two_workers(workers_dir)],
        keep_failures=True)
    return {"mirrored": mirrored, "workers": workers}


@pytest.fixture(scope="module")
def mirrored(children):
    """(reports, weights prefix) of the one-device and mirrored runs."""
    return outcome(children["mirrored"])[:2]


@pytest.fixture(scope="module")
def two_workers(children):
    return outcome(children["workers"])


def test_mirrored_tf_keras_equals_one_device(mirrored, report_measured):
    out, prefix = mirrored
    one, none = out["one"], out["none"]
    assert (one["replicas"], none["replicas"]) == (1, 4)
    assert none["strategy"] == "MirroredStrategy"
    diff = max_diff(weights(prefix, "one"), weights(prefix, "none"))
    report_measured(f"tf_keras 4 mirrored vs 1 device, 5 Adam steps: max weight diff "
                    f"{diff:.2g} (asserted < 1e-6)")
    assert diff < 1e-6
    np.testing.assert_allclose(none["loss_history"], one["loss_history"], rtol=1e-5)
    assert none["comm"]["compression_ratio"] == 1.0
    assert none["replica_spread"] == 0.0


def test_mirrored_int8_aggregator_is_used_and_close(mirrored, report_measured):
    out, prefix = mirrored
    one, int8 = out["one"], out["int8"]
    gap = abs(int8["final_loss"] - one["final_loss"]) / one["final_loss"]
    report_measured(f"tf_keras int8 hook: {int8['comm']['compression_ratio']:.2f}x fewer bytes "
                    f"(asserted > 3.9), final loss {100 * gap:.2f} % from one device "
                    f"(asserted < 0.3 %)")
    assert int8["traced"] >= 4  # traced once per replica at least
    assert int8["comm"]["compression_ratio"] > 3.9
    assert int8["comm"]["bytes_uncompressed_per_step"] == one_model_bytes(prefix)
    assert abs(int8["final_loss"] - one["final_loss"]) < 3e-3 * one["final_loss"]
    assert 0 < max_diff(weights(prefix, "one"), weights(prefix, "int8")) < 1e-2


def tail_loss(report, n=10):
    """Mean of the last `n` batch losses (one batch's loss is noisy)."""
    return float(np.mean(report["loss_history"][-n:]))


def one_model_bytes(prefix):
    return 4 * sum(w.size for w in weights(prefix, "one"))


def test_tf_keras_optimizer_really_uses_the_aggregator(mirrored):
    # An aggregator that returns zero gradients freezes plain SGD.
    out, prefix = mirrored
    from tfpar.models import legacy as legacy_models
    zeros = out["zeros"]
    assert zeros["traced"] >= 4
    initial = [np.asarray(w) for w in legacy_models.build("mlp", (32,), 10).trainable_weights]
    assert max_diff(weights(prefix, "zeros"), initial) == 0.0


def test_two_workers_tf_keras_identical_and_equal_one_device(mirrored, two_workers):
    out, prefix = mirrored
    reports, mw = two_workers
    for name in ("none", "int8", "pruned"):
        assert [r[name]["workers"] for r in reports] == [2, 2]
        assert [r[name]["replicas"] for r in reports] == [4, 4]
        assert max_diff(weights(mw, name, 0), weights(mw, name, 1)) == 0.0
        assert [r[name]["replica_spread"] for r in reports] == [0.0, 0.0]
    assert max_diff(weights(mw, "none", 0), weights(prefix, "one")) < 1e-6
    np.testing.assert_allclose(reports[0]["none"]["loss_history"], out["one"]["loss_history"],
                               rtol=1e-5)
    # Same 4 replicas, same int8 codes: the lossy run matches the mirrored one.
    assert reports[0]["int8"]["traced"] >= 2
    assert abs(reports[0]["int8"]["final_loss"] - out["int8"]["final_loss"]) < 1e-5
    assert reports[0]["int8"]["comm"] == out["int8"]["comm"]


def test_pruning_reaches_the_sparsity_under_mirrored(mirrored, report_measured):
    out, prefix = mirrored
    pruned, dense = out["pruned"], out["long"]
    report_measured(f"tfmot pruning to 75 %: last-10-step loss {tail_loss(pruned):.3f} vs "
                    f"unpruned {tail_loss(dense):.3f} "
                    f"({100 * (tail_loss(pruned) / tail_loss(dense) - 1):+.1f} %, asserted "
                    f"< +15 %)")
    assert pruned["pruning"]["sparsity"] == pytest.approx(0.75, abs=1e-3)
    assert pruned["exported_zeros"] and all(
        z == pytest.approx(0.75, abs=2e-3) for z in pruned["exported_zeros"].values())
    assert tail_loss(pruned) < 1.15 * tail_loss(dense)
    assert tail_loss(pruned) < 0.8 * pruned["loss_history"][0]  # it still learns
    assert pruned["replica_spread"] == 0.0  # weights and masks equal on all replicas


def test_pruning_under_two_workers_matches_mirrored(mirrored, two_workers):
    out, prefix = mirrored
    reports, mw = two_workers
    pruned = reports[0]["pruned"]
    assert pruned["pruning"]["sparsity"] == pytest.approx(0.75, abs=1e-3)
    # Only the chief exports (worker 1 may finish before the file exists).
    assert all(z == pytest.approx(0.75, abs=2e-3) for z in pruned["exported_zeros"].values())
    # Masks are chosen from equal weights: the same zeros as the mirrored run.
    for a, b in zip(weights(mw, "pruned", 0), weights(prefix, "pruned")):
        assert np.array_equal(a == 0, b == 0) or a.ndim == 1
    assert max_diff(weights(mw, "pruned", 0), weights(prefix, "pruned")) < 1e-5


def test_qat_under_mirrored_exports_int8_close_to_float(mirrored, report_measured):
    out, _ = mirrored
    qat, dense = out["qat"], out["long"]
    assert qat["exported_files"] == ["model_float.keras", "model_int8.tflite"]
    stats = qat["qat"]
    report_measured(f"tfmot QAT: last-10-step loss {tail_loss(qat):.3f} vs float "
                    f"{tail_loss(dense):.3f} (asserted within 3 %); int8 TFLite vs float "
                    f"logits: mean |diff| {100 * stats['relative_mean_diff']:.2f} % of their "
                    f"range (< 1 %), max {100 * stats['relative_max_diff']:.1f} % (< 20 %), "
                    f"same class {100 * stats['argmax_agreement']:.0f} % (>= 95 %)")
    assert stats["relative_mean_diff"] < 0.01, stats
    assert stats["relative_max_diff"] < 0.2, stats  # inputs outside the learnt range clip
    assert stats["argmax_agreement"] >= 0.95, stats
    assert abs(tail_loss(qat) - tail_loss(dense)) < 0.03 * tail_loss(dense)
    # Ranges equal on all replicas (tfmot's input range alone would drift apart).
    assert qat["replica_spread"] == 0.0




def test_cli_trains_a_tf_keras_model_with_an_aggregator(children):
    _, _, out, path = outcome(children["mirrored"])
    assert out["returncode"] == 0, out["stderr"][-3000:]
    metrics = json.loads(path.read_text())
    assert metrics["keras"] == 2 and metrics["replicas"] == 2
    assert metrics["comm"]["compression_ratio"] > 3.5
    assert metrics["final_loss"] < metrics["loss_history"][0]
