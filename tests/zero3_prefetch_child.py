"""Child of tests/test_zero3_prefetch.py, on 4 logical CPUs (one DTensor mesh runtime):
`python tests/zero3_prefetch_child.py CASE[,CASE...]`; prints one JSON line mapping each
case to its result.

- `equal-<model>-<layout>` (`mlp`/`transformer`, `dp4`/`dp2tp2`): ZeRO-3 built as the
  trainer builds it, with and without `zero_prefetch`, from the same seed; 3 steps on the
  same batches. The weights after them compared (`bit_equal`, `max_abs_diff`; `moved`: how
  far the steps moved them), and the
  traced step with prefetch and without read for each gathered layer's first split
  weight: which of the other layers' gathers its forward and backward gathers wait on
  (`waits`). `equal-mlp-dp4-int8` (`--zero_gather=int8`) and
  `equal-transformer-dp4-accum-fp16` (two micro-batches, fp16 loss scaling): weights only.
- `peak-<model>`: the allocator's peak (BFC) during 3 steps above what was resident
  before, with and without prefetch, a fresh model each from the same seed; the bytes of
  the largest layer's whole weights.
- `keep-<model>-<layout>`: as `equal-`, the default against
  `--nozero_reshard_after_forward` (weights only). The default run of a model and layout
  is trained once a child, the reference of both cases.
- `tail-<model>-<layout>`: as `keep-`, the default against keeping the last layers
  whole (`--zero_keep_last_layers=-1`, the others' runs keep none): also the kept layers'
  names and, per layer, how many `Relayout`s of each split weight the traced step holds
  (`relayouts`); on dp4 `tail-mlp-dp4` also counts one step's collectives of each run under
  the profiler (`lowering`, `lowering_kept`).
- `lowering-mlp`: one more step of the default run (dp4) under TensorFlow's profiler, the
  collective ops the devices ran counted by type (ZeRO-3's gathers lowered as
  `tfpar.patches.COLLECTIVE_GATHER` says: with it 0, DTensor's own, a sum).
- `save-after-zero3-mlp`: a ZeRO-3 model built (dp4), then a dp2 x tp2 top-k run (no
  ZeRO) saving checkpoints in the same process (`tfpar.train.train`).
"""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import cases  # noqa: E402
from graph_walk import ancestors  # noqa: E402
import numpy as np  # noqa: E402

from tfpar import ParallelConfig, backends, data, memory, profiling  # noqa: E402

BASE = {"cpu_devices": 4, "zero_stage": 3, "optimizer": "adam", "learning_rate": 1e-2,
        "global_batch_size": 16, "seed": 0, "verbose": 0,
        # Every layer resharded, as these cases were written for; `tail-` keeps the last.
        "zero_keep_last_layers": 0}
MODELS = {"mlp": {"model": "mlp", "model_width": 64, "model_depth": 3},
          "transformer": {"model": "transformer", "model_width": 32, "model_depth": 2}}
LAYOUTS = {"dp4": {}, "dp2tp2": {"tensor_parallel": 2, "data_parallel": 2}}
# `peak-<model>`: weights large beside the activations (batch 8), several layers deep.
PEAK_SIZES = {"mlp": {"model_width": 512, "model_depth": 10},
              "transformer": {"model_width": 128, "model_depth": 4}}
_RUNTIME = []


def _build(config):
    """`(model, trainer, task)` of `config` on a mesh of its own degrees, over the one
    runtime of this process."""
    from tfpar.layout import run
    backend = backends.for_config(config)
    if not _RUNTIME:
        _RUNTIME.append(backend.build_runtime(config))
    task = data.make_task(config)
    _, model, trainer = run.build(config, task)
    return model, trainer, task


# `_train`'s runs by config: the default ZeRO-3 run of a model and layout is the reference of
# its `equal-`, `keep-` and `lowering-` cases, trained and traced once a child.
_TRAINED = {}


def _train(config, steps=3):
    """`(model, trainer, weights after `steps` steps, how far they moved)`; a config
    trained before in this process is not trained again (its model has trained on since
    only through `lowering`, after its weights were read)."""
    from tfpar.layout.values import to_host
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if key in _TRAINED:
        return _TRAINED[key]
    model, trainer, task = _build(config)
    before = [to_host(v.value) for v in model.trainable_variables]
    for batch in data.global_batches(config, task, 0, steps):
        trainer.train_on_batch(*batch)
    after = [to_host(v.value) for v in model.trainable_variables]
    _TRAINED[key] = (model, trainer, after, max(float(np.max(np.abs(a - b)))
                                                for a, b in zip(after, before)))
    return _TRAINED[key]


