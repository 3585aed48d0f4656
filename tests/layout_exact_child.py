"""Child process for tests/test_layout_exact.py:
`python tests/layout_exact_child.py MODEL RUNS_JSON`.

MODEL is `mlp` or `transformer`; RUNS_JSON a list of `[optimizer, dp, tp, zero]`. On 4
logical CPUs: the single-device reference per optimizer (Keras's optimizer on a plain model,
dense gradients) and each mesh run of 5 steps, then a plain variable in the step and a model
built outside the mesh's scope, both refused. Prints one JSON line: each run's largest
weight difference, shard sizes and slot layouts.
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
from tfpar.errors import TfparError  # noqa: E402

MODEL = sys.argv[1]
RUNS = json.loads(sys.argv[2])
if MODEL == "transformer":
    task = data.reverse_task(0, vocab=19)   # 20 classes: the vocabulary splits over 4
    # one block: every layer kind and preset rule (a second block repeats the same layouts)
    build_model = lambda: models.transformer(task.input_shape, task.num_classes, width=32,
                                             depth=1)
else:
    task = data.teacher_task(0)
    build_model = lambda: models.mlp(task.input_shape, task.num_classes, width=64)
batches = data.global_batches(ParallelConfig(model=MODEL, global_batch_size=8), task, 0, 5)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1),
              "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(1e-3)}

def seeded(fn):
    keras.utils.set_random_seed(0)
    return fn()

def reference(opt_name):
    model, opt = seeded(build_model), OPTIMIZERS[opt_name]()
    grads_out = {}
    @tf.function
    def step(x, y, w=None):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True), w)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(value, model.trainable_variables)]
        opt.apply(grads, model.trainable_variables)
        return grads
    for i, batch in enumerate(batches):
        grads = step(*batch)
        if i == 0:
            grads_out = {v.path: float(np.max(np.abs(g)))
                         for v, g in zip(model.trainable_variables, grads)}
    return {v.path: v.numpy() for v in model.weights}, grads_out

def slot_layouts(model, optimizer):
    # (slot, weight, same layout?) for every optimizer slot, matched by name.
    by_name = {w.path.replace("/", "_"): w for w in model.trainable_variables}
    out = []
    for slot in optimizer.variables:
        names = [n for n in by_name if slot.name.startswith(n + "_")]
        if names:
            weight = by_name[max(names, key=len)]
            out.append([slot.path, weight.path, list(slot.value.layout.sharding_specs),
                        list(weight.value.layout.sharding_specs)])
    return out

rules = layout.preset_rules(layout.model_presets(MODEL))
out = {"runs": [], "first_grad_max": {}}
refs = {}
for opt_name, dp, tp, zero in RUNS:
    if opt_name not in refs:
        refs[opt_name], out["first_grad_max"][opt_name] = reference(opt_name)
    mesh = layout.make_mesh(dp, tp, devices.compute_devices()[:dp * tp])
    model, trainer = layout.build_on_mesh(mesh, rules, lambda: seeded(build_model),
                                          OPTIMIZERS[opt_name], loss,
                                          shard_optimizer_state=zero)
    losses = [trainer.train_on_batch(*b)["loss"] for b in batches]
    diffs = {v.path: float(np.max(np.abs(layout.to_host(v.value) - refs[opt_name][v.path])))
             for v in model.weights}
    sharded = [v for v in model.weights if any(a is not None for a in v._layout.axes)]
    per_device = layout.shard_sizes(model.weights)
    out["runs"].append({
        "optimizer": opt_name, "mesh": [dp, tp], "zero": zero, "diffs": diffs,
        "losses": losses,
        "slot_per_device": layout.shard_sizes(
            [v for v in trainer.optimizer.variables if len(v.shape)]),
        "iterations": int(layout.to_host(trainer.optimizer.iterations.value)),
        "per_device": per_device,
        "sharded_total": int(sum(np.prod(v.shape) for v in sharded)),
        "sharded_per_device": layout.shard_sizes(sharded),
        "total": int(sum(np.prod(v.shape) for v in model.weights)),
        "slot_layouts": slot_layouts(model, trainer.optimizer),
        "scalars": {v.path: list(v.value.layout.sharding_specs) for v in trainer.optimizer.variables
                    if len(v.shape) == 0},
    })

# A plain variable the step touches is refused before anything runs.
mesh = layout.make_mesh(1, 2, devices.compute_devices()[:2])
model, trainer = layout.build_on_mesh(mesh, rules, lambda: seeded(build_model),
                                      OPTIMIZERS["sgd"], loss)
plain = tf.Variable(1.0, name="plain_scale")
original_call = model.call
model.call = lambda *a, **k: original_call(*a, **k) * plain
try:
    trainer_with_plain = layout.MeshTrainer(mesh, model, trainer.optimizer, loss)
    trainer_with_plain.train_on_batch(*batches[0])
    out["plain_refused"] = None
except TfparError as err:
    out["plain_refused"] = str(err)
model.call = original_call
# A model built outside the scope is refused too.
outside = seeded(build_model)
try:
    layout.MeshTrainer(mesh, outside, trainer.optimizer, loss)
    out["outside_refused"] = None
except TfparError as err:
    out["outside_refused"] = str(err)
print(json.dumps(out))
