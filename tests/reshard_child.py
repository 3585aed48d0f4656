"""Child process for tests: `python tests/reshard_child.py RUNS_JSON OUT_PREFIX`.

Trains several configs one after the other in one process (one CPU split): RUNS_JSON is
`{"cpu_devices": N, "runs": [[name, config, options], ...]}`. Options:

- `{"from": DIR, "at": STEP}`: first copies checkpoint directory DIR (another layout's)
  to the run's `checkpoint_dir`, then loads it without training (`steps=STEP`) and
  records how the state landed: `load_diff`, the largest difference between every state
  tensor of DIR's checkpoint and the same tensor read back from this layout's variables
  (`tfpar.state` names); `placement`, each weight's place (a DTensor's mesh axes and
  sharding specs, or its devices); `residual_sums`, per error-feedback residual, what this
  layout's rows owe the summed gradient minus what the saved rows owed, the saved rows' largest
  magnitude and count (and `residual_rows`, this layout's replica count; `old_form_names`,
  how many names it read from an older checkpoint's aggregator objects); `predictions`,
  on a Keras model (not a mesh), its `predict` of 8 inputs drawn with numpy's
  `default_rng(0)`; then trains the config (resuming at STEP).
  With `"new_marker": true` the copy's `tfpar.json` marker is written anew for this
  run (the marker refuses another `--compression`; the Python API, `LayoutState.load`,
  has none). With `"landing": false` the load-only pass (and its record) is skipped: the
  run's own training loads DIR's checkpoint. With `"resave": true` the load-only pass
  then writes this layout's state (`tfpar.state.LayoutState`) over the copy's newest
  checkpoint, taking no step: a checkpoint as this layout writes it, for another run's
  `from`.
- none: trains the config as it is (a run that writes, or the uninterrupted reference).

Runs with the same backend and degrees share one runtime (`tfpar.train.train(runtime=)`;
a `one_device` strategy one of its own). Each run records its `seconds`.
Saves each run's final state to `OUT_PREFIX_<name>.npz` (`tfpar.state` names, `/` as
`|`) and prints one JSON line `{name: {"loss_history", "resumed_from_step", ...}}`.
"""

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import graph_optimizer  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import ParallelConfig, devices  # noqa: E402


def main():
    spec, prefix = json.loads(sys.argv[1]), sys.argv[2]
    graph_optimizer.apply()  # the test's choice (tests/graph_optimizer.py)
    devices.split_cpu(spec["cpu_devices"])
    import keras
    from tfpar import backends
    from tfpar.train import train
    runtimes, out = {}, {}
    for name, settings, options in spec["runs"]:
        print(f"run {name}: {settings} {options}", file=sys.stderr, flush=True)
        start = time.monotonic()
        config = ParallelConfig(**settings)
        keras.mixed_precision.set_global_policy("float32")
        key = (config.keras, config.strategy == "one_device", config.data_parallel,
               config.tensor_parallel, config.pipeline_stages, config.zero_stage == 3)
        if key not in runtimes:
            runtimes[key] = backends.for_config(config).build_runtime(config)
        runtime = runtimes[key]
        out[name] = {}
        if "from" in options:
            shutil.copytree(options["from"], config.checkpoint_dir)
            if options.get("new_marker"):
                from tfpar import checkpoint
                os.remove(os.path.join(config.checkpoint_dir, checkpoint.MARKER))
                checkpoint.write_marker(config)
            if options.get("landing", True):
                _, model = train(config.replace(steps=options["at"]), runtime=runtime)
                out[name].update(landing(model, options["from"]))
                if options.get("resave"):
                    resave(model, config, runtime, options["at"])
        result, model = train(config, runtime=runtime)
        out[name].update({k: result[k] for k in ("loss_history", "resumed_from_step",
                                                 "replicas")})
        out[name]["learning_rate"] = config.scaled_learning_rate
        out[name]["seconds"] = round(time.monotonic() - start, 1)  # for a test's cost
        out[name]["grappler"] = graph_optimizer.setting()
        from tfpar import state
        values = {n: e[0]() for n, e in state.LayoutState(model).entries().items()}
        np.savez(f"{prefix}_{name}.npz", **{n.replace("/", "|"): v for n, v in values.items()})
    print(json.dumps(out), flush=True)


