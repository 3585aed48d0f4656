"""The planner's cost model: pure arithmetic over a model profile and a hardware description.

A layout (`Candidate`) is data × tensor × pipeline parallelism, micro-batches, virtual
stages (interleaving), the gradient aggregator, activation recomputation and ZeRO stage.
Devices are ordered as Megatron-LM orders them: the `tensor` devices of a model shard are
neighbours, data-parallel peers next, pipeline stages outermost.

Step time (`step_seconds`) = fixed costs (per step, per parameter updated) + the pipeline
(`(M + (K-1)/V)` slots of the slowest stage, each slot the stage's forward and backward
compute on one micro-batch, its tensor-parallel all-reduces and its stage-to-stage sends) +
the data-parallel gradient all-reduce after the last backward, less the share
`Hardware.dp_overlap` of it that hides behind backward (0 unless measured). The model:

- Compute runs at `Hardware.flops` (a sustained matmul rate, not the peak) on 3× the
  forward FLOPs (4× for the blocks with recomputation). The last stage also runs the
  model's head (`Profile.last_flops_per_example`), so stages are only as fast as it.
- A ring all-reduce of S bytes over n peers takes 2(n-1)/n·S/B + 2(n-1)·latency. B is
  the link inside a machine when all peers share one; otherwise the devices' network
  interfaces, each peer group using as many in parallel as it has members per machine
  (NCCL runs one ring per interface): min(intra, members_per_machine · inter).
- The hierarchical all-reduce (`Candidate.allreduce`, data parallelism over several
  machines): an all-reduce inside each machine, a ring of one leader per machine on the
  machine's whole network share, a hand-back inside (`data_parallel_seconds`).
- Chimera (`Candidate.schedule`): its simulated schedule's idle slots (`idle_slots`),
  the exchange between a stage and its mirror (`chimera_sync_seconds`), two copies of
  the weights and gradients with one optimizer state (`memory_bytes`).
- Tensor parallelism all-reduces a block's output `tp_syncs_per_block` times forward, as
  many backward, and again when the block is recomputed. Stage-to-stage sends carry one
  block output per micro-batch each way (1/tensor of it per device, as Megatron-LM
  scatters it over the tensor group), once per virtual stage.
- Memory per device (`memory_bytes`, the first stage, which stashes the most) = training
  state of its shard (`STATE_BYTES` per parameter; ZeRO splits over data-parallel
  peers the optimizer's part (stage 1), the gradients (2) and the weights (3);
  `--offload=optimizer` keeps the optimizer's part in host memory, off the device) +
  activations of the micro-batches its schedule keeps alive (`stashed_microbatches`):
  whole blocks without recomputation, only each block's input with it, plus one block
  being recomputed. Tensor parallelism splits the matrices and the activations between
  them, not the replicated ones (layer-norm inputs: Korthikanti
  et al. 2022).

Step time is linear in the hardware's per-unit costs (seconds per FLOP, per parameter
updated, per pipeline action, per step, per parameter encoded), which is what lets
`tfpar.plan.calibration` fit them to measured steps by least squares.
"""

import dataclasses
import functools
import math

from tfpar.config import ADAM_FRONT_CODECS, LOWBIT_BITS
from tfpar.dims import ParallelDims
from tfpar.replica_split import split_examples

# Bytes per parameter for weights + gradients + optimizer state, and the optimizer's share.
# With mixed precision Keras keeps fp32 variables, so the total is the same; Megatron-LM's
# fp16 weights + fp16 gradients + fp32 master + Adam is also 16.
STATE_BYTES = {"sgd": 8, "momentum": 12, "adam": 16}
OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}
GRAD_BYTES = 4  # tfpar all-reduces fp32 gradients (mixed precision included)
# Bytes on the wire per fp32 gradient byte sent; see tfpar.compression.
COMPRESSION_RATIO = {"none": 1.0, "fp16": 2.0, "bf16": 2.0, "int8": 3.9,
                     # lowbit at its default bits: bits/32 + one fp32 scale per 256 entries
                     "lowbit": 1 / (LOWBIT_BITS / 32 + 1 / 256)}
