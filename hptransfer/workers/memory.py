"""How much memory a trial needs, and how much a device has free.

Admission (coordinator/admission.py) refuses a trial no worker could hold; a worker splits a
pack (workers/packed.py) whose members would not fit on its device together. Both price a
trial with `trial_memory`:

memory (bytes), fp32 master weights as the trainer keeps them (also under bf16 autocast):
    16 x params                weights 4 + gradients 4 + AdamW's two moments 8 per parameter
                               (a packed member: 24, see PACKED_STATE_BYTES_PER_PARAM)
  + a x B x T x L x N x (9 + 2 r)
                               activations kept for backward per block (Korthikanti et al.
                               2022, "Reducing Activation Recomputation", 34 s b h bytes per
                               layer at 2 bytes each, with the MLP's share as 2 r), a = 4 bytes
                               (fp32) or 2 (bf16), B the micro-batch (micro_batch_size) where
                               it is smaller than the batch; the T x T attention scores are left
                               out, since SDPA's fused kernels do not keep them
  + a x B x T x L x H x T      ... except where attention takes the small-head path
                               (models/layers.py), which keeps its softmax for backward
  + 4 x B x T x N              the final LayerNorm's input
  + 3 x 4 x B x T x V          logits, their softmax and its gradient (fp32: the loss is
                               computed on an fp32 copy of the logits, also under autocast)
Under bf16 autocast not every activation halves (autocast's fp32 ops keep fp32 inputs):
the two LayerNorm inputs per block stay 4 bytes (of the 9 + 2 r), the logits cost 2 + 4 + 4
bytes (bf16 logits, their fp32 softmax and gradient), and autocast's bf16 copies of the
block matrices, 2 bytes per parameter, are kept for backward too. Against what autograd
saves under CPU autocast (tests/test_pack_memory.py) the halved-everything estimate read
1.19-1.26x low; this one is checked to within 0.85-1.05x, like fp32's.
A data-parallel worker (DDP) holds all of the 16 x params and its rows' activations; a
sharded one (FSDP, workers/sharding.py) 16 x params / W, plus what FSDP gathers whole while
it runs: the unit it computes (a block, or the root: embeddings and unembedding) and the
next one prefetched, 4 bytes a parameter each, and a unit's full gradient with the
reduce-scatter's copy of it, 4 + 4: 16 x the largest unit's parameters (`worker_state_bytes`).
The estimate is deliberately simple: it stops a width 2^16, depth 1024 trial at submit and
a pack of 64 deep models from filling a GPU, not a tight fit.

The estimate is torch-free (the coordinator prices trials with it at submit and admission
without loading torch); what a device has free now, and whether an error was a failed
allocation, are asked of torch: workers/device.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from hptransfer.models.config import small_heads
from hptransfer.models.flops import param_counts
from hptransfer.spec.trial import TrialSpec, sequences_per_pass

STATE_BYTES_PER_PARAM = 16
# a pack keeps, per member and parameter, the weights, the parameters' .grad, the gathered
# gradient, a scratch buffer and AdamW's two moments, all fp32 (pack.Pack)
PACKED_STATE_BYTES_PER_PARAM = 24
# A step's peak holds more than the activations saved for backward (which the estimate
# below matches to 0.91-0.96, tests/test_pack_memory.py): the backward's own gradients and
# temporaries, and the allocator's slack. benchmarks/pack_memory.py (CPU, 2 threads,
# 2026-12-04): a pack of 1 or 4 grew its peak resident memory by 1.6-2.0x the saved
# activations plus state at widths 128-256, and by 0.84-1.10x `pack_peak` with this factor
# (2.4x for the smallest shape, 37 MB, mostly the allocator's fixed slack)
PEAK_OVER_SAVED = 2.0
_ACTIVATION_FLOATS_PER_WIDTH = 9  # plus 2 x mlp_ratio, per token and block
_FP32_FLOATS_PER_WIDTH = 2  # of them, the LayerNorm inputs: fp32 under autocast too
_LOGIT_BYTES = {False: 3 * 4, True: 2 + 4 + 4}  # per vocab entry: fp32 run, bf16 autocast
# a sharded worker's gathered units: two units' weights and one's gradient and its copy
FSDP_UNIT_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class MemoryNeed:
    params: int
    state_bytes: float  # weights, gradients, AdamW moments
    activation_bytes: float

    def pack_peak(self, members: int) -> float:
        """Peak bytes of `members` trials of this shape trained as one pack: their fp32 state
        and PEAK_OVER_SAVED x their saved activations."""
        state = PACKED_STATE_BYTES_PER_PARAM * self.params
        return members * (state + PEAK_OVER_SAVED * self.activation_bytes)


def trial_memory(spec: TrialSpec, vocab_size: int, half_activations: bool | None = None
                 ) -> MemoryNeed:
    """What one trial of `spec` needs in memory (module docstring). `half_activations`:
    whether activations are 2-byte (default: the spec asks for bf16; a worker passes whether
    it really autocasts, which only CUDA does)."""
    cfg = spec.model_config_obj(vocab_size=vocab_size)
    params = param_counts(cfg).total
    half = spec.precision == "bf16" if half_activations is None else half_activations
    t = spec.seq_len
    per_block = (_ACTIVATION_FLOATS_PER_WIDTH + 2 * cfg.mlp_ratio) * cfg.width
    if small_heads(cfg.head_dim, t):
        per_block += cfg.n_heads * t  # the small-head path's saved softmax
    # activations live for one micro-batch at a time
    live = sequences_per_pass(spec.batch_size, spec.micro_batch_size)
    if half:
        fp32 = _FP32_FLOATS_PER_WIDTH * cfg.width
        block_bytes = 4 * fp32 + 2 * (per_block - fp32)
        copies = 2 * param_counts(cfg).non_embedding  # autocast's bf16 block matrices
    else:
        block_bytes, copies = 4 * per_block, 0
    # and the final LayerNorm's input, fp32 either way
    per_token = cfg.depth * block_bytes + 4 * cfg.width + _LOGIT_BYTES[half] * vocab_size
    activations = live * t * per_token + copies
    return MemoryNeed(params=params, state_bytes=float(STATE_BYTES_PER_PARAM * params),
                      activation_bytes=float(activations))


def fsdp_unit_params(params: float, non_embedding: float, depth: int) -> float:
    """Parameters of the largest FSDP unit of a model: a block (its share of the
    non-embedding parameters) or the root (the vocab-sized tables)."""
    return max(non_embedding / max(depth, 1), params - non_embedding)


def worker_state_bytes(state_bytes: float, workers: int, shard: bool, params: float,
                       non_embedding: float, depth: int) -> float:
    """Bytes of weights, gradients and AdamW state on each of a trial's `workers`: all of
    `state_bytes` on each (one process, DDP), or with `shard` (FSDP) 1/W of it plus the
    units FSDP gathers whole (module docstring)."""
    if not shard or workers < 2:
        return state_bytes
    unit = fsdp_unit_params(params, non_embedding, depth)
    return state_bytes / workers + FSDP_UNIT_BYTES_PER_PARAM * unit


def host_memory() -> float:
    """Bytes of memory this host has in all."""
    return float(psutil.virtual_memory().total)
