"""Checkpoint and resume (workers/checkpoints.py, the trainer's loop): a trial stopped after a
checkpoint and run again resumes there and ends with the uninterrupted run's numbers, to the
bit on the CPU; a damaged checkpoint is skipped for the one before it; SIGTERM (preemption)
checkpoints, then ends the process. The store on its own: the sweep's disk bound, the minutes
clock, a writer or a pruning killed half-way (nothing half-written counts), and what a read
refuses (an altered payload, more than weights)."""

from __future__ import annotations

import fractions
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hptransfer.workers import checkpoints
from hptransfer.workers.checkpoints import CheckpointPolicy, TrialCheckpoints
from hptransfer.workers.trainer import run_trial

ARCHS = {
    "gpt": {"arch": "gpt"},
    "ngpt": {"arch": "ngpt", "parameterization": "ngpt"},
    "x0_mixing": {"arch": "gpt", "arch_options": {"x0_mixing": True, "extra_embeddings": 2}},
}


def spec(**kw) -> dict:
    base = dict(width=32, depth=2, head_dim=16, lr=2**-7, seq_len=32, batch_size=8,
                budget={"steps": 48}, data={"source": "stdlib", "tokenizer": "byte"},
                eval_every=16, num_threads=1)
    return {**base, **kw}


class Killed(BaseException):
    """Ends a run as a dead process would: nothing after it runs (not an Exception, so the
    trainer does not turn it into a failed result)."""


def killed_at(step: int):
    def reporter(metrics: dict) -> None:
        if metrics["step"] >= step:
            raise Killed
    return reporter


def policy(root: Path, **kw) -> CheckpointPolicy:
    return CheckpointPolicy(url=str(root), key="sweep/trial",
                            **{"every_steps": 12, "every_minutes": None, **kw})


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_resumed_run_ends_as_the_uninterrupted_one(arch, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "REACHED_EVERY_S", 0.0)  # these runs take under 1 s
    s = spec(**ARCHS[arch])
    whole = run_trial(s, cache_dir=str(tmp_path / "cache"))
    assert whole.status == "completed"
    ckpt = policy(tmp_path / "ckpt")
    with pytest.raises(Killed):  # dies after step 40: checkpoints at 12, 24, 36
        run_trial(s, reporter=killed_at(40), cache_dir=str(tmp_path / "cache"),
                  checkpoints=ckpt)
    resumed = run_trial(s, cache_dir=str(tmp_path / "cache"), checkpoints=ckpt)
    assert resumed.status == "completed"
    assert resumed.resumed_from_step == 36
    assert resumed.final_val_loss == whole.final_val_loss  # to the bit
    assert resumed.curve == whole.curve
    assert (resumed.steps, resumed.tokens, resumed.flops) == (whole.steps, whole.tokens,
                                                              whole.flops)
    # the killed attempt had reached step 40 (marked before the reporter heard it)
    assert resumed.retrained_tokens == (40 - 36) * 8 * 32
    assert not (tmp_path / "ckpt" / "sweep" / "trial").exists()  # finished: deleted


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    s = spec()
    whole = run_trial(s, cache_dir=str(tmp_path / "cache"))
    ckpt = policy(tmp_path / "ckpt")
    with pytest.raises(Killed):
        run_trial(s, reporter=killed_at(40), cache_dir=str(tmp_path / "cache"),
                  checkpoints=ckpt)
    folder = tmp_path / "ckpt" / "sweep" / "trial"
    latest = folder / "step-000000036.ckpt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # truncated
    resumed = run_trial(s, cache_dir=str(tmp_path / "cache"), checkpoints=ckpt)
    assert resumed.resumed_from_step == 24
    assert any("checkpoint at step 36 skipped" in n for n in resumed.notes)
    assert resumed.final_val_loss == whole.final_val_loss


def test_a_checkpoint_without_its_digest_does_not_count(tmp_path):
    """A writer killed between the payload and its digest left no checkpoint."""
    store = TrialCheckpoints(policy(tmp_path), [])
    store.save(12, {"x": 1})
    store.save(24, {"x": 2})
    (Path(store.dir) / "step-000000024.sha256").unlink()
    assert store.latest() == (12, {"x": 1})


