"""Data-parallel training against the single-device run, accumulation, resume, the CLI.

Every run happens in a child process (one strategy per process, bounded by a timeout).
Tolerances: 1e-6 after 5 steps (5e-6 for the convnet), float re-association of the
all-reduce sum only. Adam on the transformer is not compared element-wise: its update g/(sqrt(v)+eps)
turns the ~1e-9 reordering noise of gradients that are nearly zero (e.g. where softmax is
shift-invariant) into steps of ±lr, measured up to 3e-3 after 10 steps while the loss
agrees to 2e-3; Adam is compared on the MLP, whose gradients are not near zero, at 1e-6.
"""

import json
import os
import sys

import numpy as np
import pytest

from tfpar import ParallelConfig
import subproc
from subproc import ROOT, last_json_line, run, run_module

CHILD = os.path.join(ROOT, "tests", "train_child.py")
RUNS_CHILD = os.path.join(ROOT, "tests", "train_runs_child.py")
BASE = {"steps": 5, "steps_per_epoch": 5, "verbose": 0, "global_batch_size": 32}


def train_child(tmp_path, name, env=None, **config):
    prefix = str(tmp_path / name)
    out = run([sys.executable, CHILD, json.dumps({**BASE, **config}), prefix], env=env,
              timeout=240)
    return last_json_line(out.stdout), prefix


def train_runs(tmp_path, runs):
    """Several runs in one child (tests/train_runs_child.py): {name: summary}, and
    `prefix_<name>` for `weights`. A run is `[name, config]` or `[name, config, options]`
    (the child's options, e.g. `{"graft": [step, checkpoint]}`)."""
    prefix = str(tmp_path / "run")
    runs = [[n, {**BASE, **c}, *options] for n, c, *options in runs]
    out = run([sys.executable, RUNS_CHILD, json.dumps(runs), prefix], timeout=400)
    return last_json_line(out.stdout), prefix


def weights(prefix):
    data = np.load(prefix + ".npz")
    return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


MODELS = [
    ("mlp", "adam", 1e-3, 1e-6),
    ("transformer", "momentum", 0.05, 1e-6),
    # Convolution gradients sum over every pixel of every example: more re-association.
    ("convnet", "sgd", 0.05, 5e-6),
]
ACCUM = {"model": "mlp", "optimizer": "momentum", "learning_rate": 0.05, "steps": 3,
         "steps_per_epoch": 3}

# The resume test's runs; its uninterrupted run and its first part are in `on_4_cpus`.
RESUME = {"model": "mlp", "optimizer": "adam", "steps_per_epoch": 4, "checkpoint_every": 3}
# The refused-checkpoint test's first run: what `tfpar.train --checkpoint_dir=DIR --steps=2`
# trains (the flags' defaults), made in `on_4_cpus`.
DEFAULTS = ParallelConfig()
INCOMPATIBLE_BASE = {"strategy": "one_device", "steps": 2,
                     "global_batch_size": DEFAULTS.global_batch_size,
                     "steps_per_epoch": DEFAULTS.steps_per_epoch}


def runs_on_4_cpus(folder):
    """The single-device and 4-replica runs of the comparisons below; the resume test's
    first part and the refused-checkpoint test's first run write checkpoints into
    `folder` (a fresh process resumes or is refused: runs in one child save the starts of
    two processes)."""
    runs = []
    for model, optimizer, lr, _ in MODELS:
        cfg = {"model": model, "optimizer": optimizer, "learning_rate": lr,
               **({"model_depth": 1} if model == "transformer" else {})}  # one block will do
        runs += [[f"one_{model}", {**cfg, "strategy": "one_device"}],
                 [f"four_{model}", {**cfg, "strategy": "mirrored", "cpu_devices": 4}]]
    runs += [["full", {**RESUME, "strategy": "one_device", "steps": 10}],
             ["first", {**RESUME, "strategy": "one_device", "steps": 6,
                        "checkpoint_dir": str(folder / "resume_ckpt")}],
             ["incompatible_base", {**INCOMPATIBLE_BASE,
                                    "checkpoint_dir": str(folder / "incompatible_ckpt")}]]
    runs += [["big", {**ACCUM, "strategy": "one_device", "global_batch_size": 64}],
             ["acc", {**ACCUM, "strategy": "mirrored", "cpu_devices": 4,
                      "global_batch_size": 16, "grad_accum_steps": 4}]]
    return runs