def resave(model, config, runtime, step):
    """Writes `model`'s state over the newest checkpoint of `config.checkpoint_dir` (as its
    `tfpar.checkpoint.Checkpointer` saves it: the state, the step, the manifest)."""
    import tensorflow as tf

    from tfpar import checkpoint_writer, state
    prefix = tf.train.latest_checkpoint(config.checkpoint_dir)
    layout_state = state.LayoutState(model, state.layout_of(config, runtime))
    written = tf.train.Checkpoint(state=layout_state, step=tf.Variable(step, dtype=tf.int64))
    written.save_counter.assign(1)  # made on first use; the manager's saves hold it
    written.write(prefix)
    checkpoint_writer.write_manifest(prefix)


def landing(model, directory):
    """How checkpoint `directory`'s state landed in `model`'s layout (module docstring)."""
    import tensorflow as tf

    from tfpar import state
    path = tf.train.latest_checkpoint(directory)
    saved = state.tensors_of(path)
    entries = state.LayoutState(model).entries()
    out = {"loaded": len([n for n in entries if n in saved]),
           "placement": {w.path: _placement(w) for w in model.weights}}
    if not any("specs" in p for p in out["placement"].values()):
        # What the loaded model predicts (Keras's own predict, one device or a strategy).
        x = np.random.default_rng(0).normal(size=(8, *model.input_shape[1:]))
        out["predictions"] = model.predict(x.astype("float32"), verbose=0).tolist()
    # Residuals (`codec/<path>/residual`, one row per replica; an older checkpoint's
    # `aggregator/residual_slots/<position>` read under the same names).
    reader = tf.train.load_checkpoint(path)
    old = state._old_aggregator_names(reader, model)
    saved.update({n: reader.get_tensor(k) for n, k in old.items()})
    out["old_form_names"] = len(old)
    # What the rows owe the summed gradient: their sum where each row is a replica's share
    # (tf.distribute, and every older checkpoint of it), their mean where each is a
    # replica's own error (a mesh's codecs).
    units = (reader.get_tensor(state.key(state.UNITS)).decode()
             if reader.has_tensor(state.key(state.UNITS)) else "share" if old else "replica")
    units_now = "replica" if getattr(model, "tfpar_reductions", ()) else "share"

    def owed(rows, units):
        total = tf.reduce_sum(tf.constant(rows), 0)
        return total / rows.shape[0] if units == "replica" else total
    # Residual rows moved to another replica count or into other units are compared by
    # what they owe (`residual_sums`); every other tensor as it was saved.
    moved_rows = units != units_now
    read = {n: e[0]() for n, e in entries.items() if n in saved}
    out["load_diff"] = max(
        float(np.max(np.abs(saved[n] - v), initial=0.0)) for n, v in read.items()
        if not (n.endswith("/residual") and (moved_rows or saved[n].shape != v.shape)))
    sums, rows = {}, 0
    for name in sorted(n for n in entries if n.endswith("/residual") and n in saved):
        rows_now = entries[name][0]()
        rows = int(rows_now.shape[0])
        saved_rows = saved[name]
        moved = owed(rows_now, units_now) - owed(saved_rows, units)
        sums[name] = [float(np.max(np.abs(moved))), float(np.max(np.abs(saved_rows))),
                      int(saved_rows.shape[0])]
    if sums:
        out["residual_sums"], out["residual_rows"] = sums, rows
    return out


def _placement(weight):
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    variable = weight if isinstance(weight, tf.Variable) else weight.value
    value = variable.read_value()
    if dtensor.is_dtensor(value):
        layout = dtensor.fetch_layout(value)
        return {"specs": list(layout.sharding_specs),
                "mesh": {d: layout.mesh.dim_size(d) for d in layout.mesh.dim_names},
                "devices": sorted(str(d) for d in layout.mesh.local_devices())}
    components = getattr(variable, "values", None)
    return {"devices": sorted(v.device for v in components) if components
            else [variable.device]}


if __name__ == "__main__":
    main()