def test_a_checkpoint_moves_the_reached_mark_up_to_its_step(tmp_path, monkeypatch):
    """`reached` is rewritten at most once a second, so a checkpoint saved within that second
    of the last mark would be ahead of it: a retry resuming there then counted no re-trained
    steps, and the step the attempt was seen at was before the one it resumed from."""
    monkeypatch.setattr(checkpoints, "REACHED_EVERY_S", 3600.0)  # however slow the host
    store = TrialCheckpoints(policy(tmp_path), [])
    store.mark_reached(10, force=True)
    store.mark_reached(11)  # within the interval: not written
    assert store.reached() == 10
    store.save(12, {"x": 1})
    assert store.reached() == 12


def test_only_the_newest_two_are_kept_and_the_disk_bound_holds(tmp_path):
    warnings: list[str] = []
    store = TrialCheckpoints(policy(tmp_path, max_sweep_bytes=4000.0), warnings)
    for step in (12, 24, 36):
        assert store.save(step, {"step": step})
    assert sorted(p.name for p in Path(store.dir).glob("*.sha256")) == [
        "step-000000024.sha256", "step-000000036.sha256"]
    assert not store.save(48, {"blob": "x" * 5000})  # would pass the sweep's bound
    assert "max_sweep_gb" in warnings[-1]
    assert store.latest()[0] == 36


def test_keep_final_keeps_only_the_newest(tmp_path):
    s = spec()
    ckpt = CheckpointPolicy(url=str(tmp_path), key="sweep/trial", every_steps=12,
                            every_minutes=None, keep_final=True)
    run_trial(s, cache_dir=str(tmp_path / "cache"), checkpoints=ckpt)
    assert [p.name for p in (tmp_path / "sweep" / "trial").glob("*.sha256")] == [
        "step-000000036.sha256"]


SIGTERM_CHILD = """
import sys
from hptransfer.workers.checkpoints import CheckpointPolicy
from hptransfer.workers.trainer import run_trial
spec, root, cache = eval(sys.argv[1]), sys.argv[2], sys.argv[3]
import time
def slow(metrics):
    time.sleep(0.05)  # time for the parent to send SIGTERM mid-run
run_trial(spec, reporter=slow, cache_dir=cache,
          checkpoints=CheckpointPolicy(url=root, key="sweep/trial", every_steps=None,
                                       every_minutes=60.0))
print("finished without a signal")
"""


def test_sigterm_checkpoints_then_ends_the_process(tmp_path):
    """Preemption: SIGTERM mid-run; the process saves after its current step and dies of the
    signal; the next attempt resumes there and ends as an uninterrupted run."""
    s = spec(budget={"steps": 400}, eval_every=100)
    cache = str(tmp_path / "cache")
    whole = run_trial(s, cache_dir=cache)
    root = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, repr(s), str(root), cache],
                             stdout=subprocess.PIPE, text=True)
    reached = root / "sweep" / "trial" / "reached"
    deadline = time.monotonic() + 60
    while not reached.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM and "finished" not in out
    ckpts = list((root / "sweep" / "trial").glob("*.sha256"))
    assert len(ckpts) == 1  # only the minutes-interval (60) would have saved: the signal did
    resumed = run_trial(s, cache_dir=cache, checkpoints=CheckpointPolicy(
        url=str(root), key="sweep/trial", every_steps=None, every_minutes=60.0))
    assert 0 < resumed.resumed_from_step < 400
    assert resumed.final_val_loss == whole.final_val_loss
    assert resumed.retrained_tokens == 0  # it saved the step it stopped at


def test_the_sigterm_handler_is_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    run_trial(spec(budget={"steps": 4}), cache_dir=str(tmp_path))
    assert signal.getsignal(signal.SIGTERM) is before
    assert os.getpid()  # this process is alive and well


# ---- the store's own guarantees, without a training run


def payload_size(state: dict) -> int:
    """The bytes torch.save writes for `state` (what the disk bound counts)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return len(buffer.getvalue())


def test_the_disk_bound_counts_every_trial_of_the_sweep(tmp_path):
    """max_sweep_gb bounds the sweep: a second trial's checkpoint is refused once the first
    trial's bytes and its own would pass it, though alone it would fit."""
    state = {"blob": "x" * 2000}
    bound = 1.5 * payload_size(state)
    first = TrialCheckpoints(CheckpointPolicy(url=str(tmp_path), key="sweep/a",
                                              every_steps=12, max_sweep_bytes=bound), [])
    assert first.save(12, state)
    warnings: list[str] = []
    second = TrialCheckpoints(CheckpointPolicy(url=str(tmp_path), key="sweep/b",
                                               every_steps=12, max_sweep_bytes=bound), warnings)
    assert not second.save(12, state)
    assert "max_sweep_gb" in warnings[-1]
    assert not second.exists()
    # another sweep's bytes do not count
    other = TrialCheckpoints(CheckpointPolicy(url=str(tmp_path), key="other/b",
                                              every_steps=12, max_sweep_bytes=bound), [])
    assert other.save(12, state)


