"""Optuna search over the LR axis: one study per (sweep, arm, shape, sigma, seed).

Ask-and-tell from the coordinator only (Optuna advises against parallel SQLite writers);
workers report intermediate validation losses through the progress board and the pruner
decides here. Heartbeats do not work with ask-and-tell, so dead trials are told FAIL by us.

What makes a study find η* rather than its first sample:
- its sampler is seeded from a stable hash of the study's own name (sweep, arm, shape, sigma,
  seed), so shapes never replay one proposal sequence;
- it starts with `Search.startup_count()` log-spaced LRs shifted by a per-shape offset
  (stratified over the whole range), enqueued before the sampler takes over; the offset
  hashes the shape without the sweep, so resubmitting a sweep reuses that batch's results;
  then two LRs half a slice either side of the best completed one (`refinement`, never
  pruned), so the quadratic fit has near neighbours; then, before the sampler (TPE by
  default) proposes, `bracket` makes sure the best full-budget LR has a full-budget
  neighbour on both sides (never pruned either), whatever order the trials ran in: alone,
  packed or concurrently, the refinement may have been placed around a best that a later
  trial beat, or the best's neighbour may have been pruned; and when another LR, with a worse
  one between, trained about as well as the best (a rival basin, analysis/basins.py), it gets
  the refinement the best got (`rival_refinement`), so the fit is not left to a coin toss;
- pruning (`_Gate`) never decides before the trial's warmup and `prune_after` of its budget
  are trained, nor before MIN_FULL_BUDGET trials of the study completed without diverging
  (so a quadratic in log2 LR can always be fitted); the default `rank` pruner compares
  trials at the same step only and keeps `keep_top` of them alive at every step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna

from hptransfer.analysis.basins import rival_basins
from hptransfer.contracts.status import TrialStatus
from hptransfer.models import param_counts
from hptransfer.spec import Search
from hptransfer.spec.sections import MIN_FULL_BUDGET
from hptransfer.spec.trial import TrialSpec

optuna.logging.set_verbosity(optuna.logging.WARNING)

# a diverged trial is a real observation ("too high"); tell it a loss worse than uniform
# over the vocabulary so the sampler moves away, rather than FAIL, which TPE ignores
DIVERGED_PENALTY = 2.0
DIVERGED_ATTR = "hpt_diverged"  # user attr: a COMPLETE trial whose value is the penalty
# study user attr: the numbers of the refinement trials (set once they are enqueued)
REFINED_ATTR = "hpt_refined"
# study user attr: the numbers of the bracketing trials (see `bracket`)
BRACKET_ATTR = "hpt_bracket"
# study user attr: the numbers of the trials refining a rival basin (see `rival_refinement`)
RIVAL_ATTR = "hpt_rival"
# trials asked to give the fit its points around η* (never pruned)
PROTECTED_ATTRS = (REFINED_ATTR, BRACKET_ATTR, RIVAL_ATTR)


def stable_seed(key: str) -> int:
    """A 32-bit seed from `key` that is the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")


def first_batch(key: str, lr_min: float, lr_max: float, n: int) -> list[float]:
    """`n` LRs, one in each of n equal log2 slices of [lr_min, lr_max], at an offset
    into its slice that depends on `key`: the range is covered and shapes differ. Ordered
    from the middle out (upper first): the first MIN_FULL_BUDGET, which always train to
    the full budget, are the likeliest to be near η*, and the lowest LR, the worst at any
    step in practice, is left to the pruner."""
    lo, hi = math.log2(lr_min), math.log2(lr_max)
    offset = stable_seed(f"first-batch:{key}") / 2.0**32  # in [0, 1)
    order = sorted(range(n), key=lambda i: (abs(i - (n - 1) / 2), -i))
    return [2.0 ** (lo + (i + offset) * (hi - lo) / n) for i in order]


def fit_neighbours(search_method: str) -> int:
    """LRs each side of the best that η*'s parabola is fitted on: a search's LRs are dense
    near η* and sparse far away (a wider window lets the far tail pull the vertex); a grid's
    are evenly spaced."""
    return 1 if search_method == "optuna" else 2


def half_slice(lr_min: float, lr_max: float, n_startup: int) -> float:
    """Half a first-batch slice, in octaves: how far the refinement and the bracketing
    place their LRs from the best one (the first batch's points are a slice apart)."""
    return (math.log2(lr_max) - math.log2(lr_min)) / n_startup / 2


