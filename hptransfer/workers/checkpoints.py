"""A trial's checkpoints: written whole or not at all, verified on read, one folder per trial.

Layout under the store's root (HPT_CHECKPOINT_URL: a local or shared directory, or any URI
pyarrow's filesystems open, e.g. s3://bucket/prefix):

    <sweep_id>/<trial_id>/step-000001200.ckpt     torch.save of the training state
    <sweep_id>/<trial_id>/step-000001200.sha256   its size and SHA-256, written after it
    <sweep_id>/<trial_id>/reached                 the furthest step an attempt got to

A checkpoint counts only once its digest file exists and matches: the payload is written to
a temporary name and renamed, then the digest likewise, so a writer killed at any point leaves
either the previous checkpoint or a complete new one; a truncated or altered file fails its
digest and the previous one is used (with a warning on the trial). `reached` says how far the
killed attempt got, so the resumed one can say how many steps it trained again.

torch is imported where a state is serialized (save, latest), in the trainer's process: the
coordinator asks `CheckpointPolicy.has_checkpoint` (a listing) without loading it.
"""

from __future__ import annotations

import hashlib
import io
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyarrow import fs as pafs

from hptransfer.config import dir_problem
from hptransfer.redaction import mask_url

KEEP = 2  # the newest checkpoints kept per trial: the previous one backs up the latest
REACHED_EVERY_S = 1.0  # how often `reached` is rewritten (a resumed attempt's re-trained
# steps are counted from it, so this bounds their undercount to about a second of training)


@dataclass(frozen=True)
class CheckpointPolicy:
    """When and where one trial checkpoints; `None` intervals never checkpoint that way."""

    url: str  # the store's root
    key: str  # "<sweep_id>/<trial_id>": the trial's folder under the root
    every_steps: int | None = None
    every_minutes: float | None = None
    keep_final: bool = False
    max_sweep_bytes: float | None = None  # no checkpoint is written past this per sweep

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def has_checkpoint(self) -> bool:
        """Whether the trial has a complete checkpoint to resume from (raises when the store
        cannot be read: the caller decides what that means)."""
        return TrialCheckpoints(self, []).exists()