BUCKET_BYTES = 25 * 2 ** 20  # gradients fused per collective (tfpar's --bucket_mb)
# Encode + decode seconds per gradient parameter of each aggregator, when not calibrated
# and the device's memory bandwidth is unknown.
DEFAULT_ENCODE_SECONDS = {"fp16": 2e-9, "bf16": 2e-9, "int8": 2e-9, "topk": 2e-9,
                          "threshold": 2e-9, "powersgd": 2e-9, "lowbit": 2e-9}
# Memory traffic of encode + decode per gradient parameter (read fp32, write the wire
# format, read it back, write fp32; int8 adds a pass for the scale, top-k and threshold
# a selection pass, PowerSGD two thin matmuls and the error feedback), for devices whose
# memory bandwidth is given: seconds = bytes / bandwidth.
ENCODE_BYTES = {"fp16": 12, "bf16": 12, "int8": 14, "topk": 24, "threshold": 20,
                "powersgd": 24, "lowbit": 14}  # lowbit: int8's passes, codes bit-packed


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Devices and links. Rates in FLOP/s and bytes/s; memory in bytes; costs in seconds.

    Per-device rates and costs are those seen while every device works at once (devices
    that share processor cores, like logical CPUs, are each slower then than alone).
    `inter_bandwidth` is one device's share of its machine's network (a machine with 8
    devices and 8 × 200 Gbit/s interfaces: 25 GB/s).
    """

    devices: int
    memory_bytes: float
    flops: float                 # sustained training FLOP/s of one device, all busy
    intra_bandwidth: float       # between devices of one machine, per device
    inter_bandwidth: float       # between machines, per device
    devices_per_machine: int = 0  # 0: all devices on one machine
    # Aggregator name -> encode/decode seconds per gradient parameter of a device's shard;
    # None: `ENCODE_BYTES` over `memory_bandwidth`, or `DEFAULT_ENCODE_SECONDS` without it.
    encode_seconds_per_param: dict = None
    memory_bandwidth: float = 0.0  # bytes/s of one device's memory; 0: unknown
    latency: float = 20e-6        # one step of a ring collective (a message round)
    action_overhead: float = 1e-4  # fixed cost of one pipeline forward or backward action
    step_overhead: float = 0.0    # fixed cost of a training step (loop, callbacks, launches)
    update_seconds_per_param: float = 0.0  # optimizer update of one parameter of the shard
    shared_cores: bool = False    # devices are slices of the same cores (logical CPUs)
    # Share of the data-parallel gradient all-reduce hidden behind backward: a run's
    # measured `comm.overlap_fraction` (`--measure_comm`); 0 = none hides. A constant
    # share keeps the step linear in the per-unit costs (`tfpar.plan.calibration`).
    dp_overlap: float = 0.0

    def __post_init__(self):
        if not 0 <= self.dp_overlap <= 1:
            raise ValueError(f"dp_overlap={self.dp_overlap!r} is invalid: must be in [0, 1] "
                             "(a run's comm.overlap_fraction)")
        if self.encode_seconds_per_param is None:
            encode = dict(DEFAULT_ENCODE_SECONDS) if not self.memory_bandwidth else {
                k: v / self.memory_bandwidth for k, v in ENCODE_BYTES.items()}
            object.__setattr__(self, "encode_seconds_per_param", encode)

    @property
    def per_machine(self):
        return self.devices_per_machine or self.devices

    @property
    def machines(self):
        return math.ceil(self.devices / self.per_machine)


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the cost model needs to know of a model (see `tfpar.plan.profile`).

    Args:
        params: trainable parameters.
        flops_per_example: forward FLOPs for one example, whole model.
        activation_bytes_per_example: bytes the backward pass needs of one example's
            forward, whole model, without recomputation.
        boundary_bytes_per_example: bytes of one block's output (what a pipeline stage
            sends to the next, what a tensor-parallel block all-reduces, what
            recomputation keeps per block).
        blocks: how many stages the model can be cut into at most.
        tp_syncs_per_block: forward activation all-reduces per block under tensor
            parallelism (Megatron's transformer block: 2).
        max_tensor_parallel: the tensor-parallel degree must divide it (attention heads,
            hidden width); 1: no tensor-parallel preset fits the model.
        matrix_shapes: the 2-D shapes of its weight matrices (for PowerSGD's ratio).
        first_params / last_params: parameters outside the blocks that sit on the first
            stage (embeddings) and on the last stage (final norm, head; a tied head counts
            again: each end holds a copy).
        last_flops_per_example: forward FLOPs outside the blocks, on the last stage.
        replicated_activation_fraction: share of the block activations tensor
            parallelism does not split.
        block_params: parameters inside the blocks, split over pipeline stages (default:
            the rest).
    """

    name: str
    params: int
    flops_per_example: float
    activation_bytes_per_example: float
    boundary_bytes_per_example: float
    blocks: int
    tp_syncs_per_block: float = 0
    max_tensor_parallel: int = 1
    matrix_shapes: tuple = ()
    first_params: int = 0
    last_params: int = 0
    last_flops_per_example: float = 0.0
    replicated_activation_fraction: float = 0.0
    block_params: int = -1  # parameters inside the blocks; -1: all of them

    def __post_init__(self):
        if self.block_params < 0:
            object.__setattr__(self, "block_params",
                               self.params - self.first_params - self.last_params)