def refinement(best_lr: float, lr_min: float, lr_max: float, n_startup: int) -> list[float]:
    """The LRs half a first-batch slice either side of the best so far, clamped to the
    range (a best LR near an edge still gets a point between it and the edge): with them
    the points around η* are as dense as the first batch's slices allow, so the quadratic
    has local neighbours whatever the sampler does next."""
    half = half_slice(lr_min, lr_max, n_startup)
    x, lo, hi = math.log2(best_lr), math.log2(lr_min), math.log2(lr_max)
    sides = (max(lo, x - half), min(hi, x + half))
    # a best LR (almost) at the edge has nothing beyond it to refine
    return [_within(2.0**v, lr_min, lr_max) for v in sides if abs(v - x) >= half / 4]


def _within(lr: float, lr_min: float, lr_max: float) -> float:
    """`lr` clamped to the range in linear terms: 2**log2(x) can land an ulp outside it."""
    return min(lr_max, max(lr_min, lr))


@dataclass(frozen=True)
class Seen:
    """One asked LR of a study as the bracketing sees it."""

    log2_lr: float
    value: float | None  # the final loss of a full-budget run (not diverged), else None
    open: bool  # still waiting or running: it may yet complete


def bracket(seen: list[Seen], lr_min: float, lr_max: float, n_startup: int) -> float | None:
    """The LR to ask so that the best full-budget LR has a full-budget neighbour on both
    sides, or None when it has them (or the study has no full-budget run yet).

    A side is bracketed by a full-budget run at most a first-batch slice away, or by an open
    trial there (it may complete; asking again would duplicate it), or when the best LR is
    at the range's edge on that side. Otherwise the new LR goes half a slice out (clamped to
    the range), nearer when a pruned or diverged trial lies within that distance (halfway to
    it): pruned early under short-horizon bias or diverged, it says nothing about the final
    loss beside the best. The upper side first: that is the side pruning hurts."""
    done = [(s.value, s.log2_lr) for s in seen if s.value is not None]
    if not done:
        return None
    best = min(done)[1]
    half = half_slice(lr_min, lr_max, n_startup)
    for side, edge in ((1.0, math.log2(lr_max)), (-1.0, math.log2(lr_min))):
        room = side * (edge - best)
        if room < half / 4:
            continue  # the best is at this edge: nothing beyond it to bracket with
        beyond = [(side * (s.log2_lr - best), s) for s in seen if side * (s.log2_lr - best) > 0]
        if any(d <= 2 * half and (s.value is not None or s.open) for d, s in beyond):
            continue
        step = min(half, room, *(d / 2 for d, _ in beyond if d <= 2 * half))
        if step >= half / 8:  # else the side is crowded with failed runs: leave it
            return _within(2.0 ** (best + side * step), lr_min, lr_max)
    return None


def rival_refinement(seen: list[Seen], lr_min: float, lr_max: float,
                     n_startup: int) -> float | None:
    """The LR to ask so that the lowest rival basin of the full-budget runs (another LR that
    trained within basins.RIVAL_TOLERANCE of the best, with a worse LR between them) gets
    the `refinement` the best got, or None when there is none or both its sides have a run
    (full-budget or open) within that distance (half a slice, with a quarter of it to spare:
    the best's own refinement point often lies exactly that far, up to rounding). An LR
    asked before (any outcome) is not asked again."""
    done = sorted((s.log2_lr, s.value) for s in seen if s.value is not None)
    rivals = rival_basins([x for x, _ in done], [v for _, v in done])
    if not rivals:
        return None
    x = done[rivals[0]][0]
    half = half_slice(lr_min, lr_max, n_startup)
    for lr in refinement(2.0**x, lr_min, lr_max, n_startup):
        side = 1.0 if math.log2(lr) > x else -1.0
        covered = any(0 < side * (s.log2_lr - x) <= 1.25 * half
                      and (s.value is not None or s.open) for s in seen)
        asked = any(abs(s.log2_lr - math.log2(lr)) < half / 8 for s in seen)
        if not (covered or asked):
            return lr
    return None


def total_steps(spec: TrialSpec) -> int:
    """Optimizer steps of the trial's full budget (as the trainer counts them)."""
    # non-embedding parameters only depend on the vocabulary for nGPT's logit scale
    cfg = spec.model_config_obj(vocab_size=spec.data.vocab_size or 256)
    return spec.budget.steps_for(spec.batch_size * spec.seq_len, param_counts(cfg).non_embedding)


