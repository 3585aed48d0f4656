"""TensorFlow's private runtime, graph, tracking and DTensor code that tfpar reads, calls or
swaps (tensorflow 2.21.0).

- `graph_control_input`: not a replacement but a call of a private method.
  `PipelineExecutor(one_op_at_a_time=True)` adds a control edge between two ops that already
  exist (each op of a stage waits for the one created before it) with TensorFlow's
  `Operation._add_control_input`, the call `tf.function`'s automatic control dependencies
  make; the public `tf.control_dependencies` works only on ops not yet created.
  `add_control_input` is the one caller; the check looks at the C++ binding's signature and
  at TensorFlow's own use of it in `auto_control_deps`, and adds one edge in a scratch graph.
- `independent_op`: not a replacement but a call. `tfpar.compression.timing` puts
  `tf.timestamp()` ops into a traced step; a timestamp is a stateful op without a resource,
  which `tf.function`'s automatic control dependencies chain in program order with every
  other such op, so one timestamp would hold back the next (and what follows it). The
  function's `AutomaticControlDependencies` (the graph's `experimental_acd_manager`) has
  `run_independently(op)`: the op still runs before the function returns, but is left out
  of every chain. `run_independently` is the one caller; the check looks for the method
  and for the skip in `AutomaticControlDependencies.__exit__`.
- `dtensor_started`: not a replacement but a read. A mesh pipeline and ZeRO-3 must turn
  DTensor's all-reduce combining off before DTensor starts
  (`tfpar.layout.mesh.no_all_reduce_combining`); whether it has started is DTensor's
  private `api._dtensor_singleton`. `dtensor_started` is the one reader; the check looks
  for the singleton in DTensor's source.
- `function_constant_folding`: not a replacement but a setting TensorFlow has no public
  call for. ZeRO-3 turns off the constant folding TensorFlow's function runtime does when
  a function first runs on a device (`OptimizerOptions.opt_level=L0` in the eager
  context's config, before TensorFlow starts; Grappler still folds constants when the
  function is built). On a DTensor mesh each device's thread builds its part of the step
  while the other devices already run theirs; when they have filled the CPU allocator's
  cap, the folding's copy gets no memory and TensorFlow 2.21 copies into the null buffer
  (`tensor::DeepCopy` from `GraphRunner::Run` in `ConstantFold`): a SIGSEGV instead of the
  out-of-memory error. `no_function_constant_folding` is the one writer; the check looks
  for the eager context's `config` starting from its private `_config`.
- `onednn_enabled`: not a replacement but a read. Whether TensorFlow runs oneDNN's CPU
  kernels (`tfpar.cpu_kernels.active`, the metrics JSON's `cpu_kernels`) has no public
  accessor; TensorFlow's own tests ask the private binding
  `_pywrap_util_port.IsMklEnabled`. `onednn_enabled` is the one reader; the check calls
  the binding and expects a bool.
- `tensor_getitem`: a swap while a step is traced. DTensor cannot lay out a
  `StridedSlice` that inserts an axis (`t[None]`); `tfpar.layout.newaxis` rewrites such
  indexing to `tf.expand_dims` inside `tensor_getitem_replaced`, which swaps
  `tf.Tensor.__getitem__` (TensorFlow's `_slice_helper`) and puts it back after. The
  check compares `_slice_helper`'s signature, which the replacement falls back to.
- `op_callbacks`: a callback while a step is traced. DTensor lays out a `tf.concat` with a
  negative axis wrongly (`tfpar.layout.concat_axis` says how); while a mesh step is
  traced, `op_callback_added` adds TensorFlow's thread-local op callback (the hook tfdbg's
  `check_numerics` uses), through which each new `ConcatV2`'s output is relaid out, and
  removes it after. The check compares `add_op_callback`'s and `remove_op_callback`'s
  signatures and looks for the callbacks' call in `op_def_library._apply_op_helper`,
  where graph-mode ops are created.
- `vectorized_relayout`: converters registered in `tf.vectorized_map`'s registry. TF 2.21
  has none for DTensor's `Relayout` and `RelayoutLike` (its gradient): `vectorized_map`
  turns each into a `while_loop` over the iterations, and DTensor's expansion of that loop
  crashes the process when the step runs (a segmentation fault, no Python traceback: the
  mesh's per-replica step with `--sequence_parallel`'s activation layouts). Within
  `relayouts_vectorized(stacked_layout)` the stacked value is relaid out once, to
  `stacked_layout(layout)` (the per-iteration layout with the loop's dimension in front);
  outside it the converters raise pfor's `ConversionNotImplementedError`, on which pfor
  falls back to its `while_loop` as before. The check looks for the registry lookup and
  that fallback in `PFor._convert_helper`, and for no converter of TensorFlow's own.
- `trackable_tensors`: subclasses. `tfpar.compression.aggregator.PerReplicaSlot`,
  `tfpar.zero.ShardedSlot` and `tfpar.state.LayoutState` save per-replica or gathered
  state through TensorFlow's `Trackable` by overriding its `_serialize_to_tensors` / `_restore_from_tensors` (the protocol TensorFlow
  documents for custom checkpointed objects, sites in `OVERRIDES`); aggregators hold plain
  containers untracked with `NoDependency` (`no_dependency`). The check compares the
  signatures.
"""

