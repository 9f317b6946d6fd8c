"""A pack too large for its device's memory trains as smaller packs, each member still
getting run_trial's result: split up front by workers/memory.py's estimate, and halved
again when a pack really runs out of memory (a real allocation failure, in a child
process under an address-space limit)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from test_packed import CASES, assert_same_result, specs_for

from hptransfer.spec.trial import Budget
from hptransfer.workers.memory import (
    PACKED_STATE_BYTES_PER_PARAM,
    PEAK_OVER_SAVED,
    trial_memory,
)
from hptransfer.workers.pack import Pack
from hptransfer.workers.packed import run_trials, split_evenly
from hptransfer.workers.trainer import run_trial


def test_the_packed_state_estimate_counts_the_packs_own_buffers():
    specs = specs_for(CASES["gpt-x0-ve"])
    pack = Pack(specs, None, None)
    need = trial_memory(specs[0], pack.data.vocab_size)
    # parameters counted on the model torch built, not by flops.py
    assert need.params == sum(p.numel() for p in pack.template.parameters()) // len(specs)
    x = torch.stack([pack.data.train_batch(0, 4, 32, s.seed)[0] for s in specs])
    y = torch.stack([pack.data.train_batch(0, 4, 32, s.seed)[1] for s in specs])
    pack._losses(x, y).sum().backward()  # every parameter gets its .grad
    buffers = (pack.flat, pack.exp_avg, pack.exp_avg_sq, pack.grad, pack.scratch,
               *(p.grad for p in pack.params.values()))
    held = sum(b.numel() * b.element_size() for b in buffers)
    assert held == PACKED_STATE_BYTES_PER_PARAM * need.params * len(specs)
    assert need.pack_peak(3) - 3 * PEAK_OVER_SAVED * need.activation_bytes == held


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("width, depth, batch, seq", [(128, 2, 16, 128), (256, 2, 32, 128),
                                                       (128, 4, 32, 256)])
def test_the_activation_estimate_against_what_autograd_saves(width, depth, batch, seq, half):
    # torch's own count: the bytes of every tensor autograd saves for backward in one
    # training forward as the trainers run it (parameters excluded), through
    # saved_tensors_hooks; bf16 under CPU autocast standing in for CUDA's (whose fp32 ops
    # keep LayerNorm's inputs fp32 too), where the estimate that halved everything read
    # 1.19-1.26x low
    import torch.nn.functional as F

    from hptransfer.models.build import build_from_config
    from hptransfer.spec.trial import TrialSpec

    spec = TrialSpec(width=width, depth=depth, head_dim=32, batch_size=batch, seq_len=seq,
                     precision="bf16" if half else "fp32")
    model = build_from_config(spec.model_config_obj(256), spec.parameterization_obj()).model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, y = torch.randint(0, 256, (2, batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # as the trainers do
    counted = sum(n for ptr, n in saved.items() if ptr not in params)
    estimate = trial_memory(spec, 256, half_activations=half).activation_bytes
    assert 0.85 * estimate <= counted <= 1.05 * estimate, (counted, estimate)


@pytest.mark.parametrize("items, cap, sizes", [
    (list(range(5)), 2, [2, 2, 1]), (list(range(8)), 3, [3, 3, 2]), (list(range(4)), 4, [4]),
    (list(range(4)), 9, [4]), (list(range(3)), 1, [1, 1, 1]),
])
def test_split_evenly(items, cap, sizes):
    packs = split_evenly(items, cap)
    assert [len(p) for p in packs] == sizes and sum(packs, []) == items


def test_a_pack_larger_than_its_memory_limit_trains_in_turn_as_smaller_packs(tmp_path):
    specs = specs_for(CASES["gpt-completep"])
    need = trial_memory(specs[0], 256)
    seen: dict[int, list[float]] = {0: [], 1: [], 2: []}
    events: list[tuple[str, int]] = []

    def reporter(member, metrics):
        seen[member].append(metrics["lr"])
        events.append(("step", member))

    def on_result(member, result):
        events.append(("result", member))
        early[member] = result.model_dump()

    # room for two members: a pack of 2, then a pack of 1
    early: dict[int, dict] = {}
    packed = run_trials(specs, reporter=reporter, cache_dir=str(tmp_path),
                        memory_limit=2.5 * need.pack_peak(1), on_result=on_result)
    # the first group's results were handed over before the second group took a step, and
    # are the results returned at the end (the last group's come only with the return)
    first_of_member_2 = events.index(("step", 2))
    assert {e for e in events[:first_of_member_2] if e[0] == "result"} == {
        ("result", 0), ("result", 1)} and sorted(early) == [0, 1]
    assert all(early[i] == packed[i].model_dump() for i in (0, 1))
    for i, (spec, result) in enumerate(zip(specs, packed, strict=True)):
        solo_lrs: list[float] = []
        solo = run_trial(spec, reporter=lambda m, lrs=solo_lrs: lrs.append(m["lr"]),
                         cache_dir=str(tmp_path))
        assert_same_result(result, solo)
        assert seen[i] == solo_lrs  # each member reported under its own index
        group = 2 if i < 2 else 1
        assert any(f"did not fit in memory together; this member trained in a pack of {group}"
                   in n for n in result.notes), result.notes
    assert "trained packed: 2 trials" in packed[0].notes[0]
    # a limit that holds the whole pack changes nothing (run_trials splits a pack up front,
    # by the shape's estimate alone: 4 steps of these specs decide as 60 would)
    short = [s.model_copy(update={"budget": Budget(steps=4)}) for s in specs]
    whole = run_trials(short, cache_dir=str(tmp_path), memory_limit=3 * need.pack_peak(1))
    assert not any("did not fit in memory together" in n for r in whole for n in r.notes)
    assert "trained packed: 3 trials" in whole[0].notes[0]


_OUT_OF_MEMORY = textwrap.dedent("""
    import json, resource, sys
    from hptransfer.workers.packed import run_trials
    from hptransfer.workers.trainer import run_trial
    from hptransfer.spec.trial import TrialSpec

    def status(key):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith(key))

    base = dict(width=128, depth=2, head_dim=32, batch_size=32, seq_len=128,
                budget={"steps": 4}, num_threads=1,
                data={"val_tokens": 4096, "max_corpus_bytes": 300_000})
    specs = [TrialSpec(**base, lr=2**-8 * 2**i, seed=i) for i in range(4)]
    solo = [run_trial(s, cache_dir=sys.argv[1]) for s in specs]
    before = status("VmPeak")
    run_trials(specs[:2], cache_dir=sys.argv[1])  # maps what a pack of 2 needs at its peak
    pair = status("VmPeak") - before
    # the address space a pack of 2 reached and a quarter of its growth more: a pack of 4,
    # about twice that growth, cannot allocate; a pack of 2 can
    limit = status("VmPeak") + pair // 4
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    seen = []
    packed = run_trials(specs, reporter=lambda i, m: seen.append((i, m["step"])),
                        cache_dir=sys.argv[1], memory_limit=float("inf"))
    print(json.dumps({"solo": [r.model_dump(mode="json") for r in solo],
                      "packed": [r.model_dump(mode="json") for r in packed], "seen": seen}))