@dataclasses.dataclass(frozen=True)
class Candidate:
    data: int
    tensor: int
    pipeline: int
    microbatches: int
    compression: str
    virtual: int = 1       # interleaved schedule: model chunks per device
    recompute: bool = False
    zero: int = 0          # ZeRO stage (0-3)
    offload: bool = False  # --offload=optimizer: the optimizer state in host memory
    schedule: str = "1f1b"  # a pipeline's: "1f1b", "interleaved", "gpipe" or "chimera"
    allreduce: str = "flat"  # the gradients' sum: "flat" ring or "hierarchical" by host


def ring_allreduce_seconds(nbytes, n, bandwidth, latency=0.0):
    """Ring all-reduce of `nbytes` over `n` peers: 2(n-1) steps of latency α each, and
    2(n-1)/n · S / B of transfer."""
    return 0.0 if n <= 1 else 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def bubble_fraction(stages, microbatches, virtual=1):
    """Idle share of a pipeline step: (K-1) / (V·M + K-1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def group_bandwidth(hw, size, stride):
    """Bus bandwidth of a collective over `size` devices `stride` apart in device order:
    the machine's link if they share a machine, else min(intra, members per machine ·
    per-device network)."""
    if size <= 1 or size * stride <= hw.per_machine:
        return hw.intra_bandwidth
    members = max(1, hw.per_machine // stride)
    return min(hw.intra_bandwidth, members * hw.inter_bandwidth)


def crosses_machines(hw, size, stride):
    """Whether a group of `size` devices `stride` apart spans more than one machine."""
    return size > 1 and size * stride > hw.per_machine


def compression_ratio(name, profile, topk_ratio=None, rank=None, replicas=2, union=None,
                      dense_below=None):
    """fp32 bytes / bytes on the wire for aggregator `name` on `profile`'s gradients; top-k's
    ratio and union and PowerSGD's rank default to `ParallelConfig`'s (what
    `--compression=X` alone runs). Top-k with the union (`--topk_union`, the default) sends
    its indices and then values at every replica's indices: its bytes grow with `replicas`
    up to fp32's (from `topk_ratio × (1 + replicas) >= 1` on it sends every tensor whole,
    `TopKAggregator.sends_whole`). Weight matrices of at
    most `dense_below` entries (`--topk_dense_below`) and every parameter outside
    `profile.matrix_shapes` (taken as biases and norms below it) go whole, a value per
    entry; with `dense_below=0`, or a profile that lists no matrices, every entry counts as
    sparse."""
    from tfpar.config import ParallelConfig
    defaults = ParallelConfig.__dataclass_fields__
    topk_ratio = defaults["topk_ratio"].default if topk_ratio is None else topk_ratio
    union = defaults["topk_union"].default if union is None else union
    dense_below = defaults["topk_dense_below"].default if dense_below is None else dense_below
    rank = defaults["powersgd_rank"].default if rank is None else rank
    if name in COMPRESSION_RATIO:
        return COMPRESSION_RATIO[name]
    if name == "topk":
        sparse = profile.params if not (dense_below and profile.matrix_shapes) else sum(
            n * m for n, m in profile.matrix_shapes if n * m > dense_below)
        if union:  # an int32 index per kept entry, then a value per replica's kept entry
            per_entry = topk_ratio * (1 + max(1, replicas))
        else:  # a value and an int32 index per kept entry
            per_entry = 2 * topk_ratio
        per_entry = min(per_entry, 1.0)  # no tensor in more bytes than its values
        return profile.params / max(1, per_entry * sparse + profile.params - sparse)
    if name == "powersgd":
        matrix = sum(n * m for n, m in profile.matrix_shapes)
        sent = sum(rank * (n + m) for n, m in profile.matrix_shapes)
        rest = profile.params - matrix  # vectors go uncompressed
        return profile.params / max(1, sent + rest)
    raise ValueError(f"unknown compression {name!r}")


def stage_params(profile, c):
    """Parameters of the largest stage's shard on one device (before ZeRO)."""
    if c.pipeline == 1:
        whole = profile.params
    else:
        whole = profile.block_params / profile.blocks * stage_blocks(profile, c) + max(
            profile.first_params, profile.last_params)
    return whole / c.tensor


