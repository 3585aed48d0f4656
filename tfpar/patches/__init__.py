"""The one place where tfpar reaches into Keras, TensorFlow, tf_keras and
tensorflow-model-optimization internals.

Written for keras 3.15.1, tensorflow 2.21.0, tf_keras 2.21.0 and
tensorflow-model-optimization 0.8.1 (pinned in requirements.txt, `WRITTEN_FOR`). Only this
package imports those libraries' private modules (`keras.src`, TensorFlow's `python`
package, `tf_keras.src`, tfmot's `python` package) or touches a private attribute of one of
their objects; the rest of tfpar calls the small functions below.
`tests/test_internals_boundary.py` fails on any such use elsewhere, except the overrides of
a private method that `OVERRIDES` lists, and the calls through `self` that `SELF_CALLS`
lists, each with the entry that checks them.

Every entry of `REGISTRY` (patch -> (its target, who in tfpar uses it)) checks that the
code it replaces, calls or reads is still the code it was written against
(`check_targets()`, `tests/test_patches.py`); a patch refuses to apply otherwise. The
entries, each described in its module's docstring:

- `multi_worker`: `multi_worker_fit`, `multi_worker_cpu_devices` (applied by `apply()`),
  `coordination_barrier`, `coordination_config`, `strategy_workers`, `replica_tokens`,
  `heartbeat_error_text` (TensorFlow's words the launcher reads, checked in its library).
- `keras_mesh`: `mesh_variables`, `mesh_loops`, `mesh_output_layouts` (what
  `tfpar.layout.enable` hooks), `layer_tree`, `backend_mesh`, `distribution_state`,
  `symbolic_build`, `data_adapters`, `mesh_initialize`, `mesh_random`.
- `keras_model`: `function_nodes`, `function_loss`, `train_step_loss`, `loss_tracker`,
  `initial_epoch`, `uninitialized_variables`, `variable_storage`.
- `keras_variables`: `mesh_variable_values` (a Keras variable on a mesh read to and
  written from the host, what `tfpar.layout.enable` hooks for `get_weights`, `save` …),
  `autocast_scope` (mixed precision's variable cast, re-entered in a recomputed forward),
  `stateless_accesses` (the variables a forward in a `StatelessScope` read and wrote).
- `keras_optimizer`: `fused_momentum`, `optimizer_hooks`, `optimizer_base_build`,
  `stateless_optimizer`, `loss_scale_files` (set by `tfpar.DistributedOptimizer`); and
  `mix_in`/`mix_out`, how an optimizer the user built gets (or sheds) a tfpar mixin.
- `tensorflow_runtime`: `graph_control_input`, `independent_op`, `dtensor_started`,
  `function_constant_folding`, `onednn_enabled`, `op_callbacks`, `tensor_getitem`,
  `trackable_tensors`, `vectorized_relayout`.
- `tensorflow_checkpoint`: `checkpoint_snapshot` (a save read now, written later).
- `dtensor_lowering`: `collective_gather_lowering` (DTensor's gathers as all-gathers, an
  environment variable its C++ reads).
- `dtensor_readers`: `per_device_iterator` (per-device `tf.data` iterators packed as one
  iterator on a mesh, as `DTensorDataset` packs its own: host files read inside a step).
- `model_optimization` (tfmot, imported on first use): `tfmot_local_mask`,
  `tfmot_registry`, `tfmot_quantize_layer`.
"""

from tfpar.patches import (keras_mesh, keras_model, keras_optimizer, keras_variables,
                           model_optimization)
from tfpar.patches import dtensor_lowering, dtensor_readers, multi_worker
from tfpar.patches import tensorflow_checkpoint, tensorflow_runtime
from tfpar.patches.dtensor_lowering import COLLECTIVE_GATHER, set_collective_gathers
from tfpar.patches.dtensor_readers import per_device_iterator
from tfpar.patches.keras_mesh import (BACKEND_RANDOM, LIST_DEVICES, MESH_LOOPS,
                                      MESH_LOOP_ARGS, VARIABLE_INITIALIZE,
                                      attach_backend_mesh, backend_mesh, compiled_metrics,
                                      data_adapter, layout_map, set_backend_random,
                                      set_distribute_tensor, set_distribution_initialize,
                                      set_list_devices, set_trainer_loop,
                                      set_variable_initialize, sublayers, symbolic_build,
                                      train_validation_split, variable_initialize_replaced,
                                      variable_layout)
from tfpar.patches.keras_model import (forward_loss, function_loss, functional_of,
                                       initial_epoch, loss_tracker, nodes_by_depth,
                                       set_initial_epoch, uninitialized_variables_kept,
                                       variable_storage)
from tfpar.patches.keras_optimizer import (base_build, built_variables, is_base_optimizer,
                                           is_tf_optimizer, loss_scale_files,
                                           is_stateless_class, mix_in, mix_out, stateless_class,
                                           unmixed_class,
                                           to_stateless)
from tfpar.patches.model_optimization import (input_quantizers, local_mask_pruning,
                                              prunable, prunable_wrappers)
from tfpar.patches.multi_worker import (apply, configure_coordination_service,
                                        cpu_devices_per_worker, is_applied, plain_variable,
                                        replica_index, strategy_workers, wait_at_barrier)
from tfpar.patches.keras_variables import AccessScope, autocast_scope, autocasting
from tfpar.patches.tensorflow_checkpoint import publish as publish_checkpoint
from tfpar.patches.tensorflow_checkpoint import snapshot as checkpoint_snapshot
from tfpar.patches.tensorflow_checkpoint import trace_reads as trace_checkpoint_reads
from tfpar.patches.tensorflow_checkpoint import wait_for_files as wait_for_checkpoint_files
from tfpar.patches.tensorflow_checkpoint import write as write_checkpoint
from tfpar.patches.tensorflow_runtime import (Trackable, add_control_input, dtensor_started,
                                              no_dependency, no_function_constant_folding,
                                              onednn_enabled, op_callback_added,
                                              relayouts_vectorized, run_independently,
                                              tensor_getitem, tensor_getitem_replaced)
from tfpar.patches.versions import WRITTEN_FOR

_MODULES = (multi_worker, keras_mesh, keras_model, keras_optimizer, keras_variables,
            tensorflow_runtime, tensorflow_checkpoint, model_optimization, dtensor_lowering,
            dtensor_readers)
# patch -> (what it replaces, reads or calls; who in tfpar applies or uses it).
REGISTRY = {name: entry for module in _MODULES for name, entry in module.ENTRIES.items()}
# (module, class, method) -> entry: tfpar's overrides of another library's private method,
# the only ones allowed outside this package.
OVERRIDES = {**keras_optimizer.OVERRIDES, **tensorflow_runtime.OVERRIDES}
# (module, class, method) -> entry: private methods of a library class that a tfpar class
# mixed into it calls through `self`, the only such calls allowed outside this package.
SELF_CALLS = dict(keras_optimizer.SELF_CALLS)


def check_targets(names=None):
    """Returns a list of problems: patch targets whose source no longer matches.

    Args:
        names: the `REGISTRY` patches to check (default all).
    """
    names = list(REGISTRY) if names is None else list(names)
    unknown = sorted(set(names) - set(REGISTRY))
    if unknown:
        raise KeyError(f"no registry entry {unknown}; entries: {sorted(REGISTRY)}")
    problems = []
    for module in _MODULES:
        mine = [name for name in names if name in module.ENTRIES]
        if mine:
            problems += module.check(mine)
    return problems
