"""Price a sweep before it is queued (`hpt plan`, ``POST /sweeps?dry_run=true``,
`Client.plan`): per stage and in total, its trials, tokens, FLOPs, peak memory per worker,
workers per trial, device-hours and wall time on this cluster.

Every count is the sweep's worst case (`admission.stage_shapes`): a study's later stages and
extension rounds depend on fits not made yet, so each is priced at the most trials it can
plan; `planned` says how many are planned without extension rounds. FLOPs are the analytic
training FLOPs (`models.flops`) of every trial, summed. Seconds per trial come from a
throughput calibration (`calibration.py`: this cluster's completed trials, a cached
micro-run, or a GPU's peak FLOP/s at a stated MFU; the plan says which).

Wall time replays the dispatcher: the study's rounds run one after another (the tune grid,
each tune extension round, the later stages together, each check extension round); in a
round, trials on several workers lease first, the rest form packs of one shape
(`packing.plan_packs`, with the gains measured for `pack: auto`), and tasks start in plan
order while the sweep has fewer than max_concurrent in flight and the cluster has their CPUs
and GPUs free. Device-hours are each task's time x the GPUs (on a CPU sweep: the CPUs) it
holds. Not priced: reuse of trials already trained (`reuse`), retries, the dispatcher's and
Ray's own overhead between tasks (`TASK_GAP_S` per task), and the fits between rounds.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from hptransfer.spec import SweepSpec

from .admission import GB, TrialCost, admit
from .calibration import Throughput, micro_run, passes_per_step, peak_throughput
from .packing import measured_packs, on_gpu, pack_cost, pack_size, plan_packs

# Between one task's end and the next one's start on its slot: the dispatcher's tick, the
# lease, Ray's task start and the worker's data load (benchmarks/dispatch_overhead.py
# measures the whole path)
TASK_GAP_S = 0.5


@dataclass(frozen=True)
class Cluster:
    """What the plan runs on: CPUs and GPUs in all, the GPU type where known, and where the
    figures came from."""

    cpus: float
    gpus: float
    gpu_type: str | None = None
    source: str = "this host"


@dataclass
class _Item:
    """One trial of a round: its cost entry and its TrialSpec as packing reads it."""

    cost: TrialCost
    spec: dict[str, Any]
    seconds: float


@dataclass
class _Task:
    members: list[_Item]
    seconds: float
    cpus: float
    gpus: float


@dataclass
class StageTotals:
    stage: str
    trials: int = 0
    planned: int = 0
    tokens: float = 0.0
    flops: list[float] = field(default_factory=list)  # every trial's, summed exactly
    peak_worker_bytes: float = 0.0
    workers: set[int] = field(default_factory=set)
    device_hours: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "trials": self.trials, "planned": self.planned,
                "tokens": self.tokens, "flops": math.fsum(self.flops),
                "peak_memory_per_worker_gb": self.peak_worker_bytes / GB,
                "workers_per_trial": sorted(self.workers),
                "device_hours": self.device_hours}


def cluster_now(cpus: float | None = None, gpus: float | None = None) -> Cluster:
    """The Ray cluster's CPUs and GPUs when Ray is initialised, else this host's; `cpus`,
    `gpus` replace them (a plan for a cluster you do not have yet)."""
    import os

    found, gpu_type, source = None, None, "this host"
    try:
        import ray

        if ray.is_initialized():
            res = ray.cluster_resources()
            found = (float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0)))
            types = sorted(k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:"))
            gpu_type = types[0] if types else None
            source = "the Ray cluster"
    except Exception:  # Ray unreachable: price against this host
        found = None
    if found is None:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        found = (float(os.cpu_count() or 1), float(n))
        if n:
            gpu_type = next((k for k in ("H200", "H100", "A100", "L40S", "L4")
                             if k in torch.cuda.get_device_name(0)), None)
    if cpus is not None or gpus is not None:
        source = "the cluster asked for"
    return Cluster(cpus if cpus is not None else found[0],
                   gpus if gpus is not None else found[1], gpu_type, source)


def throughput(spec: SweepSpec, store: Any, home: Any, cluster: Cluster,
               calibrate: bool = False) -> Throughput:
    """The calibration this sweep's trials are priced with (`calibration.py`)."""
    from .calibration import from_store

    device = "gpu" if on_gpu(spec) else "cpu"
    measured = None if calibrate else from_store(store, spec, device)
    if measured is not None:
        return measured
    if device == "cpu":
        return micro_run(spec, home, refresh=calibrate)
    return peak_throughput(cluster.gpu_type)