def stage_blocks(profile, c):
    """Blocks of the largest stage: blocks are not split, so K stages of B blocks hold
    ceil(B / K) at most."""
    return math.ceil(profile.blocks / c.pipeline)


def stashed_microbatches(c, schedule=None):
    """Micro-batches whose activations the first stage holds at its peak, in units of a
    whole stage (an interleaved chunk is 1/V of one). Matches `tfpar.pipeline.schedule`:
    without a pipeline one (accumulation runs micro-batches one after another); GPipe
    all M; 1F1B min(K, M); interleaved (warm-up forwards + 1) chunks; Chimera its
    simulated peak over both pipelines (up to K + 1). `schedule` defaults to `c.schedule`."""
    schedule = schedule or c.schedule
    if c.pipeline == 1:
        return 1
    if schedule == "gpipe":
        return c.microbatches
    if schedule == "chimera":
        return _chimera_simulation(c.pipeline, c.microbatches)[1]
    if c.virtual > 1:
        total = c.microbatches * c.virtual
        warmup = total if c.microbatches == c.pipeline else min(
            (c.pipeline - 1) * 2 + (c.virtual - 1) * c.pipeline, total)
        return min(warmup + 1, total) / c.virtual
    return min(c.pipeline, c.microbatches)


def state_bytes(profile, c, optimizer="adam", copies=1):
    """Bytes of training state one device of the first stage holds: weights, gradients
    and optimizer state of its shard. ZeRO splits over the data-parallel peers the
    optimizer state (stage 1), also the gradients (2), also the weights (3, which then
    gathers one block's weights at a time while it runs). With `c.offload` the optimizer
    state is in host memory (`tfpar.offload`): none of it on the device. ZeRO 1/2 with
    Adam in front of a lossy codec saves nothing over data parallelism: whole moments,
    ZeRO's 1/N slots allocated beside them, whole gradients (the summed steps are whole on
    every replica) and the codec's residual. `copies` of the
    weights and their gradients share one optimizer state (Chimera: 2, the second
    pipeline's copy takes its first copy's updated weights)."""
    shard = stage_params(profile, c)
    weight = STATE_BYTES[optimizer] - OPTIMIZER_BYTES[optimizer] - GRAD_BYTES
    split = c.data if c.data > 1 else 1
    # ZeRO 1/2 with Adam in front of lowbit/top-k/PowerSGD (`tfpar.zero.sharded.adam_in_front`,
    # the default there; `--offload=optimizer` keeps Adam behind) runs data parallelism's
    # step: every replica holds the whole moments and an error-feedback residual (fp32, P)
    # and sums whole steps, beside ZeRO's unused 1/N slots.
    front = (c.zero in (1, 2) and optimizer == "adam" and not c.offload
             and c.compression in ADAM_FRONT_CODECS)
    if c.offload:
        opt = 0.0
    elif front:
        opt = OPTIMIZER_BYTES[optimizer] * shard * (1 + 1 / split) + GRAD_BYTES * shard
    else:
        opt = OPTIMIZER_BYTES[optimizer] * shard / (split if c.zero >= 1 else 1)
    grads = GRAD_BYTES * shard / (split if c.zero >= 2 and not front else 1)
    if c.zero >= 3:
        gathered = profile.block_params / max(1, profile.blocks) / c.tensor
        weights = weight * (shard / split + gathered)
    else:
        weights = weight * shard
    return copies * (weights + grads) + opt


