"""Child process for tests: `python tests/reshard_child.py RUNS_JSON OUT_PREFIX`.

Trains several configs one after the other in one process (one CPU split): RUNS_JSON is
`{"cpu_devices": N, "runs": [[name, config, options], ...]}`. Options:

- `{"from": DIR, "at": STEP}`: first copies checkpoint directory DIR (another layout's)
  to the run's `checkpoint_dir`, then loads it without training (`steps=STEP`) and
  records how the state landed: `load_diff`, the largest difference between every state
  tensor of DIR's checkpoint and the same tensor read back from this layout's variables
  (`tfpar.state` names); `placement`, each weight's place (a DTensor's mesh axes and
  sharding specs, or its devices); `residual_sums`, per error-feedback residual, the sum
  over this layout's replicas minus the sum of the saved rows (and `residual_rows`, the
  replica count); `predictions`, on a Keras model (not a mesh), its `predict` of 8 inputs
  drawn with numpy's `default_rng(0)`; then trains the config (resuming at STEP).
- none: trains the config as it is (a run that writes, or the uninterrupted reference).

Runs with the same backend and degrees share one runtime (`tfpar.train.train(runtime=)`).
Saves each run's final state to `OUT_PREFIX_<name>.npz` (`tfpar.state` names, `/` as
`|`) and prints one JSON line `{name: {"loss_history", "resumed_from_step", ...}}`.
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tfpar import ParallelConfig, devices  # noqa: E402


def main():
    spec, prefix = json.loads(sys.argv[1]), sys.argv[2]
    devices.split_cpu(spec["cpu_devices"])
    import keras
    from tfpar import backends
    from tfpar.train import train
    runtimes, out = {}, {}
    for name, settings, options in spec["runs"]:
        print(f"run {name}: {settings} {options}", file=sys.stderr, flush=True)
        config = ParallelConfig(**settings)
        keras.mixed_precision.set_global_policy("float32")
        key = (config.keras, config.data_parallel, config.tensor_parallel,
               config.pipeline_stages, config.zero_stage == 3)
        if key not in runtimes:
            runtimes[key] = backends.for_config(config).build_runtime(config)
        runtime = runtimes[key]
        out[name] = {}
        if "from" in options:
            shutil.copytree(options["from"], config.checkpoint_dir)
            _, model = train(config.replace(steps=options["at"]), runtime=runtime)
            out[name].update(landing(model, options["from"]))
        result, model = train(config, runtime=runtime)
        out[name].update({k: result[k] for k in ("loss_history", "resumed_from_step",
                                                 "replicas")})
        from tfpar import state
        values = {n: e[0]() for n, e in state.LayoutState(model).entries().items()}
        np.savez(f"{prefix}_{name}.npz", **{n.replace("/", "|"): v for n, v in values.items()})
    print(json.dumps(out), flush=True)


def landing(model, directory):
    """How checkpoint `directory`'s state landed in `model`'s layout (module docstring)."""
    import tensorflow as tf

    from tfpar import state
    from tfpar.compression import aggregator as aggregator_lib
    from tfpar.compression import keras_hook
    path = tf.train.latest_checkpoint(directory)
    saved = state.tensors_of(path)
    entries = state.LayoutState(model).entries()
    diff = max(float(np.max(np.abs(saved[n] - e[0]()), initial=0.0))
               for n, e in entries.items() if n in saved)
    out = {"load_diff": diff, "loaded": len([n for n in entries if n in saved]),
           "placement": {w.path: _placement(w) for w in model.weights}}
    if not any("specs" in p for p in out["placement"].values()):
        # What the loaded model predicts (Keras's own predict, one device or a strategy).
        x = np.random.default_rng(0).normal(size=(8, *model.input_shape[1:]))
        out["predictions"] = model.predict(x.astype("float32"), verbose=0).tolist()
    aggregator = keras_hook.aggregator_of(model.optimizer) if model.optimizer else None
    if aggregator is not None and getattr(aggregator, "residuals", None):
        reader = tf.train.load_checkpoint(path)
        keys = [k for k in reader.get_variable_to_shape_map() if "per_replica" in k]
        sums, rows = {}, 0
        for i, variable in aggregator.residuals.items():
            rows_now = aggregator_lib._stack_replicas(variable)
            rows = int(rows_now.shape[0])
            saved_rows = reader.get_tensor([k for k in keys if f"residual_slots/{i}/" in k][0])
            # The same reduction both sides: the sum moved, not re-rounded.
            moved = tf.reduce_sum(rows_now, 0) - tf.reduce_sum(tf.constant(saved_rows), 0)
            sums[i] = [float(np.max(np.abs(moved))),
                       float(np.max(np.abs(saved_rows))), int(saved_rows.shape[0])]
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