""")


def test_a_pack_that_runs_out_of_memory_is_halved_and_loses_no_member(tmp_path):
    from hptransfer.spec.trial import TrialResult

    # memory_limit=inf: no split up front, so the pack of 4 really fails to allocate
    done = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HPT_COMPILE": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    solo = [TrialResult.model_validate(r) for r in out["solo"]]
    packed = [TrialResult.model_validate(r) for r in out["packed"]]
    for p, s in zip(packed, solo, strict=True):
        assert p.status == "completed", p.error
        assert_same_result(p, s)
        note = next(n for n in p.notes if "did not fit in memory together" in n)
        assert re.search(r"this member trained in a pack of [123] \(", note), note
        assert "a pack of 4 ran out of memory" in note and "can't allocate memory" in note
    # each member's steps reached the reporter once, in order, whatever was trained again
    for i, s in enumerate(solo):
        assert [step for m, step in out["seen"] if m == i] == [p["step"] for p in s.curve]


def test_a_member_trained_again_reports_each_step_once():
    from hptransfer.workers.packed import _Relay

    calls = []

    def reporter(i, metrics):
        calls.append((i, metrics["step"]))
        return i == 1 and metrics["step"] == 2  # stop member 1 at step 2

    relay = _Relay(reporter)
    first = relay.for_group([0, 1, 2, 3])  # a pack of 4 that reports steps 1 and 2 ...
    assert [first(r, {"step": 1}) for r in range(4)] == [False] * 4
    assert [first(r, {"step": 2}) for r in range(4)] == [False, True, False, False]
    # ... then runs out of memory; its halves (member 1, stopped, is final) train again
    second, third = relay.for_group([0]), relay.for_group([2, 3])
    assert [second(0, {"step": s}) for s in (1, 2, 3)] == [False] * 3
    assert [third(r, {"step": s}) for s in (1, 2, 3) for r in range(2)] == [False] * 6
    assert calls == [(i, 1) for i in range(4)] + [(i, 2) for i in range(4)] + [
        (0, 3), (2, 3), (3, 3)]


def test_a_member_pruned_before_its_pack_ran_out_of_memory_keeps_its_result(tmp_path):
    # the pack of 3 prunes member 1 at step 20, then fails to allocate at step 30 (raised
    # from the reporter: the pack's own code path for any allocation failure); member 1's
    # result was handed over at step 20 and is kept, not trained again; 0 and 2 train again
    specs = specs_for(CASES["gpt-mup"])
    steps: dict[int, list[int]] = {0: [], 1: [], 2: []}
    failed = []

    def reporter(member, metrics):
        steps[member].append(metrics["step"])
        if metrics["step"] == 30 and not failed:
            failed.append(member)
            raise torch.OutOfMemoryError("can't allocate memory (injected)")
        return member == 1 and "val_loss" in metrics and metrics["step"] >= 20

    delivered: list[int] = []
    packed = run_trials(specs, reporter=reporter, cache_dir=str(tmp_path),
                        on_result=lambda i, r: delivered.append(i))
    assert failed == [0] and delivered[0] == 1
    assert [r.status for r in packed] == ["completed", "pruned", "completed"]
    assert steps[1] == list(range(1, 21))  # trained once, to where it was pruned
    assert steps[0] == steps[2] == list(range(1, 61))  # each step reported once
    solo = run_trial(specs[1], cache_dir=str(tmp_path),
                     reporter=lambda m: "val_loss" in m and m["step"] >= 20)
    assert_same_result(packed[1], solo)
    for i in (0, 2):
        assert_same_result(packed[i], run_trial(specs[i], cache_dir=str(tmp_path)))
        assert any("a pack of 3 ran out of memory" in n for n in packed[i].notes)


def test_a_cpu_task_plans_for_its_share_of_the_host():
    import psutil

    from hptransfer.workers.device import free_memory

    cpus, host = os.cpu_count() or 1, psutil.virtual_memory()
    whole = free_memory(torch.device("cpu"), cpus)  # a task with every CPU: all that is free
    assert whole == pytest.approx(host.available, rel=0.05)
    one = free_memory(torch.device("cpu"), 1)  # one of `cpus` such tasks: its share at most
    assert one <= whole * 1.05 and one <= host.total / cpus * 1.001
