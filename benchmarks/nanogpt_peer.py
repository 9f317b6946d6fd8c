"""The peer for trainer_throughput.py: nanoGPT-mup's `model.py` (EleutherAI/nanoGPT-mup, branch
`completep`) trained at one of our shapes, timed per step.

The peer's code is never vendored: the user extracts it and passes its folder (--peer DIR or
HPT_PEER_NANOGPT). Its training step is train.py's: per-group LR (lr x lr_scale), forward with
targets, backward, clip at 1.0, AdamW step, zero_grad(set_to_none=True); the batches come from
our own data layer, so both sides read the same tokens the same way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from hptransfer.data import TokenDataset

ENV = "HPT_PEER_NANOGPT"
HOW_TO_GET = (
    "nanoGPT-mup is not vendored; to compare against it, extract its model.py and pass the "
    "folder:\n"
    "    git clone --branch completep --depth 1 https://github.com/EleutherAI/nanoGPT-mup "
    "/tmp/nanoGPT-mup\n"
    "    python benchmarks/trainer_throughput.py --peer /tmp/nanoGPT-mup   "
    f"(or set {ENV}=/tmp/nanoGPT-mup)"
)


def peer_dir(arg: str | None) -> Path | None:
    """The folder holding the peer's model.py (from --peer, else the env var), or None."""
    value = arg or os.environ.get(ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not (path / "model.py").is_file():
        raise SystemExit(f"--peer / {ENV}: no model.py in {path}\n{HOW_TO_GET}")
    return path


def load_peer(folder: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("nanogpt_mup_model", folder / "model.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {folder / 'model.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_trainer(peer: ModuleType, data: TokenDataset, *, width: int, depth: int, head_dim: int,
                 base_width: int, base_depth: int, lr: float, batch: int, seq_len: int,
                 threads: int) -> Callable[[int], torch.Tensor]:
    """The peer's model and AdamW at one of our shapes (CompleteP, alpha = 1), as a function
    that runs training step `step` and returns its loss."""
    torch.set_num_threads(threads)
    cfg = peer.GPTConfig(
        block_size=seq_len, vocab_size=data.vocab_size, n_layer=depth,
        n_head=width // head_dim, n_embd=width, dropout=0.0, bias=False, init_std=0.02,
        mup_enabled=True, mup_width_multiplier=width / base_width,
        depth_alpha_enabled=True, depth_multiplier=depth / base_depth, depth_alpha_exp=1.0,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # it prints parameter counts
        model = peer.GPT(cfg)
        opt = model.configure_optimizers(0.0, lr, (0.9, 0.95), 1e-12, "cpu")
    model.train()

    def step(number: int) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_scale"]
        x, y = data.train_batch(number, batch, seq_len, 0)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def time_peer(peer: ModuleType, data: TokenDataset, *, steps: int, warmup: int,
              **shape: int | float) -> list[float]:
    """Seconds of each of the peer's training steps after `warmup` (shape: peer_trainer's)."""
    step = peer_trainer(peer, data, **shape)
    times = []
    for number in range(steps):
        t = time.perf_counter()
        loss = step(number)
        times.append(time.perf_counter() - t)
    if not torch.isfinite(loss):
        raise RuntimeError("the peer's timing run diverged")
    return times[warmup:]
