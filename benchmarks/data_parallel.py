"""Data-parallel trials and checkpoints, measured in one run:

1. tokens/s of one trial in one process (W = 1, the baseline) and on W Ray Train workers
   (TorchTrainer, DDP; with `--shard` also FSDP), the path the service runs: "x" = W / W=1
   (W would be perfect scaling). On the CPU, W = 2 workers of one thread each (gloo); on the
   GPU machine (`--device cuda`), W = every visible GPU (NCCL), when there are 2 or more.
   tokens/s is the trial's own (training steps only), so Ray Train's start-up (~20-30 s
   here) is printed beside it, not in it.
2. checkpoint overhead: each checkpoint of a trial checkpointing every `--every` steps
   timed (model and optimizer state, written and renamed, with its digest): ms per
   checkpoint and its share of training time at that interval and at the default one
   (every 10 minutes).

    .venv/bin/python benchmarks/data_parallel.py [--width 128] [--depth 4] [--batch 32]
        [--steps 60] [--rounds 3] [--every 20] [--device cpu] [--shard]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid

from _timing import alternating, bench_head_dim

from hptransfer.workers.checkpoints import CheckpointPolicy, TrialCheckpoints
from hptransfer.workers.ray_train import execute_trial_on_workers
from hptransfer.workers.trainer import run_trial


def on_train_workers(spec: dict, workers: int, gpus: float, shard: bool,
                     storage: str) -> tuple[float, float]:
    """The trial on `workers` Ray Train workers: its tokens/s and the run's wall seconds."""
    t0 = time.perf_counter()
    out = execute_trial_on_workers(
        spec, f"bench-{uuid.uuid4().hex[:8]}", None, None, None, None, workers=workers,
        cpus=1, gpus=gpus, checkpoint=None, storage_path=storage,
        run_name=f"bench-{uuid.uuid4().hex[:8]}", shard=shard)
    if out.get("status") != "completed":
        raise SystemExit(f"the Ray Train run ended {out.get('status')}: {out.get('error')}")
    return out["tokens_per_s"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shard", action="store_true", help="also FSDP (fully_shard) workers")
    args = ap.parse_args()
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    world = gpus if gpus >= 2 else 2
    if args.device == "cuda" and gpus < 2:
        raise SystemExit(f"{gpus} GPU visible: data-parallel scaling needs 2 or more")
    spec = dict(arch="gpt", width=args.width, depth=args.depth,
                head_dim=bench_head_dim(args.width), lr=2**-8, seq_len=args.seq_len,
                batch_size=args.batch, budget={"steps": args.steps},
                data={"source": "stdlib", "tokenizer": "byte"}, eval_every=args.steps,
                num_threads=1, device=args.device)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_trial({**spec, "budget": {"steps": 2}})  # the corpus tokenized once, before timing

    # ---- 1. W = 1 in one process against W Ray Train workers (DDP, and FSDP with --shard)
    import ray

    ray.init(address="local", num_cpus=world, num_gpus=gpus, include_dashboard=False,
             log_to_driver=False)
    sides = {"W=1": lambda: (run_trial(spec).tokens_per_s, 0.0)}
    with tempfile.TemporaryDirectory() as storage:
        for shard in ([False, True] if args.shard else [False]):
            sides[f"W={world} {'FSDP' if shard else 'DDP'}"] = (
                lambda shard=shard: on_train_workers(spec, world, 1 if gpus else 0, shard,
                                                     storage))
        runs = alternating(sides, args.rounds)
    ray.shutdown()
    one = statistics.median(r for r, _ in runs["W=1"])
    print(f"{args.width}x{args.depth}, batch {args.batch} x {args.seq_len}, {args.steps} "
          f"steps, {'nccl' if gpus else 'gloo'}, medians of {args.rounds} rounds")
    print(f"  tokens/s  W=1 (one process, the baseline) {one:,.0f}")
    for name, got in runs.items():
        if name == "W=1":
            continue
        rate = statistics.median(r for r, _ in got)
        wall = statistics.median(w for _, w in got)
        print(f"  tokens/s  {name} on Ray Train {rate:,.0f}   x {rate / one:.2f} (scaling "
              f"efficiency {rate / one / world:.0%}); the run's wall time {wall:.0f} s")

    # ---- 2. checkpoint overhead: each save timed inside a checkpointed run
    saves: list[float] = []
    save = TrialCheckpoints.save

    def timed_save(self, done, state):  # noqa: ANN001 - the method's own signature
        t0 = time.perf_counter()
        try:
            return save(self, done, state)
        finally:
            saves.append(time.perf_counter() - t0)

    TrialCheckpoints.save = timed_save
    with tempfile.TemporaryDirectory() as root:
        walls = []
        for _ in range(args.rounds):
            policy = CheckpointPolicy(url=root, key="bench/trial", every_steps=args.every,
                                      every_minutes=None)
            walls.append(run_trial(spec, checkpoints=policy).wall_time_s)
    TrialCheckpoints.save = save
    per_save = statistics.median(saves)
    step = (statistics.median(walls) - per_save * len(saves) / args.rounds) / args.steps
    print(f"  one checkpoint: {per_save * 1e3:.1f} ms (median of {len(saves)}); a training "
          f"step {step * 1e3:.1f} ms")
    print(f"  overhead: every {args.every} steps {per_save / (args.every * step):.2%} of "
          f"training time; at the default interval (every 10 min) {per_save / 600:.5%}")


if __name__ == "__main__":
    main()