def memory_bytes(profile, c, global_batch, optimizer="adam", schedule=None):
    """Bytes one device of the first stage needs: its shard's training state
    (`state_bytes`; with Chimera, whose stages each hold two copies of a stage, two
    copies of the weights and gradients, one optimizer state) + the activations its
    schedule (default `c.schedule`) keeps alive."""
    schedule = schedule or c.schedule
    copies = 2 if schedule == "chimera" and c.pipeline > 1 else 1
    return state_bytes(profile, c, optimizer, copies) + activation_bytes(
        profile, c, global_batch, schedule)


def activation_bytes(profile, c, global_batch, schedule=None):
    """Activation bytes of the first stage's device at its peak."""
    micro = padded_batch(global_batch, c) / c.microbatches
    blocks = stage_blocks(profile, c)
    rep = profile.replicated_activation_fraction
    per_block = profile.activation_bytes_per_example / profile.blocks * (
        rep + (1 - rep) / c.tensor)
    stash = stashed_microbatches(c, schedule)
    if c.recompute:
        # Each block keeps its input; one block at a time is recomputed whole.
        return micro * (stash * blocks * profile.boundary_bytes_per_example + per_block)
    return micro * stash * blocks * per_block


def padded_batch(global_batch, c):
    """Examples each replica of layout `c` computes on per step: its share of the global
    batch, padded to whole micro-batches with examples of weight 0 where `c.data` does not
    divide it (`tfpar.replica_split`, 22/21/21 -> 22 for 64 over 3); `global_batch / data`
    when it does. The padding's cost is this batch's compute over the real examples."""
    return split_examples(global_batch, c.data, c.microbatches).padded


def padding_fraction(global_batch, c):
    """Extra examples the padding computes, as a share of the global batch (0 when even)."""
    return padded_batch(global_batch, c) * c.data / global_batch - 1


