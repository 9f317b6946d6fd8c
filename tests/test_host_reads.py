"""The trainers read device values back to the host only at sync steps (curve points,
evaluations, every DIVERGENCE_CHECK_EVERY steps), never every step: on CUDA each read would
stall the host until the queued kernels finish.

Checked on the CPU by recording every op that reads a tensor's value into Python
(`.item()`, `float()`, `bool()`, `.tolist()`, data-dependent shapes) and the training step
it happened in; the step is the one whose batch was drawn last.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hptransfer.data import TokenDataset
from hptransfer.spec.trial import TrialSpec
from hptransfer.workers import pack as pack_trainer
from hptransfer.workers import trainer
from hptransfer.workers.packed import run_trials
from hptransfer.workers.plan import load_trial_data, plan_trial
from hptransfer.workers.trainer import run_trial

# 200 steps: a curve point every 4 steps, so most steps are not sync steps
SPEC = dict(width=32, depth=2, head_dim=16, batch_size=2, seq_len=16, base_width=32,
            base_depth=2, data={"val_tokens": 256, "max_corpus_bytes": 200_000},
            budget={"steps": 200}, eval_every=50, lr=2**-7)
# ops whose result is a Python value read from a tensor's data (or a shape that depends on it)
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
              torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
              torch.ops.aten.equal.default}


class HostReads(TorchDispatchMode):
    """Counts host reads per training step: dispatched ops, plus `Tensor.tolist`, which on
    the CPU reads the data without dispatching an op (on CUDA it copies to the host)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.step: int | None = None  # the step whose batch was drawn last
        self.reads: collections.Counter[int | None] = collections.Counter()
        train_batch, tolist = TokenDataset.train_batch, torch.Tensor.tolist

        def drawing(data, step, *args, **kwargs):  # noqa: ANN001, ANN202
            self.step = step
            return train_batch(data, step, *args, **kwargs)

        def reading(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
            self.reads[self.step] += 1
            return tolist(tensor, *args, **kwargs)

        monkeypatch.setattr(TokenDataset, "train_batch", drawing)
        monkeypatch.setattr(torch.Tensor, "tolist", reading)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in HOST_READS:
            self.reads[self.step] += 1
        return func(*args, **(kwargs or {}))


def sync_steps(spec: TrialSpec, tmp_path) -> set[int]:  # noqa: ANN001
    plan = plan_trial(spec, load_trial_data(spec, str(tmp_path)))
    return {s for s in range(plan.total_steps) if plan.is_sync_step(s + 1)}


@pytest.mark.parametrize("arch, param", [("gpt", "completep"), ("ngpt", "ngpt")])
@pytest.mark.parametrize("packed", [False, True], ids=["run_trial", "run_trials"])
def test_device_values_are_read_only_at_sync_steps(arch, param, packed, tmp_path,
                                                   monkeypatch):
    spec = TrialSpec(**SPEC, arch=arch, parameterization=param)
    syncs = sync_steps(spec, tmp_path)
    assert 30 < len(syncs) < 100  # most steps are not sync steps: the test can tell
    # the trainers as they run on CUDA: on the CPU, where reading back is free, they read
    # their clipping factors (and a pack its alive mask) every step; on CUDA they must not
    for module in (trainer, pack_trainer):
        monkeypatch.setattr(module, "reading_back_is_free", lambda device: False)
    with HostReads(monkeypatch) as probe:
        if packed:
            results = run_trials([spec, spec.model_copy(update={"seed": 1, "lr": 2**-8})],
                                 cache_dir=str(tmp_path))
        else:
            results = [run_trial(spec, cache_dir=str(tmp_path))]
    assert all(r.status == "completed" for r in results), [r.error for r in results]
    trained = {s for s in probe.reads if s is not None}  # steps with reads, set-up aside
    assert trained <= syncs, sorted(trained - syncs)  # no read between sync steps
    # every sync step read its buffered losses back (so the probe sees the reads it should)
    assert trained == syncs