def rounds(spec: SweepSpec, costs: list[TrialCost], worst: bool = True
           ) -> list[tuple[str, list[tuple[TrialCost, int]]]]:
    """The study's rounds in order, each (name, [(cost, trials per cost)]): the tune grid,
    each tune extension round, the later stages together, each check extension round
    (`worst`: all of them; else none)."""
    st = spec.stages
    if st is None:
        return [("grid", [(c, c.trials) for c in costs])]
    reps = len(spec.grid.sigma_bases) * len(spec.grid.seeds)
    tune = [c for c in costs if c.stage == "tune"]
    later = [c for c in costs if c.stage != "tune"]
    out = [("tune", [(c, c.planned) for c in tune])]
    if worst:
        out += [(f"tune extension {k + 1}", [(c, st.tune.extend_lrs * reps) for c in tune])
                for k in range(st.tune.extend)]
    if later:
        out.append((" + ".join(st.enabled()[1:]), [(c, c.planned) for c in later]))
    checks = [c for c in later if c.stage == "check"]
    if worst and st.check is not None and checks:
        out += [(f"check extension {k + 1}",
                 [(c, st.check.extend_lrs * len(spec.grid.seeds)) for c in checks])
                for k in range(st.check.extend)]
    return out


def _tasks(spec: SweepSpec, items: list[_Item], slots: int) -> list[_Task]:
    """One round's Ray tasks as the dispatcher forms them: trials on several workers alone
    and first, the rest in packs (`packing.plan_packs`) unless the spec never packs."""
    spanning = [i for i in items if i.cost.task.spans]
    rest = [i for i in items if not i.cost.task.spans]
    where = measured_packs(spec)
    if spec.resources.pack == 1:
        packs = [[i] for i in rest]
    else:
        packs = plan_packs(rest, slots, lambda t: pack_size(spec, t.spec),
                           lambda t, n: pack_cost(n, t.spec, where))
    out = []
    for members in [[i] for i in spanning] + packs:
        first = members[0]
        seconds = first.seconds * pack_cost(len(members), first.spec, where)
        task = first.cost.task
        out.append(_Task(members, seconds, task.cpus * task.workers, task.gpus * task.workers))
    return out


def _makespan(tasks: list[_Task], limit: int, cluster: Cluster
              ) -> tuple[float | None, list[str]]:
    """When the last of `tasks` ends, started in order while fewer than `limit` are in
    flight and their CPUs and GPUs are free; None, and why, when some task needs more than
    the whole cluster has (its trials wait until the cluster grows)."""
    too_big = sorted({f"a task needs {t.cpus:g} CPUs and {t.gpus:g} GPUs, the cluster has "
                      f"{cluster.cpus:g} CPUs and {cluster.gpus:g} GPUs: its trials wait "
                      "until the cluster grows (plan for a cluster with --cpus/--gpus)"
                      for t in tasks if t.cpus > cluster.cpus + 1e-9
                      or t.gpus > cluster.gpus + 1e-9})
    if too_big:
        return None, too_big
    now, running = 0.0, []  # heap of (end, cpus, gpus)
    cpus, gpus = cluster.cpus, cluster.gpus
    for task in tasks:
        while running and (len(running) >= limit or task.cpus > cpus + 1e-9
                           or task.gpus > gpus + 1e-9):
            end, c, g = heapq.heappop(running)
            now, cpus, gpus = max(now, end), cpus + c, gpus + g
        heapq.heappush(running, (now + task.seconds + TASK_GAP_S, task.cpus, task.gpus))
        cpus, gpus = cpus - task.cpus, gpus - task.gpus
    return max((end for end, _, _ in running), default=now), []