import contextlib
import inspect

import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.core.protobuf import config_pb2 as _config_pb2
from tensorflow.dtensor.python import api as _dtensor_api
from tensorflow.dtensor.python import gen_dtensor_ops as _dtensor_ops
from tensorflow.python.eager import context as _eager_context
from tensorflow.python.framework import auto_control_deps as _auto_control_deps
from tensorflow.python.framework import op_callbacks as _op_callbacks
from tensorflow.python.framework import op_def_library as _op_def_library
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.python.ops.parallel_for import pfor as _pfor
from tensorflow.python.ops import tensor_getitem_override as _getitem_override
from tensorflow.python.trackable import base as _trackable
from tensorflow.python.trackable import data_structures as _data_structures
from tensorflow.python.util import _pywrap_util_port

from tfpar.patches.versions import WRITTEN_FOR, check_entries

ENTRIES = {
    "graph_control_input": ("tensorflow.python.framework.ops.Operation._add_control_input "
                            "(called, not replaced)",
                            "tfpar.pipeline.executor (one_op_at_a_time)"),
    "independent_op": ("tensorflow.python.framework.auto_control_deps."
                       "AutomaticControlDependencies.run_independently (called, not replaced)",
                       "tfpar.compression.timing (the in-step timestamps)"),
    "dtensor_started": ("tensorflow.dtensor.python.api._dtensor_singleton (read, not replaced)",
                        "tfpar.layout.mesh.no_all_reduce_combining"),
    "function_constant_folding": ("tensorflow.python.eager.context.Context._config "
                                  "(written before TensorFlow starts, not replaced)",
                                  "tfpar.backends.dtensor (zero_stage=3)"),
    "onednn_enabled": ("tensorflow.python.util._pywrap_util_port.IsMklEnabled (called, not "
                       "replaced)", "tfpar.cpu_kernels.active"),
    "tensor_getitem": ("tf.Tensor.__getitem__ (swapped while a step is traced)",
                       "tfpar.layout.newaxis.expand_dims_for_newaxis"),
    "op_callbacks": ("tensorflow.python.framework.op_callbacks.add_op_callback/"
                     "remove_op_callback (called while a step is traced, not replaced)",
                     "tfpar.layout.concat_axis.concat_axis_whole"),
    "vectorized_relayout": ("tensorflow.python.ops.parallel_for.pfor's converter registry "
                            "(Relayout, RelayoutLike added, nothing replaced)",
                            "tfpar.layout.activations.per_replica"),
    "trackable_tensors": ("tensorflow.python.trackable.base.Trackable._serialize_to_tensors/"
                          "_restore_from_tensors (overridden at the OVERRIDES sites), "
                          "data_structures.NoDependency",
                          "tfpar.compression.aggregator, tfpar.zero, tfpar.state"),
}
OVERRIDES = {
    (module, cls, method): "trackable_tensors"
    for module, cls in (("tfpar.compression.aggregator", "PerReplicaSlot"),
                        ("tfpar.zero.sharded", "ShardedSlot"), ("tfpar.state", "LayoutState"))
    for method in ("_serialize_to_tensors", "_restore_from_tensors")}
