"""Pipeline schedules as data: per stage, the ordered list of actions it runs.

A schedule is `list[list[Action]]`: entry `s` is what stage `s` does, in order. Stage `s`
holds `V` model chunks; chunk `c` of stage `s` is global virtual stage `c * K + s`, so a
micro-batch flows through stages 0..K-1 once per chunk (Megatron's interleaving). With
`V = 1` a virtual stage is just a stage. Chimera (`chimera_schedule`) is the exception: a
`BidirectionalSchedule` whose chunk 1 is a second pipeline running the other way, so that
chunk 1 of stage `s` is virtual stage `K - 1 - s` (`virtual_stage` maps both).

Pure Python, no TensorFlow: schedules can be printed, checked and simulated alone.

    python -m tfpar.pipeline.schedule --stages 4 --microbatches 8 --schedule 1f1b
"""

import argparse
import dataclasses

from tfpar import compat
from tfpar.errors import ConfigError, TfparError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "chimera")


class ScheduleError(TfparError):
    """A schedule that cannot run: deadlock, missing or duplicate action."""


class BidirectionalSchedule(list):
    """A schedule of two pipelines over the same K stages (Chimera): chunk 0 of stage `s`
    is virtual stage `s` of the "down" pipeline, chunk 1 is virtual stage `K - 1 - s` of
    the "up" one. Each micro-batch takes one of them; the two chunks of one virtual stage
    are copies of the same weights (the executor sums their gradients)."""


def virtual_stage(schedule, s, action):
    """Where stage `s`'s `action` sits in its micro-batch's path through the model: the
    virtual stage it runs (0 is the model's input end). `chunk * K + s`, except on a
    `BidirectionalSchedule`'s chunk 1: `K - 1 - s`."""
    K = len(schedule)
    if isinstance(schedule, BidirectionalSchedule) and action.chunk == 1:
        return K - 1 - s
    return action.chunk * K + s


def path_length(schedule):
    """The virtual stages a micro-batch passes: K·V, or K for a `BidirectionalSchedule`."""
    return len(schedule) * (1 if isinstance(schedule, BidirectionalSchedule)
                            else chunks_of(schedule))


@dataclasses.dataclass(frozen=True)
class Action:
    """One forward ('F'), backward ('B') or weight-gradient pass ('W') of one micro-batch
    through one model chunk.

    In schedules without 'W' actions a backward computes the input gradient and the weight
    gradients together. With them (zero-bubble schedules) 'B' computes only the input
    gradient, which the previous stage waits for, and 'W' the weight gradients, which
    nobody waits for and which can therefore fill the pipeline's idle slots.

    Args:
        kind: 'F', 'B' or 'W'.
        microbatch: micro-batch index in [0, M).
        chunk: model chunk (virtual stage slot) of this stage in [0, V).
    """
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def _check_sizes(K, M, V=1):
    for name, value in (("pipeline_stages", K), ("microbatches", M), ("virtual_stages", V)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, value, "must be an integer >= 1")


