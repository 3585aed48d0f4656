"""Reads and calls of Keras's private model, loss and trainer code (keras 3.15.1).

- `function_nodes`: not a replacement but a read. `tfpar.pipeline.partition` walks a
  functional model's graph through `Function._nodes_by_depth` (Keras has no public
  accessor for its nodes) and a `Sequential`'s graph through its `_functional`;
  `nodes_by_depth` and `functional_of` are the readers, and the check looks for the
  attributes being built in `keras.src.ops.function.Function` and `Sequential`.
- `function_loss`: not a replacement but a call. `PipelineModel.compile` (and the mesh
  step of `tfpar.layout.enable`) wraps a loss given as a function in Keras's own `LossFunctionWrapper` (private; it matches the ranks
  of labels and predictions as `compile` does for Keras's models); `function_loss` is the
  one caller, and the check compares the wrapper's signature.
- `train_step_loss`: not a replacement but Keras's `TensorFlowTrainer.train_step` up to
  the loss, for `tfpar.accumulation`'s step over micro-batches: the forward pass (with
  `training=True` when `call` takes it), `Model._compute_loss`, and the update of the
  loss tracker with the loss unscaled for distribution. `forward_loss` is the one caller;
  the check looks for those lines in `train_step`.
- `loss_tracker`: a read. The `Mean` metric that reports `fit`'s loss is the model's
  private `_loss_tracker`; `tfpar.nan_guard` resets it after a skipped step.
- `initial_epoch`: a write and a read. `fit` starts from the model's private
  `_initial_epoch` when set (what Keras's own backup-and-restore callback writes); tfpar's
  checkpoint callback writes it after a restore (`set_initial_epoch`), and the mesh `fit`
  of `tfpar.layout.enable` reads it after `on_train_begin` as Keras's `fit` does
  (`initial_epoch`).
- `uninitialized_variables`: a read and a write. `tfpar.plan.symbolic.deferred_weights`
  keeps Keras from initializing variables a `StatelessScope` created, by restoring Keras's
  global list `uninitialized_variables` (`backend.common.global_state`).
- `variable_storage`: a read. `tfpar.memory` counts the storage of a Keras variable,
  kept in its private `_value`.
"""

import contextlib
import inspect

import keras
from keras.src.backend.common import global_state as _global_state
from keras.src.backend.common import variables as _keras_variables
from keras.src.backend.tensorflow import trainer as _tf_trainer
from keras.src.losses import loss as _loss_module
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.ops import function as _keras_function

from tfpar.patches.versions import WRITTEN_FOR, check_entries, check_fragments

ENTRIES = {
    "function_nodes": ("keras.src.ops.function.Function._nodes_by_depth, "
                       "Sequential._functional (read, not replaced)",
                       "tfpar.pipeline.partition"),
    "function_loss": ("keras.src.losses.losses.LossFunctionWrapper (called, not replaced)",
                      "tfpar.pipeline.model.PipelineModel.compile, "
                      "tfpar.layout.keras_distribution"),
    "train_step_loss": ("TensorFlowTrainer.train_step's forward pass and loss: "
                        "Model._call_has_training_arg, _compute_loss, _loss_tracker, "
                        "loss.unscale_loss_for_distribution (called, not replaced)",
                        "tfpar.accumulation"),
    "loss_tracker": ("Trainer._loss_tracker, tf_keras's LossesContainer._total_loss_mean "
                     "(read, not replaced)", "tfpar.nan_guard, tfpar.metrics.report_step_loss"),
    "initial_epoch": ("Trainer._initial_epoch (written and read, not replaced)",
                      "tfpar.callbacks (checkpoint restore), tfpar.layout.trainer"),
    "uninitialized_variables": ("keras.src.backend.common.global_state "
                                "uninitialized_variables (read and written)",
                                "tfpar.plan.symbolic.deferred_weights"),
    "variable_storage": ("keras.src.backend.common.variables.Variable._value (read)",
                         "tfpar.memory"),
}
# `function_nodes`: where Keras 3.15.1 builds the attribute; `function_loss`: its signature.
_EXPECTED_FUNCTION_NODES = "self._nodes_by_depth = nodes_by_depth"
_EXPECTED_FUNCTION_LOSS = ("(self, fn, reduction='sum_over_batch_size', name=None, dtype=None, "
                           "**kwargs)")