# `graph_control_input`: the binding's signature (tensorflow 2.21.0) and TensorFlow's own call.
_EXPECTED_CONTROL_INPUT = {
    "signature": "(self: object, arg0: object) -> None",
    "auto_control_deps": "op._add_control_input(o)",
}
# `function_constant_folding`: the eager context builds its ConfigProto from `_config`.
_EXPECTED_CONTEXT_CONFIG = "config.CopyFrom(self._config)"
_EXPECTED_DTENSOR_SINGLETON = "_dtensor_singleton = None"
_ONEDNN_READER = "IsMklEnabled"  # `onednn_enabled`: the binding TensorFlow's tests ask
_TENSOR_GETITEM = tf.Tensor.__getitem__  # TensorFlow's own
FRAGMENTS = {
    "tensor_getitem": [
        ("tf.Tensor.__getitem__", lambda: ("signature", _TENSOR_GETITEM),
         "(tensor, slice_spec, var=None)"),
        ("tf.Tensor.__getitem__", lambda: _TENSOR_GETITEM, "def _slice_helper(")],
    "op_callbacks": [
        ("op_callbacks.add_op_callback",
         lambda: ("signature", _op_callbacks.add_op_callback), "(callback_fn)"),
        ("op_callbacks.remove_op_callback",
         lambda: ("signature", _op_callbacks.remove_op_callback), "(op_callback)"),
        ("op_def_library._apply_op_helper", lambda: _op_def_library._apply_op_helper,
         "op_callbacks.invoke_op_callbacks(")],
    "vectorized_relayout": [
        ("pfor.PFor._convert_helper", lambda: _pfor.PFor._convert_helper,
         "converter = _pfor_converter_registry.get(y_op.type, None)"),
        ("pfor.PFor._convert_helper", lambda: _pfor.PFor._convert_helper,
         "except ConversionNotImplementedError as e:"),
        ("pfor.RegisterPFor", lambda: ("signature", _pfor.RegisterPFor), "(op_type)"),
        ("pfor._PforInput.stack_inputs", lambda: ("signature", _pfor._PforInput.stack_inputs),
         "(self, stack_indices=None, tile_variants=False)")],
    "independent_op": [
        ("AutomaticControlDependencies.run_independently",
         lambda: ("signature", _auto_control_deps.AutomaticControlDependencies.run_independently),
         "(self, op)"),
        ("AutomaticControlDependencies.__exit__",
         lambda: _auto_control_deps.AutomaticControlDependencies.__exit__,
         "if op in self._independent_ops:")],
    "trackable_tensors": [
        ("Trackable._serialize_to_tensors",
         lambda: ("signature", _trackable.Trackable._serialize_to_tensors), "(self)"),
        ("Trackable._restore_from_tensors",
         lambda: ("signature", _trackable.Trackable._restore_from_tensors),
         "(self, restored_tensors)"),
        ("NoDependency", lambda: ("signature", _data_structures.NoDependency.__init__),
         "(self, value)")],
}


