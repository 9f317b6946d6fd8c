"""Placement groups that a dead Ray Train controller left behind, found and removed.

A trial on several workers runs as a Ray Train run whose controller actor creates the run's
placement group. Ray ties a group to its creator job, not to its creator actor, so when the
controller dies without shutting its run down (the trial's driver task force-cancelled, which
kills the controller it owns) the group keeps its CPUs and GPUs until the coordinator's job
ends: every later trial then waits for resources that never come back. Ray Train's own
cleaner (a detached actor) asks Ray's state API whether the controller lives, and a cluster
without a dashboard (the embedded default) has no state API, so it never cleans up.

The GCS itself knows each group's creator actor and whether it died; this reads that
(Ray's internal accessor: the public table leaves the creator out) and removes the groups of
this job whose creator actor is dead. The coordinator's job creates no placement group of
its own, and an actor that created one and died no longer needs it."""

from __future__ import annotations

import logging

import ray

log = logging.getLogger(__name__)

_LIVE_STATES = ("PENDING", "PREPARED", "CREATED", "RESCHEDULING")


def orphaned_placement_groups() -> list[bytes]:
    """The binary ids of this job's live placement groups whose creator actor is dead."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = state._connect_and_get_accessor().get_placement_group_table()
    job = ray.get_runtime_context().get_job_id()
    states = gcs_pb2.PlacementGroupTableData.PlacementGroupState
    live = {states.Value(name) for name in _LIVE_STATES}
    orphans = []
    for raw in table:
        group = gcs_pb2.PlacementGroupTableData.FromString(raw)
        # a group made by a driver or a task has no creator actor (and counts its actor as
        # dead from the start): only an actor's group can be orphaned by that actor's death
        made_by_actor = not ray.ActorID(group.creator_actor_id).is_nil()
        if (group.state in live and made_by_actor and group.creator_actor_dead
                and not group.is_detached and group.creator_job_id.hex() == job):
            orphans.append(group.placement_group_id)
    return orphans


def remove_orphaned_placement_groups() -> int:
    """Remove every orphaned placement group of this job; how many were removed. Best
    effort: a Ray whose internals differ logs why and removes nothing."""
    from ray.util.placement_group import PlacementGroup, PlacementGroupID

    try:
        orphans = orphaned_placement_groups()
    except Exception as exc:  # noqa: BLE001 - an internal API: never fail a tick over it
        log.warning("could not list Ray's placement groups: %s", exc)
        return 0
    removed = 0
    for group_id in orphans:
        try:
            ray.util.remove_placement_group(PlacementGroup(PlacementGroupID(group_id)))
            removed += 1
        except Exception as exc:  # noqa: BLE001 - removed meanwhile, or the GCS away
            log.info("placement group %s not removed: %s", group_id.hex(), exc)
    if removed:
        log.warning("removed %d placement group(s) left by a Ray Train run that did not "
                    "shut down (a cancelled or lost trial on several workers)", removed)
    return removed