def price(spec: SweepSpec, settings: Any, store: Any, cluster: Cluster,
          calibrate: bool = False) -> dict[str, Any]:
    """The plan of `spec` (module docstring) as JSON-able data, with its text."""
    costs = admit(spec, settings)
    speed = throughput(spec, store, settings.home, cluster, calibrate)
    gpu = on_gpu(spec)
    unit = "GPU-hours" if gpu else "CPU-hours"
    per_trial = {id(c): _seconds(c, speed) for c in costs}
    stages: dict[str, StageTotals] = {}
    for c in costs:
        s = stages.setdefault(c.stage or "grid", StageTotals(c.stage or "grid"))
        s.trials += c.trials  # c is one arm's shape
        s.planned += c.planned
        s.tokens += c.tokens * c.trials
        s.flops += [c.flops] * c.trials
        s.peak_worker_bytes = max(s.peak_worker_bytes, c.worker_memory_bytes)
        s.workers.add(c.task.workers)
    timeline, warnings = [], []
    total_wall: dict[bool, float | None] = {True: 0.0, False: 0.0}
    for worst in (True, False):
        for name, entries in rounds(spec, costs, worst):
            items = [_Item(c, _pack_spec(spec, c), per_trial[id(c)])
                     for c, n in entries for _ in range(n)]
            # the dispatcher's own count of packs that run at once (dispatch.py)
            fitting = spec.resources.base.count_in(cluster.cpus, cluster.gpus)
            slots = max(1, min(spec.max_concurrent, fitting))
            tasks = _tasks(spec, items, slots)
            wall, why = _makespan(tasks, spec.max_concurrent, cluster)
            before = total_wall[worst]
            total_wall[worst] = None if wall is None or before is None else before + wall
            if worst:
                warnings += why
                timeline.append({"round": name, "trials": len(items), "tasks": len(tasks),
                                 "wall_s": wall})
                for task in tasks:  # each member holds its share of the task's devices
                    held = task.gpus if gpu else task.cpus
                    for item in task.members:
                        stage = stages[item.cost.stage or "grid"]
                        stage.device_hours += task.seconds * held / len(task.members) / 3600
    rows = [s.to_dict() for s in stages.values()]
    totals = {"trials": sum(r["trials"] for r in rows),
              "planned": sum(r["planned"] for r in rows),
              "tokens": sum(r["tokens"] for r in rows),
              "flops": math.fsum(f for s in stages.values() for f in s.flops),
              "peak_memory_per_worker_gb": max(r["peak_memory_per_worker_gb"] for r in rows),
              "workers_per_trial": sorted({w for r in rows for w in r["workers_per_trial"]}),
              "device_hours": sum(r["device_hours"] for r in rows),
              "wall_s": total_wall[True], "wall_s_planned": total_wall[False]}
    plan = {"name": spec.name, "device": "gpu" if gpu else "cpu", "unit": unit,
            "stages": rows, "total": totals, "rounds": timeline,
            "throughput": speed.to_dict(),
            "cluster": {"cpus": cluster.cpus, "gpus": cluster.gpus,
                        "gpu_type": cluster.gpu_type, "source": cluster.source},
            "max_concurrent": spec.max_concurrent,
            "warnings": sorted(set(warnings))}
    plan["text"] = plan_text(plan)
    return plan


def _seconds(cost: TrialCost, speed: Throughput) -> float:
    passes = passes_per_step(cost.batch_size, cost.micro_batch_size, cost.task.workers)
    seconds = speed.seconds(cost.flops, cost.steps, passes, cost.depth, cost.task.workers)
    if speed.source == "peak x MFU" and 0 < cost.task.gpus < 1:
        # a GPU's peak, shared: the trials Ray puts beside it take the rest (measured
        # figures already ran shared)
        seconds /= cost.task.gpus
    return seconds


def _pack_spec(spec: SweepSpec, cost: TrialCost) -> dict[str, Any]:
    """The trial spec packing groups by and sizes packs from (LR, sigma, seed aside)."""
    return {"arm": cost.arm, "width": cost.width, "depth": cost.depth,
            "tokens": cost.tokens, "batch_size": cost.batch_size, "seq_len": cost.seq_len,
            "micro_batch_size": cost.micro_batch_size}


