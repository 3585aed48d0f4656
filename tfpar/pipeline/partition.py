"""Split a Keras model (Sequential, or a functional chain of blocks) into pipeline stages.

The model's graph is read in topological order. A cut may go after an operation only
when exactly one tensor crosses it (branches, e.g. a residual connection, must stay
inside one stage). Among the valid cuts, the split minimises the largest stage cost
(parameter count by default). Each stage becomes a new functional `keras.Model` whose
layers are fresh copies built under the stage's device, so its variables live there, with
the original weights copied in.

Examples:
    >>> stages = partition(model, 2, devices=["/device:CPU:0", "/device:CPU:1"])
    >>> y = stages[1](stages[0](x))
"""

import contextlib

import keras

from tfpar import patches
from tfpar.errors import ConfigError, TfparError
from tfpar.pipeline.placement import variables_on


def _graph(model):
    """Topologically ordered (non-input) nodes of a built single-input, single-output model."""
    functional = patches.functional_of(model)  # Sequential wraps a Functional
    by_depth = patches.nodes_by_depth(functional)
    if by_depth is None or not getattr(model, "inputs", None):
        raise TfparError(f"model {model.name!r} is not built as a graph; give it a "
                         "keras.Input (Sequential) or build it with the functional API")
    if len(functional.inputs) != 1 or len(functional.outputs) != 1:
        raise TfparError(f"model {model.name!r} has {len(functional.inputs)} inputs and "
                         f"{len(functional.outputs)} outputs; pipelining needs one of each")
    nodes = [n for d in sorted(by_depth, reverse=True) for n in by_depth[d]
             if n.operation is not None and not n.is_input]
    return functional, nodes


def _valid_cuts(functional, nodes):
    """{i: the tensor crossing the cut} for each i such that a cut after nodes[i] is
    crossed by exactly one tensor, and what blocks the first invalid cut (for errors)."""
    tensors = {id(functional.inputs[0]): functional.inputs[0]}
    made = {id(functional.inputs[0]): -1}  # tensor -> index of the node producing it
    for i, n in enumerate(nodes):
        for t in n.outputs:
            made[id(t)], tensors[id(t)] = i, t
    last_use = {}  # tensor -> (index of its last consumer, consumer name)
    for i, n in enumerate(nodes):
        for t in n.input_tensors:
            last_use[id(t)] = (i, n.operation.name)
    last_use[id(functional.outputs[0])] = (len(nodes), "the model output")
    cuts, blocker = {}, None
    for i in range(len(nodes) - 1):
        live = [(t, use) for t, use in last_use.items() if made.get(t, -2) <= i < use[0]]
        if len(live) == 1:
            cuts[i] = tensors[live[0][0]]
        elif blocker is None:
            src = {id(t): n.operation.name for n in nodes for t in n.outputs}
            early = min(live, key=lambda tu: made[tu[0]])
            blocker = (f"the output of {src.get(early[0], 'the model input')!r} feeds "
                       f"{early[1][1]!r} across the cut after {nodes[i].operation.name!r}")
    return cuts, blocker


def _cost(op):
    return op.count_params() if isinstance(op, keras.layers.Layer) and op.built else 0


def balanced_bounds(costs, cuts, num_stages):
    """Stage boundaries minimising the most expensive stage.

    Args:
        costs: cost of each unit (node). cuts: indices after which a cut is allowed.
        num_stages: number of stages.
    Returns:
        list of (start, end) unit ranges, one per stage, covering all units.
    """
    n = len(costs)
    ends = [c + 1 for c in cuts] + [n]
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[j][e]: (largest stage cost, sum of squared costs, bounds) splitting units[:e]
    # into j stages; the squared sum breaks ties toward even stages.
    best = [{0: (0, 0, [])}] + [{} for _ in range(num_stages)]
    for j in range(1, num_stages + 1):
        for e in ends:
            for b, (mx, sq, bounds) in best[j - 1].items():
                if b < e:
                    c = prefix[e] - prefix[b]
                    cand = (max(mx, c), sq + c * c, bounds + [(b, e)])
                    if e not in best[j] or cand[:2] < best[j][e][:2]:
                        best[j][e] = cand
    return best[num_stages][n][2]