def _gathers(concrete, model):
    """`{variable name: [Relayout ops gathering it]}` of the traced step: each gather's
    input, followed back through adds, casts and identities, is a read of the variable."""
    handles = {id(external): internal for external, internal in concrete.graph.captures}
    by_input = {}
    for variable in model.trainable_variables:
        internal = handles.get(id(variable.value.handle))
        if internal is not None:
            by_input[internal.op.name] = variable.path
    found = {}
    for op in concrete.graph.get_operations():
        if op.type != "Relayout":
            continue
        node = op.inputs[0].op
        while node.type in ("AddV2", "Cast", "Identity") and node.inputs:
            node = node.inputs[0].op
        if node.type == "ReadVariableOp" and node.inputs[0].op.name in by_input:
            found.setdefault(by_input[node.inputs[0].op.name], []).append(op)
    return found


def _waits(model, trainer):
    """For each gathered layer (in call order), its first split weight's forward and
    backward gathers: the indices of the layers whose gather of the same kind it waits
    on (through data edges)."""
    concrete = trainer._train.python_function._list_all_concrete_functions()[0]
    gathers = _gathers(concrete, model)
    layers = []
    for layer in model.layers:
        names = [v.path for v in layer.trainable_variables if v.path in gathers]
        if names:
            layers.append((layer.name, gathers[names[0]]))
    kinds = []  # per layer (forward gather, backward gather): the backward waits on both
    for name, ops in layers:
        if len(ops) != 2:
            raise AssertionError(f"{name}: {len(ops)} gathers of one weight, expected 2")
        first, second = ops
        kinds.append((first, second) if first in ancestors(second) else (second, first))
    out = {"layers": [name for name, _ in layers], "forward": [], "backward": []}
    for i, (forward, backward) in enumerate(kinds):
        before_f, before_b = ancestors(forward), ancestors(backward)
        out["forward"].append([j for j, (f, _) in enumerate(kinds) if f in before_f])
        out["backward"].append([j for j, (_, b) in enumerate(kinds) if b in before_b])
    return out


def equal(model_name, layout, waits=True, other=None, **extra):
    """The default ZeRO-3 against `other` (settings; default no prefetch)."""
    config = ParallelConfig(**{**BASE, **MODELS[model_name], **LAYOUTS[layout], **extra})
    on_model, on_trainer, on, moved = _train(config)
    off_model, off_trainer, off, _ = _train(config.replace(
        **(other or {"zero_prefetch": False})))
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(on, off)]
    return {"bit_equal": all(np.array_equal(a, b) for a, b in zip(on, off)),
            "max_abs_diff": max(diffs), "moved": moved,
            "waits": waits and {"on": _waits(on_model, on_trainer),
                                "off": _waits(off_model, off_trainer)}}


def peak(model_name):
    """Allocator peaks above the start of training, on and off (each a fresh model)."""
    out = {}
    for prefetch in (False, True):
        config = ParallelConfig(**{**BASE, **MODELS[model_name], **PEAK_SIZES[model_name],
                                   "global_batch_size": 8, "zero_prefetch": prefetch})
        model, trainer, task = _build(config)
        batches = data.global_batches(config, task, 0, 3)
        trainer.train_on_batch(*batches[0])  # traced; its one-time allocations done
        start = memory.reset_peaks()
        if start is None:
            raise AssertionError("the allocator cannot be read: TF_CPU_ALLOCATOR_USE_BFC")
        for batch in batches[1:]:
            trainer.train_on_batch(*batch)
        out["on" if prefetch else "off"] = max(memory.peak_bytes()) - start[0]
        out["layer_bytes"] = max(
            4 * sum(int(np.prod(v.shape)) for v in layer.trainable_variables)
            for layer in model.layers)
    return out


