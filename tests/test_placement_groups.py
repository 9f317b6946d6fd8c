"""What a coordinator must not leave in Ray: placement groups left by a dead Ray Train
controller are found and removed, no other group touched (placement_groups.py); a stopped
coordinator's progress board ends with it."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import (
    PlacementGroup,
    PlacementGroupID,
    placement_group,
    remove_placement_group,
)
from waiting import wait_for

from hptransfer.config import get_settings
from hptransfer.coordinator.placement_groups import (
    orphaned_placement_groups,
    remove_orphaned_placement_groups,
)
from hptransfer.coordinator.service import Coordinator


@ray.remote(num_cpus=0)
class _Creator:
    """Stands for a Train controller: an actor that creates a group and holds it."""

    def create(self, cpus: float) -> bytes:
        group = placement_group([{"CPU": cpus}])
        ray.get(group.ready())
        return group.id.binary()


@ray.remote(num_cpus=0)
def _created_by_a_task() -> bytes:
    group = placement_group([{"CPU": 0.25}])
    ray.get(group.ready())
    return group.id.binary()


def test_only_a_dead_actors_group_is_an_orphan_and_removing_it_frees_its_cpus(ray_cluster):
    free = ray.available_resources().get("CPU", 0.0)
    by_driver = placement_group([{"CPU": 0.25}])
    ray.get(by_driver.ready())
    by_task = ray.get(_created_by_a_task.remote())
    alive, dying = _Creator.remote(), _Creator.remote()
    ray.get(alive.create.remote(0.25))
    orphan = ray.get(dying.create.remote(0.5))
    try:
        assert orphaned_placement_groups() == []  # every creator lives, or is no actor
        ray.kill(dying)
        wait_for(lambda: orphaned_placement_groups() == [orphan], 30,
                 "the killed actor's group seen as an orphan")
        assert remove_orphaned_placement_groups() == 1
        # its half CPU is back; the driver's, the task's and the live actor's stay held
        wait_for(lambda: abs(ray.available_resources().get("CPU", 0.0) - (free - 0.75)) < 1e-6,
                 30, lambda: f"CPUs back: {ray.available_resources()}")
        assert orphaned_placement_groups() == []
        assert remove_orphaned_placement_groups() == 0
    finally:
        ray.kill(alive)
        remove_placement_group(by_driver)
        remove_placement_group(PlacementGroup(PlacementGroupID(by_task)))


def test_a_stopped_coordinators_progress_board_ends_with_it(hpt_home, ray_cluster):
    """An actor lives as long as the process that made it: without this, each coordinator
    started and stopped in one process (the tests, an embedded API) left an idle worker."""
    coordinator = Coordinator(get_settings())
    coordinator.start()
    board = coordinator.dispatcher.ray_runner.progress_board
    assert ray.get(board.drain.remote(), timeout=30) == ({}, {})
    coordinator.stop()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(board.drain.remote(), timeout=30)
