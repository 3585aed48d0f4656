"""Child process for tests/test_pipeline_chimera.py: `python tests/pipeline_chimera_child.py
[codecs [all]]`.

Splits the CPU into 4 logical devices, then checks Chimera's two pipelines against the
single-device model: weights after 3 steps with SGD and Adam on 2 and 4 stages (and with
gradient accumulation, recomputation, a residual model, fp16 loss scaling with a step
past fp16's range: tests/pipeline_runs_child.py's `fp16_overflow_steps`), that each
stage's two weight copies stay equal bit for bit, predict, the Keras round trip
(`get_config`, weights file) and the trainer's checkpoint onto 1F1B and Chimera; then
Chimera against 1F1B under `OneDeviceStrategy`. Prints one JSON line.

With `codecs`: the trainer (`tfpar.train.train`) on 2 stages × 2 replicas with each codec
(and fp16 loss scaling, gradient accumulation), once with 1F1B and once with Chimera, on
one runtime; prints per run the first pipeline's weights, the largest difference between
any copy of a weight (Chimera's second pipeline, every replica) and its first, the
metrics JSON's `comm` block and the losses (`all`: bf16, lowbit, threshold and `auto`
too); then PowerSGD stopped after 2 steps (Chimera, 1F1B) and resumed with Chimera.
"""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # pipeline_models; tfpar

from tfpar.devices import split_cpu  # noqa: E402

split_cpu(4)

import numpy as np  # noqa: E402

from tfpar.pipeline.model import PipelineModel  # noqa: E402

from pipeline_models import OPTS, error, flat, mlp, reference, residual, x, y  # noqa: E402

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def case(build, opt, K, M, steps=3, **kwargs):
    """Max |weights - one device's| after `steps` steps over the first pipeline's stages,
    the max |copy - its partner| over all of them, and max |predict - one device's|."""
    pm = PipelineModel.split(build(), K, "chimera", M, devices=DEVICES[:K], **kwargs)
    pm.compile(optimizer=OPTS[opt](), loss="mse")
    before = [flat([pm.stages[p]]) - flat([pm.stages[2 * K - 1 - p]]) for p in range(K)]
    assert max(np.abs(d).max() for d in before) == 0  # the copies start equal
    for _ in range(steps):
        pm.train_on_batch(x, y)
    want, want_pred = reference(build, opt, steps)
    # Stage model K + s on device s is the copy of virtual stage K - 1 - s.
    copies = [pm.stages[2 * K - 1 - p] for p in range(K)]
    homes = [sorted({v.value.device[-5:] for v in m.weights}) for m in pm.stages]
    assert homes == [[f"CPU:{v % K}"] for v in range(2 * K)], homes
    return {"weights": float(np.abs(flat(pm.stages[:K]) - want).max()),
            "copies": float(np.abs(flat(pm.stages[:K]) - flat(copies)).max()),
            "predict": float(np.abs(pm.predict(x, verbose=0) - want_pred).max()),
            "moved": float(np.abs(flat(pm.stages[:K]) - flat([build()])).max())}



def codec_runs():
    """See the module docstring (`codecs`)."""
    from pipeline_runs_child import runtime_for
    from tfpar import ParallelConfig
    from tfpar import train as T
    base = dict(model="mlp", pipeline_stages=2, microbatches=4, cpu_devices=4,
                data_parallel=2, optimizer="sgd", learning_rate=0.1, steps=4,
                global_batch_size=16, verbose=0)
    runs = [("none", {}), ("fp16", dict(compression="fp16")),
            ("int8", dict(compression="int8")), ("topk", dict(compression="topk")),
            ("powersgd", dict(compression="powersgd", powersgd_rank=2)),
            ("int8/adam", dict(compression="int8", optimizer="adam", learning_rate=1e-2)),
            ("mp_fp16/int8", dict(compression="int8", mixed_precision="fp16")),
            ("accum/topk", dict(compression="topk", grad_accum_steps=2, microbatches=2))]
    if sys.argv[2:] == ["all"]:  # the other codecs too (docs/benchmarks/pipelines.md)
        runs += [(c, dict(compression=c)) for c in ("bf16", "lowbit", "threshold", "auto")]
    out = {}

    def train(settings):
        config = ParallelConfig(**settings)
        result, model = T.train(config, runtime=runtime_for(config))
        K = len(model.devices)
        return {"weights": flat(model.stages[:K]).tolist(), "spread": spread(model),
                "comm": result.get("comm"), "loss": result["loss_history"],
                "resumed_from_step": result.get("resumed_from_step")}

    for name, changes in runs:
        for schedule in ("1f1b", "chimera"):
            print(f"run {name} {schedule}", file=sys.stderr, flush=True)
            out[f"{name}/{schedule}"] = train({**base, **changes, "schedule": schedule})
    # PowerSGD's state (Q, residuals) per stage in a checkpoint: stopped after 2 steps
    # (Chimera, or 1F1B) and resumed with Chimera to step 4.
    for first in ("chimera", "1f1b"):
        print(f"run resume from {first}", file=sys.stderr, flush=True)
        settings = {**base, "compression": "powersgd", "powersgd_rank": 2,
                    "checkpoint_dir": tempfile.mkdtemp(prefix="tfpar-chimera-codec-"),
                    "checkpoint_every": 2, "checkpoint_async": False}
        train({**settings, "schedule": first, "steps": 2})
        out[f"resume/{first}"] = train({**settings, "schedule": "chimera"})
    print(json.dumps(out))


