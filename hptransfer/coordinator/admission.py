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

from dataclasses import dataclass

from hptransfer.config import DEFAULT_MAX_SWEEP_FLOPS, DEFAULT_MAX_TRIAL_FLOPS, Settings
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.spec import SpecError, SweepSpec
from hptransfer.spec.stages import STAGE_ORDER
from hptransfer.workers.memory import host_memory, trial_memory

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
    activation_bytes: float
    tokens: float
    flops: float
    field: str = "grid"  # the spec field that asks for this shape (where an error points)
    steps: int = 0
    trials: int = 1  # how many of the sweep's trials train this arm at this shape, at most

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    def describe(self) -> str:
        return (
            f"arm {self.arm!r} at width {self.width}, depth {self.depth}, batch "
            f"{self.batch_size} x seq_len {self.seq_len}: {self.params:.3g} parameters, "
            f"~{self.memory_bytes / GB:.3g} GB ({self.state_bytes / GB:.3g} GB weights, "
            f"gradients and AdamW state + {self.activation_bytes / GB:.3g} GB activations), "
            f"{self.flops:.3g} training FLOPs for {self.tokens:.3g} tokens"
        )


def trained_shapes(spec: SweepSpec) -> dict[tuple[int, int, float | None], str]:
    """Every (width, depth, tokens_per_param) the sweep can train -> the spec field that
    first asks for it: the grid's shapes (at the sweep's budget: None), then a study's later
    stages' shapes at their budgets (the tune stage is the grid; extension rounds add LRs,
    never shapes)."""
    shapes = {(w, d, None): "grid" for d in spec.grid.depths for w in spec.grid.widths}
    if spec.stages is not None:
        for stage in STAGE_ORDER[1:]:
            for s in spec.stages.shapes_of(stage):
                key = (s.width, s.depth, spec.stages.tokens_per_param(stage, s))
                shapes.setdefault(key, f"stages.{stage}.shapes")
    return shapes


def trials_per_shape(spec: SweepSpec) -> dict[tuple[int, int, float | None], int]:
    """The most trials one arm can train at each key of `trained_shapes`: SweepSpec's
    trial_count, shape by shape (LRs, or Optuna's trials, x sigmas x seeds on the grid, with
    the tune stage's extensions; a later stage's trials per seed)."""
    g = spec.grid
    per_lr = ((spec.search.n_trials or 0) if spec.search.method == "optuna"
              else len(g.lr_values()))
    if spec.stages is not None:
        per_lr += spec.stages.tune.extend * spec.stages.tune.extend_lrs
    counts = {(w, d, None): per_lr * len(g.sigma_bases) * len(g.seeds)
              for d in g.depths for w in g.widths}
    if spec.stages is not None:
        st = spec.stages
        for stage in st.enabled()[1:]:
            per_shape = (len(st.check.log2_offsets) + st.check.extend * st.check.extend_lrs
                         if stage == "check" and st.check else 1)
            for s in st.shapes_of(stage):
                key = (s.width, s.depth, st.tokens_per_param(stage, s))
                counts[key] = counts.get(key, 0) + per_shape * len(g.seeds)
    return counts


def trial_costs(spec: SweepSpec) -> list[TrialCost]:
    """The cost of every trained shape of every arm of `spec` (LR, sigma and seed change
    nothing)."""
    lr, sigma, seed = spec.grid.lr_values()[0], spec.grid.sigma_bases[0], spec.grid.seeds[0]
    vocab = spec.model_vocab_size()
    costs = []
    trials = trials_per_shape(spec)
    for arm in spec.arms:
        for key, field in trained_shapes(spec).items():
            width, depth, tokens_per_param = key
            trial = spec.trial_spec(arm, width, depth, lr, sigma, seed, tokens_per_param)
            cfg = trial.model_config_obj(vocab_size=vocab)
            # bf16 autocasts on CUDA only: a trial that may run on a CPU trains fp32 there
            need = trial_memory(trial, vocab,
                                half_activations=trial.precision == "bf16" and on_gpu(spec))
            b, t = trial.batch_size, trial.seq_len
            steps = trial.budget.steps_for(b * t, param_counts(cfg).non_embedding)
            tokens = float(steps) * b * t
            costs.append(TrialCost(
                arm=arm.name, width=width, depth=depth, batch_size=b, seq_len=t,
                params=need.params,
                state_bytes=need.state_bytes,
                activation_bytes=need.activation_bytes,
                tokens=tokens,
                flops=tokens * flops_per_token(cfg, t).training,
                field=field,
                steps=steps,
                trials=trials[key],
            ))
    return costs


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


def admit(spec: SweepSpec, settings: Settings) -> list[TrialCost]:
    """Raise SpecError with the figures for every shape that cannot run, each under the
    field that asks for it (``grid`` or ``stages.<stage>.shapes``), and for a sweep past its
    compute ceilings (see the module's docstring)."""
    if on_gpu(spec):
        # a GPU trial lives in its GPU's memory, which Ray does not report (and no GPU node
        # may have joined yet: the sweep waits for one); its worker splits or halves a pack
        # that would not fit there. Past the largest GPU made it cannot run anywhere.
        limits = [(LARGEST_GPU_BYTES, f"the {LARGEST_GPU_BYTES / GB:.3g} GB of the largest "
                                      "GPU (a trial runs on one)")]
    else:  # a CPU trial lives in its node's memory
        worker_bytes, where = largest_worker_memory()
        limits = [(worker_bytes, f"the {worker_bytes / GB:.3g} GB of {where}")]
    if settings.max_trial_memory_gb is not None:
        limits.append((settings.max_trial_memory_gb * GB,
                       f"HPT_MAX_TRIAL_MEMORY_GB={settings.max_trial_memory_gb:g}"))
    costs = trial_costs(spec)
    problems: list[tuple[int, str, str]] = []  # (index in costs, field, message)
    for i, cost in enumerate(costs):
        for limit, name in limits:
            if cost.memory_bytes > limit:
                problems.append((i, cost.field, f"trial too large: {cost.describe()}; needs "
                                                f"more memory than {name}"))
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
    for i, cost in enumerate(costs):
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
        problems.append((len(costs), "grid", f"sweep too large: its {spec.trial_count()} "
                                             f"trials (at most) train {total:.3g} FLOPs in "
                                             f"all; exceeds {sweep_name}"))
    return problems
