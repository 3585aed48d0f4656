"""`fit` / `evaluate` / `predict` on a mesh, checkpoints across meshes, the train entry.

One child process (4 logical CPUs): a transformer (one block: every layer kind and layout
rule; a second block repeats them) trained on a 2×2 mesh is saved, restored onto 1×4 and
onto a plain single-device model (exactly), and training continues on 1×4 as it would have
on 2×2. The same child then runs the `python -m tfpar.train`
command line (`tfpar.train.run()`, in-process: one TensorFlow start for everything) and
resumes a run of the train entry from its checkpoint.
"""

import pytest

from subproc import last_json_line, run_module, run_python

CHILD = r"""
import json, os, sys
from tfpar import devices
devices.split_cpu(4)
import numpy as np, tensorflow as tf, keras
from tfpar import models
from tfpar import ParallelConfig, data, layout
from tfpar.train import train

task = data.reverse_task(0, vocab=19)
config = ParallelConfig(model="transformer", global_batch_size=16)
batches = data.global_batches(config, task, 0, 45)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
devs = devices.compute_devices()
out = {}

def build(seed, mesh):
    def model():
        keras.utils.set_random_seed(seed)
        return models.transformer(task.input_shape, task.num_classes, width=32, depth=1)
    return layout.build_on_mesh(mesh, layout.preset_rules(layout.model_presets("transformer")),
                                model, lambda: keras.optimizers.Adam(3e-3), loss)

def state(model, optimizer):
    # optimizer paths start with the optimizer's own name (adam, adam_1, ...)
    out = {v.path: layout.to_host(v.value) for v in model.weights}
    out.update({"optimizer/" + v.path.split("/", 1)[1]: layout.to_host(v.value)
                for v in optimizer.variables})
    return out

def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(a[k], "float64") - np.asarray(b[k], "float64"))))
               for k in a)

mesh22 = layout.make_mesh(2, 2, devs)
model, trainer = build(0, mesh22)
from tfpar.errors import TfparError
try:
    model.fit(batches[0][0], batches[0][1])
except TfparError as err:
    out["keras_fit_refused"] = str(err)
tf.config.run_functions_eagerly(True)
try:
    layout.MeshTrainer(mesh22, model, trainer.optimizer, loss)
except TfparError as err:
    out["run_eagerly_refused"] = str(err)
tf.config.run_functions_eagerly(False)
out["eval_before"] = trainer.evaluate(batches[40:45])
history = trainer.fit(batches[:40], epochs=4, steps_per_epoch=10)
out["history"] = history
out["eval_after"] = trainer.evaluate(batches[40:45])

# save on 2x2 after 40 steps
path = trainer.checkpoint().save(os.path.join(sys.argv[1], "ckpt"))
saved = state(model, trainer.optimizer)

# restore onto 1x4 (built from another seed, so nothing matches by accident)
mesh14 = layout.make_mesh(1, 4, devs)
model14, trainer14 = build(1, mesh14)
trainer14.checkpoint().restore(path).assert_existing_objects_matched()
out["restore_1x4"] = max_diff(saved, state(model14, trainer14.optimizer))

# restore onto a plain single-device model and stock optimizer
keras.utils.set_random_seed(2)
plain = models.transformer(task.input_shape, task.num_classes, width=32, depth=1)
plain_opt = keras.optimizers.Adam(3e-3)
plain_opt.build(plain.trainable_variables)
tf.train.Checkpoint(model=plain, optimizer=plain_opt).restore(path).assert_existing_objects_matched()
plain_state = {v.path: v.numpy() for v in plain.weights}
plain_state.update({"optimizer/" + v.path.split("/", 1)[1]: v.numpy() for v in plain_opt.variables})
out["restore_plain"] = max_diff(saved, plain_state)
out["plain_is_plain"] = not any(layout.is_dvariable(v) for v in plain.weights)

# predict on the mesh equals the plain model's predictions
x = batches[44][0]
out["predict_vs_plain"] = float(np.max(np.abs(trainer14.predict(x, batch_size=8)
                                               - plain.predict(x, verbose=0))))

# continue 2 steps on 2x2 and on the restored 1x4: same weights
for b in batches[40:42]:
    trainer.train_on_batch(*b)
    trainer14.train_on_batch(*b)
out["continue_2x2_vs_1x4"] = max_diff(state(model, trainer.optimizer),
                                      state(model14, trainer14.optimizer))

# save_weights on 1x4, load_weights on a fresh 2x2 model
written = trainer14.save_weights(os.path.join(sys.argv[1], "weights"))
model_w, trainer_w = build(3, mesh22)
trainer_w.load_weights(written)
out["weights_1x4_to_2x2"] = max_diff({v.path: layout.to_host(v.value) for v in model14.weights},
                                     {v.path: layout.to_host(v.value) for v in model_w.weights})

# the python -m tfpar.train command line (what tfpar-train runs), in this process: flags ->
# ParallelConfig -> train -> the summary line on stdout and the metrics JSON
import tfpar.train
sys.argv = [tfpar.train.__file__, "--model=transformer", "--model_depth=1",
            "--tensor_parallel=2", "--data_parallel=2", "--cpu_devices=4", "--steps=24",
            "--steps_per_epoch=8", "--global_batch_size=16", "--verbose=0",
            "--metrics_json=" + os.path.join(sys.argv[1], "metrics.json")]
try:
    tfpar.train.run()
except SystemExit as end:
    out["cli_exit"] = end.code
with open(os.path.join(sys.argv[1], "metrics.json")) as f:
    result = json.load(f)
out["train"] = {k: result[k] for k in ("steps", "final_loss", "loss_history", "memory",
                                       "strategy", "mesh")}
run_config = ParallelConfig(
    model="transformer", model_depth=1, tensor_parallel=2, data_parallel=2, cpu_devices=4,
    steps=24, steps_per_epoch=8, global_batch_size=16, verbose=0)
# stopped at step 12 with checkpoints, then resumed to 24: the same losses from step 12
resumable = run_config.replace(checkpoint_dir=os.path.join(sys.argv[1], "run"),
                               checkpoint_every=4, metrics_json="")
train(resumable.replace(steps=12))
resumed, _ = train(resumable)
out["resumed_from_step"] = resumed["resumed_from_step"]
out["resume_vs_uninterrupted"] = max(
    abs(a - b) for a, b in zip(resumed["loss_history"], result["loss_history"][12:]))
out["resumed_steps"] = len(resumed["loss_history"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("layout_fit"))
    out = run_python(CHILD.replace("sys.argv[1]", repr(directory)), timeout=400)
    found = last_json_line(out.stdout)
    found["dir"] = directory
    found["stdout"] = out.stdout
    return found


def test_fit_lowers_the_loss_and_evaluate_agrees(result):
    losses = result["history"]["loss"]
    assert len(losses) == 4
    assert losses[-1] < 0.8 * losses[0], losses
    assert result["eval_after"]["loss"] < 0.8 * result["eval_before"]["loss"]
    assert result["eval_after"]["accuracy"] > result["eval_before"]["accuracy"]


def test_keras_loops_and_run_eagerly_are_refused_clearly(result):
    assert "model.fit cannot run" in result["keras_fit_refused"]
    assert "MeshTrainer's fit" in result["keras_fit_refused"]
    assert "run_eagerly cannot work on a DTensor mesh" in result["run_eagerly_refused"]


def test_checkpoint_restores_across_meshes_exactly(result):
    assert result["restore_1x4"] == 0.0
    assert result["restore_plain"] == 0.0
    assert result["plain_is_plain"]
    assert result["continue_2x2_vs_1x4"] <= 1e-5
    assert result["weights_1x4_to_2x2"] == 0.0


def test_predict_matches_the_single_device_model(result):
    assert result["predict_vs_plain"] <= 1e-5


def test_cli_runs_tensor_parallel_and_writes_the_metrics_json(result):
    # `python -m tfpar.train --tensor_parallel=2 --data_parallel=2 --cpu_devices=4`, run
    # inside the fixture's child (tfpar.train.run(): the same flags, config and main).
    assert result["cli_exit"] in (0, None)
    line = [l for l in result["stdout"].splitlines() if l.startswith("tfpar: strategy=")]
    assert len(line) == 1 and "strategy=DTensorMesh" in line[0], result["stdout"][-2000:]
    train = result["train"]
    assert train["steps"] == 24 and train["mesh"] == {"data_parallel": 2,
                                                      "tensor_parallel": 2}
    assert train["strategy"] == "DTensorMesh"
    assert train["loss_history"][-1] < train["loss_history"][0]
    # 17 classes do not split over 2: embedding and head stay whole, the rest is halved.
    assert len(train["memory"]["params_per_device"]) == 4
    # the JSON holds the losses the command printed
    assert (f"loss {train['loss_history'][0]:.4f} -> {train['final_loss']:.4f}"
            in line[0]), (line, train["final_loss"])


def test_train_entry_resumes_from_its_checkpoint_exactly(result):
    assert result["resumed_from_step"] == 12 and result["resumed_steps"] == 12
    # The same mesh, weights, slots and data position: the same losses, bit for bit.
    assert result["resume_vs_uninterrupted"] == 0


def test_cli_refuses_degrees_that_do_not_match_the_devices():
    out = run_module("tfpar.train", "--model=transformer", "--tensor_parallel=2",
                     "--data_parallel=3", "--cpu_devices=4", "--steps=2", check=False,
                     timeout=120)
    assert out.returncode == 2
    assert "data_parallel=3" in out.stderr and "--cpu_devices=6" in out.stderr
