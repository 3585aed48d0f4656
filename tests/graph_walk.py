"""The traced-graph walks the test children share: what an op waits for; the step
function Keras's `fit` traced and the op types in it."""

import collections


def ancestors(*ops):
    """Every op that `ops` wait for, through data inputs or control edges."""
    seen, stack = set(), list(ops)
    while stack:
        node = stack.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def fit_step_graph(model):
    """The step function `fit` traced for `model` (once): its GraphDef, with the library
    of the functions it calls."""
    fit_function = model.train_function
    closure = dict(zip(fit_function.__code__.co_freevars,
                       (cell.cell_contents for cell in fit_function.__closure__)))
    traced = closure["multi_step_on_iterator"]._list_all_concrete_functions()
    assert len(traced) == 1, traced
    return traced[0].graph.as_graph_def()


def op_counts(graph):
    """Op type -> count over a GraphDef and every function in its library (the replicas'
    bodies, the optimizer's update)."""
    counts = collections.Counter(node.op for node in graph.node)
    for function in graph.library.function:
        counts.update(node.op for node in function.node_def)
    return counts
