"""The traced-graph walk the test children share: what an op waits for."""


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
