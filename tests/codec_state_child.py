"""Child process for tests: `python tests/codec_state_child.py RUNS_JSON OUT_PREFIX`.

`tests/reshard_child.py`'s runs (its docstring: RUNS_JSON, what each run records). A run
whose `checkpoint_dir` is named `old_*` writes its checkpoints as tfpar wrote them before
a codec's state moved under `tfpar.state`'s `codec/` names (synchronously, as then): the
objects beside the state, none of their state in the `LayoutState`: a tf.distribute
aggregator's (`aggregator/residual_slots/<position>`, `aggregator/qs/<position>`,
`aggregator/step`), ZeRO 1/2's aggregator as `zero_residual/...` and ZeRO's own flat
residual as `zero_residual` (`[replicas, flat length]`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reshard_child  # noqa: E402

_OLD_FORM = [False]


def _old_objects(model):
    """What an older tfpar saved beside the `LayoutState` for `model`'s codecs."""
    from tfpar import state
    from tfpar.compression import aggregator as aggregator_lib
    from tfpar.zero import sharded
    out = {}
    zero_aggregators = [sharded.aggregator_of(o) for o in state.optimizers_of(model)]
    for name, aggregator in state._aggregators(model).items():
        if any(aggregator is a for a in zero_aggregators):
            name = name.replace("aggregator", "zero_residual")
        out[name] = aggregator
    for optimizer in state.optimizers_of(model):
        zero = sharded.zero_of(optimizer)
        if zero is not None and zero._tfpar_layout.residual is not None:
            out["zero_residual"] = aggregator_lib.PerReplicaSlot(zero._tfpar_layout.residual)
    return out


def write_old_form_for_old_dirs():
    """Before: `state.aggregators_of` handed over those objects (saved by TensorFlow's
    object graph) and `LayoutState` left their state out; so here for a run whose
    checkpoint directory is named `old_*`."""
    from tfpar import state
    from tfpar.zero import sharded
    import importlib
    train_lib = importlib.import_module("tfpar.train")
    beside, entries, train = state.aggregators_of, state._aggregator_entries, train_lib.train
    residual_entries = sharded.residual_entries

    def aggregators_of(model):
        return {**(_old_objects(model) if _OLD_FORM[0] else {}), **beside(model)}

    def old_train(config, **kwargs):
        folder = os.path.basename(str(config.checkpoint_dir or "").rstrip("/"))
        _OLD_FORM[0] = folder.startswith("old_")
        if _OLD_FORM[0]:  # objects beside the state were saved synchronously then
            config = config.replace(checkpoint_async=False)
        try:
            return train(config, **kwargs)
        finally:
            _OLD_FORM[0] = False
    state.aggregators_of = aggregators_of
    state._aggregator_entries = lambda model: {} if _OLD_FORM[0] else entries(model)
    sharded.residual_entries = lambda *args: [] if _OLD_FORM[0] else residual_entries(*args)
    train_lib.train = old_train


if __name__ == "__main__":
    write_old_form_for_old_dirs()
    reshard_child.main()
