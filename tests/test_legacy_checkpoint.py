"""`--keras=2` checkpoints: stopped at step 4 of 8 and resumed, a tf_keras run equals the
uninterrupted one, and its checkpoint resumes a Keras 3 run of the same model.

The runs (`python -m tfpar.train`, 2 replicas, Adam, int8 with error feedback, so the
checkpoint holds Adam's slots, the step and the aggregator's residuals; 3 steps an epoch,
so the resume starts inside an epoch):
- tf_keras, 8 steps, no checkpoint;
- tf_keras, 4 steps, a checkpoint at step 4; then the same directory with `--steps=8`;
- Keras 3, `--steps=8`, on a copy of that directory at step 4.

Asserted: the resumed losses are the uninterrupted run's bit for bit (measured so on
2026-12-05); the Keras 3 run resumes at step 4 and its 4 losses are the tf_keras resume's
within 1e-6 (measured bit-equal: the same weights, slots, learning rate and residuals give
the same steps; tf_keras's `m`/`v` slots are saved as Keras 3's `momentum`/`velocity`).
"""

import json
import shutil

import pytest

from subproc import run_concurrently, run_module

FLAGS = ("--model=mlp", "--optimizer=adam", "--global_batch_size=32", "--steps_per_epoch=3",
         "--cpu_devices=2", "--compression=int8", "--verbose=0")


def _train(tmp_path, name, *args):
    """The metrics JSON of `python -m tfpar.train FLAGS ARGS`."""
    path = tmp_path / f"{name}.json"
    run_module("tfpar.train", *FLAGS, *args, f"--metrics_json={path}", timeout=240)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("legacy_ckpt")
    ckpt, copy = tmp / "ckpt", tmp / "ckpt_keras3"
    full, half = run_concurrently([
        lambda: _train(tmp, "full", "--keras=2", "--steps=8"),
        lambda: _train(tmp, "half", "--keras=2", "--steps=4", f"--checkpoint_dir={ckpt}",
                       "--checkpoint_every=4")])
    shutil.copytree(ckpt, copy)
    resumed, keras3 = run_concurrently([
        lambda: _train(tmp, "resumed", "--keras=2", "--steps=8", f"--checkpoint_dir={ckpt}",
                       "--checkpoint_every=4"),
        lambda: _train(tmp, "keras3", "--keras=3", "--steps=8", f"--checkpoint_dir={copy}",
                       "--checkpoint_every=4")])
    return {"full": full, "half": half, "resumed": resumed, "keras3": keras3}


def test_resumed_keras2_run_equals_the_uninterrupted_one(runs):
    assert runs["resumed"]["resumed_from_step"] == 4
    assert runs["half"]["loss_history"] == runs["full"]["loss_history"][:4]
    assert runs["resumed"]["loss_history"] == runs["full"]["loss_history"][4:]


def test_keras2_checkpoint_resumes_a_keras3_run(runs):
    assert runs["keras3"]["resumed_from_step"] == 4
    assert runs["keras3"]["loss_history"] == pytest.approx(runs["resumed"]["loss_history"],
                                                           abs=1e-6)
