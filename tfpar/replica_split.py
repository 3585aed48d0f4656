"""A step's examples over data-parallel replicas that need not divide them. Imports no
TensorFlow.

Step `s` takes examples `s*E … s*E+E-1` (`tfpar.data`) whatever the number of replicas `R`.
When `R` divides `E` (and each replica's share splits into the accumulation's micro-steps)
replica `r` takes `E/R` consecutive examples, as always. Otherwise replica `r` takes
`E//R` or `E//R + 1` consecutive examples (the first `E % R` replicas one more: 22/21/21
for 64 over 3) and every replica's batch is padded to the same `padded` size with copies
of an example whose weight is zero, so the replicas run one shape.

Keras's default reduction (`sum_over_batch_size`) divides a replica's weighted loss sum by
its batch size, padding included, and by `R` (Keras's loss scaling for a distribution
strategy); the replicas' gradients are then summed. So the summed
gradient is that of `sum(w·loss) / (padded·R)`. The global batch's mean loss is
`sum(w·loss) / E`: real examples carry the weight `padded·R / E` (`weight`), which makes
the two equal, and weighted metrics are unchanged (the factor is the same on every
replica and cancels in `sum(w·m) / sum(w)`). With accumulation over `k` micro-steps each
micro-batch is `padded / k` and the `k` gradients are averaged: the same factor holds.

>>> split = split_examples(64, replicas=3)
>>> split.counts, split.offsets, split.padded, split.even, split.weight
((22, 21, 21), (0, 22, 43), 22, False, 1.03125)
>>> split_examples(64, replicas=4).even
True
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReplicaSplit:
    """Where one step's `examples` go over `replicas`, each batch cut into `microsteps`.

    Args:
        counts: real examples of each replica (consecutive, replica 0 first).
        offsets: each replica's first example within the step.
        padded: examples each replica computes on (real and padding), a multiple of
            `microsteps`.
    """

    examples: int
    replicas: int
    microsteps: int
    counts: tuple
    offsets: tuple
    padded: int

    @property
    def even(self):
        """True when no replica needs padding: every replica takes `padded` real examples."""
        return self.padded * self.replicas == self.examples

    @property
    def weight(self):
        """The weight each real example's loss is multiplied by (padding's is 0) so that the
        replicas' summed gradient is the step's mean-loss gradient; 1.0 when `even`."""
        return self.padded * self.replicas / self.examples

    def describe(self):
        """Real examples per replica: `"22/21/21"`, or `"16"` when even."""
        if self.even:
            return str(self.padded)
        return "/".join(str(c) for c in self.counts)


def split_examples(examples, replicas, microsteps=1):
    """The `ReplicaSplit` of `examples` over `replicas`, each batch cut into `microsteps`
    micro-batches (`grad_accum_steps`). Arguments are integers >= 1 (checked by
    `ParallelConfig`)."""
    base, extra = divmod(examples, replicas)
    counts = tuple(base + (r < extra) for r in range(replicas))
    offsets = tuple(r * base + min(r, extra) for r in range(replicas))
    micro = -(-examples // (replicas * microsteps))  # ceil: every replica's micro-batch size
    return ReplicaSplit(examples, replicas, microsteps, counts, offsets, micro * microsteps)