def step_seconds(profile, hw, c, global_batch):
    """Predicted seconds per optimizer step, and its parts (the compute of the padded
    per-replica batch, `padded_batch`)."""
    per_replica = padded_batch(global_batch, c)
    micro = per_replica / c.microbatches
    K, V, T = c.pipeline, c.virtual, c.tensor
    edge = profile.last_flops_per_example
    blocks_flops = (profile.flops_per_example - edge) / profile.blocks * stage_blocks(profile, c)
    # Per micro-batch on the slowest (last) stage: 3x forward (4x for recomputed blocks).
    flops = micro * ((4 if c.recompute else 3) * blocks_flops + 3 * edge) / T
    work = flops / hw.flops
    # A pipeline (or accumulation, micro-batches without one) runs a forward and a
    # backward action per micro-batch and chunk, each with a fixed cost whatever its size;
    # a step of one micro-batch without a pipeline is one `fit` step.
    actions = 2 * V * hw.action_overhead if K > 1 or c.microbatches > 1 else 0.0
    tp_bandwidth = group_bandwidth(hw, T, 1)
    syncs = profile.tp_syncs_per_block * (3 if c.recompute else 2) * stage_blocks(profile, c)
    tp = syncs * ring_allreduce_seconds(micro * profile.boundary_bytes_per_example, T,
                                        tp_bandwidth, hw.latency)
    p2p = 0.0
    if K > 1:
        p2p_bandwidth = hw.inter_bandwidth if crosses_machines(hw, 2, T * c.data) \
            else hw.intra_bandwidth
        p2p = 2 * V * (hw.latency + micro * profile.boundary_bytes_per_example / T
                       / p2p_bandwidth)
    slot = work + actions + tp + p2p
    compute = c.microbatches * work
    # (K-1)/V idle slots on the critical path (Chimera: its simulated schedule's). Devices
    # that share cores lend them to the busy ones while idle: the bubble then costs only
    # its actions' fixed costs.
    idle = idle_slots(c)
    bubble = idle * (actions + p2p if hw.shared_cores else slot)
    shard = stage_params(profile, c)
    overhead = hw.step_overhead + hw.update_seconds_per_param * shard + \
        c.microbatches * actions
    ratio = compression_ratio(c.compression, profile, replicas=c.data)
    grad_bytes = GRAD_BYTES * shard
    buckets = max(1, math.ceil(grad_bytes / ratio / BUCKET_BYTES))
    dp = data_parallel_seconds(hw, c, grad_bytes / ratio, buckets)
    # Top-k that sends every tensor whole (`TopKAggregator.sends_whole`) selects nothing.
    if c.compression != "none" and c.data > 1 and not (c.compression == "topk" and ratio == 1):
        dp += hw.encode_seconds_per_param[c.compression] * shard
    dp *= 1 - hw.dp_overlap  # the gradients' exchange only, not ZeRO-3's gathers below
    if c.zero >= 3:
        # The weights all-gathered for the forward and again for the backward: two
        # all-gathers of (n-1)/n·S each, the volume of one all-reduce.
        dp += ring_allreduce_seconds(4 * shard, c.data, group_bandwidth(hw, c.data, T),
                                     hw.latency * buckets)
    tp_total = c.microbatches * tp
    p2p_total = c.microbatches * p2p + chimera_sync_seconds(hw, c, grad_bytes)
    total = overhead + compute + bubble + dp + tp_total + p2p_total
    return total, {"overhead": overhead, "compute": compute, "bubble": bubble,
                   "data_parallel": dp, "tensor_parallel": tp_total,
                   "pipeline_p2p": p2p_total}


def idle_slots(c):
    """Idle slots (a slot: one micro-batch's forward and backward on one stage) on the
    pipeline's critical path: (K-1)/V, or Chimera's from its simulated schedule (a
    backward twice a forward): M·b/(1-b) for its bubble fraction b."""
    if c.pipeline == 1:
        return 0.0
    if c.schedule == "chimera":
        b = _chimera_simulation(c.pipeline, c.microbatches)[0]
        return c.microbatches * b / (1 - b)
    return (c.pipeline - 1) / c.virtual


@functools.lru_cache(maxsize=None)
def _chimera_simulation(K, M):
    """(bubble fraction, peak stashed micro-batches) of Chimera's schedule simulated with
    a backward twice a forward (`tfpar.pipeline.schedule`: pure Python, no TensorFlow)."""
    from tfpar.pipeline import schedule as schedule_lib
    sim = schedule_lib.simulate(schedule_lib.chimera_schedule(K, M), K, M, 2, 1.0, 2.0)
    return sim.bubble, max(sim.peak_stash)


def chimera_sync_seconds(hw, c, grad_bytes):
    """Chimera's exchange between a stage and its mirror (stage K-1-s): the second
    copy's gradients to the first (`grad_bytes` of the stage), its updated weights back,
    one after the other; none for the middle stage of an odd K (both copies on it)."""
    if c.schedule != "chimera" or c.pipeline < 2:
        return 0.0
    bandwidth = hw.inter_bandwidth if crosses_machines(hw, 2, c.tensor * c.data) \
        else hw.intra_bandwidth
    return 2 * (hw.latency + grad_bytes / c.tensor / bandwidth)