def check(names):
    """Problems of this module's `ENTRIES` among `names`."""
    problems = []
    if "graph_control_input" in names:
        problems += _check_control_input()
    if "dtensor_started" in names and _EXPECTED_DTENSOR_SINGLETON not in inspect.getsource(
            _dtensor_api):
        problems.append(f"tensorflow {tf.__version__} changed dtensor's api._dtensor_singleton; "
                        "tfpar.layout.mesh was written for tensorflow "
                        f"{WRITTEN_FOR['tensorflow']}")
    if "function_constant_folding" in names and (
            _EXPECTED_CONTEXT_CONFIG not in inspect.getsource(_eager_context.Context.config.fget)
            or "self._initialized = False" not in inspect.getsource(
                _eager_context.Context.__init__)):
        problems.append(f"tensorflow {tf.__version__} changed the eager Context's _config; "
                        "tfpar.patches.no_function_constant_folding was written for "
                        f"tensorflow {WRITTEN_FOR['tensorflow']}")
    if "onednn_enabled" in names and not isinstance(
            getattr(_pywrap_util_port, _ONEDNN_READER, lambda: None)(), bool):
        problems.append(f"tensorflow {tf.__version__} changed _pywrap_util_port."
                        f"{_ONEDNN_READER}; tfpar.cpu_kernels was written for tensorflow "
                        f"{WRITTEN_FOR['tensorflow']}")
    if "tensor_getitem" in names and _TENSOR_GETITEM is not _getitem_override._slice_helper:
        problems.append(f"tensorflow {tf.__version__}: tf.Tensor.__getitem__ is no longer "
                        "tensor_getitem_override._slice_helper (registry entry "
                        "tensor_getitem)")
    if "vectorized_relayout" in names and not _relayout_converters_ours():
        problems.append(f"tensorflow {tf.__version__} has its own vectorized Relayout or "
                        "RelayoutLike (registry entry vectorized_relayout); tfpar's were "
                        f"written for tensorflow {WRITTEN_FOR['tensorflow']}, which had none")
    problems += check_entries(names, "tensorflow", FRAGMENTS, ENTRIES)
    return problems


def _check_control_input():
    method = getattr(_tf_ops.Operation, "_add_control_input", None)
    found = [
        method is not None and _EXPECTED_CONTROL_INPUT["signature"] in (method.__doc__ or ""),
        _EXPECTED_CONTROL_INPUT["auto_control_deps"] in inspect.getsource(
            _auto_control_deps.AutomaticControlDependencies.__exit__),
    ]
    if all(found):
        graph = tf.Graph()
        with graph.as_default():
            a, b = tf.constant(1.0), tf.constant(2.0)
            add_control_input(b.op, a.op)
            found.append(list(b.op.control_inputs) == [a.op])
    if all(found):
        return []
    return [f"tensorflow {tf.__version__} changed Operation._add_control_input; "
            "PipelineExecutor(one_op_at_a_time=True) was written for tensorflow "
            f"{WRITTEN_FOR['tensorflow']}"]


def add_control_input(op, before):
    """Makes graph op `op` wait for op `before` (both already created; graph building
    only). Registry entry `graph_control_input`."""
    op._add_control_input(before)


def run_independently(op):
    """Leaves graph op `op` (just created inside a `tf.function` being traced) out of the
    function's automatic control dependencies: it runs once its own inputs and control
    inputs have, waits for no other stateful op and holds none back; it still runs before
    the function returns. Registry entry `independent_op`.

    Raises:
        RuntimeError: not inside a `tf.function` being traced.
    """
    manager = getattr(op.graph, "experimental_acd_manager", None)
    if manager is None:
        raise RuntimeError(f"run_independently({op.name}): only inside a tf.function being "
                           "traced")
    manager.run_independently(op)


def dtensor_started():
    """Whether DTensor has started in this process. Registry entry `dtensor_started`."""
    return getattr(_dtensor_api, "_dtensor_singleton", None) is not None


def onednn_enabled():
    """Whether this process's TensorFlow runs oneDNN's CPU kernels. Registry entry
    `onednn_enabled`."""
    return bool(getattr(_pywrap_util_port, _ONEDNN_READER)())


def no_function_constant_folding():
    """Turns off the constant folding of TensorFlow's function runtime for this process
    (see the module docstring). Registry entry `function_constant_folding`.

    Returns:
        Whether it is off: False when TensorFlow already started in this process (its
        config is read once), which changes nothing but the out-of-memory path.
    """
    ctx = _eager_context.context()
    if ctx._initialized:
        return ctx._config is not None and (ctx._config.graph_options.optimizer_options
                                            .opt_level == _config_pb2.OptimizerOptions.L0)
    config = _config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    config.graph_options.optimizer_options.opt_level = _config_pb2.OptimizerOptions.L0
    ctx._config = config
    return True