def _hours(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


# FLOP/s no device of its kind reaches in training (a B200's dense bf16 peak is 2.25e15; a
# CPU core's ~1e11): a sweep whose FLOPs at this rate stay under the ceiling needs no
# pricing at submit
FASTEST_FLOPS = {"gpu": 2.5e15, "cpu": 1e13}
# the least a trial costs on its task beyond its FLOPs (below what any micro-run measured)
MIN_TRIAL_S = 0.01


def may_exceed(spec: SweepSpec, costs: list[TrialCost], hours: float) -> bool:
    """Whether the sweep could cost more than `hours` device-hours: a bound at FASTEST_FLOPS
    that needs no calibration (the many small sweeps are never priced at submit)."""
    rate = FASTEST_FLOPS["gpu" if on_gpu(spec) else "cpu"]
    held = max(c.task.workers * (c.task.gpus if on_gpu(spec) else c.task.cpus) for c in costs)
    seconds = sum((c.flops / rate + MIN_TRIAL_S) * c.trials for c in costs)
    return seconds * max(1.0, held) / 3600 > hours


def cost_message(plan: dict[str, Any], limit: float) -> str:
    """Why a sweep is not queued without confirmation: its estimate and the flag."""
    t = plan["total"]
    wall = f", ~{_hours(t['wall_s'])} of wall time" if t["wall_s"] is not None else ""
    return (f"this sweep is estimated at {t['device_hours']:.3g} {plan['unit']}{wall} "
            f"({t['trials']} trials at most, {t['flops']:.3g} FLOPs; throughput: "
            f"{plan['throughput']['detail']}), more than HPT_MAX_SWEEP_DEVICE_HOURS="
            f"{limit:g}; `hpt plan` shows the figures. To queue it anyway, submit with "
            "--confirm-cost (REST: POST /sweeps?confirm_cost=true; Python: "
            "Client.submit(spec, confirm_cost=True))")


def plan_text(plan: dict[str, Any]) -> str:
    """The plan as `hpt plan` prints it."""
    unit = plan["unit"]
    head = (f"{'stage':<13} {'trials':>11} {'tokens':>9} {'FLOPs':>9} {'mem/worker':>10} "
            f"{'workers':>7} {unit:>10}")
    lines = [f"plan for {plan['name']!r}: nothing queued", head]

    def row(name: str, r: dict[str, Any]) -> str:
        trials = f"{r['planned']}-{r['trials']}" if r["planned"] != r["trials"] else str(
            r["trials"])
        workers = ",".join(str(w) for w in r["workers_per_trial"])
        return (f"{name:<13} {trials:>11} {r['tokens']:>9.3g} {r['flops']:>9.3g} "
                f"{r['peak_memory_per_worker_gb']:>7.3g} GB {workers:>7} "
                f"{r['device_hours']:>10.3g}")

    for r in plan["stages"]:
        lines.append(row(r["stage"], r))
    t = plan["total"]
    lines.append(row("total", t))
    c = plan["cluster"]
    gpus = f", {c['gpus']:g} GPUs" + (f" ({c['gpu_type']})" if c["gpu_type"] else "")
    where = (f"on {c['source']}: {c['cpus']:g} CPUs{gpus}, max_concurrent "
             f"{plan['max_concurrent']}")
    if t["wall_s"] is None:
        lines.append(f"wall time: none: the trials cannot run {where}")
    else:
        lines.append(f"wall time: {_hours(t['wall_s'])} at most, "
                     f"{_hours(t['wall_s_planned'])} without extension rounds, {where}")
        lines.append("  " + "; ".join(f"{r['round']} {_hours(r['wall_s'])} ({r['trials']} "
                                      f"trials, {r['tasks']} tasks)" for r in plan["rounds"]))
    lines.append(f"throughput: {plan['throughput']['detail']}")
    lines += [f"warning: {w}" for w in plan["warnings"]]
    lines.append("trials: planned without extension rounds - at most; each figure at the "
                 "most (worst case); reused trials and retries not counted")
    return "\n".join(lines)
