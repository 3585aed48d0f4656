"""ZeRO: optimizer state, gradients and parameters split over the data-parallel replicas.

- `sharded`: stages 1 and 2 on `tf.distribute` data parallelism (`--zero_stage=1|2`):
  the optimizer's slots as equal flat pieces, one per replica; gradients all-reduced
  (stage 1) or reduce-scattered (stage 2); the updated pieces all-gathered.
- `fsdp`: stage 3 on a DTensor mesh (`--zero_stage=3`): every weight split over the
  `batch` axis with its slots, gathered one layer at a time in the step.

`tfpar.optimizers.make_optimizer` applies stages 1–2 (`sharded.wrap_optimizer`); the
DTensor backend lays out stage 3 (`tfpar.layout.run`, `fsdp.gather_per_layer`). Which
stage runs with what is the rulebook's (`tfpar.compat`).
"""
