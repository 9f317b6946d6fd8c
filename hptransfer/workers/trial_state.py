"""A trial's checkpoint, written and read in one place: the lone optimizer a trial trains
with, the state saved after a step (model, optimizer, progress, RNG), and the resume that
loads it back. run_trial writes it; a packed member's checkpoint (pack.py) is written in
the same format so that its retry resumes alone through run_trial."""

from __future__ import annotations

from typing import Any

import torch

from .checkpoints import TrialCheckpoints
from .flat_adamw import FlatAdamW
from .outcome import Progress


def lone_optimizer(groups: list[dict[str, Any]], betas: tuple[float, float],
                   device: torch.device) -> Any:
    """A trial's AdamW alone on one device (a packed member's checkpoint is written in its
    format, pack.py): fused on CUDA; on the CPU foreach's arithmetic on one buffer per
    group."""
    return (torch.optim.AdamW(groups, betas=betas, fused=True) if device.type == "cuda"
            else FlatAdamW(groups, betas=betas))


def trial_state(done: int, model: torch.nn.Module, opt: Any, progress: Progress,
           weights: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything the loop needs to go on after `done` steps exactly as if never stopped:
    the data position is the step (a batch depends only on seed and step). `weights`: the
    model's and optimizer's full state dicts where they are gathered (a sharded trial)."""
    model_state, opt_state = weights or (model.state_dict(), opt.state_dict())
    return {
        "steps_done": done,
        "model": model_state,
        "optimizer": opt_state,
        "progress": {"steps_done": progress.steps_done, "initial_loss": progress.initial_loss,
                     "train_loss": progress.train_loss, "val_loss": progress.val_loss,
                     "curve": progress.curve},
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def resume_checkpoint(checkpoints: TrialCheckpoints | None, model: torch.nn.Module, opt: Any,
            progress: Progress, notes: list[str]) -> tuple[int, int]:
    """Load the latest complete checkpoint into the model, optimizer and progress: the
    steps it had done (0: start from scratch), and how many steps past it an earlier
    attempt had got to (trained again now)."""
    found = checkpoints.latest() if checkpoints is not None else None
    if found is None:
        return 0, 0
    done, state = found
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return resume_from(done, state, checkpoints.reached(), progress, notes)


def resume_from(done: int, state: dict[str, Any], reached: int, progress: Progress,
                 notes: list[str]) -> tuple[int, int]:
    """The progress and RNG states of a checkpoint after `done` steps restored."""
    saved = state["progress"]
    progress.steps_done, progress.initial_loss = saved["steps_done"], saved["initial_loss"]
    progress.train_loss, progress.val_loss = saved["train_loss"], saved["val_loss"]
    progress.curve = list(saved["curve"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    retrained = max(0, reached - done)
    notes.append(f"resumed from the checkpoint after step {done} (an earlier attempt had "
                 f"reached step {done + retrained})")
    return done, retrained
