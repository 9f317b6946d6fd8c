"""A data-parallel trial whose model is sharded over its ranks (FSDP2, `fully_shard`): for a
shape whose weights, gradients and AdamW state do not fit one device.

Each transformer block is one FSDP unit and the root (embeddings, final norm, unembedding)
another: a rank keeps 1/W of every parameter (rows of dim 0, a DTensor shard), all-gathers a
unit's weights for its forward and backward, and reduce-scatters its gradients, averaged as
DDP's are. The trainer's loss weighting (data_parallel.py), LR schedule, per-group LRs and
multipliers are unchanged, so the numbers are one process's up to the order of the sums.
NCCL on GPUs; on CPUs gloo, whose reduce_scatter and all_gather FSDP2 uses as it does
NCCL's (torch 2.13; tests/test_fsdp.py).

What differs from a DDP rank:
- the optimizer is torch's AdamW over the DTensor shards (foreach on the CPU: FlatAdamW's
  numbers to the bit, since AdamW is elementwise; fused on CUDA). FlatAdamW re-points each
  parameter's storage into one buffer, which would cut a shard off from FSDP's own storage.
- gradient clipping takes the norm over the whole model (clip_grad_norm_ on DTensors).
- nGPT's unit-norm projection after each step: a matrix normalised along its rows (dim 1)
  has whole rows on each rank; one normalised along its columns (dim 0, the sharded one)
  sums its squares over the ranks first.
- the evaluation is data-parallel too (a forward all-gathers on every rank, so every rank
  runs one): passes of W x pass_size windows, each rank the loss of its rows of each pass
  (no more activations than a micro-batch's), summed over the ranks. The windows, and so
  the mean, are one process's.
- checkpoints hold the full state dicts, gathered to rank 0's CPU (the model's in the
  one-process layout); a resume reads them on rank 0 and scatters them back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .device import autocast, to_device

if TYPE_CHECKING:
    from .plan import TrialPlan


def shard_model(model: nn.Module, device: torch.device, world: int) -> nn.Module:
    """`model` (built on the CPU) sharded in place over the `world` ranks of the process
    group, its shards moved to `device`: one FSDP unit per block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    blocks = getattr(model, "blocks", None)
    for block in blocks if blocks is not None else []:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # moves the shards and the buffers to the mesh's device
    return model


def sharded_optimizer(groups: list[dict[str, Any]], betas: tuple[float, float],
                      device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the shards: fused on CUDA (as one process), foreach on the CPU."""
    if device.type == "cuda":
        return torch.optim.AdamW(groups, betas=betas, fused=True)
    return torch.optim.AdamW(groups, betas=betas, foreach=True)


def micro_batches(x: torch.Tensor, y: torch.Tensor, passes: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """A rank's rows in `passes` micro-batches (x, y, weight), as TrialPlan.micro_batches
    makes them but as many on every rank: each pass all-gathers and reduce-scatters, so a
    rank with one row fewer must not run one pass fewer. A pass with no rows of its own
    runs on the first row with weight 0 (the model takes no empty batch)."""
    if passes <= 1:
        return [(x, y, 1.0)]
    rows = x.shape[0]
    return [(xs, ys, xs.shape[0] / rows) if xs.shape[0] else (x[:1], y[:1], 0.0)
            for xs, ys in zip(x.tensor_split(passes), y.tensor_split(passes), strict=True)]


def passes_per_step(batch_size: int, pass_size: int, world: int) -> int:
    """Micro-batches a step takes on every rank: the largest rank's rows in passes of at
    most `pass_size`."""
    most = -(-batch_size // world)
    return -(-most // pass_size)


def clip_sharded(params: Iterable[nn.Parameter], max_norm: float) -> None:
    """clip_grad_norm_ over the whole model: the norm of the full gradients, from shards."""
    torch.nn.utils.clip_grad_norm_(list(params), max_norm)


@torch.no_grad()
def normalize_sharded(model: nn.Module) -> None:
    """nGPT's normalize_matrices on sharded matrices: unit norm along each one's d_model
    axis, as F.normalize (x / max(norm, 1e-12)) computes it on the whole matrix."""
    params = dict(model.named_parameters())
    for name, axis in model.unit_norm_axes().items():
        p = params[name]
        local = p.to_local()
        if axis == _sharded_dim(p):
            squares = local.square().sum(dim=axis, keepdim=True)
            dist.all_reduce(squares, op=dist.ReduceOp.SUM)
            norm = squares.sqrt()
        else:
            norm = torch.linalg.vector_norm(local, 2, dim=axis, keepdim=True)
        local.div_(norm.clamp_min(1e-12))


def _sharded_dim(p: torch.Tensor) -> int | None:
    from torch.distributed.tensor import Shard

    for placement in getattr(p, "placements", ()):
        if isinstance(placement, Shard):
            return placement.dim
    return None


@torch.no_grad()
def evaluate_sharded(model: nn.Module, plan: TrialPlan, rank: int, world: int) -> float:
    """trainer.evaluate for a sharded model: the mean loss over the fixed validation set,
    every rank (`rank` of `world`) its rows of each pass; every rank gets the mean."""
    device = plan.device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, targets
    for x, y in plan.data.val_batches(plan.pass_size * world, plan.spec.seq_len):
        n = x.shape[0]  # the last pass may hold fewer windows than ranks: some get none
        rows = slice(n * rank // world, n * (rank + 1) // world)
        # a rank with none still runs the pass (it is collective), on one window it ignores
        own = rows.stop > rows.start
        xs, ys = to_device(x[rows if own else slice(0, 1)], device), to_device(y[rows], device)
        with autocast(device, plan.bf16):
            logits = model(xs)
        if not own:
            continue
        loss = F.cross_entropy(logits.float().flatten(0, 1), ys.flatten(), reduction="sum")
        total[0] += loss.double()
        total[1] += ys.numel()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total[0] / total[1]).item()


def _options(**kw: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def gather_state(model: nn.Module, opt: torch.optim.Optimizer
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full model and optimizer state dicts on rank 0's CPU ({} on the other ranks).
    Every rank calls it (the shards are all-gathered)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = _options(cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, opt, options=options))


def scatter_state(model: nn.Module, opt: torch.optim.Optimizer, model_state: dict[str, Any],
                  opt_state: dict[str, Any]) -> None:
    """Load full state dicts that rank 0 holds (the others pass {}) into the shards."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = _options(broadcast_from_rank0=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, opt, opt_state, options=options)


def from_rank0(value: Any) -> Any:
    """Rank 0's picklable `value`, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