FRAGMENTS = {
    "function_nodes": [("Sequential._functional", lambda: keras.Sequential.build,
                        "self._functional = Functional(inputs=inputs, outputs=outputs)")],
    "train_step_loss": [
        ("TensorFlowTrainer.train_step", lambda: _tf_trainer.TensorFlowTrainer.train_step,
         fragment) for fragment in (
             "if self._call_has_training_arg:\n                y_pred = self(x, training=True)",
             "loss = self._compute_loss(\n                x=x,\n                y=y,\n"
             "                y_pred=y_pred,\n                sample_weight=sample_weight,\n"
             "                training=True,\n            )",
             "self._loss_tracker.update_state(\n"
             "                loss_module.unscale_loss_for_distribution(loss),",
             "loss = self.optimizer.scale_loss(loss)")],
    "loss_tracker": [("Trainer._loss_tracker", lambda: keras.Model.compile,
                      'self._loss_tracker = metrics_module.Mean(name="loss")')],
    "initial_epoch": [("TensorFlowTrainer.fit", lambda: _tf_trainer.TensorFlowTrainer.fit,
                       "initial_epoch = self._initial_epoch or initial_epoch")],
    "uninitialized_variables": [
        ("backend.common.variables.register_uninitialized_variable",
         lambda: _keras_variables.register_uninitialized_variable,
         '"uninitialized_variables", [], set_to_default=True'),
        ("backend.common.global_state.set_global_attribute",
         lambda: ("signature", _global_state.set_global_attribute), "(name, value)")],
    "variable_storage": [("Variable._initialize",
                          lambda: _keras_variables.Variable._initialize_with_initializer,
                          "self._initialize(value)")],  # `_value`: see `mesh_variables`
}


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    problems = []
    if "function_nodes" in names and _EXPECTED_FUNCTION_NODES not in inspect.getsource(
            _keras_function.Function.__init__):
        problems.append(f"keras {keras.__version__} changed Function._nodes_by_depth; "
                        "tfpar.pipeline.partition was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    if "function_loss" in names and str(inspect.signature(
            LossFunctionWrapper.__init__)) != _EXPECTED_FUNCTION_LOSS:
        problems.append(f"keras {keras.__version__} changed LossFunctionWrapper; "
                        "PipelineModel.compile was written for keras "
                        f"{WRITTEN_FOR['keras']}")
    problems += check_entries(names, "keras", FRAGMENTS, ENTRIES)
    if "loss_tracker" in names and _tf_keras_compile_utils() is not None:
        problems += check_fragments("loss_tracker", "tf_keras", TF_KERAS_FRAGMENTS,
                                    ENTRIES["loss_tracker"][1])
    return problems


def _tf_keras_compile_utils():
    try:  # tf_keras (`keras=2`) is optional
        from tf_keras.src.engine import compile_utils
    except ImportError:
        return None
    return compile_utils


# Where tf_keras 2.21.0 updates the loss tracker `loss_tracker` returns for its models.
TF_KERAS_FRAGMENTS = [("LossesContainer.__call__",
                       lambda: _tf_keras_compile_utils().LossesContainer.__call__,
                       "self._total_loss_mean.update_state(")]


def nodes_by_depth(functional):
    """{depth: [nodes]} of a functional model's graph, or None if it has none. Registry
    entry `function_nodes`."""
    return getattr(functional, "_nodes_by_depth", None)


def functional_of(model):
    """The functional graph of `model`: a `Sequential`'s inner `Functional`, else the model
    itself. Registry entry `function_nodes`."""
    return getattr(model, "_functional", None) or model


def function_loss(fn):
    """A `keras.losses.Loss` computing `fn(y_true, y_pred)` as Keras's `compile` wraps a
    function. Registry entry `function_loss`."""
    return LossFunctionWrapper(fn)


def forward_loss(model, x, y, sample_weight, batch_size):
    """Keras's `train_step` up to the scaled loss, on one batch: returns `(y_pred, loss,
    scaled_loss)` and updates the model's loss tracker with `loss` weighted by
    `batch_size`. Call inside the `GradientTape`. Registry entry `train_step_loss`."""
    y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=True)
    model._loss_tracker.update_state(_loss_module.unscale_loss_for_distribution(loss),
                                     sample_weight=batch_size)
    return y_pred, loss, model.optimizer.scale_loss(loss)


def loss_tracker(model):
    """The `Mean` metric `fit` reports as `loss`: Keras 3's `_loss_tracker`, a tf_keras
    model's `compiled_loss._total_loss_mean`. Registry entry `loss_tracker`."""
    if isinstance(model, keras.Model):
        return model._loss_tracker
    return model.compiled_loss._total_loss_mean


def set_initial_epoch(model, epoch):
    """The epoch the next `model.fit` starts from whatever its `initial_epoch` argument
    (None: the argument's). Registry entry `initial_epoch`."""
    model._initial_epoch = epoch


def initial_epoch(model):
    """The epoch a callback asked the next `fit` to start from (Keras's `BackupAndRestore`
    writes it in `on_train_begin`), or None. Registry entry `initial_epoch`."""
    return getattr(model, "_initial_epoch", None)


@contextlib.contextmanager
def uninitialized_variables_kept():
    """Within, variables Keras registers as waiting to be initialized are taken off its
    list again at exit (the list is restored as it was). Registry entry
    `uninitialized_variables`."""
    waiting = list(_global_state.get_global_attribute("uninitialized_variables") or [])
    try:
        yield
    finally:
        _global_state.set_global_attribute("uninitialized_variables", waiting)


def variable_storage(variable):
    """The storage a Keras variable keeps in `_value` (None if it has none). Registry
    entry `variable_storage`."""
    return getattr(variable, "_value", None)
