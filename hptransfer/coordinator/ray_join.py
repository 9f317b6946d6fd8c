"""Joining the Ray cluster at RAY_ADDRESS, for the coordinator and for `hpt doctor`."""

from __future__ import annotations

from typing import Any

from hptransfer.sockets import no_listener


class RayUnreachable(RuntimeError):
    """Nothing listens at RAY_ADDRESS."""


def join_ray(address: str, **init: Any) -> None:
    """ray.init on the cluster at `address`, or RayUnreachable at once when nothing listens
    there (ray.init would retry for minutes, deaf to SIGTERM)."""
    if why := no_listener(address):
        raise RayUnreachable(f"no Ray cluster answers at RAY_ADDRESS={address} ({why}): start "
                             "its head (`ray start --head`), fix RAY_ADDRESS, or unset it for "
                             "an in-process cluster")
    import ray

    ray.init(address=address, **init)