def data_parallel_seconds(hw, c, nbytes, buckets=1):
    """The gradients' sum over the `c.data` replicas (`nbytes` each, in `buckets`
    collectives). Flat: one ring over all of them (`group_bandwidth`). Hierarchical
    (`tfpar.compression.hierarchical`, `c.allreduce`): an all-reduce inside each machine,
    one ring of the machines' leaders across (the leader sending on its machine's whole
    network: one device's share times the replicas it holds), and a hand-back all-reduce
    inside; added up (its buckets overlap the phases somewhat: an upper bound)."""
    latency = hw.latency * buckets
    if c.allreduce != "hierarchical":
        return ring_allreduce_seconds(nbytes, c.data, group_bandwidth(hw, c.data, c.tensor),
                                      latency)
    local = max(1, min(c.data, hw.per_machine // c.tensor))
    hosts = math.ceil(c.data / local)
    inside = ring_allreduce_seconds(nbytes, local, hw.intra_bandwidth, latency)
    across = ring_allreduce_seconds(nbytes, hosts, local * hw.inter_bandwidth, latency)
    return 2 * inside + across


def hierarchical_applies(hw, c):
    """Whether `--allreduce=hierarchical` is a distinct choice for layout `c` on `hw`: data
    parallelism alone over several machines, several replicas on each, through a sum
    (not ZeRO, not an all-gather codec: `tfpar.compat`'s `allreduce` rows)."""
    from tfpar import compat  # no TensorFlow
    return (c.data > 1 and c.tensor == 1 and c.pipeline == 1 and c.zero == 0
            and not c.offload and c.compression not in compat.GATHER_CODECS
            and crosses_machines(hw, c.data, 1) and min(c.data, hw.per_machine) > 1)


def candidates(profile, hw, global_batch, compressions=("none", "fp16", "int8", "topk",
                                                         "powersgd"),
               schedule="1f1b", recompute=(False, True), zero=(0,), virtual=(1, 2, 4)):
    """Every layout that uses all devices: data × tensor × pipeline × micro-batches × virtual
    stages (with `schedule="interleaved"`) × aggregator × recomputation × ZeRO stage, and
    where they differ, the pipeline's schedule (`schedule="auto"`: 1F1B and Chimera) and
    the flat or hierarchical all-reduce (`hierarchical_applies`).
    Micro-batch counts: every divisor of the replica's batch that a schedule can take;
    where `data` does not divide the batch (each replica's share padded with examples of
    weight 0, `padded_batch`), every divisor of the global batch up to the largest share.
    Whether tfpar can run one yet is `tfpar.plan.planner.runnable`'s call."""
    schedules = ("1f1b", "chimera") if schedule == "auto" else (schedule,)
    out = []
    for dims in ParallelDims.layouts(hw.devices):  # dp × tp × pp filling the devices
        data, tensor, pipeline = dims.dp, dims.tp, dims.pp
        if profile.max_tensor_parallel % tensor or pipeline > profile.blocks \
                or data > global_batch:
            continue
        if global_batch % data == 0:
            micro_counts = _divisors(global_batch // data)
        else:
            micro_counts = [m for m in _divisors(global_batch) if m <= -(-global_batch // data)]
        if not dims.pp_enabled:
            virtuals = (1,)
        else:
            micro_counts = [m for m in micro_counts if m >= pipeline]
            virtuals = [v for v in virtual if v == 1 or (
                schedule == "interleaved" and pipeline * v <= profile.blocks)]
        for m in micro_counts:
            for v in virtuals:
                if v > 1 and m % pipeline:
                    continue  # the interleaved schedule takes whole groups of K
                comps = ("none",) if data == 1 else compressions
                for comp in comps:
                    for rc in recompute:
                        for z in zero if data > 1 else (0,):
                            for sched in _schedules(schedules, tensor, pipeline, m, v):
                                c = Candidate(data, tensor, pipeline, m, comp, v, rc, z,
                                              schedule=sched)
                                out.append(c)
                                if hierarchical_applies(hw, c):
                                    out.append(dataclasses.replace(c, allreduce="hierarchical"))
    return out


def _schedules(schedules, tensor, pipeline, microbatches, virtual):
    """The schedules a pipeline of these sizes can take ("1f1b" without a pipeline)."""
    if pipeline == 1:
        return ("1f1b",)
    # Chimera sends half the micro-batches each way, runs no virtual stages, and not on
    # the mesh pipeline (`tfpar.compat.CHIMERA_MESH`: one copy of each stage there).
    return [s for s in schedules if s != "chimera"
            or (microbatches % 2 == 0 and virtual == 1 and tensor == 1)]


def _divisors(n):
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