def open_root(url: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and base path of a store URL (a bare path is a local directory)."""
    if "://" not in url:
        return pafs.LocalFileSystem(), url.rstrip("/") or "/"
    filesystem, path = pafs.FileSystem.from_uri(url)
    return filesystem, path.rstrip("/")


# The stores a root may name: a scheme and the pyarrow filesystem that opens it. A local one
# is opened (by `open_root`) to check it; a remote one would need credentials or a round trip
# (pyarrow's S3 asks for the bucket's region) and is opened by the trials that use it.
LOCAL_SCHEMES = ("file", "local")
REMOTE_SCHEMES = {"s3": "S3FileSystem", "gs": "GcsFileSystem", "gcs": "GcsFileSystem",
                  "hdfs": "HadoopFileSystem", "viewfs": "HadoopFileSystem",
                  "abfs": "AzureFileSystem", "abfss": "AzureFileSystem"}
ACCEPTED = ("an absolute directory path, file:///path, "
            + ", ".join(f"{s}://..." for s in REMOTE_SCHEMES))


def root_problem(url: str) -> str | None:
    """Why a store URL cannot hold checkpoints, or None; found before any trial runs (each
    one failed on it with a pyarrow traceback). Remote stores are checked by scheme only."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else None
    if scheme in REMOTE_SCHEMES:
        if not hasattr(pafs, REMOTE_SCHEMES[scheme]):
            return f"needs pyarrow with {REMOTE_SCHEMES[scheme]}, which this one lacks"
        return None
    if scheme is not None and scheme not in LOCAL_SCHEMES:
        return f"has a scheme pyarrow does not open ({scheme}://)"
    try:
        filesystem, path = open_root(url)
    except Exception as exc:  # pyarrow's ArrowInvalid for a malformed file:// URI
        return f"cannot be opened ({type(exc).__name__}: {exc})"
    if not path.startswith("/"):
        return ("is not an absolute path (trials run in Ray's working directories; `~` is "
                "not expanded): give /absolute/path or file:///absolute/path")
    local = isinstance(filesystem, pafs.LocalFileSystem)
    problem = dir_problem(Path(path)) if local else None
    return problem and f"cannot be used: {problem}"


def checkpoint_url_problem(url: str) -> str | None:
    """Why $HPT_CHECKPOINT_URL cannot hold the trials' checkpoints, or None (unset: the
    folder under HPT_HOME, checked with it)."""
    if not url:
        return None
    problem = root_problem(url)
    return problem and f"HPT_CHECKPOINT_URL={mask_url(url)} {problem}; give {ACCEPTED}"


class TrialCheckpoints:
    """The checkpoints of one trial under a policy; warnings (a checkpoint skipped on read,
    a write refused for disk) go to `warnings`, which the trial's notes show."""

    def __init__(self, policy: CheckpointPolicy, warnings: list[str]) -> None:
        self.policy = policy
        self.warnings = warnings
        self.fs, root = open_root(policy.url)
        self.sweep_dir = f"{root}/{policy.key.split('/')[0]}"
        self.dir = f"{root}/{policy.key}"
        self._last_saved_at = time.monotonic()
        self._reached_at = 0.0
        self._dir_made = False

    def exists(self) -> bool:
        """Whether the trial has a complete checkpoint (a digest file) to resume from."""
        return bool(self._steps())

    # ---- when
    def due(self, done: int) -> bool:
        """Whether to checkpoint after `done` optimizer steps (asked at sync steps only)."""
        p = self.policy
        if p.every_steps and done % p.every_steps == 0:
            return True
        return bool(p.every_minutes and
                    time.monotonic() - self._last_saved_at >= 60.0 * p.every_minutes)

    def step_is_due(self, done: int) -> bool:
        """Whether a step-count checkpoint falls after `done` (the loop syncs there)."""
        return bool(self.policy.every_steps and done % self.policy.every_steps == 0)

    # ---- write
    def save(self, done: int, state: dict[str, Any]) -> bool:
        """Write the state after `done` steps; False (with a warning) if the sweep's disk
        bound would be passed. Older checkpoints beyond KEEP are deleted after it lands."""
        import torch  # see the module's docstring

        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        bound = self.policy.max_sweep_bytes
        if bound is not None and self._bytes_under(self.sweep_dir) + len(payload) > bound:
            self.warnings.append(
                f"checkpoint at step {done} not written: the sweep's checkpoints would pass "
                f"{bound / 1e9:g} GB (checkpoint.max_sweep_gb)")
            self._last_saved_at = time.monotonic()
            return False
        # the mark (rewritten at most once a second) never lags a checkpoint: a retry from
        # one ahead of it would count no re-trained steps; written first, since the attempt
        # got to `done` whether or not the checkpoint lands
        self.mark_reached(done, force=True)
        name = f"{self.dir}/step-{done:09d}"
        digest = f"{len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode()
        self._write_atomically(f"{name}.ckpt", payload)
        self._write_atomically(f"{name}.sha256", digest)  # the checkpoint counts from here
        self._last_saved_at = time.monotonic()
        for old in self._steps()[KEEP:]:
            self._delete(old)
        return True

    def mark_reached(self, done: int, force: bool = False) -> None:
        """Record that an attempt got to `done` steps (at most every REACHED_EVERY_S)."""
        now = time.monotonic()
        if not force and now - self._reached_at < REACHED_EVERY_S:
            return
        self._reached_at = now
        self._ensure_dir()
        self._write_atomically(f"{self.dir}/reached", str(done).encode())

    # ---- read
    def reached(self) -> int:
        """The furthest step an earlier attempt recorded (0 if none)."""
        try:
            with self.fs.open_input_stream(f"{self.dir}/reached") as f:
                return int(f.read().decode().strip() or 0)
        except (FileNotFoundError, OSError, ValueError):
            return 0

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint whose payload matches its digest, as (steps done, state);
        each one skipped on the way leaves a warning. None when there is none."""
        import torch  # see the module's docstring

        for done in self._steps():
            name = f"{self.dir}/step-{done:09d}"
            try:
                size, digest = self._read(f"{name}.sha256").decode().split()
                payload = self._read(f"{name}.ckpt")
                if len(payload) != int(size) or hashlib.sha256(payload).hexdigest() != digest:
                    raise ValueError(f"{len(payload)} bytes do not match the {size} bytes "
                                     "and SHA-256 recorded when it was written")
                state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is skipped
                self.warnings.append(f"checkpoint at step {done} skipped ({exc}); using the "
                                     "one before it")
                continue
            return done, state
        return None

    # ---- end
    def finish(self) -> None:
        """A finished trial's checkpoints go (all but the newest with keep_final)."""
        if self.policy.keep_final:
            for old in self._steps()[1:]:
                self._delete(old)
            return
        try:
            self.fs.delete_dir(self.dir)
        except (FileNotFoundError, OSError):
            pass

    # ---- plumbing
    def _steps(self) -> list[int]:
        """Steps with a digest file, newest first."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.dir, allow_not_found=True))
        except OSError:
            return []
        steps = [int(i.base_name[5:-7]) for i in infos
                 if i.base_name.startswith("step-") and i.base_name.endswith(".sha256")
                 and i.base_name[5:-7].isdigit()]
        return sorted(steps, reverse=True)

    def _ensure_dir(self) -> None:
        if not self._dir_made:
            self.fs.create_dir(self.dir, recursive=True)
            self._dir_made = True

    def _write_atomically(self, path: str, data: bytes) -> None:
        temporary = f"{path}.{uuid.uuid4().hex}.partial"
        with self.fs.open_output_stream(temporary) as f:
            f.write(data)
        self.fs.move(temporary, path)

    def _read(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def _delete(self, done: int) -> None:
        name = f"{self.dir}/step-{done:09d}"
        for suffix in (".sha256", ".ckpt"):  # the digest first: the pair stops counting
            try:
                self.fs.delete_file(name + suffix)
            except (FileNotFoundError, OSError):
                pass

    def _bytes_under(self, path: str) -> int:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(path, recursive=True,
                                                             allow_not_found=True))
        except OSError:
            return 0
        return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)
