"""Child process for tests/test_layout_fit.py: `python tests/layout_fit_child.py DIR`.

On 4 logical CPUs: a one-block transformer fitted on a 2x2 mesh (Keras's `fit` and
`run_eagerly` refused), saved under DIR, restored onto 1x4 and onto a plain single-device
model, training continued on both meshes; then the `python -m tfpar.train` command line run
in this process (`tfpar.train.run()`) and a train-entry run resumed from its checkpoint.
Prints one JSON line of results.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar import devices  # noqa: E402
devices.split_cpu(4)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
from tfpar import models  # noqa: E402
from tfpar import ParallelConfig, data, layout  # noqa: E402
import tfpar.train  # noqa: E402
from tfpar.errors import TfparError  # noqa: E402
from tfpar.train import train  # noqa: E402

DIR = sys.argv[1]

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
path = trainer.checkpoint().save(os.path.join(DIR, "ckpt"))
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
written = trainer14.save_weights(os.path.join(DIR, "weights"))
model_w, trainer_w = build(3, mesh22)
trainer_w.load_weights(written)
out["weights_1x4_to_2x2"] = max_diff({v.path: layout.to_host(v.value) for v in model14.weights},
                                     {v.path: layout.to_host(v.value) for v in model_w.weights})

# the python -m tfpar.train command line (what tfpar-train runs), in this process: flags ->
# ParallelConfig -> train -> the summary line on stdout and the metrics JSON
sys.argv = [tfpar.train.__file__, "--model=transformer", "--model_depth=1",
            "--tensor_parallel=2", "--data_parallel=2", "--cpu_devices=4", "--steps=24",
            "--steps_per_epoch=8", "--global_batch_size=16", "--verbose=0",
            "--metrics_json=" + os.path.join(DIR, "metrics.json")]
try:
    tfpar.train.run()
except SystemExit as end:
    out["cli_exit"] = end.code
with open(os.path.join(DIR, "metrics.json")) as f:
    result = json.load(f)
out["train"] = {k: result[k] for k in ("steps", "final_loss", "loss_history", "memory",
                                       "strategy", "mesh")}
run_config = ParallelConfig(
    model="transformer", model_depth=1, tensor_parallel=2, data_parallel=2, cpu_devices=4,
    steps=24, steps_per_epoch=8, global_batch_size=16, verbose=0)
# stopped at step 12 with checkpoints, then resumed to 24: the same losses from step 12
resumable = run_config.replace(checkpoint_dir=os.path.join(DIR, "run"),
                               checkpoint_every=4, metrics_json="")
train(resumable.replace(steps=12))
resumed, _ = train(resumable)
out["resumed_from_step"] = resumed["resumed_from_step"]
out["resume_vs_uninterrupted"] = max(
    abs(a - b) for a, b in zip(resumed["loss_history"], result["loss_history"][12:]))
out["resumed_steps"] = len(resumed["loss_history"])
print(json.dumps(out))