def tail(model_name, layout):
    """The default (every layer resharded) against the last layers kept whole: weights,
    which layers were kept, each split weight's gathers in the kept run's traced step."""
    kept = {"zero_keep_last_layers": -1}
    out = equal(model_name, layout, False, kept)
    config = ParallelConfig(**{**BASE, **MODELS[model_name], **LAYOUTS[layout], **kept})
    model, trainer, _, _ = _train(config)
    concrete = trainer._train.python_function._list_all_concrete_functions()[0]
    gathers = _gathers(concrete, model)
    out["kept"] = [l.name for l in model.layers if getattr(l, "_tfpar_kept_whole", False)]
    out["relayouts"] = {l.name: sorted({len(gathers[v.path]) for v in l.trainable_variables
                                        if v.path in gathers})
                        for l in model.layers if getattr(l, "_tfpar_recomputed", False)}
    if layout == "dp4":
        out["lowering"] = lowering(model_name)
        out["lowering_kept"] = lowering(model_name, **kept)
    return out


def lowering(model_name, **extra):
    """Collective ops of one step (dp4) by type, counted over the devices, under
    TensorFlow's profiler; the split weights' count, and of those in layers kept whole."""
    import tensorflow as tf
    from tfpar.zero import fsdp
    config = ParallelConfig(**{**BASE, **MODELS[model_name], **extra})
    # the default run's model (equal-/keep-'s reference, or trained here): traced and
    # compiled, one more step profiled
    model, trainer, _, _ = _train(config)
    batch, = data.global_batches(config, data.make_task(config), 3, 1)
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        trainer.train_on_batch(*batch)
        tf.profiler.experimental.stop()
        kinds = [profiling.op_type(name) for name, _, _ in profiling.read_events(logdir)]
    out = {k: kinds.count(k) for k in ("CollectiveGatherV2", "CollectiveReduceV2")}
    out["split_weights"] = sum(fsdp._split_layout(v) is not None
                               for v in model.trainable_variables)
    out["kept_split_weights"] = sum(
        fsdp._split_layout(v) is not None for l in model.layers
        if getattr(l, "_tfpar_kept_whole", False) for v in l.trainable_variables)
    return out


def save_after_zero3(model_name):
    """A ZeRO-3 model built on dp4 (its gathers lowered to all-gathers), then in the same
    process a dp2 x tp2 run without ZeRO, with top-k, saving a checkpoint after each of
    its 2 steps (`tfpar.train.train`; the codec's rows are gathered for the save): the
    lowering's variable after each build, the steps saved, the losses."""
    from tfpar import checkpoint, patches
    from tfpar.train import train
    _build(ParallelConfig(**{**BASE, **MODELS[model_name]}))
    out = {"set_by_zero3": os.environ.get(patches.COLLECTIVE_GATHER)}
    with tempfile.TemporaryDirectory() as directory:
        config = ParallelConfig(**{**BASE, **MODELS[model_name], **LAYOUTS["dp2tp2"],
                                   "zero_stage": 0, "compression": "topk", "steps": 2,
                                   "steps_per_epoch": 2, "checkpoint_dir": directory,
                                   "checkpoint_every": 1})
        result, _ = train(config)
        out["saved"] = [os.path.basename(p) for p in checkpoint.published(directory)]
    out.update(set_after=os.environ.get(patches.COLLECTIVE_GATHER),
               loss=result["loss_history"])
    return out


CASES = {**{f"equal-{m}-{l}": (lambda m=m, l=l: equal(m, l))
            for m in MODELS for l in LAYOUTS},
         # ZeRO++'s int8 gather; two micro-batches (a second forward pass in one step) under
         # fp16 loss scaling: weights only.
         "equal-mlp-dp4-int8": lambda: equal("mlp", "dp4", False, zero_gather="int8"),
         "equal-transformer-dp4-accum-fp16": lambda: equal(
             "transformer", "dp4", False, grad_accum_steps=2, mixed_precision="fp16"),
         **{f"peak-{m}": (lambda m=m: peak(m)) for m in MODELS},
         # Each layer gathered once, whole weights and activations kept for the backward
         # (`--nozero_reshard_after_forward`) against the default's recomputation.
         **{f"keep-{m}-{l}": (lambda m=m, l=l: equal(
             m, l, False, {"zero_reshard_after_forward": False}))
            for m in MODELS for l in LAYOUTS},
         # The last layers kept whole (`--zero_keep_last_layers=-1`) against none kept.
         **{f"tail-{m}-{l}": (lambda m=m, l=l: tail(m, l)) for m in MODELS for l in LAYOUTS},
         "lowering-mlp": lambda: lowering("mlp"),
         "save-after-zero3-mlp": lambda: save_after_zero3("mlp")}

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(json.dumps(cases.run_cases(CASES, sys.argv[1].split(","))), flush=True)
