"""Child process for tests: `python tests/train_configs_child.py CONFIGS_JSON OUT_PREFIX`.

Trains each `ParallelConfig(**c)` of the JSON list one after the other in this process,
on the runtime the first one built (`tfpar.train.train(..., runtime=...)`: one strategy or
DTensor mesh per process), saves config i's final weights to
`OUT_PREFIX.<i>[.worker<w>].npz` (its optimizer's variables to `....optimizer.npz`) and
prints one JSON line: a list of metric summaries.
Under `tfpar.launch` every worker does the same.

A config may carry `"dense_gradients": true` (not a `ParallelConfig` field): its optimizer
is then handed every `IndexedSlices` gradient (an embedding's) as a dense tensor, the
reference a DTensor mesh's dense gradients are compared with (Keras's Adam squares an
`IndexedSlices` gradient slice by slice, before duplicate rows are summed).

A mesh pipeline's config (dp × tp × pp) may carry `"nonfinite_stage": v`: stage model v
then passes an infinite gradient back (to its weights and earlier stages) on every step.
Its result gets the initial weights (`OUT_PREFIX.<i>.initial.npz`); every fp16 mesh
pipeline's result gets each stage optimizer's `loss_scales` and `iterations`, and every
compressed one the largest entry of its stages' error-feedback residuals (`residual_max`).
"""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import graph_optimizer  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import (ParallelConfig, backends, optimizers, relayout,  # noqa: E402
                   wait_for_workers)
from tfpar.train import train  # noqa: E402

DENSE = "dense_gradients"
NONFINITE = "nonfinite_stage"


@contextlib.contextmanager
def dense_gradients(on):
    """While on, `tfpar.optimizers.make_optimizer` returns optimizers whose `apply`
    densifies `IndexedSlices` gradients first."""
    if not on:
        yield
        return
    import tensorflow as tf
    make = optimizers.make_optimizer

    def make_dense(config, **kwargs):
        optimizer = make(config, **kwargs)
        apply = optimizer.apply

        def apply_dense(grads, trainable_variables=None):
            return apply([tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                          for g in grads], trainable_variables)
        optimizer.apply = apply_dense
        return optimizer
    optimizers.make_optimizer = make_dense
    try:
        yield
    finally:
        optimizers.make_optimizer = make


@contextlib.contextmanager
def mesh_pipeline_probe(nonfinite_stage):
    """Yields a list that gets the `MeshPipelineTrainer`s built meanwhile (their initial
    weights as `trainer.initial`); with `nonfinite_stage` set, that stage model's output
    passes back an infinite gradient."""
    import tensorflow as tf
    from tfpar.layout import pipeline
    from tfpar.layout.values import to_host
    cls = pipeline.MeshPipelineTrainer
    init, forward = cls.__init__, cls.stage_forward
    built = []

    @tf.custom_gradient
    def infinite_gradient(x):
        return tf.identity(x), lambda dy: dy * float("inf")

    def probed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.initial = [to_host(v.value) for v in self.model.weights]
        built.append(self)

    def poisoned_forward(self, v, *args, **kwargs):
        out = forward(self, v, *args, **kwargs)
        return infinite_gradient(out) if v == nonfinite_stage else out

    cls.__init__ = probed_init
    if nonfinite_stage is not None:
        cls.stage_forward = poisoned_forward
    try:
        yield built
    finally:
        cls.__init__, cls.stage_forward = init, forward


def _loss_scaling(trainer):
    from tfpar.layout.values import to_host
    optimizers = trainer.stage_optimizers
    codec = {}
    if trainer.reductions:  # the largest entry of any stage's residuals
        residuals = [r for reduction in trainer.reductions for r in reduction.residuals]
        codec = {"residual_max": max(float(np.max(np.abs(to_host(r)))) for r in residuals)}
    if not all(hasattr(o, "inner_optimizer") for o in optimizers):
        return codec
    return {**codec,
            "loss_scales": [float(to_host(o.dynamic_scale.value)) for o in optimizers],
            "iterations": [int(to_host(o.iterations.value)) for o in optimizers]}


def _optimizer_state(model, result):
    """The model's optimizer variables (step count and slots) as host arrays, gathered on a
    mesh; None for a model without one (a mesh pipeline's are per stage)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "variables", None):
        return None
    if result.get("strategy") == "DTensorMesh":
        from tfpar.layout.values import to_host
        return [to_host(v.value) for v in optimizer.variables]
    return [np.asarray(v) for v in optimizer.variables]


def main():
    graph_optimizer.apply()  # the test's choice (tests/graph_optimizer.py)
    raw = json.loads(sys.argv[1])
    # As `python -m tfpar.train` does: an elastic launch's new world re-lays out a mesh.
    configs = [relayout.for_cluster(
        ParallelConfig(**{k: v for k, v in c.items() if k not in (DENSE, NONFINITE)}))
        for c in raw]
    runtime = backends.for_config(configs[0]).build_runtime(configs[0])
    worker = os.environ.get("TFPAR_WORKER_INDEX")
    out = []
    for i, config in enumerate(configs):
        probe = (mesh_pipeline_probe(raw[i].get(NONFINITE))
                 if config.tensor_parallel > 1 and config.pipeline_stages > 1
                 else contextlib.nullcontext([]))
        with dense_gradients(raw[i].get(DENSE, False)), probe as trainers:
            result, model = train(config, runtime=runtime)
        extra = _loss_scaling(trainers[-1]) if trainers else {}
        if NONFINITE in raw[i]:
            np.savez(f"{sys.argv[2]}.{i}.initial.npz", *trainers[-1].initial)
        if result.get("strategy") == "DTensorMesh":  # sharded on a mesh: gather
            from tfpar.layout.values import to_host
            arrays = [to_host(v.value) for v in model.weights]
        else:
            arrays = [np.asarray(v) for v in model.weights]
        suffix = f".worker{worker}" if worker is not None else ""
        np.savez(f"{sys.argv[2]}.{i}{suffix}.npz", *arrays)
        slots = _optimizer_state(model, result)
        if slots is not None:  # each rank's view: compared across ranks after a resize
            np.savez(f"{sys.argv[2]}.{i}{suffix}.optimizer.npz", *slots)
        keys = ("replicas", "workers", "steps", "final_loss", "loss_history", "comm",
                "strategy", "mesh", "memory", "validation", "resumed_from_step")
        out.append({**{k: result[k] for k in keys if k in result}, **extra,
                    "grappler": graph_optimizer.setting()})
    # The gathers above (`to_host`) are collectives after train()'s own barrier: worker 0,
    # which hosts the coordination service, must not leave before the others finish them.
    wait_for_workers("gathered", timeout_s=120)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