def test_a_checkpoint_exactly_at_the_disk_bound_is_written(tmp_path):
    state = {"blob": "x" * 2000}
    store = TrialCheckpoints(policy(tmp_path, max_sweep_bytes=float(payload_size(state))), [])
    assert store.save(12, state)
    assert store.latest() == (12, state)


class Clock:
    """Stands in for the `time` module in checkpoints.py: monotonic() is `now`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_every_minutes_counts_minutes_from_the_last_checkpoint(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(checkpoints, "time", clock)
    store = TrialCheckpoints(policy(tmp_path, every_steps=None, every_minutes=2.0), [])
    clock.now += 119.0
    assert not store.due(7)
    clock.now += 1.0
    assert store.due(7)
    assert store.save(7, {"x": 1})
    clock.now += 60.0
    assert not store.due(9)  # a minute after the checkpoint: the clock starts there
    clock.now += 60.0
    assert store.due(9)


def test_a_refused_checkpoint_waits_a_whole_interval_before_the_next_try(tmp_path,
                                                                         monkeypatch):
    """A sweep at its disk bound does not serialize the state again at every sync step."""
    clock = Clock()
    monkeypatch.setattr(checkpoints, "time", clock)
    warnings: list[str] = []
    store = TrialCheckpoints(policy(tmp_path, every_steps=None, every_minutes=1.0,
                                    max_sweep_bytes=10.0), warnings)
    clock.now += 60.0
    assert store.due(5)
    assert not store.save(5, {"x": 1})
    assert len(warnings) == 1
    clock.now += 1.0
    assert not store.due(6)
    clock.now += 59.0
    assert store.due(7)


class Dies:
    """A checkpoint store's filesystem whose writer is killed when `when(method, args)`
    says so: at that call, or (`half`) halfway through the bytes that call's stream writes."""

    def __init__(self, filesystem, when, half: bool = False) -> None:
        self.filesystem, self.when, self.half = filesystem, when, half

    def __getattr__(self, name: str):
        real = getattr(self.filesystem, name)

        def call(*args, **kwargs):
            if not self.when(name, args):
                return real(*args, **kwargs)
            if not self.half:
                raise Killed
            return HalfWritten(real(*args, **kwargs))
        return call