def decision_step(spec: TrialSpec, prune_after: float) -> int:
    """The first step at which the trial may be pruned: warmup over and `prune_after` of
    the budget trained (the short-horizon bias is worst early, while the LR ramps up)."""
    total = total_steps(spec)
    return max(1, spec.schedule.warmup_steps(total), math.ceil(prune_after * total))


def _diverged(trial: optuna.trial.FrozenTrial) -> bool:
    return bool(trial.user_attrs.get(DIVERGED_ATTR))


class RankPruner(optuna.pruners.BasePruner):
    """Stop a trial once `keep_top` other trials had a lower validation loss at the same
    step. Compares equal steps only, never a late report against an early one, and keeps
    the best `keep_top` alive at every step whatever the number of trials."""

    def __init__(self, keep_top: int) -> None:
        self.keep_top = keep_top

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        value = trial.intermediate_values[step]
        if not math.isfinite(value):
            return True
        better = 0
        for other in study.get_trials(deepcopy=False):  # less diverged ones (_Yardsticks)
            if other.number == trial.number:
                continue
            seen = other.intermediate_values.get(step)
            if seen is not None and seen < value:
                better += 1
        return better >= self.keep_top


def _sampler(name: str, seed: int, n_startup: int) -> optuna.samplers.BaseSampler:
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "qmc":
        return optuna.samplers.QMCSampler(seed=seed, scramble=True)
    # the enqueued first batch is TPE's start-up; constant_liar keeps two concurrent asks
    # from proposing the same LR
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(n_startup, 3),
                                      constant_liar=True)


class _WithoutDiverged:
    """A study as a pruner sees it, less its diverged trials: told COMPLETE with a penalty,
    a run that diverged late would be a yardstick as good as its early values."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[Any]:
        return [t for t in self._study.get_trials(deepcopy=deepcopy, states=states)
                if not _diverged(t)]


class _Yardsticks(optuna.pruners.BasePruner):
    """Optuna's `inner` pruner comparing with the trials that did not diverge."""

    def __init__(self, inner: optuna.pruners.BasePruner) -> None:
        self.inner = inner

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return self.inner.prune(_WithoutDiverged(study), trial)  # type: ignore[arg-type]


def _pruner(search: Search) -> optuna.pruners.BasePruner:
    # every pruner hears every report (successive halving records a trial's rung values only
    # when asked), but its verdict counts only where the gate allows it (after
    # decision_step, with MIN_FULL_BUDGET trials completed; see should_prune)
    if search.pruner == "rank":
        return _Yardsticks(RankPruner(search.keep_top))
    if search.pruner == "successive_halving":
        return _Yardsticks(optuna.pruners.SuccessiveHalvingPruner(min_resource=1,
                                                                  reduction_factor=2))
    if search.pruner == "median":
        return _Yardsticks(optuna.pruners.MedianPruner(n_startup_trials=MIN_FULL_BUDGET,
                                                       n_warmup_steps=0))
    return optuna.pruners.NopPruner()


@dataclass
class _Live:
    trial: optuna.trial.Trial
    study: optuna.Study
    decide_from: int  # no pruning decision before this step
    total: int  # the full budget's steps: the last report is never pruned


