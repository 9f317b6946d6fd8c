"""Checkpoint and resume (workers/checkpoints.py, the trainer's loop): a trial stopped after a
checkpoint and run again resumes there and ends with the uninterrupted run's numbers, to the
bit on the CPU; a damaged checkpoint is skipped for the one before it; SIGTERM (preemption)
checkpoints, then ends the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    return CheckpointPolicy(url=str(root), key="sweep/trial", every_minutes=None,
                            **{"every_steps": 12, **kw})


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