class HalfWritten:
    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()

    def write(self, data: bytes) -> None:
        self.stream.write(data[: len(data) // 2])
        raise Killed


def nth(n: int, method: str, part: str = ""):
    """A `Dies.when` that is true at the n-th call of `method` whose first path holds `part`
    (move: the destination)."""
    calls = []

    def when(name: str, args: tuple) -> bool:
        path = args[-1] if name == "move" else args[0]
        if name == method and part in path:
            calls.append(path)
            return len(calls) == n
        return False
    return when


def test_a_writer_killed_between_payload_and_digest_leaves_no_checkpoint(tmp_path):
    """The payload lands before its digest: killed between the two, the attempt leaves the
    checkpoint before it, read without a warning (nothing half-written counts)."""
    warnings: list[str] = []
    store = TrialCheckpoints(policy(tmp_path), warnings)
    store.fs = Dies(store.fs, nth(2, "move", "step-000000012"))
    with pytest.raises(Killed):
        store.save(12, {"x": 1})
    assert not policy(tmp_path).has_checkpoint()
    store.fs = Dies(store.fs.filesystem, nth(2, "move", "step-000000024"))
    assert store.save(12, {"x": 1})
    with pytest.raises(Killed):
        store.save(24, {"x": 2})
    assert store.latest() == (12, {"x": 1})
    assert warnings == []


def test_a_writer_killed_mid_write_leaves_the_previous_file_whole(tmp_path):
    store = TrialCheckpoints(policy(tmp_path), [])
    store.mark_reached(10, force=True)
    store.fs = Dies(store.fs, nth(1, "open_output_stream"), half=True)
    with pytest.raises(Killed):
        store.mark_reached(2000, force=True)
    assert store.reached() == 10


def test_a_delete_killed_between_the_two_files_leaves_no_checkpoint_without_payload(
        tmp_path):
    """An old checkpoint goes digest first: a pruning killed half-way leaves no digest that
    names a deleted payload."""
    store = TrialCheckpoints(policy(tmp_path), [])
    for step in (12, 24):
        store.save(step, {"step": step})
    store.fs = Dies(store.fs, nth(2, "delete_file"))
    with pytest.raises(Killed):
        store.save(36, {"step": 36})
    folder = Path(store.dir)
    digests = {p.stem for p in folder.glob("step-*.sha256")}
    assert digests == {"step-000000024", "step-000000036"}
    assert digests <= {p.stem for p in folder.glob("step-*.ckpt")}


def test_an_unreadable_reached_mark_counts_as_none(tmp_path):
    store = TrialCheckpoints(policy(tmp_path), [])
    store.mark_reached(10, force=True)
    (Path(store.dir) / "reached").write_text("step ten")
    assert store.reached() == 0


def test_a_checkpoint_altered_to_the_same_size_is_skipped(tmp_path):
    """A flipped weight keeps the file's size and still unpickles: the SHA-256 catches it."""
    warnings: list[str] = []
    store = TrialCheckpoints(policy(tmp_path), warnings)
    store.save(12, {"w": torch.zeros(64)})
    store.save(24, {"w": torch.ones(64)})
    latest = Path(store.dir) / "step-000000024.ckpt"
    one, two = torch.tensor(1.0).numpy().tobytes(), torch.tensor(2.0).numpy().tobytes()
    data = latest.read_bytes()
    latest.write_bytes(data.replace(one, two, 1))
    assert len(latest.read_bytes()) == len(data)
    done, state = store.latest()
    assert done == 12 and torch.equal(state["w"], torch.zeros(64))
    assert "checkpoint at step 24 skipped" in warnings[-1]


def test_a_checkpoint_holding_more_than_tensors_and_plain_data_is_not_unpickled(tmp_path):
    """A store may be shared storage: a checkpoint is read as weights only, so one that
    would run arbitrary unpickling is skipped."""
    warnings: list[str] = []
    store = TrialCheckpoints(policy(tmp_path), warnings)
    store.save(12, {"x": 1})
    store.save(24, {"x": fractions.Fraction(1, 3)})
    assert store.latest() == (12, {"x": 1})
    assert "checkpoint at step 24 skipped" in warnings[-1]


def test_stray_files_in_a_trial_folder_are_not_checkpoints(tmp_path):
    store = TrialCheckpoints(policy(tmp_path), [])
    store.save(12, {"x": 1})
    folder = Path(store.dir)
    (folder / "step-latest.sha256").write_text("0 0\n")
    (folder / "step-000000024.sha256.0f0f.partial").write_text("0 0\n")
    assert store.latest() == (12, {"x": 1})
    assert policy(tmp_path).has_checkpoint()


def test_a_trial_has_a_checkpoint_from_its_first(tmp_path):
    assert not policy(tmp_path).has_checkpoint()
    TrialCheckpoints(policy(tmp_path), []).save(12, {"x": 1})
    assert policy(tmp_path).has_checkpoint()


@pytest.mark.parametrize("url,says", [
    ("bogus://x/y", "has a scheme pyarrow does not open (bogus://)"),
    ("mock:///x", "has a scheme pyarrow does not open (mock://)"),  # in memory, per process
    ("relative/dir", "is not an absolute path"),
    ("~/ckpt", "is not an absolute path"),
    ("file://host/x", "cannot be opened (ArrowInvalid"),
])
def test_a_root_trials_cannot_use_is_named_before_any_trial(url, says):
    """Each checkpointing trial failed on these with a pyarrow traceback."""
    assert (checkpoints.root_problem(url) or "").startswith(says)


def test_a_root_under_a_file_is_refused_and_good_roots_pass_without_a_network(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert checkpoints.root_problem(str(afile / "ckpt")) == (
        f"cannot be used: {afile} is a file, so {afile / 'ckpt'} cannot be created under it")
    for url in (str(tmp_path / "new"), f"file://{tmp_path}", "s3://bucket/prefix",
                "gs://bucket/prefix"):  # remote ones by scheme: no credentials needed here
        assert checkpoints.root_problem(url) is None, url
