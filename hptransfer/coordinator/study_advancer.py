"""Moves a staged study (coordinator/study.py) on: once every trial planned so far has
finished, its next stage is planned (or the study is stopped, or finished) in one
transaction."""

from __future__ import annotations

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from hptransfer.contracts.status import ACTIVE
from hptransfer.redaction import first_line
from hptransfer.spec import SweepSpec
from hptransfer.store.store import SweepRecord

from .dispatch_context import DispatchContext, log
from .optuna_bridge import OptunaBridge
from .ray_runner import RayRunner
from .recovery import RecoveryLedger
from .study import next_step


class StudyAdvancer:
    """Plans a study's next stage once its current one has finished."""

    def __init__(self, context: DispatchContext, ray_runner: RayRunner,
                 optuna_bridge: OptunaBridge, recovery: RecoveryLedger) -> None:
        self.context, self.ray_runner = context, ray_runner
        self.optuna_bridge, self.recovery = optuna_bridge, recovery

    def advance(self, sweep: SweepRecord, spec: SweepSpec) -> bool:
        """When every trial of a study planned so far has finished, plan its next stage
        (or stop it, or finish it) in one transaction. True if the sweep ended."""
        if not self._stage_finished(sweep, spec):
            return False
        sid, store = sweep.id, self.context.store
        if sweep.study.get("done"):
            # recorded done, and its status refresh lost (a failed write): finish it now
            self.recovery.refresh_sweep(sid)
            return True
        try:
            step = next_step(spec, sweep.study, store.results_frame(sid))
        except Exception as exc:  # a planner bug must not stall every other sweep's ticks
            self._fail(sweep, f"could not plan the study's next stage: "
                              f"{type(exc).__name__}: {exc}")
            return True
        stop = ("stopped", step.reason) if step.kind == "stop" else None
        try:
            planned = store.plan_stage(sid, int(sweep.study.get("round", 0)), step.state,
                                       step.trials, stop=stop)
        except (OperationalError, InterfaceError, PoolTimeout):
            raise  # the database away or busy: the tick backs off and this is tried again
        except Exception as exc:  # a stage the database refuses: every tick would refuse it
            # its first line: a database error goes on with the SQL and its parameters
            self._fail(sweep, f"could not store the study's next stage: "
                              f"{type(exc).__name__}: {first_line(str(exc))[:1000]}")
            return True
        if not planned:
            return False  # planned by someone else in the meantime: next tick sees it
        log.info("study %s: %s%s", sid, step.kind,
                 f" ({step.reason})" if step.reason else
                 f" {len(step.trials)} trials" if step.trials else "")
        if step.kind == "stop":
            return True  # stored as `stopped` with its reason; the mirror closes the run
        if step.kind == "done":
            self.recovery.refresh_sweep(sid)
            return True
        return False

    def _stage_finished(self, sweep: SweepRecord, spec: SweepSpec) -> bool:
        """No trial of the study in flight, pending or running, nor left to ask of Optuna."""
        sid = sweep.id
        if self.ray_runner.in_flight_for(sid):
            return False
        if self.context.store.count_trials(sid, status=list(ACTIVE)):
            return False
        return not (spec.search.method == "optuna"
                    and self.optuna_bridge.trials_left_to_ask(sid, spec) > 0)

    def _fail(self, sweep: SweepRecord, reason: str) -> None:
        """The study could not be planned: stored failed with the reason."""
        log.exception("study %s: %s", sweep.id, reason)
        state = {**sweep.study, "stop_reason": reason[:4000]}
        self.context.store.plan_stage(sweep.id, int(sweep.study.get("round", 0)), state, [],
                                      stop=("failed", reason[:4000]))
        self.context.wake_mirror()