class OptunaSearch:
    def __init__(self, storage_url: str) -> None:
        self._url = storage_url
        self._storage: optuna.storages.RDBStorage | None = None
        self._studies: dict[str, optuna.Study] = {}
        self._search: dict[str, Search] = {}
        self._live: dict[str, _Live] = {}  # our trial id -> asked Optuna trial
        self._asked: dict[tuple[int, str], optuna.trial.Trial] = {}
        # trials the pruner stopped: the worker sees the stop late, and its later reports
        # must not reach the pruner (they would be compared with later-step values)
        self._pruned: set[str] = set()

    @property
    def storage(self) -> optuna.storages.RDBStorage:
        """Opened at first use, not at start-up (opening connects, and creates the schema):
        a coordinator started while Optuna's database is down starts, and its Optuna
        sweeps wait out the outage (the dispatcher's backoff) like a running one's."""
        if self._storage is None:
            self._storage = optuna.storages.RDBStorage(
                self._url, engine_kwargs={"connect_args": {"timeout": 30}}
                if self._url.startswith("sqlite") else {},
            )
        return self._storage

    def reconnect(self) -> None:
        """Drop the storage's pooled connections (after a failure): the next call opens a
        fresh one. SQLite opens a connection read-only for good when its file cannot be
        written at that moment, and a database server's restart leaves dead ones."""
        if self._storage is not None:
            self._storage.engine.dispose()

    def study(
        self, name: str, search: Search, shape: str, lr_min: float, lr_max: float
    ) -> optuna.Study:
        """The study `name` (created, with its first batch enqueued, if new). `shape` names
        the shape without the sweep: it places the first batch."""
        if name not in self._studies:
            n_startup = search.startup_count()
            study = optuna.create_study(
                study_name=name, storage=self.storage, load_if_exists=True,
                # seeded by the shape, not the sweep: the same spec and results ask the
                # same LRs, so a resubmitted sweep reuses every trial, not the first batch only
                direction="minimize", sampler=_sampler(search.sampler, stable_seed(shape),
                                                       n_startup),
                pruner=_pruner(search),
            )
            if not study.get_trials(deepcopy=False):  # new (a restart finds its trials)
                for lr in first_batch(shape, lr_min, lr_max, n_startup):
                    study.enqueue_trial({"lr": lr})
            self._studies[name] = study
            self._search[name] = search
        return self._studies[name]

    def ask(self, study: optuna.Study, lr_min: float, lr_max: float) -> tuple[int, float]:
        self._refine(study, lr_min, lr_max)
        self._bracket(study, lr_min, lr_max)
        self._rival(study, lr_min, lr_max)
        trial = study.ask()
        lr = trial.suggest_float("lr", lr_min, lr_max, log=True)
        self._asked[trial.number, study.study_name] = trial
        return trial.number, lr

    def _refine(self, study: optuna.Study, lr_min: float, lr_max: float) -> None:
        """Once the first batch is asked and one of it completed: enqueue `refinement`
        around the best completed LR (once per study; the mark survives a restart)."""
        if REFINED_ATTR in study.user_attrs:
            return
        trials = study.get_trials(deepcopy=False)
        n_startup = self._search[study.study_name].startup_count()
        if len(trials) < n_startup or any(
                t.state == optuna.trial.TrialState.WAITING for t in trials):
            return  # the first batch is still being asked
        done = [t for t in trials
                if t.state == optuna.trial.TrialState.COMPLETE and not _diverged(t)]
        if not done:
            return  # nothing to refine around yet: the sampler proposes meanwhile
        best = min(done, key=lambda t: t.value)
        lrs = refinement(best.params["lr"], lr_min, lr_max, n_startup)
        for lr in lrs:
            study.enqueue_trial({"lr": lr})
        # an enqueued trial gets its number at once: these are the refinement's numbers
        study.set_user_attr(REFINED_ATTR, list(range(len(trials), len(trials) + len(lrs))))

    def _bracket(self, study: optuna.Study, lr_min: float, lr_max: float) -> None:
        """After the refinement, before the sampler: enqueue `bracket`'s LR while the best
        full-budget LR lacks a full-budget neighbour on a side, whatever order the earlier
        trials ran and finished in (alone, packed or concurrently)."""
        self._enqueue_protected(study, lr_min, lr_max, bracket, BRACKET_ATTR)

    def _rival(self, study: optuna.Study, lr_min: float, lr_max: float) -> None:
        """After the bracketing, before the sampler: enqueue `rival_refinement`'s LR while a
        rival basin lacks the refinement the best got."""
        self._enqueue_protected(study, lr_min, lr_max, rival_refinement, RIVAL_ATTR)

    def _enqueue_protected(self, study: optuna.Study, lr_min: float, lr_max: float,
                           choose: Callable[[list[Seen], float, float, int], float | None],
                           attr: str) -> None:
        """Once the refinement is asked and no enqueued LR waits: enqueue the LR `choose`
        picks from what the study has seen (if any), its number kept under `attr`."""
        if REFINED_ATTR not in study.user_attrs:
            return
        trials = study.get_trials(deepcopy=False)
        if any(t.state == optuna.trial.TrialState.WAITING for t in trials):
            return  # an enqueued LR is still to be asked
        open_states = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
        seen = [Seen(math.log2(t.params["lr"]),
                     t.value if t.state == optuna.trial.TrialState.COMPLETE
                     and not _diverged(t) else None,
                     t.state in open_states)
                for t in trials if "lr" in t.params]
        lr = choose(seen, lr_min, lr_max, self._search[study.study_name].startup_count())
        if lr is None:
            return
        study.enqueue_trial({"lr": lr})
        numbers = list(study.user_attrs.get(attr, []))
        study.set_user_attr(attr, [*numbers, len(trials)])

    def bind(self, trial_id: str, study: optuna.Study, number: int, spec: TrialSpec) -> None:
        """Remember an asked trial under our trial id, for pruning reports."""
        trial = self._asked.pop((number, study.study_name), None)
        if trial is not None:
            search = self._search[study.study_name]
            # the refinement, the bracketing and a rival's refinement are never pruned: they
            # give the fit its neighbours around η*
            protected = any(number in study.user_attrs.get(attr, [])
                            for attr in PROTECTED_ATTRS)
            total = total_steps(spec)
            decide_from = total if protected else decision_step(spec, search.prune_after)
            self._live[trial_id] = _Live(trial, study, decide_from, total)

    def verdict_step(self, trial_id: str) -> int | None:
        """The step at which the trial's worker waits for the pruner's first verdict (the
        progress board's gate); None when the pruner can never stop it."""
        live = self._live.get(trial_id)
        if live is None or live.decide_from >= live.total \
                or self._search[live.study.study_name].pruner == "none":
            return None
        return live.decide_from

    def should_prune(self, trial_id: str, step: int, val_loss: float) -> bool:
        live = self._live.get(trial_id)
        if live is None or not math.isfinite(val_loss):
            return False  # after a coordinator restart the re-run is not pruned, only told
        if trial_id in self._pruned:
            return True
        live.trial.report(val_loss, step)  # every step: later trials compare against it
        verdict = live.trial.should_prune()  # asked every time: the pruner records rungs
        if step < live.decide_from or step >= live.total:
            return False
        if self.full_budget_count(live.study) < MIN_FULL_BUDGET:
            return False
        if verdict:
            self._pruned.add(trial_id)
            return True
        return False

    @staticmethod
    def running_numbers(study: optuna.Study) -> list[int]:
        """The numbers of the study's asked trials that have not been told."""
        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        return [t.number for t in running]

    @staticmethod
    def full_budget_count(study: optuna.Study) -> int:
        """Trials of the study that completed their budget without diverging."""
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return sum(1 for t in done if not _diverged(t))

    def tell(
        self, study: optuna.Study, number: int, status: str, value: float | None, vocab: int
    ) -> None:
        """Tell a trial its outcome, once: a trial already finished (told before a restart,
        or retracted) is left as it is, so a repeated tell cannot stall the caller."""
        if self._state(study, number) != optuna.trial.TrialState.RUNNING:
            return
        if status == TrialStatus.COMPLETED and value is not None and math.isfinite(value):
            study.tell(number, value)
        elif status == TrialStatus.DIVERGED:
            # marked first, so neither the gate nor the rank pruner counts it as a yardstick;
            # the storage API because after a restart no Trial object is at hand
            storage = study._storage
            storage.set_trial_user_attr(self._trial_id(study, number), DIVERGED_ATTR, True)
            study.tell(number, DIVERGED_PENALTY * math.log(vocab))
        else:
            study.tell(number, state=optuna.trial.TrialState.PRUNED if status == TrialStatus.PRUNED
                       else optuna.trial.TrialState.FAIL)

    def retract(self, study: optuna.Study, number: int) -> None:
        """An asked trial that will never run (its row could not be added): told FAIL, and
        its LR enqueued again so the next ask takes it up, keeping its place in the plan
        (first batch, refinement, bracketing or a rival's refinement, whose protection from
        pruning moves with it). A trial asked but killed before it suggested an LR is only
        told FAIL."""
        self._asked.pop((number, study.study_name), None)
        frozen = study._storage.get_trial(self._trial_id(study, number))
        if frozen.state != optuna.trial.TrialState.RUNNING:
            return
        lr = frozen.params.get("lr", frozen.system_attrs.get("fixed_params", {}).get("lr"))
        study.tell(number, state=optuna.trial.TrialState.FAIL)
        if lr is None:
            return
        again = len(study.get_trials(deepcopy=False))  # an enqueued trial's number
        study.enqueue_trial({"lr": lr})
        for attr in PROTECTED_ATTRS:
            numbers = list(study.user_attrs.get(attr, []))
            if number in numbers:
                study.set_user_attr(attr, [*numbers, again])

    @staticmethod
    def _trial_id(study: optuna.Study, number: int) -> int:
        return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)

    def _state(self, study: optuna.Study, number: int) -> optuna.trial.TrialState:
        return study._storage.get_trial(self._trial_id(study, number)).state

    def forget(self, trial_id: str) -> None:
        self._live.pop(trial_id, None)
        self._pruned.discard(trial_id)