def partition(model, num_stages, costs=None, devices=None, setting="pipeline_stages"):
    """Splits `model` into `num_stages` stage models, balanced by parameter count.

    Args:
        model: a built keras.Sequential (with a keras.Input) or functional keras.Model with
            one input and one output.
        num_stages: number of stages (K, or K*V for interleaved virtual stages).
        costs: optional cost per operation in topological order (e.g. measured time);
            default: parameter count of each layer.
        devices: optional placement per stage: a device name, or one device per replica
            of the current strategy (`tfpar.pipeline.placement`); each stage's layers (and
            variables) are created there. Default: the current device scope.
        setting: name of the setting reported in errors.
    Returns:
        list of `num_stages` functional keras.Models, named `stage_<i>`; feeding the output
        of each to the next computes `model`.
    Raises:
        ConfigError: num_stages is larger than the number of layers, or costs/devices have
            the wrong length.
        TfparError: the model cannot be cut into that many stages (a branch crosses every
            remaining cut), or it is not a single-input single-output graph.
    """
    functional, nodes = _graph(model)
    if not isinstance(num_stages, int) or num_stages < 1 or num_stages > len(nodes):
        raise ConfigError(setting, num_stages, f"model {model.name!r} has {len(nodes)} "
                          f"layers, so use between 1 and {len(nodes)} stages")
    costs = costs if costs is not None else [_cost(n.operation) for n in nodes]
    if len(costs) != len(nodes):
        raise ConfigError("costs", f"{len(costs)} values", f"give one per layer ({len(nodes)})")
    if devices is not None and len(devices) != num_stages:
        raise ConfigError("devices", devices, f"give one device per stage ({num_stages})")
    cuts, blocker = _valid_cuts(functional, nodes)
    cuts[len(nodes) - 1] = functional.outputs[0]
    cuts[-1] = functional.inputs[0]
    if len(cuts) - 1 < num_stages:
        raise TfparError(f"model {model.name!r} can be cut into at most {len(cuts) - 1} "
                         f"stages, not {num_stages}: {blocker}. Wrap each branching block "
                         "in one layer or use fewer stages.")
    stages = []
    for s, (b, e) in enumerate(balanced_bounds(costs, sorted(cuts)[1:-1], num_stages)):
        with variables_on(devices[s]) if devices else contextlib.nullcontext():
            stages.append(_rebuild(nodes[b:e], cuts[b - 1], cuts[e - 1], s))
    return stages


def _rebuild(nodes, src, out, index):
    """A functional model from tensor `src` to `out` replaying `nodes` with fresh copies of
    their layers."""
    inp = keras.Input(shape=src.shape[1:], dtype=src.dtype, name=f"stage_{index}_input")
    values = {id(src): inp}
    copies = {}
    for n in nodes:
        op = n.operation
        if isinstance(op, keras.layers.Layer):
            if id(op) not in copies:  # a layer applied twice keeps sharing its weights
                copies[id(op)] = (op.__class__.from_config(op.get_config()), op)
            op = copies[id(op)][0]
        args, kwargs = n.arguments.fill_in(values)
        outputs = op(*args, **kwargs)
        for t, v in zip(n.outputs, keras.tree.flatten(outputs)):
            values[id(t)] = v
    for copy, original in copies.values():
        copy.set_weights(original.get_weights())
        if getattr(original, "_tfpar_recomputed", False):  # --recompute=blocks carries over
            from tfpar.recompute import rematerialize
            rematerialize(copy)
    return keras.Model(inp, values[id(out)], name=f"stage_{index}")