def spread(model):
    """The largest difference between any replica's value of any copy of a weight
    (Chimera's second pipeline's too) and replica 0's value of its first copy."""
    K = len(model.devices)
    firsts = flat_vars(model.stages[:K])
    seconds = flat_vars(model.stages[2 * K - 1:K - 1:-1]) if len(model.stages) > K else firsts
    return max(float(np.abs(part.numpy() - components(w)[0].numpy()).max())
               for w, c in zip(firsts, seconds) for part in components(w) + components(c))


def flat_vars(models):
    return [w for m in models for w in m.weights]


def components(w):
    """Every replica's tf.Variable of Keras variable `w` (itself outside a strategy)."""
    return list(getattr(w.value, "values", [w.value]))


if sys.argv[1:2] == ["codecs"]:
    codec_runs()
    sys.exit(0)

def one_device_strategy(steps=3):
    """Chimera and 1F1B under `OneDeviceStrategy` (`tfpar.make_strategy("one_device")`,
    built in its scope as `tfpar.PipelineModel`'s docstring builds it), the same model,
    optimizer and batch: max |Chimera's weights - 1F1B's| after `steps` steps, how far
    Chimera's moved, and max |copy - its partner|."""
    import tfpar
    strategy = tfpar.make_strategy("one_device", cpu_devices=len(DEVICES))
    trained = {}
    for schedule in ("1f1b", "chimera"):
        with strategy.scope():
            pm = PipelineModel.split(mlp(), 2, schedule, 4)
            pm.compile(optimizer=OPTS["sgd"](), loss="mse")
        for _ in range(steps):
            pm.train_on_batch(x, y)
        trained[schedule] = pm
    chim = trained["chimera"]
    return {"weights": float(np.abs(flat(chim.stages[:2]) - flat(trained["1f1b"].stages))
                             .max()),
            "moved": float(np.abs(flat(chim.stages[:2]) - flat([mlp()])).max()),
            "copies": float(np.abs(flat(chim.stages[:2]) - flat(chim.stages[:1:-1])).max())}


from pipeline_runs_child import fp16_overflow_steps  # noqa: E402

out = {}
out["fp16_overflow"] = fp16_overflow_steps("chimera", DEVICES[:2])[0]
for K, M in ((2, 4), (4, 8)):
    for opt in ("sgd", "adam"):
        out[f"{opt}/K{K}"] = case(mlp, opt, K, M)
out["accum/adam/K2"] = case(mlp, "adam", 2, 2, grad_accum_steps=2)
out["recompute/adam/K2"] = case(mlp, "adam", 2, 4, recompute=True)
out["residual/adam/K2"] = case(residual, "adam", 2, 4)

# The Keras round trip: config (2·K stage models back onto K devices) and weights file.
pm = PipelineModel.split(mlp(), 2, "chimera", 4, devices=DEVICES[:2])
pm.compile(optimizer="adam", loss="mse")
pm.fit(x, y, batch_size=8, epochs=2, verbose=0)
saved = tempfile.mkdtemp(prefix="tfpar-chimera-")
pm.save_weights(os.path.join(saved, "chimera.weights.h5"))
fresh = PipelineModel.from_config(json.loads(json.dumps(pm.get_config())))
fresh.load_weights(os.path.join(saved, "chimera.weights.h5"))
out["reload"] = [len(fresh.stages), len(fresh.devices),
                 float(np.abs(fresh.predict(x, verbose=0) - pm.predict(x, verbose=0)).max())]
out["metrics"] = pm.pipeline_metrics()

# The trainer's checkpoint (`tfpar.state`): each weight once, by its single-device path;
# loaded onto 1F1B (one copy) and onto Chimera (both copies written).
import tensorflow as tf  # noqa: E402

from tfpar import state as state_lib  # noqa: E402

path = tf.train.Checkpoint(state=state_lib.LayoutState(pm)).write(os.path.join(saved, "state"))
names = [n for n in state_lib.tensors_of(path) if n.startswith("model/")]
loaded = {}
for schedule in ("1f1b", "chimera"):
    other = PipelineModel.split(mlp(seed=1), 2, schedule, 4, devices=DEVICES[:2])
    other.compile(optimizer="adam", loss="mse")
    state_lib.LayoutState(other).load(path)
    loaded[schedule] = float(np.abs(flat(other.stages) - flat(pm.stages[:len(other.stages)])).max())
out["state"] = {"names": len(names), "weights": sum(len(s.weights) for s in pm.stages[:2]),
                **loaded}
out["odd_microbatches"] = error(lambda: PipelineModel.split(mlp(), 2, "chimera", 3))
out["one_device_strategy"] = one_device_strategy()  # last: it applies tfpar's patches
print(json.dumps(out))
