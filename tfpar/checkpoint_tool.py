"""`tfpar-checkpoint` / `python -m tfpar.checkpoint_tool`: inspect a checkpoint, export it.

    python -m tfpar.checkpoint_tool inspect runs/ckpt
    python -m tfpar.checkpoint_tool export runs/ckpt --to=model.keras   # or .weights.h5

`inspect` prints the newest checkpoint's step, the layout that wrote it, the settings of the
directory's `tfpar.json` marker, its world sizes, what a codec's state holds
(`meta/residual_units`, `meta/adam_moments`, where saved), the writer's gradient
accumulation (`meta/accumulation`), then every state tensor
(`tfpar.state` names) with its shape, dtype and size. `export` builds the run's model on
one device from the marker's settings, loads the checkpoint's weights into it and saves
it with Keras (`model.save` or `model.save_weights`): stock Keras loads the file without
tfpar (for a `.keras` file, `keras.models.load_model`). Either takes a directory (its
newest checkpoint) or one checkpoint's prefix (`runs/ckpt/ckpt-200`).
"""

import json
import os
import sys

from absl import app, flags

from tfpar import flags as tfpar_flags
from tfpar.errors import ConfigError, TfparError

FLAGS = flags.FLAGS
_EXPORTS = (".keras", ".weights.h5")
# Keys of the checkpoint that are not training state: the object graph, the save count and
# the step (printed on its own line).
_BOOKKEEPING = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter", "step")


def define_flags():
    """The `--to` flag of `export` (defined by the entry point, not on import)."""
    flags.DEFINE_string("to", "", "export: the file to write, ending .keras or .weights.h5 "
                                  "(never overwritten).")
    tfpar_flags.declare_key_flags(["to"])  # listed by --help under the console script too


def resolve(path):
    """The checkpoint prefix `path` names (a directory: its newest). Raises ConfigError."""
    import tensorflow as tf
    prefix = tf.train.latest_checkpoint(path) if os.path.isdir(path) else path
    if not prefix or not tf.io.gfile.exists(prefix + ".index"):
        raise ConfigError("checkpoint", path, "a tfpar checkpoint directory (it holds a "
                                              "`checkpoint` file) or a prefix like DIR/ckpt-200")
    return prefix


def _marker(prefix):
    from tfpar import checkpoint
    try:
        with open(os.path.join(os.path.dirname(prefix), checkpoint.MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def inspect(path):
    """The lines `inspect` prints for checkpoint `path` (module docstring)."""
    import tensorflow as tf

    from tfpar import checkpoint, state
    prefix = resolve(path)
    reader = tf.train.load_checkpoint(prefix)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    step = reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") if reader.has_tensor(
        "step/.ATTRIBUTES/VARIABLE_VALUE") else None
    lines = [f"checkpoint: {prefix}", f"step: {step}",
             f"layout: {json.dumps(state.read_layout(prefix), sort_keys=True)}",
             f"settings: {json.dumps(_marker(prefix), sort_keys=True)}",
             f"world: {json.dumps(checkpoint.read_world(os.path.dirname(prefix)))}"]
    # What the codec state's rows hold; the writer's gradient accumulation.
    for meta in (state.UNITS, state.ADAM_UNITS, state.ACCUMULATION):
        if reader.has_tensor(state.key(meta)):
            value = reader.get_tensor(state.key(meta))
            lines.append(f"{meta}: {value.decode() if isinstance(value, bytes) else value}")
    rows, total = [], 0
    for key in sorted(shapes):
        if key.split("/")[0] in _BOOKKEEPING or state.name_of(key) in (
                state.LAYOUT, state.UNITS, state.ADAM_UNITS, state.ACCUMULATION):
            continue
        name = state.name_of(key) or key  # the aggregator's tensors keep TensorFlow's key
        size = int(dtypes[key].size * max(1, _count(shapes[key])))
        total += size
        rows.append(f"  {name}  {shapes[key]}  {dtypes[key].name}  {size} B")
    lines.append(f"tensors: {len(rows)}, {total} B")
    return lines + rows


def _count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def export(path, to):
    """Writes checkpoint `path`'s weights as a single-device Keras model to `to` (a
    `.keras` or `.weights.h5` file that does not exist yet); returns `to`."""
    if not to.endswith(_EXPORTS):
        raise ConfigError("to", to, "a file name ending .keras (the whole model) or "
                                    ".weights.h5 (its weights)")
    if os.path.exists(to):
        raise ConfigError("to", to, "exists; name a new file (nothing is overwritten)")
    prefix = resolve(path)
    settings = _marker(prefix)
    if settings.get("model") is None:
        raise ConfigError("checkpoint", path, "a directory with the tfpar.json marker its "
                                              "run wrote (it names the model to build)")
    from tfpar import ParallelConfig, data, models, state
    config = ParallelConfig(**{k: v for k, v in settings.items()
                               if v is not None and k in ("model", "model_width",
                                                          "model_depth", "dataset",
                                                          "num_classes", "seed")})
    task = data.make_task(config)
    model = models.build(config.model, task.input_shape, task.num_classes,
                         width=config.model_width, depth=config.model_depth)
    try:
        state.LayoutState(model).load(prefix, only="model/")
    except ValueError as err:
        raise ConfigError("checkpoint", path, f"does not hold this model's weights ({err})")
    if to.endswith(".keras"):
        model.save(to)
    else:
        model.save_weights(to)
    return to


def main(argv):
    commands = {"inspect": 2, "export": 2}
    if len(argv) != 3 or argv[1] not in commands:
        print("tfpar.checkpoint_tool: error: use `inspect DIR` or `export DIR "
              "--to=model.keras`", file=sys.stderr)
        sys.exit(2)
    try:
        if argv[1] == "inspect":
            print("\n".join(inspect(argv[2])))
        else:
            print(export(argv[2], FLAGS.to))
    except TfparError as err:
        print(f"tfpar: error: {err}", file=sys.stderr)
        sys.exit(2)


def run():
    """`tfpar-checkpoint` / `python -m tfpar.checkpoint_tool`."""
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
