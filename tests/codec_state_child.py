"""Child process for tests: `python tests/codec_state_child.py RUNS_JSON OUT_PREFIX`.

`tests/reshard_child.py`'s runs (its docstring: RUNS_JSON, what each run records). A run
whose `checkpoint_dir` is named `old_*` writes its checkpoints as tfpar wrote them before
a tf.distribute aggregator's state moved under `tfpar.state`'s `codec/` names: the
aggregator's own objects beside the state (`aggregator/residual_slots/<position>`,
`aggregator/qs/<position>`, `aggregator/step`), none of its state in the `LayoutState`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reshard_child  # noqa: E402

_OLD_FORM = [False]


def write_old_form_for_old_dirs():
    """Before: `state.aggregators_of` also handed over the tf.distribute aggregators (saved
    by TensorFlow's object graph) and `LayoutState` left them out; so here for a run whose
    checkpoint directory is named `old_*`."""
    from tfpar import state
    import importlib
    train_lib = importlib.import_module("tfpar.train")
    beside, entries, train = state.aggregators_of, state._aggregator_entries, train_lib.train

    def aggregators_of(model):
        return {**(state._aggregators(model) if _OLD_FORM[0] else {}), **beside(model)}

    def old_train(config, **kwargs):
        folder = os.path.basename(str(config.checkpoint_dir or "").rstrip("/"))
        _OLD_FORM[0] = folder.startswith("old_")
        try:
            return train(config, **kwargs)
        finally:
            _OLD_FORM[0] = False
    state.aggregators_of = aggregators_of
    state._aggregator_entries = lambda model: {} if _OLD_FORM[0] else entries(model)
    train_lib.train = old_train


if __name__ == "__main__":
    write_old_form_for_old_dirs()
    reshard_child.main()