# Mixed precision on 2 replicas against one device (SGD: an update linear in the gradient,
# whose rounding differences Adam would normalise), 5 steps of `BASE`.
MIXED = {"model": "mlp", "optimizer": "sgd", "learning_rate": 0.1}
# Each replica rounds its half batch's activations and gradients to 16 bits where one
# device rounds the whole batch's: the runs differ by the precision's rounding, as the
# mesh's mixed-precision runs do against one device; the tolerance is theirs
# (tests/test_layout_compose.py, tests/test_layout_pipeline.py).
MIXED_TOLERANCE = 1e-2


def runs_on_2_cpus():
    """float32, bf16 and fp16 runs and the --measure_comm run; `again` repeats `fp32` on
    the strategy `fp32` made (`train(runtime=...)`); `MIXED` in bf16 and fp16 on both
    replicas (`dp_…`) and on one device (`one_…`, and `one_none` in float32)."""
    cfg = {"model": "mlp", "steps": 60, "steps_per_epoch": 60, "cpu_devices": 2,
           "strategy": "mirrored"}
    return [["fp32", cfg], ["again", cfg], ["bf16", {**cfg, "mixed_precision": "bf16"}],
            ["fp16", {**cfg, "mixed_precision": "fp16"}],
            ["comm", {"model": "mlp", "strategy": "mirrored", "cpu_devices": 2, "steps": 3,
                      "steps_per_epoch": 3, "compression": "fp16", "measure_comm": True}]
            ] + [[f"{where}_{precision}", {**MIXED, "mixed_precision": precision, **strategy}]
                 for precision in ("bf16", "fp16", "none")
                 for where, strategy in (("one", {"strategy": "one_device"}),
                                         ("dp", {"strategy": "mirrored", "cpu_devices": 2}))
                 if (where, precision) != ("dp", "none")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both children at once (4 and 2 logical CPUs: one split per process).

    The folders are made before the threads start: a worker's first `mktemp` (re)creates
    pytest's base folder, so two first calls at once can delete each other's folder."""
    on_4, on_2 = tmp_path_factory.mktemp("on_4_cpus"), tmp_path_factory.mktemp("on_2_cpus")
    return subproc.run_concurrently([lambda: train_runs(on_4, runs_on_4_cpus(on_4)),
                                     lambda: train_runs(on_2, runs_on_2_cpus())])


@pytest.fixture(scope="module")
def on_4_cpus(trained):
    return trained[0]


@pytest.fixture(scope="module")
def on_2_cpus(trained):
    return trained[1][0]


@pytest.fixture(scope="module")
def on_2_cpus_prefix(trained):
    return trained[1][1]


@pytest.mark.parametrize("model,optimizer,lr,tolerance", MODELS)
def test_mirrored_on_4_devices_equals_one_device(on_4_cpus, model, optimizer, lr, tolerance,
                                                 report_measured):
    out, prefix = on_4_cpus
    one, four = out[f"one_{model}"], out[f"four_{model}"]
    assert (one["replicas"], four["replicas"]) == (1, 4)
    assert four["strategy"] == "MirroredStrategy"
    diff = max_diff(weights(f"{prefix}_one_{model}"), weights(f"{prefix}_four_{model}"))
    report_measured(f"train: {model} 4 replicas vs one device, max |dw| = {diff:.2e}")
    assert diff < tolerance
    assert abs(one["final_loss"] - four["final_loss"]) < 1e-5


def test_grad_accumulation_equals_the_larger_batch(on_4_cpus):
    out, prefix = on_4_cpus
    big, acc = out["big"], out["acc"]
    assert acc["steps"] == big["steps"] == 3
    assert max_diff(weights(f"{prefix}_big"), weights(f"{prefix}_acc")) < 1e-6
    np.testing.assert_allclose(acc["loss_history"], big["loss_history"], rtol=1e-5)


def test_resume_continues_at_the_saved_step(tmp_path, on_4_cpus):
    cfg = RESUME
    full, pf = on_4_cpus[0]["full"], f"{on_4_cpus[1]}_full"  # uninterrupted, 10 steps
    ckpt = os.path.join(os.path.dirname(on_4_cpus[1]), "resume_ckpt")
    first = on_4_cpus[0]["first"]  # 6 steps, saved to ckpt
    assert first["resumed_from_step"] == 0
    rest, pr = train_child(tmp_path, "rest", steps=10, checkpoint_dir=ckpt, **cfg)
    assert rest["resumed_from_step"] == 6
    assert rest["steps"] == 4  # only the missing steps ran
    # The same replicas, weights, Adam slots and data position: the same numbers.
    assert max_diff(weights(pf), weights(pr)) == 0
    np.testing.assert_array_equal(rest["loss_history"], full["loss_history"][6:])


def test_no_flag_default_run_learns(cli_runs):
    out, path = cli_runs["default"], cli_runs["default_metrics"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tfpar: strategy=" in out.stdout
    metrics = json.loads(path.read_text())
    losses = metrics["loss_history"]
    assert metrics["steps"] == 200 and len(losses) == 200
    assert np.mean(losses[-20:]) < 0.6 * np.mean(losses[:20])
    for key in ("config", "strategy", "replicas", "workers", "final_loss", "examples_per_sec",
                "step_time_ms", "memory"):
        assert key in metrics


def test_user_dataset_its_held_out_batches_and_tensorboard(cli_runs):
    out, path, logs = cli_runs["user"], cli_runs["user_metrics"], cli_runs["user_logs"]
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads(path.read_text())
    assert metrics["replicas"] == 2
    # The module's own `sign_of_sum_validation` batches, evaluated at both epochs' ends (a
    # module without one is refused: tests/test_validation.py).
    validation = metrics["validation"]
    assert len(validation["loss_history"]) == 2 and validation["batches"] == 2
    assert np.mean(metrics["loss_history"][-10:]) < 0.5 * metrics["loss_history"][0]
    events = [os.path.join(d, f) for d, _, files in os.walk(logs) for f in files
              if "tfevents" in f]
    assert any("epoch_loss" in open(e, "rb").read().decode("latin-1") for e in events)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_like_float32(on_2_cpus, precision):
    full, mixed = on_2_cpus["fp32"], on_2_cpus[precision]
    assert mixed["final_loss"] < 0.75 * mixed["loss_history"][0]
    # Same seed and data: half precision changes the trajectory only a little.
    assert abs(mixed["final_loss"] - full["final_loss"]) < 0.05 * full["final_loss"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_2_replicas_equals_one_device(on_2_cpus, on_2_cpus_prefix,
                                                         precision, report_measured):
    # Same seed and batches; fp16 with Keras's dynamic loss scaling on both.
    dp, one = on_2_cpus[f"dp_{precision}"], on_2_cpus[f"one_{precision}"]
    assert (dp["replicas"], one["replicas"]) == (2, 1)
    dp_w, one_w, fp32_w = (weights(f"{on_2_cpus_prefix}_{name}") for name in (
        f"dp_{precision}", f"one_{precision}", "one_none"))
    diff = max_diff(dp_w, one_w)
    assert diff < MIXED_TOLERANCE, diff
    np.testing.assert_allclose(dp["loss_history"], one["loss_history"], rtol=1e-2)
    # The bound is loose next to the precision's own effect (one device, mixed against
    # float32: its largest entries are as large as the runs' difference), so also: on
    # average over the weights, splitting the batch moved them less than the precision.
    split, precision_moved = mean_diff(dp_w, one_w), mean_diff(fp32_w, one_w)
    report_measured(f"mlp {precision}, 2 replicas vs one device, 5 SGD steps: weights max "
                    f"{diff:.1e}, mean {split:.1e}; one device {precision} vs float32: max "
                    f"{max_diff(fp32_w, one_w):.1e}, mean {precision_moved:.1e}")
    assert split < precision_moved, (split, precision_moved)


def mean_diff(a, b):
    return float(np.mean(np.concatenate([np.abs(x - y).ravel() for x, y in zip(a, b)])))


def test_two_workers_end_identical_and_equal_one_device(tmp_path, on_4_cpus):
    cfg = {"model": "mlp", "optimizer": "adam", "cpu_devices": 2}
    # The single-device reference: MODELS' mlp run (adam at the default 1e-3).
    assert MODELS[0][:3] == ("mlp", "adam", ParallelConfig().learning_rate)
    p1 = f"{on_4_cpus[1]}_one_mlp"
    prefix = str(tmp_path / "mw")
    out = run_module("tfpar.launch", "--workers=2", "--timeout=200", "--", sys.executable,
                     CHILD, json.dumps({**BASE, **cfg, "strategy": "multi_worker"}), prefix,
                     timeout=240)
    lines = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines()
             if "] {" in line]
    assert [r["workers"] for r in lines] == [2, 2]
    assert [r["replicas"] for r in lines] == [4, 4]  # 2 logical CPUs on each worker
    w0, w1 = weights(prefix + ".worker0"), weights(prefix + ".worker1")
    assert max_diff(w0, w1) == 0.0
    assert max_diff(w0, weights(p1)) < 1e-6


def test_launch_cli_writes_metrics_with_two_workers(tmp_path):
    path = tmp_path / "m.json"
    run_module("tfpar.launch", "--workers=2", "--timeout=200", "--", sys.executable, "-m",
               "tfpar.train", "--strategy=multi_worker", f"--metrics_json={path}",
               "--steps=20", "--verbose=0", timeout=240)
    metrics = json.loads(path.read_text())
    assert metrics["workers"] == 2 and metrics["replicas"] == 2
    assert metrics["final_loss"] < metrics["loss_history"][0]


def error_line(out):
    """The one `tfpar: error:` line of a failed CLI run (no traceback, no second line)."""
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("tfpar: error:")]
    assert len(errors) == 1, out.stderr[-2000:]
    return errors[0]


BAD_TF_CONFIGS = [
    ("{not json", "TF_CONFIG"),
    ('{"cluster": {"worker": ["localhost:1", "localhost:2"]}}', "TF_CONFIG.task"),
    ('{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}}',
     "TF_CONFIG.task.index"),
    ('{"cluster": {"worker": ["localhost:1", "localhost:1"]}, '
     '"task": {"type": "worker", "index": 0}}', "TF_CONFIG.cluster.worker"),
    ('{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}',
     "TF_CONFIG.cluster.worker[0]"),
]
# Any batch splits over data-parallel replicas, a pipeline's too (tests/test_uneven_batch.py,
# test_pipeline_uneven_batch.py); its micro-batches must still divide the global batch.
BAD_SETTINGS = [("--cpu_devices=4", "--pipeline_stages=2", "--microbatches=4",
                 "--global_batch_size=30", "--steps=1"),
                ("--collective=nccl", "--steps=1"), ("--steps=0",)]


def _unused_ports(count):
    import socket
    ports = []
    for _ in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, on_4_cpus):
    """Every CLI run of this file, through one child (`subproc.run_cli_cases`: one
    TensorFlow import, a process forked per run, two at a time): {key: its
    CompletedProcess}, and what the tests check around them.

    Keys: "default" (no flag but --metrics_json) and "user" (a user's dataset module with
    held-out batches, TensorBoard logs), which must train; each bad TF_CONFIG and bad
    setting; "foreign" (a checkpoint_dir holding a user's file); "peer" (worker 0 of a
    2-worker cluster whose worker 1 never starts); "incompatible" (the checkpoint of
    `--checkpoint_dir=DIR --steps=2`, trained in on_4_cpus, resumed with another model
    width and optimizer), which must fail. The child has tests/ on its path (the user's
    dataset module, tests/user_data.py)."""
    folder = tmp_path_factory.mktemp("cli")
    foreign = tmp_path_factory.mktemp("foreign")
    (foreign / "precious.txt").write_text("mine")
    incompatible = os.path.join(os.path.dirname(on_4_cpus[1]), "incompatible_ckpt")
    lonely = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in _unused_ports(2)]},
                         "task": {"type": "worker", "index": 0}})
    cases = ([("default", (f"--metrics_json={folder / 'default.json'}", "--verbose=0"), None),
              ("user", ("--dataset=user_data:sign_of_sum", "--num_classes=2",
                        "--cpu_devices=2", "--steps=60", "--steps_per_epoch=30",
                        "--learning_rate=0.01", "--validation_steps=2",
                        f"--metrics_json={folder / 'user.json'}",
                        f"--tensorboard_dir={folder / 'tb'}", "--verbose=0"), None)]
             + [(tf_config, ("--steps=1",), {"TF_CONFIG": tf_config})
                for tf_config, _ in BAD_TF_CONFIGS]
             + [(args, args, None) for args in BAD_SETTINGS]
             + [("foreign", (f"--checkpoint_dir={foreign}", "--steps=2"), None),
                ("peer", ("--startup_timeout_s=8", "--steps=1"), {"TF_CONFIG": lonely}),
                ("incompatible", (f"--checkpoint_dir={incompatible}", "--steps=4",
                                  "--model_width=32", "--optimizer=sgd"), None)])
    before = sorted(os.listdir(incompatible))
    outs = subproc.run_cli_cases([(args, env) for _, args, env in cases], timeout=400,
                                 env={"PYTHONPATH": os.path.join(ROOT, "tests")})
    return {**{key: out for (key, _, _), out in zip(cases, outs)},
            "default_metrics": folder / "default.json", "user_metrics": folder / "user.json",
            "user_logs": folder / "tb", "foreign_dir": foreign,
            "incompatible_dir": incompatible, "incompatible_before": before}


def test_a_bad_command_line_ends_before_tensorflow_loads():
    # `tfpar.train` checks flags, the config, TF_CONFIG and the strategy it contradicts
    # before importing TensorFlow (~5 CPU seconds): the error line comes at once.
    two_workers = json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                              "task": {"type": "worker", "index": 0}})
    out = run([sys.executable, os.path.join(ROOT, "tests", "train_before_tf_child.py"),
               "--steps=1", "--strategy=one_device"],
              env={"TF_CONFIG": two_workers}, timeout=60, fresh=True)
    assert last_json_line(out.stdout) == {"code": 2, "tensorflow": False}
    assert out.stderr.strip().splitlines()[-1] == (
        "tfpar: error: strategy='one_device' is invalid: TF_CONFIG names 2 workers; use "
        "--strategy=multi_worker or auto, or unset TF_CONFIG")


@pytest.mark.parametrize("tf_config,field", BAD_TF_CONFIGS)
def test_bad_tf_config_is_one_clear_error(cli_runs, tf_config, field):
    line = error_line(cli_runs[tf_config])
    assert field in line


def test_bad_settings_are_one_clear_error(cli_runs):
    line = error_line(cli_runs[BAD_SETTINGS[0]])
    assert "microbatches=4 is invalid: must divide global_batch_size=30" in line, line
    line = error_line(cli_runs[BAD_SETTINGS[1]])
    assert "collective='nccl'" in line and "ring" in line
    line = error_line(cli_runs[BAD_SETTINGS[2]])
    assert "--steps=0" in line and ">= 1" in line


def test_foreign_checkpoint_dir_is_refused_and_kept(cli_runs):
    folder = cli_runs["foreign_dir"]
    line = error_line(cli_runs["foreign"])
    assert "checkpoint_dir" in line and "precious.txt" in line
    assert (folder / "precious.txt").read_text() == "mine"
    assert sorted(os.listdir(folder)) == ["precious.txt"]


def test_a_peer_that_never_starts_fails_within_the_bound(cli_runs):
    out = cli_runs["peer"]
    line = error_line(out)
    assert out.seconds < 60
    assert "startup_timeout_s=8" in line


def test_checkpoint_of_an_incompatible_run_is_refused_with_what_differs(cli_runs):
    line = error_line(cli_runs["incompatible"])
    assert "model_width: saved 0, now 32" in line and "optimizer: saved 'adam', now 'sgd'" in line
    # nothing written over
    assert sorted(os.listdir(cli_runs["incompatible_dir"])) == \
        cli_runs["incompatible_before"]


def test_two_runs_in_one_process_share_the_strategy_and_repeat_exactly(on_2_cpus,
                                                                     on_2_cpus_prefix):
    # `train(runtime=...)` (tests/train_runs_child.py): a second run on the first run's
    # strategy (TensorFlow allows one per process) starts from the same seed, so it must
    # repeat the first bit for bit.
    first, second = on_2_cpus["fp32"], on_2_cpus["again"]
    assert first["strategy_object"] == second["strategy_object"]
    assert [first["replicas"], second["replicas"]] == [2, 2]
    assert first["loss_history"] == second["loss_history"]
    assert first["loss_history"][-1] < first["loss_history"][0]
    assert max_diff(weights(f"{on_2_cpus_prefix}_fp32"),
                    weights(f"{on_2_cpus_prefix}_again")) == 0.0


def test_measure_comm_reports_share_and_overlap(on_2_cpus):
    comm = on_2_cpus["comm"]["comm"]
    assert comm["compression_ratio"] == 2.0
    # The trainer reports the shares the timing measured (their size is timing: planted
    # slow collectives and computations test it, tests/test_compression_timing.py).
    for key in ("comm_time_fraction", "overlap_fraction", "comm_fraction_unclamped",
                "overlap_fraction_unclamped"):
        assert isinstance(comm[key], float) and np.isfinite(comm[key]), (key, comm)
