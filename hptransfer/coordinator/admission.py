"""Resource admission: refuse, at submit, a sweep with a trial no worker could run.

Each (arm, width, depth) shape a sweep can train is priced before anything is stored: the
grid's, and a study's later stages' (transfer ladder, check and aspect-ratio shapes, at their
own token budgets): memory by `workers.memory.trial_memory` (weights, gradients, AdamW
state and the activations kept for backward), compute as analytic training FLOPs
(`models.flops`) x the trial's token budget.

A trial is refused when its memory exceeds the memory of the largest alive Ray node (when
Ray is initialised; else this host's; not for a sweep on GPUs, whose memory Ray does not
report), or a configured cap (HPT_MAX_TRIAL_MEMORY_GB).

Nothing stops a trial once it runs (the trainer has no time limit), so the compute it asks
for is bounded here: its steps (HPT_MAX_TRIAL_STEPS), its FLOPs (HPT_MAX_TRIAL_FLOPS) and the
FLOPs of every trial the sweep can plan (HPT_MAX_SWEEP_FLOPS); the FLOP ceilings default by
device (`config.DEFAULT_MAX_TRIAL_FLOPS`, `DEFAULT_MAX_SWEEP_FLOPS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hptransfer.config import DEFAULT_MAX_SWEEP_FLOPS, DEFAULT_MAX_TRIAL_FLOPS, Settings
from hptransfer.models.flops import param_counts
from hptransfer.spec import SpecError, SweepSpec
from hptransfer.spec.sections import TaskResources
from hptransfer.workers.memory import host_memory, trial_memory, worker_state_bytes

from .packing import on_gpu

GB = 1e9
LARGEST_GPU_BYTES = 192 * GB  # B200, MI300X: no single accelerator holds more today


@dataclass(frozen=True)
class TrialCost:
    arm: str
    width: int
    depth: int
    batch_size: int
    seq_len: int
    params: int
    state_bytes: float  # weights, gradients, AdamW moments
    activation_bytes: float  # of the whole batch in one process
    tokens: float
    flops: float
    field: str = "grid"  # the spec field that asks for this shape (where an error points)
    steps: int = 0
    trials: int = 1  # how many of the sweep's trials train this arm at this shape, at most
    stage: str | None = None  # a study's stage (None: a sweep without stages)
    planned: int = 1  # of `trials`, those planned without extension rounds
    task: TaskResources = TaskResources(1, 1.0, 0.0)  # what its Ray task asks for
    worker_activation_bytes: float | None = None  # one data-parallel worker's share
    non_embedding: int = 0  # parameters (scale_out rules and FLOPs count these)
    tokens_per_param: float | None = None  # its own budget (None: the sweep's)
    micro_batch_size: int | None = None

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def worker_memory_bytes(self) -> float:
        """Peak bytes on each of its workers: DDP keeps the whole weights, gradients and
        AdamW state on every worker, FSDP (task.shard) 1/W of them plus the units it
        gathers (memory.worker_state_bytes); and the activations of its share of the
        batch."""
        share = (self.activation_bytes if self.worker_activation_bytes is None
                 else self.worker_activation_bytes)
        return share + worker_state_bytes(self.state_bytes, self.task.workers,
                                          self.task.shard, self.params, self.non_embedding,
                                          self.depth)

    def describe(self) -> str:
        spread = ""
        if self.task.spans:
            spread = (f", ~{self.worker_memory_bytes / GB:.3g} GB on each of its "
                      f"{self.task.workers} data-parallel workers")
        return (
            f"arm {self.arm!r} at width {self.width}, depth {self.depth}, batch "
            f"{self.batch_size} x seq_len {self.seq_len}: {self.params:.3g} parameters, "
            f"~{self.memory_bytes / GB:.3g} GB ({self.state_bytes / GB:.3g} GB weights, "
            f"gradients and AdamW state + {self.activation_bytes / GB:.3g} GB activations)"
            f"{spread}, {self.flops:.3g} training FLOPs for {self.tokens:.3g} tokens"
        )


@dataclass(frozen=True)
class StageShape:
    """One shape a stage trains (per arm), and how many trials it trains there."""

    stage: str | None  # None: a sweep without stages (its grid)
    width: int
    depth: int
    tokens_per_param: float | None  # None: the sweep's budget
    field: str  # the spec field that asks for it
    trials: int  # per arm, at most: with every extension round a fit may ask for
    planned: int  # per arm, without extension rounds

    @property
    def key(self) -> tuple[int, int, float | None]:
        return (self.width, self.depth, self.tokens_per_param)


def stage_shapes(spec: SweepSpec) -> list[StageShape]:
    """Every shape each stage can train, with the most trials it trains there per arm: the
    one definition of a sweep's worst case. The grid (a study's tune stage): its LRs (or
    Optuna's n_trials) x sigmas x seeds per shape, plus each tune extension round's
    `extend_lrs` LRs; a later stage, per seed: its LR offsets at the shape (the check
    bracket without 0 at a ladder shape, whose own trial that is), plus each check
    extension round's `extend_lrs` LRs."""
    g = spec.grid
    per_lr = ((spec.search.n_trials or 0) if spec.search.method == "optuna"
              else len(g.lr_values()))
    reps, seeds = len(g.sigma_bases) * len(g.seeds), len(g.seeds)
    st = spec.stages
    extra = st.tune.extend * st.tune.extend_lrs if st is not None else 0
    tune = "tune" if st is not None else None
    out = [StageShape(tune, w, d, None, "grid", (per_lr + extra) * reps, per_lr * reps)
           for d in g.depths for w in g.widths]
    if st is None:
        return out
    _add_target_cap(spec, "tune", out)
    for stage in st.enabled()[1:]:
        # check without shapes brackets the ladder's largest: transfer's field asks for it
        given = stage != "check" or (st.check is not None and st.check.shapes is not None)
        field = f"stages.{stage}.shapes" if given else "stages.transfer.shapes"
        extend = (st.check.extend * st.check.extend_lrs
                  if stage == "check" and st.check is not None else 0)
        shapes = []
        for s in st.shapes_of(stage):
            n = len(st.lr_offsets(stage, s))
            shapes.append(StageShape(stage, s.width, s.depth, st.tokens_per_param(stage, s),
                                     field, (n + extend) * seeds, n * seeds))
        _add_target_cap(spec, stage, shapes)
        out += shapes
    return out


def _add_target_cap(spec: SweepSpec, stage: str, shapes: list[StageShape]) -> None:
    """The trials a stage target may add, in the worst case: its `max_extra_trials`, all at
    the stage's largest shape (by 12·N²·L; a check target may add some at the smaller base
    shape instead). With `max_extra_flops`, no more trials than that many FLOPs buy at the
    cheapest shape the target may add at, and of them no more at the largest shape than
    the cap needs to be spent there (so the FLOPs priced are never below what it may
    spend); the rest at the stage's cheapest shape."""
    assert spec.stages is not None
    n = spec.stages.extra_cap(stage)
    if not n or not shapes:
        return
    top = max(range(len(shapes)), key=lambda k: (shapes[k].width**2 * shapes[k].depth,
                                                shapes[k].width))
    at_top, cheapest = n, top
    cap = spec.stages.extra_flops_cap(stage)
    if cap is not None:
        flops = [min(_shape_flops(spec, s)) for s in shapes]
        cheapest = min(range(len(shapes)), key=lambda k: flops[k])
        # a check target may add trials at the (cheaper) base shape: they count as well
        low = min([flops[cheapest], *(min(_shape_flops(spec, s)) for s in (
            _tune_shapes(spec) if stage == "check" else []))])
        n = min(n, math.floor(cap / low))
        at_top = min(n, math.ceil(cap / max(_shape_flops(spec, shapes[top]))))
    shapes[top] = replace(shapes[top], trials=shapes[top].trials + at_top)
    if n > at_top:
        shapes[cheapest] = replace(shapes[cheapest],
                                   trials=shapes[cheapest].trials + n - at_top)


def _shape_flops(spec: SweepSpec, shape: StageShape) -> list[float]:
    """One trial's training FLOPs at `shape`, per arm (`SweepSpec.trial_flops`)."""
    lr, sigma, seed = spec.grid.lr_values()[0], spec.grid.sigma_bases[0], spec.grid.seeds[0]
    return [spec.trial_flops(spec.trial_spec(arm, shape.width, shape.depth, lr, sigma, seed,
                                             shape.tokens_per_param))
            for arm in spec.arms]


def _tune_shapes(spec: SweepSpec) -> list[StageShape]:
    """The tune stage's shapes (the grid's), without trial counts: a check target's base."""
    return [StageShape("tune", w, d, None, "grid", 0, 0)
            for d in spec.grid.depths for w in spec.grid.widths]


def trained_shapes(spec: SweepSpec) -> dict[tuple[int, int, float | None], str]:
    """Every (width, depth, tokens_per_param) the sweep can train -> the spec field that
    first asks for it (tokens_per_param None: the sweep's budget)."""
    shapes: dict[tuple[int, int, float | None], str] = {}
    for s in stage_shapes(spec):
        shapes.setdefault(s.key, s.field)
    return shapes


def trials_per_shape(spec: SweepSpec) -> dict[tuple[int, int, float | None], int]:
    """The most trials one arm can train at each key of `trained_shapes`, every stage's
    together (`stage_shapes`)."""
    counts: dict[tuple[int, int, float | None], int] = {}
    for s in stage_shapes(spec):
        counts[s.key] = counts.get(s.key, 0) + s.trials
    return counts


def stage_costs(spec: SweepSpec) -> list[TrialCost]:
    """The cost of one trial of every arm at every shape of every stage (`stage_shapes`:
    LR, sigma and seed change nothing), with the Ray resources it will get
    (`SweepSpec.task_resources`) and its memory on each of its workers."""
    lr, sigma, seed = spec.grid.lr_values()[0], spec.grid.sigma_bases[0], spec.grid.seeds[0]
    vocab = spec.model_vocab_size()
    # bf16 autocasts on CUDA only: a trial that may run on a CPU trains fp32 there
    gpu = on_gpu(spec)
    costs = []
    for arm in spec.arms:
        for shape in stage_shapes(spec):
            trial = spec.trial_spec(arm, shape.width, shape.depth, lr, sigma, seed,
                                    shape.tokens_per_param)
            cfg = trial.model_config_obj(vocab_size=vocab)
            half = trial.precision == "bf16" and gpu
            need = trial_memory(trial, vocab, half_activations=half)
            task = spec.task_resources(trial, shape.stage)
            share = None
            if task.spans:  # each rank trains on its rows of every global batch
                rows = math.ceil(trial.batch_size / task.workers)
                share = trial_memory(trial.model_copy(update={"batch_size": rows}), vocab,
                                     half_activations=half).activation_bytes
            b, t = trial.batch_size, trial.seq_len
            counts = param_counts(cfg)
            steps = trial.budget.steps_for(b * t, counts.non_embedding)
            tokens = float(steps) * b * t
            costs.append(TrialCost(
                arm=arm.name, width=shape.width, depth=shape.depth, batch_size=b, seq_len=t,
                params=need.params,
                state_bytes=need.state_bytes,
                activation_bytes=need.activation_bytes,
                tokens=tokens,
                flops=spec.trial_flops(trial),
                field=shape.field,
                steps=steps,
                trials=shape.trials,
                stage=shape.stage,
                planned=shape.planned,
                task=task,
                worker_activation_bytes=share,
                non_embedding=counts.non_embedding,
                tokens_per_param=shape.tokens_per_param,
                micro_batch_size=trial.micro_batch_size,
            ))
    return costs


def trial_costs(spec: SweepSpec) -> list[TrialCost]:
    """The cost of every trained shape of every arm of `spec`, once per (arm, shape,
    budget) however many stages train it: the first stage's, with every stage's trials."""
    merged: dict[tuple[str, int, int, float | None], TrialCost] = {}
    for cost in stage_costs(spec):
        key = (cost.arm, cost.width, cost.depth, cost.tokens_per_param)
        if key in merged:
            first = merged[key]
            merged[key] = replace(first, trials=first.trials + cost.trials,
                                  planned=first.planned + cost.planned)
        else:
            merged[key] = cost
    return list(merged.values())


def largest_worker_memory() -> tuple[float, str]:
    """(bytes, where): the memory of the largest alive Ray node when Ray is initialised,
    else this host's physical memory."""
    try:
        import ray

        if ray.is_initialized():
            sizes = [float(n.get("Resources", {}).get("memory", 0))
                     for n in ray.nodes() if n.get("Alive")]
            if sizes and max(sizes) > 0:
                return max(sizes), "the largest Ray worker node"
    except Exception:  # Ray unreachable: fall back to this host rather than refuse everything
        pass
    return host_memory(), "this host"


def gpu_memory() -> tuple[float, str] | None:
    """(bytes, which GPU) of the GPUs the cluster has, where known: the smallest GPU of the
    alive Ray nodes that name their accelerator type (`GPU_MEMORY`, the larger variant where
    a type comes in two), else this host's own GPU; None when neither is known."""
    try:
        import ray

        if ray.is_initialized():
            kinds = {key.split(":", 1)[1] for n in ray.nodes() if n.get("Alive")
                     for key in n.get("Resources", {}) if key.startswith("accelerator_type:")}
            known = [(GPU_MEMORY[k], k) for k in kinds if k in GPU_MEMORY]
            if known:
                size, kind = min(known)
                return size, f"an {kind}"
            if kinds:
                return None
    except Exception:  # Ray unreachable: nothing known about its GPUs
        return None
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"this host's {props.name}"
    return None


# GPU memory by Ray's accelerator type (its `accelerator_type:` label); a type sold with two
# sizes (A100 40/80 GB) counts its larger, so that no trial is refused that could fit
GPU_MEMORY = {"H200": 141 * GB, "H100": 80 * GB, "GH200": 96 * GB, "A100": 80 * GB,
              "L40S": 48 * GB, "L40": 48 * GB, "A10G": 24 * GB, "L4": 24 * GB,
              "B200": 192 * GB, "MI300X": 192 * GB}


def _memory_limits(spec: SweepSpec, settings: Settings,
                   task: TaskResources) -> list[tuple[float, str]]:
    """(bytes, how an error names them) a worker of a trial with these resources must fit."""
    if on_gpu(spec) and task.gpus > 0:
        # a GPU trial lives in its GPU's memory, which Ray does not report (and no GPU node
        # may have joined yet: the sweep waits for one); a fraction of a GPU shares it with
        # the tasks Ray puts beside it. Unknown GPUs: past the largest made it cannot run.
        share = min(1.0, task.gpus)
        known = gpu_memory()
        size, what = known if known else (LARGEST_GPU_BYTES, "the largest GPU")
        part = f"{share:g} of " if share < 1 else ""
        limits = [(share * size, f"the {share * size / GB:.3g} GB of {part}{what} (each "
                                 f"{'worker' if task.spans else 'trial'} gets "
                                 f"{task.gpus:g} GPU)")]
    else:  # a CPU trial lives in its node's memory
        worker_bytes, where = largest_worker_memory()
        limits = [(worker_bytes, f"the {worker_bytes / GB:.3g} GB of {where}")]
    if settings.max_trial_memory_gb is not None:
        limits.append((settings.max_trial_memory_gb * GB,
                       f"HPT_MAX_TRIAL_MEMORY_GB={settings.max_trial_memory_gb:g}"))
    return limits


def resources_field(spec: SweepSpec, cost: TrialCost) -> str:
    """The spec field that gives this trial its resources: the first scale_out rule it
    matches, else `resources`."""
    for i, rule in enumerate(spec.resources.scale_out):
        if rule.matches(cost.non_embedding, cost.flops, cost.stage):
            return f"resources.scale_out[{i}]"
    return "resources"


def admit(spec: SweepSpec, settings: Settings) -> list[TrialCost]:
    """Raise SpecError with the figures for every shape that cannot run, each under the
    field that asks for it (``grid`` or ``stages.<stage>.shapes``), and for a sweep past its
    compute ceilings (see the module's docstring). Memory is priced per worker for the
    resources each trial gets (resources.workers, scale_out): one worker of a DDP trial
    holds the whole state and the activations of its share of the batch."""
    costs = stage_costs(spec)
    problems: list[tuple[int, str, str]] = []  # (index in costs, field, message)
    seen: set[tuple[str, int, int, float, TaskResources]] = set()  # once per shape
    for i, cost in enumerate(costs):
        key = (cost.arm, cost.width, cost.depth, cost.tokens, cost.task)
        if key in seen:
            continue
        seen.add(key)
        if cost.task.workers > cost.batch_size:
            problems.append((i, f"{resources_field(spec, cost)}.workers", (
                f"{cost.task.workers} data-parallel workers for a batch of {cost.batch_size} "
                f"sequences ({cost.describe()}): every worker needs a sequence of each batch; "
                "use fewer workers or a larger batch")))
            continue
        for limit, name in _memory_limits(spec, settings, cost.task):
            if cost.worker_memory_bytes > limit:
                where = (f"on each of its {cost.task.workers} workers "
                         f"({resources_field(spec, cost)})" if cost.task.spans else "")
                problems.append((i, cost.field, f"trial too large: {cost.describe()}; needs "
                                                f"more memory {where + ' ' if where else ''}"
                                                f"than {name}"))
                break
    held = {i for i, _, _ in problems}
    for i, field, message in compute_problems(spec, settings, costs):
        # a shape no worker can hold is not also refused by a default ceiling (noise); a
        # FLOPs cap the operator set is always named
        if i not in held or settings.max_trial_flops is not None:
            problems.append((i, field, message))
    problems.sort(key=lambda p: p[0])  # stable: each shape's problems together
    if problems:
        raise SpecError([{"field": field, "message": message}
                         for _, field, message in problems[:10]])
    return costs


def _ceiling(configured: float | None, defaults: dict[str, float], device: str,
             env: str, what: str) -> tuple[float, str]:
    """(limit, how an error names it): the configured value, else the device's default."""
    if configured is not None:
        return configured, f"{env}={configured:.3g}"
    limit = defaults[device]
    return limit, (f"the server's ceiling of {limit:.3g} FLOPs {what} on a {device.upper()} "
                   f"(raise it with {env} on the server)")


def compute_problems(spec: SweepSpec, settings: Settings,
                     costs: list[TrialCost]) -> list[tuple[int, str, str]]:
    """(index in `costs`, field, message) for each shape past the steps ceiling, else the
    FLOPs ceiling, per trial; when every shape is within them, (len(costs), ...) for a sweep
    whose trials together pass the FLOPs ceiling per sweep."""
    device = "gpu" if on_gpu(spec) else "cpu"
    trial_limit, trial_name = _ceiling(settings.max_trial_flops, DEFAULT_MAX_TRIAL_FLOPS,
                                       device, "HPT_MAX_TRIAL_FLOPS", "per trial")
    sweep_limit, sweep_name = _ceiling(settings.max_sweep_flops, DEFAULT_MAX_SWEEP_FLOPS,
                                       device, "HPT_MAX_SWEEP_FLOPS", "per sweep")
    budget = next(k for k in ("steps", "tokens", "tokens_per_param") if getattr(spec.budget, k))
    problems = []
    seen: set[tuple[str, int, int, float]] = set()
    for i, cost in enumerate(costs):
        if (cost.arm, cost.width, cost.depth, cost.tokens) in seen:
            continue  # one refusal per shape, under the first stage that trains it
        seen.add((cost.arm, cost.width, cost.depth, cost.tokens))
        if cost.steps > settings.max_trial_steps:
            field = f"budget.{budget}" if cost.field == "grid" else cost.field
            problems.append((i, field, f"trial too large: {cost.describe()} in "
                                       f"{cost.steps:.3g} steps; more than HPT_MAX_TRIAL_STEPS="
                                       f"{settings.max_trial_steps} (shrink the budget, or "
                                       "raise it on the server)"))
        elif cost.flops > trial_limit:
            problems.append((i, cost.field, f"trial too large: {cost.describe()}; exceeds "
                                            f"{trial_name}"))
    total = sum(c.flops * c.trials for c in costs)
    if not problems and total > sweep_limit:
        trials = sum(c.trials for c in costs)
        problems.append((len(costs), "grid", f"sweep too large: its {trials} "
                                             f"trials (at most) train {total:.3g} FLOPs in "
                                             f"all; exceeds {sweep_name}"))
    return problems
