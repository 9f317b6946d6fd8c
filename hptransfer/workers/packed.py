"""run_trials: K trial specs of one shape trained together, packed (pack.py: one batched
model), in as few packs as the memory holds.

A pack that would not fit is split into near-equal packs trained one after another, and a
pack that still runs out of memory is halved and trained again; a member's result is the
same whatever pack it trained in (run_trial's for its spec alone, up to fp32 rounding).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hptransfer.data import TokenDataset
from hptransfer.spec.trial import TrialResult, TrialSpec

from .checkpoints import CheckpointPolicy
from .device import free_memory, is_out_of_memory
from .memory import trial_memory
from .outcome import failed_result
from .pack import Pack, PackedReporter
from .packable import PACKABLE_FIELDS, check_packable, split_evenly
from .plan import load_trial_data, plan_trial, prepare_process
from .subnormals import subnormals_flushed
from .trainer import run_trial

__all__ = ["PACKABLE_FIELDS", "PackedReporter", "check_packable", "run_trials", "split_evenly"]

# a pack plans to use at most this share of the memory its device has free when it starts,
# leaving room for what its estimate leaves out (the data, the compiler's workspace)
MEMORY_HEADROOM = 0.8

@subnormals_flushed()
def run_trials(
    specs: Sequence[TrialSpec | dict],
    reporter: PackedReporter | None = None,
    cache_dir: str | None = None,
    memory_limit: float | None = None,
    on_result: Callable[[int, TrialResult], None] | None = None,
    roots: Sequence[str] | None = None,
    data_hash: str | None = None,
    max_hours: float | None = None,
    checkpoints: Sequence[CheckpointPolicy | None] | None = None,
) -> list[TrialResult]:
    """Train K specs of one shape together; one TrialResult per spec, in order.

    A pack that would not fit in memory is split into the fewest near-equal packs that
    `memory_limit` bytes hold by `workers.memory`'s estimate (default: what the device has
    free now, on the CPU at most the task's share by threads, less a headroom), trained one
    after another; a pack that still runs out of memory is halved and trained again (its
    members from the start; the reporter sees each step of a member once). A split pack's
    members say so in their notes; their results are a smaller pack's, i.e. still
    run_trial's for each spec alone; a member with a checkpoint when its pack ran out of
    memory goes on alone from it (run_trial's resume), re-training at most one checkpoint
    interval. `on_result(i, result)` hears each member's final result
    once, as soon as it is final, so that a caller can keep it should the process die later:
    a member that stopped early (diverged, pruned) when it stopped, a split pack's members
    when their group has trained (the last group's come with the return only).
    Raises ValueError if the specs are not packable; training problems never raise (every
    member's result then says failed, as run_trial's would). `roots`, `data_hash`: a
    sweep's data guard (plan.load_trial_data). `max_hours`: the server's wall-time ceiling
    (HPT_MAX_TRIAL_HOURS): members still training past it stop failed, as in run_trial.
    `checkpoints`: each member's checkpoint policy (or None), as run_trial's: a member
    checkpoints in run_trial's format, so that a retry resumes it alone (a pack itself
    always starts at step 0).
    """
    started = time.perf_counter()
    specs = [s if isinstance(s, TrialSpec) else TrialSpec.model_validate(s) for s in specs]
    check_packable(specs)
    try:
        prepare_process(specs[0])
        data = load_trial_data(specs[0], cache_dir, roots, data_hash)
        plan = plan_trial(specs[0], data)  # the shape's: device, precision, batches
        budget = (MEMORY_HEADROOM * free_memory(plan.device, plan.threads)
                  if memory_limit is None else memory_limit)
        need = trial_memory(specs[0], data.vocab_size, half_activations=plan.bf16)
    except Exception as exc:
        return [failed_result(spec, exc, started) for spec in specs]
    k = len(specs)
    fits = k if budget >= need.pack_peak(k) else max(1, int(budget // need.pack_peak(1)))
    why = [] if fits == k else [f"estimated {need.pack_peak(1) / 1e9:.3g} GB per member, "
                                f"{budget / 1e9:.3g} GB to use"]
    packing = _Packing(specs, data, plan.device, reporter, on_result, why, max_hours,
                       checkpoints, (cache_dir, roots, data_hash))
    return packing.train(split_evenly(list(range(k)), fits))


class _Relay:
    """The caller's reporter across a pack's attempts: a member trained again after its pack
    ran out of memory reports each step once (a retry's repeats are not passed on; a member
    the reporter stopped is final and not trained again)."""

    def __init__(self, reporter: PackedReporter | None):
        self.reporter = reporter
        self.last: dict[int, int] = {}  # member -> last step passed on

    def for_group(self, group: list[int]) -> PackedReporter:
        def report(row: int, metrics: dict[str, Any]) -> bool:
            i, step = group[row], int(metrics["step"])
            if step <= self.last.get(i, 0):  # a retry's repeat
                return False
            self.last[i] = step
            return self.reporter is not None and bool(self.reporter(i, metrics))

        return report


class _Packing:
    """The packs of one run_trials call, trained one after another: each member's final
    result, handed over as soon as it is final, and a pack that ran out of memory halved
    and queued again."""

    def __init__(self, specs: list[TrialSpec], data: TokenDataset, device: torch.device,
                 reporter: PackedReporter | None,
                 on_result: Callable[[int, TrialResult], None] | None, why: list[str],
                 max_hours: float | None = None,
                 policies: Sequence[CheckpointPolicy | None] | None = None,
                 data_source: tuple[str | None, Sequence[str] | None, str | None] = (
                     None, None, None)):
        self.specs, self.data, self.device = specs, data, device
        self.policies = policies
        self.data_source = data_source  # run_trial's cache_dir, roots, data_hash
        self.alone: set[int] = set()  # members to go on alone from their checkpoint
        self.max_hours = max_hours
        self.on_result, self.why = on_result, why  # why: the reasons packs were split
        self.relay = _Relay(reporter)
        self.results: dict[int, TrialResult] = {}
        self.early: dict[int, TrialResult] = {}  # members handed over when they stopped

    def train(self, queue: list[list[int]]) -> list[TrialResult]:
        k = len(self.specs)
        while queue:
            group = queue.pop(0)
            out, oom = (self.train_alone(group[0]) if group[0] in self.alone
                        else self.train_pack(group))
            if oom and len(group) > 1:
                queue[:0] = self.halved(group, out[0])
                continue
            out = [self.early.get(i, r) for i, r in zip(group, out, strict=True)]
            if len(group) < k:  # final now: the note says only what this member's group was
                how = ("went on alone from its checkpoint" if group[0] in self.alone
                       else f"trained in a pack of {len(group)}")
                note = (f"a pack of {k} did not fit in memory together; this member {how} "
                        f"({'; '.join(self.why)})")
                for r in out:
                    r.notes.append(note)
            self.results.update(zip(group, out, strict=True))
            if queue and self.on_result is not None:
                for i, result in zip(group, out, strict=True):
                    if i not in self.early:
                        self.on_result(i, result)
        return [self.results[i] for i in range(k)]

    def train_alone(self, i: int) -> tuple[list[TrialResult], bool]:
        """Member `i` trained alone by run_trial, which resumes it from its latest checkpoint
        (the member's own, written by the pack that ran out of memory)."""
        report = self.relay.for_group([i])
        cache_dir, roots, data_hash = self.data_source
        result = run_trial(self.specs[i], lambda metrics: report(0, metrics), cache_dir,
                           roots, data_hash, checkpoints=self.policies[i],
                           max_hours=self.max_hours)
        return [result], False

    def train_pack(self, group: list[int]) -> tuple[list[TrialResult], bool]:
        """Train the members in `group` as one pack; (results, whether it ran out of memory,
        so that it may be trained again smaller)."""
        specs = [self.specs[i] for i in group]
        started = time.perf_counter()
        pack = None
        try:
            pack = Pack(specs, self.relay.for_group(group), None, data=self.data,
                        on_stop=lambda row, result: self.stopped(group[row], result),
                        max_hours=self.max_hours,
                        policies=None if self.policies is None
                        else [self.policies[i] for i in group])
            return pack.train(), False
        except Exception as exc:
            curves = [m.progress.curve for m in pack.members] if pack else [None] * len(specs)
            return ([failed_result(s, exc, started, c)
                     for s, c in zip(specs, curves, strict=True)], is_out_of_memory(exc))

    def stopped(self, i: int, result: TrialResult) -> None:
        """Member `i` stopped early (diverged, pruned): its result is final."""
        if i not in self.early:  # a retried pack's repeat is not handed over again
            self.early[i] = result
            if self.on_result is not None:
                self.on_result(i, result)

    def halved(self, group: list[int], failed: TrialResult) -> list[list[int]]:
        """The packs to train again after `group` ran out of memory: its members that had not
        stopped, in two halves."""
        self.why.append(f"a pack of {len(group)} ran out of memory: "
                        f"{failed.error.splitlines()[0][:200]}")
        gc.collect()  # the failed pack's tensors (held in cycles) go before the halves'
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        again = [i for i in group if i not in self.early]  # those that stopped are final
        self.results.update((i, self.early[i]) for i in group if i in self.early)
        # a member that checkpointed goes on alone from there (re-training at most an
        # interval, not the steps since 0): alone it needs the least memory there is
        resumable = [i for i in again if self._checkpointed(i)]
        self.alone.update(resumable)
        again = [i for i in again if i not in self.alone]
        halves = split_evenly(again, (len(again) + 1) // 2) if again else []
        return [[i] for i in resumable] + halves

    def _checkpointed(self, i: int) -> bool:
        policy = None if self.policies is None else self.policies[i]
        try:
            return policy is not None and policy.has_checkpoint()
        except Exception:  # noqa: BLE001 - an unreadable store: train it again in a pack
            return False