@contextlib.contextmanager
def tensor_getitem_replaced(getitem):
    """Within, `tensor[spec]` calls `getitem(tensor, spec)`; the previous `__getitem__`
    after. Registry entry `tensor_getitem`."""
    previous = tf.Tensor.__getitem__
    tf.Tensor.__getitem__ = getitem
    try:
        yield
    finally:
        tf.Tensor.__getitem__ = previous


@contextlib.contextmanager
def op_callback_added(callback):
    """Within, on this thread, every op created while a graph is built is handed to
    `callback(op_type, inputs, attrs, outputs, op_name=None, graph=None)`, which may return
    tensors that replace the op's outputs. Registry entry `op_callbacks`."""
    _op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        _op_callbacks.remove_op_callback(callback)


def tensor_getitem(tensor, spec):
    """TensorFlow's own `tensor[spec]` (whatever `__getitem__` is now). Registry entry
    `tensor_getitem`."""
    return _TENSOR_GETITEM(tensor, spec)


Trackable = _trackable.Trackable  # registry entry `trackable_tensors`


def no_dependency(value):
    """`value` held by a trackable without being tracked (not saved in its checkpoint).
    Registry entry `trackable_tensors`."""
    return _data_structures.NoDependency(value)


# `vectorized_relayout`: the stacked layout of a relayout inside `relayouts_vectorized`.
_STACKED_LAYOUT = None
_RELAYOUT_OPS = ("Relayout", "RelayoutLike")


@contextlib.contextmanager
def relayouts_vectorized(stacked_layout):
    """Within, `tf.vectorized_map` vectorizes DTensor's `Relayout` of a value that differs
    per iteration into one relayout of the stacked value to `stacked_layout(layout)` (a
    `dtensor.Layout` of one more dimension, the loop's first), and its gradient
    `RelayoutLike` into one of the stacked values. Registry entry `vectorized_relayout`.

    Args:
        stacked_layout: `dtensor.Layout -> dtensor.Layout`, the per-iteration layout to
            the stacked value's.
    """
    global _STACKED_LAYOUT
    _register_relayout_converters()
    before, _STACKED_LAYOUT = _STACKED_LAYOUT, stacked_layout
    try:
        yield
    finally:
        _STACKED_LAYOUT = before


def _register_relayout_converters():
    """tfpar's converters, where TensorFlow has none (`check` reports one of its own)."""
    for op, mine in zip(_RELAYOUT_OPS, _CONVERTERS):
        if op not in _pfor._pfor_converter_registry:
            _pfor.RegisterPFor(op)(mine)


def _relayout_converters_ours():
    """No converter for the relayout ops but tfpar's (none before tfpar registers)."""
    return all(_pfor._pfor_converter_registry.get(op) in (None, mine)
               for op, mine in zip(_RELAYOUT_OPS, _CONVERTERS))


def _outside():
    # pfor falls back to its `while_loop` on this error, as it did with no converter.
    return _pfor.ConversionNotImplementedError(
        "a relayout vectorized outside tfpar's relayouts_vectorized")


def _vectorized_relayout(pfor_input):
    if _STACKED_LAYOUT is None:
        raise _outside()
    layout = dtensor.Layout.from_string(pfor_input.get_attr("layout"))
    stacked = _STACKED_LAYOUT(layout)
    return _pfor.wrap(dtensor.relayout(pfor_input.stacked_input(0), stacked), True)


def _vectorized_relayout_like(pfor_input):
    if _STACKED_LAYOUT is None:
        raise _outside()
    pfor_input.stack_inputs()  # the value and the tensor whose layout it takes
    value, like = pfor_input.stacked_input(0), pfor_input.stacked_input(1)
    return _pfor.wrap(_dtensor_ops.relayout_like(value, layout_input=like), True)


_CONVERTERS = (_vectorized_relayout, _vectorized_relayout_like)
