"""Training throughput of `run_trial` on this machine, against a plain fp32 matmul.

For each shape, `run_trial` trains for a fixed number of steps with evaluation pushed to the
end (eval_every larger than the run). Its reporter is called once per optimizer step, so the
time between the reporter calls after the warm-up steps and before the final step (which
evaluates) is pure training: data batch, forward, backward, clipping, optimizer step.
Achieved FLOP/s = analytic training FLOPs per token
(`flops_per_token(cfg, seq_len).training`) x tokens/s.

The peer is nanoGPT-mup's `model.py` (EleutherAI, branch `completep`, CompleteP alpha = 1),
timed at the same width, depth, heads, batch, sequence length, vocabulary and threads, in the
same process: for every plain `gpt` shape the two are timed in alternating rounds (ours, peer,
peer, ours, ...; --rounds) so that a busy moment of a shared machine hits both, and "vs peer"
is our tokens/s over the peer's (median steps). With --interleave a round is one run in which
the two take turns step by step (our trainer's reporter runs one step of the peer after each
of ours), and "vs peer" is the median over steps of the peer's step time over ours just
before it, which keeps the ratio steady on a noisy shared machine. "rounds" gives the lowest
and highest of that ratio taken round by round, the run-to-run spread the verdict must clear.
The models differ as designed: ours has rotary positions, relu^2, untied embeddings and
LayerNorm biases; the peer learned positions, GELU and a tied unembedding. The peer is not
vendored: pass its folder with --peer (see nanogpt_peer.py).

The reference is the FLOP/s of one fp32 matmul of the MLP's first projection,
(batch*seq) x width @ width x 4*width, timed in the same process with the same thread count
just before and just after each shape's run (the better of the two). "vs matmul" is the share
of that practical limit the trainer reaches (attention, norms, the optimizer and Python
overhead are why it is below 1).

Both are medians (of the timed steps, of the matmul repetitions), so that other processes
briefly taking a core move the figures less; a row whose median step is over 1.25x its best
step is marked `!` (the machine was busy during it: rerun, or use --threads 1, which suffers
far less from a shared core than threads waiting on each other). The load average is printed
too.

--compile also times our trainer under torch.compile (HPT_COMPILE=all; by default the CPU
compiles only runs of 3e13+ training FLOPs, and these timing runs are far shorter) in every
round, after a dynamo reset so that each round compiles again: its median step, the ratio
to eager and to the peer (still eager), and the compile's cost as seconds and as the steps
that repay it, for the first round (the first compile in the process: imports, inductor's
worker pool) and the later ones (inductor's on-disk kernel cache makes a shape compiled
before on this machine cheaper).

    .venv/bin/python benchmarks/trainer_throughput.py [--steps 16] [--warmup 3] [--threads N]
        [--peer DIR] [--rounds 3] [--only gpt:128:2 ...] [--compile]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from _timing import alternating, matmul_flops, step_stamps
from nanogpt_peer import HOW_TO_GET, load_peer, peer_dir, peer_trainer, time_peer

from hptransfer.data import DataSpec
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.spec.trial import ArchOptions, Budget, TrialSpec
from hptransfer.workers.plan import load_trial_data

SEQ_LEN, BATCH, HEAD_DIM, BASE_WIDTH, BASE_DEPTH, LR = 128, 8, 64, 128, 2, 2.0**-7
NOISY = 1.25  # median step over best step: flagged as disturbed
# (label, arch, parameterization, width, depth, arch options)
# "gpt-gelu": our trainer with the peer's activation, to separate the trainer from relu^2
SHAPES: list[tuple[str, str, str, int, int, dict[str, Any]]] = [
    ("gpt", "gpt", "completep", 128, 2, {}),
    ("gpt-gelu", "gpt", "completep", 128, 2, {"activation": "gelu"}),
    ("gpt", "gpt", "completep", 256, 2, {}),
    ("gpt", "gpt", "completep", 256, 4, {}),
    ("gpt-gelu", "gpt", "completep", 256, 4, {"activation": "gelu"}),
    ("gpt", "gpt", "completep", 512, 2, {}),
    ("gpt", "gpt", "completep", 512, 4, {}),
    ("ngpt", "ngpt", "ngpt", 256, 4, {}),
    ("gpt+x0", "gpt", "completep", 256, 4, {"x0_mixing": True, "extra_embeddings": 1}),
]


PEER_LABELS = ("gpt", "gpt-gelu")  # CompleteP GPTs: the peer's own scheme


@dataclass
class Row:
    label: str
    width: int
    depth: int
    params: int
    flops_per_token: float
    step_ms: float  # median
    best_ms: float
    tokens_per_s: float
    achieved: float  # FLOP/s
    matmul: float  # FLOP/s
    trial_tokens_per_s: float  # run_trial's own figure: warm-up and final eval included
    peer_ms: float | None = None  # nanoGPT-mup's median step at this shape
    peer_best_ms: float | None = None
    compiled_ms: float | None = None  # with --compile: our median step under torch.compile
    compile_s: list[float] | None = None  # its first step's extra time (compiling), per round
    round_ratios: list[float] | None = None  # per round: peer median step / our median step
    pair_ratio: float | None = None  # --interleave: median over steps of peer step / our step

    @property
    def ratio(self) -> float:
        return self.achieved / self.matmul

    @property
    def vs_peer(self) -> float | None:
        if self.pair_ratio is not None:
            return self.pair_ratio
        return None if self.peer_ms is None else self.peer_ms / self.step_ms

    @property
    def compiled_vs_peer(self) -> float | None:
        if self.peer_ms is None or self.compiled_ms is None:
            return None
        return self.peer_ms / self.compiled_ms


def trial_spec(arch: str, param: str, width: int, depth: int, options: dict[str, Any],
               steps: int, threads: int) -> TrialSpec:
    return TrialSpec(
        arch=arch, parameterization=param, arch_options=ArchOptions(**options),
        width=width, depth=depth, head_dim=HEAD_DIM, base_width=BASE_WIDTH,
        base_depth=BASE_DEPTH, lr=LR, batch_size=BATCH, seq_len=SEQ_LEN, budget=Budget(steps=steps),
        eval_every=10**9,  # only the final step evaluates; it is left out of the timing
        data=DataSpec(source="stdlib", val_tokens=2048, max_corpus_bytes=2_000_000),
        device="cpu", precision="fp32", num_threads=threads,
        divergence_factor=1e9,  # a timing run must not stop early
    )


def time_training(spec: TrialSpec, warmup: int, cache_dir: str,
                  compiled: bool = False) -> tuple[list[float], float, float]:
    """(seconds of each training step after the warm-up, run_trial's tokens/s, seconds to the
    first step's end); `compiled`: the trainer under torch.compile (HPT_COMPILE=all)."""
    before = os.environ.get("HPT_COMPILE")
    os.environ["HPT_COMPILE"] = "all" if compiled else "0"
    try:
        start = time.perf_counter()
        stamps, result = step_stamps(spec, cache_dir)
    finally:
        if before is None:
            del os.environ["HPT_COMPILE"]
        else:
            os.environ["HPT_COMPILE"] = before
    steps = spec.budget.steps or 0
    first, last = warmup, steps - 1  # step numbers are 1-based; `steps` itself evaluates
    missing = [s for s in (first, last) if s not in stamps]
    if missing:
        raise RuntimeError(f"no reporter call at steps {missing} (is steps <= 50?)")
    times = [stamps[s + 1] - stamps[s] for s in range(first, last)]
    return times, result.tokens_per_s or 0.0, stamps[1] - start


def time_interleaved(spec: TrialSpec, peer_step: Callable[[int], torch.Tensor], warmup: int,
                     cache_dir: str) -> tuple[list[float], list[float]]:
    """(seconds of our steps, of the peer's) from one `run_trial` whose reporter runs one step of
    the peer after each of ours: the two alternate step by step, so each of their steps starts
    after one of the other's, and a busy moment of the machine hits both alike. Item i of both
    lists is the same step number, the peer's run right after ours."""
    left: dict[int, float] = {}
    losses: list[torch.Tensor] = []

    def peer_turn(step: int) -> None:
        losses.append(peer_step(step))
        left[step] = time.perf_counter()

    entered, _ = step_stamps(spec, cache_dir, between=peer_turn)
    if not torch.isfinite(losses[-1]):
        raise RuntimeError("the peer's timing run diverged")
    steps = spec.budget.steps or 0
    first, last = warmup, steps - 1  # our step s+1 runs from left[s] to entered[s+1]
    if any(s not in entered for s in range(first, last + 1)):
        raise RuntimeError("the reporter missed a step (is steps <= 50?)")
    ours = [entered[s + 1] - left[s] for s in range(first, last)]
    theirs = [left[s] - entered[s] for s in range(first + 1, last + 1)]
    return ours, theirs


def time_matmul(width: int, threads: int, reps: int = 30) -> float:
    """FLOP/s of (batch*seq) x width @ width x 4*width in fp32 (median of `reps`)."""
    return matmul_flops(BATCH * SEQ_LEN, width, 4 * width, threads, reps=reps)


def measure(label: str, arch: str, param: str, width: int, depth: int,
            options: dict[str, Any], steps: int, warmup: int, threads: int,
            cache_dir: str, peer: ModuleType | None, rounds: int, compiled: bool,
            interleave: bool) -> Row:
    spec = trial_spec(arch, param, width, depth, options, steps, threads)
    data = load_trial_data(spec, cache_dir)
    cfg = spec.model_config_obj(vocab_size=data.vocab_size)
    fpt = flops_per_token(cfg, SEQ_LEN).training
    with_peer = peer is not None and label in PEER_LABELS
    matmul_before = time_matmul(width, threads)
    step_times: list[float] = []
    peer_times: list[float] = []
    trial_tps: list[float] = []
    compiled_times: list[float] = []
    compile_s: list[float] = []
    round_ratios: list[float] = []  # per round: peer median step / our median step
    pair_ratios: list[float] = []  # interleaved: each step of the peer over our step before it

    def time_ours() -> list[float]:
        eager, tps, _ = time_training(spec, warmup, cache_dir)
        step_times.extend(eager)
        trial_tps.append(tps)
        if compiled:
            torch._dynamo.reset()  # every round compiles again (inductor's disk cache stays)
            times, _, first = time_training(spec, warmup, cache_dir, compiled=True)
            compiled_times.extend(times)
            compile_s.append(first - statistics.median(times))
        return eager

    # the peer at our shape: nanogpt_peer.peer_trainer's arguments
    peer_shape = dict(width=width, depth=depth, head_dim=HEAD_DIM, base_width=BASE_WIDTH,
                      base_depth=BASE_DEPTH, lr=LR, batch=BATCH, seq_len=SEQ_LEN,
                      threads=threads)

    def time_theirs() -> list[float]:
        times = time_peer(peer, data, steps=steps - 1, warmup=warmup, **peer_shape)
        peer_times.extend(times)
        return times

    def time_together() -> None:  # one round, the two sides step by step
        ours, theirs = time_interleaved(spec, peer_trainer(peer, data, **peer_shape), warmup,
                                        cache_dir)
        step_times.extend(ours)
        peer_times.extend(theirs)
        pairs = [t / o for o, t in zip(ours, theirs, strict=True)]
        pair_ratios.extend(pairs)
        round_ratios.append(statistics.median(pairs))

    if with_peer and interleave:
        for _ in range(rounds):
            time_together()
    elif with_peer:
        got = alternating({"ours": time_ours, "theirs": time_theirs}, rounds)
        round_ratios = [statistics.median(theirs) / statistics.median(ours)
                        for ours, theirs in zip(got["ours"], got["theirs"], strict=True)]
    else:
        time_ours()
    matmul = max(matmul_before, time_matmul(width, threads))
    step_s = statistics.median(step_times)
    tokens_per_s = BATCH * SEQ_LEN / step_s
    return Row(
        label=label, width=width, depth=depth, params=param_counts(cfg).non_embedding,
        flops_per_token=fpt, step_ms=1e3 * step_s, best_ms=1e3 * min(step_times),
        tokens_per_s=tokens_per_s,
        achieved=fpt * tokens_per_s, matmul=matmul,
        trial_tokens_per_s=statistics.median(trial_tps) if trial_tps else math.nan,
        peer_ms=1e3 * statistics.median(peer_times) if peer_times else None,
        peer_best_ms=1e3 * min(peer_times) if peer_times else None,
        compiled_ms=1e3 * statistics.median(compiled_times) if compiled_times else None,
        compile_s=compile_s or None,
        round_ratios=round_ratios or None,
        pair_ratio=statistics.median(pair_ratios) if pair_ratios else None,
    )


def print_table(rows: list[Row], threads: int, steps: int, warmup: int,
                load: tuple[float, float], interleave: bool) -> None:
    print(f"\ntorch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()} "
          f"(requested {threads}), {os.cpu_count()} CPUs, 1-min load average "
          f"{load[0]:.1f} before / {load[1]:.1f} after; seq {SEQ_LEN}, batch {BATCH}; "
          f"{steps} steps per shape, steps {warmup + 1}..{steps - 1} timed")
    header = (f"{'arch':<8} {'width':>5} {'depth':>5} {'params':>8} {'MFLOP/tok':>9} "
              f"{'ms/step':>8} {'best ms':>8} {'tok/s':>8} {'GFLOP/s':>8} {'mm GFLOP/s':>10} "
              f"{'vs matmul':>9} {'trial tok/s':>11} {'peer ms':>8} {'vs peer':>7} "
              f"{'rounds':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.label:<8} {r.width:>5} {r.depth:>5} {r.params / 1e6:>7.2f}M "
              f"{r.flops_per_token / 1e6:>9.1f} {r.step_ms:>8.1f} {r.best_ms:>8.1f} "
              f"{r.tokens_per_s:>8.0f} "
              f"{r.achieved / 1e9:>8.2f} {r.matmul / 1e9:>10.2f} {r.ratio:>9.2f} "
              f"{_or_dash(r.trial_tokens_per_s, '.0f'):>11} "
              + (f"{r.peer_ms:>8.1f} {r.vs_peer:>7.3f} {_spread(r.round_ratios):>11}"
                 if r.vs_peer else f"{'-':>8} {'-':>7} {'-':>11}")
              + (" !" if r.step_ms > NOISY * r.best_ms
                 or (r.peer_ms and r.peer_ms > NOISY * (r.peer_best_ms or 0)) else ""))
    print("\nms/step, tok/s, GFLOP/s: median step; vs matmul = achieved / matmul FLOP/s (the "
          "practical limit at this width); trial tok/s = run_trial's own figure, warm-up "
          "steps and the final eval included (- when interleaved: its clock holds the peer's "
          "steps too); vs peer = our tok/s / nanoGPT-mup's tok/s (median steps; > 1: ours is "
          "faster), "
          + ("the median over steps of the peer's step over ours just before it, ours and "
             "the peer taking turns step by step, one run per round"
             if interleave else "alternating rounds, each round's pair back to back")
          + "; rounds = the lowest and highest of the same ratio taken per round, so a "
          "spread that straddles 1 means the two are level within this machine's noise")
    compiled = [r for r in rows if r.compiled_ms is not None]
    if compiled:
        print("\nunder torch.compile (HPT_COMPILE=all; by default the CPU compiles only "
              "runs of 3e13+ training FLOPs):")
        for r in compiled:
            first, later = r.compile_s[0], statistics.median(r.compile_s[1:] or r.compile_s)
            saved_s = (r.step_ms - r.compiled_ms) / 1e3  # per step
            print(f"{r.label:<8} {r.width:>5} {r.depth:>5}: {r.compiled_ms:.1f} ms/step, "
                  f"{r.step_ms / r.compiled_ms:.3f} x eager"
                  + (f", {r.compiled_vs_peer:.3f} x nanoGPT-mup's tok/s" if r.compiled_vs_peer
                     else "")
                  + f"; compiling took {first:.1f} s in round 1 (first in this process), "
                  f"{later:.1f} s later, repaid after "
                  + (f"{first / saved_s:.0f} / {later / saved_s:.0f} steps" if saved_s > 0
                     else "never"))


def _or_dash(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _spread(ratios: list[float] | None) -> str:
    return f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"


def _names(shape: tuple) -> set[str]:
    """What --only accepts for a SHAPES entry: its label, or label:width:depth."""
    return {shape[0], f"{shape[0]}:{shape[3]}:{shape[4]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16,
                        help="steps per shape, at most 50 (one reporter call per step)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--only", nargs="*", help="labels or arch:width:depth to run")
    parser.add_argument("--peer", help="folder with nanoGPT-mup's model.py (branch completep)")
    parser.add_argument("--compile", action="store_true",
                        help="also time our trainer under torch.compile, each round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="ours/peer rounds per shape (with --peer)")
    parser.add_argument("--interleave", action="store_true",
                        help="with --peer: each round one run in which ours and the peer "
                             "take turns step by step (default: whole runs, alternating)")
    args = parser.parse_args()
    folder = peer_dir(args.peer)
    peer = load_peer(folder) if folder else None
    if peer is None:
        print(HOW_TO_GET + "\n(running without the peer column)\n")
    if not 2 <= args.warmup + 2 <= args.steps <= 50:
        parser.error("need warmup + 2 <= steps <= 50")
    only = set(args.only or ())
    names = {n for s in SHAPES for n in _names(s)}
    if only - names:  # a typo would otherwise time fewer shapes than asked, silently
        parser.error(f"--only {' '.join(sorted(only - names))}: no such shape; choose from "
                     f"{', '.join(sorted(names))}")
    shapes = [s for s in SHAPES if not only or only & _names(s)]
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="hpt-bench-") as cache_dir:
        for label, arch, param, width, depth, options in shapes:
            rows.append(measure(label, arch, param, width, depth, options, args.steps,
                                args.warmup, args.threads, cache_dir, peer, args.rounds,
                                args.compile, args.interleave))
            r = rows[-1]
            print(f"{label} w{width} d{depth}: {r.tokens_per_s:.0f} tok/s, "
                  f"{r.achieved / 1e9:.2f} GFLOP/s, {r.ratio:.2f} of matmul"
                  + (f", {r.vs_peer:.3f} x nanoGPT-mup's tok/s (rounds "
                     f"{_spread(r.round_ratios)})" if r.vs_peer else ""),
                  flush=True)
    print_table(rows, args.threads, args.steps, args.warmup,
                (load_before, os.getloadavg()[0]), args.interleave)


if __name__ == "__main__":
    main()
