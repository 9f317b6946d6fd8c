"""Data-parallel trials and checkpoints, measured in one run:

1. tokens/s of one trial on W = 1 process and on W = 2 gloo ranks (one thread each, the same
   global batch split by rows): "x" = W=2 / W=1 (2.0 would be perfect scaling). On the GPU
   machine (`--device cuda`), W = every visible GPU over NCCL against W = 1.
2. checkpoint overhead: each checkpoint of a trial checkpointing every `--every` steps
   timed (model and optimizer state, written and renamed, with its digest): ms per
   checkpoint and its share of training time at that interval and at the default one
   (every 10 minutes).

    .venv/bin/python benchmarks/data_parallel.py [--width 128] [--depth 4] [--batch 32]
        [--steps 60] [--rounds 3] [--every 20] [--device cpu]

The ranks are processes started here with torch.distributed (what Ray Train's workers run,
without Ray's start-up, ~20-30 s a run on this host, which would swamp a short trial).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import alternating, bench_head_dim

from hptransfer.workers.checkpoints import CheckpointPolicy, TrialCheckpoints
from hptransfer.workers.trainer import run_trial

RANK = """
import json, os, sys
import torch, torch.distributed as dist
rank, world, port, spec, out, backend = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                         eval(sys.argv[4]), sys.argv[5], sys.argv[6])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
if backend == "nccl":
    torch.cuda.set_device(rank)
dist.init_process_group(backend, rank=rank, world_size=world)
from hptransfer.workers.data_parallel import DataParallel
from hptransfer.workers.trainer import run_trial
result = run_trial(spec, parallel=DataParallel.current())
if rank == 0:
    open(out, "w").write(result.model_dump_json())
dist.destroy_process_group()
"""


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def on_ranks(spec: dict, world: int, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rank0.json"
        port = free_port()
        ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), port,
                                   repr(spec), str(out), backend]) for r in range(world)]
        if any(p.wait() != 0 for p in ranks):
            raise SystemExit("a rank failed")
        return json.loads(out.read_text())


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
    args = ap.parse_args()
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    world = max(2, gpus)
    backend = "nccl" if args.device == "cuda" else "gloo"
    spec = dict(arch="gpt", width=args.width, depth=args.depth,
                head_dim=bench_head_dim(args.width), lr=2**-8, seq_len=args.seq_len,
                batch_size=args.batch, budget={"steps": args.steps},
                data={"source": "stdlib", "tokenizer": "byte"}, eval_every=args.steps,
                num_threads=1, device=args.device)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_trial({**spec, "budget": {"steps": 2}})  # the corpus tokenized once, before timing

    # ---- 1. W = 1 against W = world
    rates = alternating({
        "W=1": lambda: run_trial(spec).tokens_per_s,
        f"W={world}": lambda: on_ranks(spec, world, backend)["tokens_per_s"],
    }, args.rounds)
    one, many = statistics.median(rates["W=1"]), statistics.median(rates[f"W={world}"])
    print(f"{args.width}x{args.depth}, batch {args.batch} x {args.seq_len}, {args.steps} "
          f"steps, {backend}, medians of {args.rounds} rounds")
    print(f"  tokens/s  W=1 {one:,.0f}   W={world} {many:,.0f}   x {many / one:.2f} "
          f"(scaling efficiency {many / one / world:.0%})")

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
