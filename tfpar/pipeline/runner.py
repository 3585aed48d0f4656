"""The one walk of a pipeline schedule that both executors trace.

A schedule (`tfpar.pipeline.schedule`) says, per stage, which action runs when: `F` (a
micro-batch's forward through one virtual stage), a whole backward, or with zero-bubble
schedules `B` (the input gradient only) and `W` (the weights' gradient). `ScheduleRunner`
traces those actions in simulated start order (every tensor an action needs was made by
an action traced before it) and carries the messages between virtual stages: a forward's
output to the next virtual stage's forward, a backward's input gradient to the previous
virtual stage's backward, and what `B` leaves for its `W`. What an action computes, and
where it runs, is the executor's: `tfpar.pipeline.executor.PipelineExecutor` (stages on
tf.distribute devices) and `tfpar.layout.pipeline.MeshPipelineTrainer` (stages on DTensor
meshes) each hand the runner an object with these methods, where `v` is the stage model
(chunk · K + s) and `ScheduleRunner.position(v)` its virtual stage on the micro-batch's
path (the same number, except on Chimera's second pipeline,
`tfpar.pipeline.schedule.BidirectionalSchedule`):

- `forward(s, v, m, x)`: stage model `v` (on stage `s`) on micro-batch `m`'s input `x`;
  returns its output (the last virtual stage's is not passed on).
- `backward(s, v, m, upstream)`: the whole backward; `upstream` is the output's gradient
  (None on the last virtual stage); returns the input's gradient (ignored on the first).
- `backward_input(s, v, m, upstream)` and `backward_weight(s, v, m, pending)`: a zero-bubble
  schedule's `B` returns `(input gradient, pending)`, and its `W` gets that `pending`.
- `scope(s, action, m)`: a context manager around every action (devices, control edges,
  name scopes), or `contextlib.nullcontext()`.

Ops within the step still run in data-dependency order: the runner fixes the trace order,
which is the order control edges can follow, not the execution order.

Examples:
    >>> from tfpar.pipeline.schedule import make_schedule
    >>> runner = ScheduleRunner(make_schedule("1f1b", 2, 2))
    >>> [(s, a.kind, a.microbatch) for _, s, a in runner.order][:4]
    [(0, 'F', 0), (0, 'F', 1), (1, 'F', 0), (1, 'B', 0)]
"""

from tfpar.pipeline.schedule import (chunks_of, has_weight_passes, path_length, simulate,
                                     virtual_stage)


def trace_order(schedule):
    """Every `(start, stage, action)` of `schedule` in simulated start order (ties by
    stage)."""
    K, V = len(schedule), chunks_of(schedule)
    M = 1 + max(a.microbatch for a in schedule[0])
    sim = simulate(schedule, K, M, V)
    return sorted(((start, s, a) for s in range(K) for a, start, _ in sim.timeline[s]),
                  key=lambda t: t[:2])


class ScheduleRunner:
    """Traces a schedule's actions in order and passes their messages.

    Args:
        schedule: a list of K action lists (`tfpar.pipeline.schedule.make_schedule`).

    Attributes:
        K: stages. V: stage models (chunks) per stage. M: micro-batches.
        last: the last virtual stage on a micro-batch's path (K·V − 1; K − 1 on Chimera).
        split: whether backwards are split into `B` and `W` (zero-bubble schedules).
        order: the actions in trace order, `(start, stage, action)`.
    """

    def __init__(self, schedule):
        self.K, self.V = len(schedule), chunks_of(schedule)
        self.M = 1 + max(a.microbatch for a in schedule[0])
        self.split = has_weight_passes(schedule)
        self.order = trace_order(schedule)
        self.last = path_length(schedule) - 1
        self._positions = {a.chunk * self.K + s: virtual_stage(schedule, s, a)
                           for s, actions in enumerate(schedule) for a in actions}

    def virtual_stage(self, s, action):
        """The stage model an action of stage `s` runs: chunk · K + s."""
        return action.chunk * self.K + s

    def position(self, v):
        """Stage model `v`'s virtual stage on its micro-batches' path (0: the input end)."""
        return self._positions[v]

    def run(self, actions, inputs, groups=1):
        """Traces the schedule `groups` times (gradient accumulation: group g runs
        micro-batches g·M … g·M + M − 1).

        Args:
            actions: the executor's object (the module docstring lists its methods).
            inputs: `inputs(m)`, the first virtual stage's input for micro-batch `m`.
            groups: how many times the schedule runs in this step.
        """
        last = self.last
        for g in range(groups):
            # Keyed by (virtual stage, micro-batch): what the neighbour on the path takes.
            outputs, input_grads, pending = {}, {}, {}
            for _, s, a in self.order:
                v, m = self.virtual_stage(s, a), g * self.M + a.microbatch
                p = self._positions[v]
                with actions.scope(s, a, m):
                    if a.kind == "F":
                        x = inputs(m) if p == 0 else outputs.pop((p - 1, m))
                        out = actions.forward(s, v, m, x)
                        if p < last:
                            outputs[(p, m)] = out
                        continue
                    if a.kind == "W":
                        actions.backward_weight(s, v, m, pending.pop((v, m)))
                        continue
                    upstream = None if p == last else input_grads.pop((p + 1, m))
                    if self.split:
                        grad, pending[(v, m)] = actions.backward_input(s, v, m, upstream)
                    else:
                        grad = actions.backward(s, v, m, upstream)
                    if p > 0:
                        input_grads[(p, m)] = grad