def gpipe_schedule(K, M):
    """GPipe (fill-drain): every stage runs all M forwards, then all M backwards.

    Args:
        K: number of stages. M: number of micro-batches.
    Returns:
        list of K action lists. Every stage stashes all M micro-batches at the peak.
    """
    _check_sizes(K, M)
    return [[Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
            for _ in range(K)]


def one_f_one_b_schedule(K, M):
    """1F1B (PipeDream-Flush): stage s runs K-s-1 warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards.

    Args:
        K: number of stages. M: number of micro-batches.
    Returns:
        list of K action lists. Stage s stashes at most min(K - s, M) micro-batches.
    """
    _check_sizes(K, M)
    schedule = []
    for s in range(K):
        warmup = min(K - s - 1, M)
        actions = [Action("F", m) for m in range(warmup)]
        for i in range(M - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", m) for m in range(M - warmup, M)]
        schedule.append(actions)
    return schedule


def interleaved_schedule(K, M, V):
    """Interleaved 1F1B (Megatron-LM): each stage holds V model chunks; the bubble shrinks
    by V at the cost of V times more stage-to-stage transfers.

    Micro-batches go through the chunks in groups of K: stage s runs forwards of
    micro-batches 0..K-1 on chunk 0, then the same group on chunk 1, ... and backwards
    in the mirrored order (last chunk first).

    Args:
        K: number of stages. M: number of micro-batches, a multiple of K.
        V: model chunks per stage (virtual stages), >= 1.
    Returns:
        list of K action lists, each with M * V forwards and M * V backwards.
    Raises:
        ConfigError: M is not a multiple of K (the grouping above needs whole groups).
    """
    _check_sizes(K, M, V)
    compat.enforce(compat.INTERLEAVED_MICROBATCHES, compat.view(
        schedule="interleaved", pipeline_stages=K, microbatches=M, virtual_stages=max(V, 2)))
    total = M * V

    def action(kind, k):  # k-th forward (or backward) of this stage -> Action
        group, slot = divmod(k, K * V)
        chunk = slot // K
        return Action(kind, group * K + slot % K, V - 1 - chunk if kind == "B" else chunk)

    schedule = []
    for s in range(K):
        # Megatron's warm-up: enough forwards that chunk 0's outputs reach the last chunk.
        warmup = total if M == K else min((K - s - 1) * 2 + (V - 1) * K, total)
        actions = [action("F", k) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [action("F", warmup + i), action("B", i)]
        actions += [action("B", k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zero_bubble_h1_schedule(K, M):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with every
    backward split into the input-gradient pass 'B' and the weight-gradient pass 'W'.

    Built by list scheduling with F, B and W of equal cost: whenever a stage is free it
    runs, in this order of preference, a B whose input gradient has arrived (the critical
    path between stages), an F if fewer than K micro-batches are between their F and
    their W (1F1B's peak, on its first stage: no stage stashes more than 1F1B's worst),
    else the oldest pending W. The W passes thus fill slots where 1F1B waits for the next
    stage. With K=2 the bubble is the ideal (K-1)/(3M+K-1), a third of 1F1B's idle time;
    with more stages the memory limit keeps it above that (K=4, M=8: 0.172 against
    1F1B's 0.273; see `theory_bubble`).

    Args:
        K: number of stages. M: number of micro-batches.
    Returns:
        list of K action lists, each with M F, M B and M W actions.
    """
    _check_sizes(K, M)
    schedule = [[] for _ in range(K)]
    done = {}  # (kind, mb, stage) -> end time
    free = [0] * K
    next_f, next_b = [0] * K, [0] * K
    pending_w = [[] for _ in range(K)]
    clock = 0
    while any(len(actions) < 3 * M for actions in schedule):
        for s in range(K):
            if free[s] > clock:
                continue
            choice = None
            b = next_b[s]
            if b < next_f[s] and done.get(("F", b, s), clock + 1) <= clock and (
                    s == K - 1 or done.get(("B", b, s + 1), clock + 1) <= clock):
                choice = Action("B", b)
                next_b[s] += 1
                pending_w[s].append(b)
            elif next_f[s] < M and next_f[s] - next_b[s] + len(pending_w[s]) < K and (
                    s == 0 or done.get(("F", next_f[s], s - 1), clock + 1) <= clock):
                choice = Action("F", next_f[s])
                next_f[s] += 1
            elif pending_w[s]:
                choice = Action("W", pending_w[s].pop(0))
            if choice is not None:
                schedule[s].append(choice)
                free[s] = done[(choice.kind, choice.microbatch, s)] = clock + 1
        clock += 1
    return schedule


def chimera_schedule(K, M):
    """Chimera (Li and Hoefler, SC'21): two 1F1B pipelines in opposite directions over the
    same K stages. Stage `s` holds virtual stage `s` of the "down" pipeline (chunk 0) and a
    copy of virtual stage `K - 1 - s` for the "up" one (chunk 1); even micro-batches go
    down, odd ones up. One pipeline's warm-up and drain fall where the other has work, so
    the bubble is below 1F1B's at the cost of a second copy of the weights per stage
    (`tfpar.pipeline.executor` sums both copies' gradients, so they stay equal).

    Built by list scheduling with a forward of cost 1 and a backward of cost 2: whenever a
    stage is free it runs the forward (of either pipeline) whose input arrived first, if
    that pipeline has fewer than K - p micro-batches between forward and backward on its
    virtual stage p here (1F1B's limit, per pipeline), else the backward whose inputs
    arrived first (each pipeline's in micro-batch order). The bubble is about half of
    1F1B's (`simulate`: K=4, M=8 0.143 against 0.273; K=8, M=16 0.238 against 0.304); a
    stage stashes up to K + 1 micro-batches (1F1B: K), both pipelines together.

    Args:
        K: number of stages. M: number of micro-batches, even (half go each way).
    Returns:
        a `BidirectionalSchedule` of K action lists, each with M forwards and M backwards
        (chunk 0 for even micro-batches, 1 for odd).
    Raises:
        ConfigError: M is odd (`tfpar.compat.CHIMERA_MICROBATCHES`).
    """
    _check_sizes(K, M)
    compat.enforce(compat.CHIMERA_MICROBATCHES, compat.view(
        schedule="chimera", pipeline_stages=max(K, 2), microbatches=M))
    schedule = BidirectionalSchedule([] for _ in range(K))
    done = {}  # (kind, mb, virtual stage) -> end time
    free = [0] * K
    issued = [[0, 0] for _ in range(K)]  # per stage and direction: forwards issued
    stashed = [[[], []] for _ in range(K)]  # per stage and direction: mbs awaiting B
    never = float("inf")
    clock, remaining = 0, 2 * M * K
    while remaining:
        for s in range(K):
            if free[s] > clock:
                continue
            best = None  # (ready time, kind, direction, micro-batch)
            for d in (0, 1):
                p, m = s if d == 0 else K - 1 - s, 2 * issued[s][d] + d
                if m < M and len(stashed[s][d]) < K - p:
                    ready = done.get(("F", m, p - 1), never) if p > 0 else 0
                    if ready <= clock and (best is None or ready < best[0]):
                        best = (ready, "F", d, m)
            for d in (0, 1) if best is None else ():
                p, queue = s if d == 0 else K - 1 - s, stashed[s][d]
                if queue:
                    m = queue[0]
                    ready = max([done.get(("F", m, p), never)] + (
                        [done.get(("B", m, p + 1), never)] if p < K - 1 else []))
                    if ready <= clock and (best is None or ready < best[0]):
                        best = (ready, "B", d, m)
            if best is None:
                continue
            _, kind, d, m = best
            if kind == "F":
                issued[s][d] += 1
                stashed[s][d].append(m)
            else:
                stashed[s][d].pop(0)
            schedule[s].append(Action(kind, m, d))
            p = s if d == 0 else K - 1 - s
            free[s] = done[(kind, m, p)] = clock + (1 if kind == "F" else 2)
            remaining -= 1
        clock += 1
    return schedule


def make_schedule(name, K, M, V=1):
    """The schedule called `name` ('gpipe', '1f1b', 'interleaved', 'zb_h1' or 'chimera')
    for K stages, M micro-batches and V virtual stages (V is used by 'interleaved' only).

    Raises:
        ConfigError: unknown name, or sizes the schedule cannot take.
    """
    if name == "gpipe":
        return gpipe_schedule(K, M)
    if name == "1f1b":
        return one_f_one_b_schedule(K, M)
    if name == "interleaved":
        return interleaved_schedule(K, M, V)
    if name == "zb_h1":
        return zero_bubble_h1_schedule(K, M)
    if name == "chimera":
        return chimera_schedule(K, M)
    raise ConfigError("schedule", name, f"choose one of {', '.join(SCHEDULES)}")


def chunks_of(schedule):
    """V: the number of model chunks a schedule uses per stage."""
    return 1 + max(a.chunk for actions in schedule for a in actions)


def theory_bubble(K, M, V=1, name=None):
    """Idle fraction of a balanced pipeline: (K-1) / (V*M + K-1).

    For 'zb_h1' it is the bubble of the schedule simulated with F, B and W of equal cost
    (B+W is 1F1B's backward): (K-1) / (3M + K-1) for K=2, more for deeper pipelines,
    where the schedule's memory limit leaves some idle time. For 'chimera' it is the
    bubble of the schedule simulated with a backward twice a forward.
    """
    if name == "zb_h1":
        return simulate(zero_bubble_h1_schedule(K, M), K, M, 1, 1.0, 2.0).bubble
    if name == "chimera":
        return simulate(chimera_schedule(K, M), K, M, 2, 1.0, 2.0).bubble
    return (K - 1) / (V * M + K - 1)


def has_weight_passes(schedule):
    """True when the schedule splits backwards into 'B' (input) and 'W' (weights)."""
    return any(a.kind == "W" for actions in schedule for a in actions)


@dataclasses.dataclass
class Simulation:
    """What `simulate` found.

    timeline: per stage, list of (Action, start, end) in execution order.
    makespan: time from the first start to the last end.
    bubble: idle fraction over all stages, 1 - busy / (K * makespan).
    peak_stash: per stage, the most micro-batch chunks whose forward has run and whose
        backward has not (activations that must be kept).
    """
    timeline: list
    makespan: float
    bubble: float
    peak_stash: list


def _validate(schedule, K, M, V):
    if len(schedule) != K:
        raise ScheduleError(f"schedule has {len(schedule)} stage lists, expected {K}")
    kinds = "FBW" if has_weight_passes(schedule) else "FB"
    if isinstance(schedule, BidirectionalSchedule):  # micro-batch m takes chunk m % 2
        want = {(k, m, m % 2) for k in kinds for m in range(M)}
    else:
        want = {(k, m, c) for k in kinds for m in range(M) for c in range(V)}
    for s, actions in enumerate(schedule):
        seen = set()
        for a in actions:
            key = (a.kind, a.microbatch, a.chunk)
            if key not in want:
                raise ScheduleError(f"stage {s}: action {a} is out of range for M={M}, V={V}")
            if key in seen:
                raise ScheduleError(f"stage {s}: action {a} appears twice")
            seen.add(key)
        if seen != want:
            missing = sorted(want - seen)[0]
            raise ScheduleError(f"stage {s}: action {Action(*missing)} is missing")


def simulate(schedule, K, M, V=1, f_cost=1.0, b_cost=2.0, w_cost=None):
    """Runs the per-stage lists against the cross-stage dependencies and times them.

    Each stage runs its actions in order, one at a time. Forward of virtual stage v
    (`virtual_stage`) needs
    the forward of v-1 (same micro-batch); backward of v needs its own forward and the
    backward of v+1; a weight pass W needs its own B. Transfers are free. A micro-batch
    stays stashed from its F to its last backward action (W where there is one).

    Args:
        schedule: list of K action lists. K, M, V: stages, micro-batches, chunks per stage
            (a `BidirectionalSchedule`'s two directions need no V: it is ignored).
        f_cost, b_cost: time of one forward / whole backward of one chunk: a number, or one
            per stage (a list of K: stages of unequal cost).
        w_cost: with W actions, the part of `b_cost` the W pass takes (a number or one per
            stage; default half), B takes the rest.
    Returns:
        a `Simulation`.
    Raises:
        ScheduleError: an action is missing, duplicated or out of range, or the
            schedule deadlocks (named: which stage waits for what).
    """
    _validate(schedule, K, M, V)
    split = has_weight_passes(schedule)
    per_stage = [c if isinstance(c, (list, tuple)) else [c] * K
                 for c in (f_cost, b_cost, w_cost)]
    if per_stage[2] == [None] * K:
        per_stage[2] = [b / 2 for b in per_stage[1]]
    cost = [{"F": f, "B": b - w if split else b, "W": w} for f, b, w in zip(*per_stage)]
    releases = "W" if split else "B"
    last = path_length(schedule) - 1
    done = {}  # (kind, mb, virtual stage) -> end time
    pos, free = [0] * K, [0.0] * K
    timeline = [[] for _ in range(K)]
    stash, peak = [0] * K, [0] * K
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for s in range(K):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                v = virtual_stage(schedule, s, a)
                if a.kind == "F":
                    deps = [("F", a.microbatch, v - 1)] if v > 0 else []
                elif a.kind == "W":
                    deps = [("B", a.microbatch, v)]
                else:
                    deps = [("F", a.microbatch, v)] + (
                        [("B", a.microbatch, v + 1)] if v < last else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] for d in deps])
                end = start + cost[s][a.kind]
                done[(a.kind, a.microbatch, v)] = free[s] = end
                timeline[s].append((a, start, end))
                stash[s] += 1 if a.kind == "F" else -1 if a.kind == releases else 0
                peak[s] = max(peak[s], stash[s])
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits = [f"stage {s} waits at {schedule[s][pos[s]]}" for s in range(K)
                     if pos[s] < len(schedule[s])]
            raise ScheduleError("schedule deadlocks: " + "; ".join(waits))
    makespan = max(free)
    busy = sum(e - b for row in timeline for _, b, e in row)
    return Simulation(timeline, makespan, 1.0 - busy / (K * makespan), peak)


def pipeline_metrics(name, K, M, V=1, bubble_measured=None):
    """The `pipeline` block of the metrics JSON for a schedule (theory from `simulate`)."""
    sim = simulate(make_schedule(name, K, M, V), K, M, V)
    block = {"stages": K, "microbatches": M, "schedule": name, "virtual_stages": V,
             "bubble_theory": theory_bubble(K, M, V, name),
             "peak_stashed_microbatches": max(sim.peak_stash)}
    if bubble_measured is not None:
        block["bubble_measured"] = bubble_measured
    return block


def draw(sim, unit=1.0, width=None):
    """The timeline as text: one row per stage, `width` characters per `unit` of time
    (default: wide enough for the longest label).

    Forwards show as `F<mb>`, backwards as `B<mb>`, weight passes as `W<mb>` (`.c` adds the
    chunk), idle as dots.
    """
    width = width or 1 + max(len(str(a)) for row in sim.timeline for a, _, _ in row)
    rows = []
    for s, row in enumerate(sim.timeline):
        line, t = "", 0.0
        for a, start, end in row:
            line += "." * round((start - t) / unit * width)
            cells = round((end - start) / unit * width)
            label = str(a)[:max(cells - 1, 1)]
            line += (label + ("-" if a.kind != "F" else " ") * cells)[:cells - 1] + "|"
            t = end
        rows.append(f"stage {s}: {line}")
    return "\n".join(rows)


def main(argv=None):
    # argparse, not absl flags: absl would register --microbatches globally and clash with
    # tfpar.flags whenever both modules are imported.
    p = argparse.ArgumentParser(prog="python -m tfpar.pipeline.schedule",
                                description="Print a pipeline schedule's timeline and bubble.")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages K")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches M")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--virtual_stages", type=int, default=2,
                   help="model chunks per stage V (interleaved only)")
    p.add_argument("--f_cost", type=float, default=1.0, help="time of one forward")
    p.add_argument("--b_cost", type=float, default=2.0, help="time of one backward")
    args = p.parse_args(argv)
    V = args.virtual_stages if args.schedule == "interleaved" else 1
    try:
        sched = make_schedule(args.schedule, args.stages, args.microbatches, V)
    except TfparError as err:
        p.exit(2, f"tfpar: error: {err}\n")
    sim = simulate(sched, args.stages, args.microbatches, V, args.f_cost, args.b_cost)
    print(draw(sim, unit=min(args.f_cost, args.b_cost)))
    print(f"schedule={args.schedule} K={args.stages} M={args.microbatches} V={V} "
          f"makespan={sim.makespan:g} bubble={sim.bubble:.3f} "
          f"theory={theory_bubble(args.stages, args.microbatches, V, args.schedule):.3f} "
          f"peak_stash={sim.peak_stash}")


if __name__ == "__main__":
    main()
