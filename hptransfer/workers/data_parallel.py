"""One trial over W data-parallel ranks (Ray Train's workers, DDP): which rows of each global
batch a rank trains on, how its loss is weighted, and the few values the ranks must agree on.

Every rank builds the same model from the seed and takes the same optimizer steps; DDP
averages the gradients, so with rank r's loss weighted by W * rows_r / B the average is the
gradient of the global batch's mean loss, as in one process (up to the order of the sums).
Decisions that end a trial (divergence, a pruning stop, the validation loss) are rank 0's,
sent to the others, so every rank leaves the loop at the same step.

With `shard` the ranks shard the model (FSDP, sharding.py) instead of each holding all of it;
the rows, weights and decisions are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DataParallel:
    rank: int
    world: int
    shard: bool = False  # FSDP (fully_shard) instead of DDP

    @classmethod
    def current(cls, shard: bool = False) -> DataParallel | None:
        """The process group's ranks (Ray Train starts it), None for one process."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        world = dist.get_world_size()
        return cls(dist.get_rank(), world, shard) if world > 1 else None

    @property
    def leads(self) -> bool:
        """Rank 0 reports, evaluates, logs and checkpoints."""
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch (as even as whole rows allow)."""
        if batch_size < self.world:
            raise ValueError(f"a batch of {batch_size} sequences cannot be split over "
                             f"{self.world} data-parallel workers; use fewer workers")
        return slice(batch_size * self.rank // self.world,
                     batch_size * (self.rank + 1) // self.world)

    def share(self, batch_size: int) -> float:
        """The weight of this rank's mean loss, so DDP's average is the global mean's."""
        rows = self.rows(batch_size)
        return self.world * (rows.stop - rows.start) / batch_size

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """DDP around `model`, or with `shard` the model itself sharded in place (built on the
        CPU, its shards moved to `device`)."""
        if self.shard:
            from .sharding import shard_model

            return shard_model(model, device, self.world)
        from torch.nn.parallel import DistributedDataParallel

        # no buffers are sent at each forward: rank 0 evaluates alone, on the bare model
        if device.type != "cuda":
            return DistributedDataParallel(model, broadcast_buffers=False)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DistributedDataParallel(model, device_ids=[index], broadcast_buffers=False)

    def mean_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """Per-step global batch losses from each rank's weighted ones (every rank gets them)."""
        total = losses.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.world

    def any_rank(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` holds on some rank (every rank gets the answer)."""
        t = torch.tensor([float(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def from_leader(self, values: list[float], device: torch.device) -> list[float]:
        """Rank 0's values, on every rank."""
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.broadcast(t, src=0)
        return t.tolist()
