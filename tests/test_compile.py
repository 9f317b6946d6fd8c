"""The CUDA path compiles the model (`workers/compiling.Compiled`): checked here on the CPU, where
short runs stay eager, so that a graph break or a compile failure shows up without a GPU.

- dynamo traces every arch variant's forward, and the packed trainer's batched loss and
  AdamW step, as ONE graph (a break per layer would split the model into pieces that
  compile and launch separately);
- the traced forward and backward equal eager's;
- `Compiled` falls back to eager, with a note, when compiling fails.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo as dynamo
import torch._dynamo.testing
from test_packed import CASES, specs_for

from hptransfer.models.build import build_from_config
from hptransfer.spec.trial import Budget, TrialSpec
from hptransfer.workers.compiling import CPU_COMPILE_MIN_FLOPS, Compiled, compile_wanted
from hptransfer.workers.pack import Pack, stack_size_may_change
from hptransfer.workers.plan import load_trial_data, plan_trial

CUDA = torch.device("cuda")  # only decides that `Compiled` compiles; the tensors stay on the CPU
# head_dim 8: attention takes the explicit small-head path (a custom autograd function)
SMALL_HEADS = {"small-heads-rope": {**CASES["gpt-completep"], "head_dim": 8},
               "small-heads-alibi": {**CASES["gpt-alibi-bias"], "head_dim": 8}}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test traces from scratch: dynamo caches per code object and stops tracing one
    that hit its recompile limit (eight model variants share GPT.forward)."""
    dynamo.reset()
    yield
    dynamo.reset()

def _model(case: dict) -> tuple[torch.nn.Module, torch.Tensor]:
    spec: TrialSpec = specs_for(case)[0]
    cfg = spec.model_config_obj()
    model = build_from_config(cfg, spec.parameterization_obj(), seed=0).model
    tokens = torch.randint(0, cfg.vocab_size, (2, spec.seq_len),
                           generator=torch.Generator().manual_seed(0))
    return model, tokens


def _breaks(explained) -> list[str]:  # noqa: ANN001 (dynamo's ExplainOutput)
    return [f"{r.reason.splitlines()[0]} at {r.user_stack[-1] if r.user_stack else '?'}"
            for r in explained.break_reasons]


@pytest.mark.parametrize("name", [*CASES, *SMALL_HEADS])
def test_every_model_traces_as_one_graph(name):
    model, tokens = _model({**CASES, **SMALL_HEADS}[name])
    explained = dynamo.explain(model)(tokens)
    assert explained.graph_break_count == 0, _breaks(explained)
    assert explained.graph_count == 1


def _pack_and_batch(name: str) -> tuple[Pack, torch.Tensor, torch.Tensor]:
    pack = Pack(specs_for(CASES[name])[:2], None, None)
    pack._row_idx = torch.tensor(pack.rows)
    batches = [pack.data.train_batch(0, pack.spec.batch_size, pack.spec.seq_len, seed)
               for seed in (0, 1)]
    return pack, torch.stack([x for x, _ in batches]), torch.stack([y for _, y in batches])


def _update_args(pack: Pack, losses: torch.Tensor) -> tuple:
    return (pack.gather_grads(), losses.detach(), torch.ones(2, dtype=torch.bool),
            losses.detach().double(), pack.factors[0, pack._row_idx], pack.bias1[0],
            pack.bias2_sqrt[0])


@pytest.mark.parametrize("name", ["gpt-x0-ve", "gpt-alibi-bias", "ngpt"])
def test_packed_loss_and_update_trace_as_one_graph_each(name):
    pack, xs, ys = _pack_and_batch(name)
    explained = dynamo.explain(pack._losses)(xs, ys)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, _breaks(explained)

    losses = pack._losses(xs, ys)
    losses.sum().backward()
    with torch.no_grad():
        explained = dynamo.explain(pack._update)(*_update_args(pack, losses))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, _breaks(explained)


def test_compiled_packed_step_equals_eager():
    """A pack's loss, gradients and AdamW step through dynamo and AOTAutograd equal eager's:
    its parameters are views into one buffer, which tracing must neither copy nor miss."""
    def step(compile_: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pack, xs, ys = _pack_and_batch("gpt-x0-ve")
        wrap = ((lambda f: torch.compile(f, backend="aot_eager", fullgraph=True)) if compile_
                else (lambda f: f))
        losses = wrap(pack._losses)(xs, ys)
        losses.sum().backward()
        with torch.no_grad():
            wrap(pack._update)(*_update_args(pack, losses))
        return losses.detach(), pack.flat.clone()

    eager_losses, eager_flat = step(False)
    losses, flat = step(True)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
    assert not torch.equal(flat, _pack_and_batch("gpt-x0-ve")[0].flat)  # the step moved it
    torch.testing.assert_close(flat, eager_flat, rtol=1e-5, atol=1e-7)


def test_a_shrinking_pack_compiles_its_model_once_more_not_once_per_size():
    """Compaction drops stopped members from the stacks the model's parameters are views of.
    The first smaller K compiles the model again with K dynamic; later sizes reuse that graph
    (parameters traced as static shapes compiled it anew for every K), and it stays right."""
    specs = specs_for(CASES["gpt-completep"], [dict(lr=2**-8, seed=s) for s in range(4)])
    pack = Pack(specs, None, None)
    batches = [pack.data.train_batch(0, pack.spec.batch_size, pack.spec.seq_len, s.seed)
               for s in specs]
    xs, ys = torch.stack([x for x, _ in batches]), torch.stack([y for _, y in batches])
    counter = dynamo.testing.CompileCounterWithBackend("aot_eager")
    losses = torch.compile(pack._losses, backend=counter)
    for stopped in (None, 0, 2):  # K = 4, then 3, then 2
        if stopped is not None:
            pack.members[stopped].progress.status = "pruned"
            pack._compact()
        rows = pack.rows
        with stack_size_may_change():
            got = losses(xs[rows], ys[rows])
        torch.testing.assert_close(got, pack._losses(xs[rows], ys[rows]), rtol=1e-6, atol=0)
    assert pack.rows == [1, 3]
    assert counter.frame_count == 2  # K = 4 static, then one dynamic graph for 3 and 2


@pytest.mark.parametrize("name", ["gpt-completep", "gpt-x0-ve", "ngpt"])
def test_traced_adamw_step_equals_the_eager_one(name):
    """A traced pack's AdamW step (whole buffers, each column looking its group's numbers up)
    equals eager's group-by-group step over three steps: members with their own LR, weight
    decay, eps and schedule, groups with their own LR and eps, gradients from 1e-12 to 1 (the
    small ones make eps decide the step, so a column given another group's eps shows)."""
    def run(traced: bool) -> list[torch.Tensor]:
        pack = Pack(specs_for(CASES[name]), None, None)
        k = len(pack.rows)
        update = (torch.compile(pack._update, backend="aot_eager", fullgraph=True) if traced
                  else pack._update)
        gen = torch.Generator().manual_seed(0)
        losses, alive = torch.ones(k), torch.ones(k, dtype=torch.bool)
        for step in range(3):
            scale = 10.0 ** torch.empty(pack.flat.shape).uniform_(-12, 0, generator=gen)
            pack.grad.copy_(torch.randn(pack.flat.shape, generator=gen) * scale)
            with torch.no_grad():
                update(pack.grad, losses, alive, losses.double(), pack.factors[step],
                       pack.bias1[step], pack.bias2_sqrt[step])
        return [pack.flat, pack.exp_avg, pack.exp_avg_sq]

    eps = Pack(specs_for(CASES[name]), None, None).hp["eps"]  # (members, groups)
    assert eps[:, 0].unique().numel() > 1  # members' eps differ (and, in GPT, groups' too)
    eager, traced = run(False), run(True)
    # parameters to rounding of their ~1e-3 steps (a few land near 0, where relative error
    # means nothing); the moments, which never cancel, relatively
    for got, want, atol in zip(traced, eager, (1e-8, 0, 0), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("name", ["gpt-x0-ve", *SMALL_HEADS])
def test_compiled_forward_and_backward_equal_eager(name):
    """Through dynamo and AOTAutograd (which see our custom autograd functions for relu² and
    small-head attention), forward and gradients equal eager's. The `aot_eager` backend runs
    the traced graphs without inductor's code generation (a C++ build per kernel here, half a
    minute), which is torch's own to test."""
    model, tokens = _model({**CASES, **SMALL_HEADS}[name])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)

    def loss_and_grads(fn) -> tuple[torch.Tensor, list[torch.Tensor]]:  # noqa: ANN001
        model.zero_grad(set_to_none=True)
        loss = fn(tokens).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(model)
    loss, grads = loss_and_grads(compiled)
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-6)
    for g, ref in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


def test_a_failing_compile_falls_back_to_eager_with_a_note():
    """A worker without a working C++ compiler: inductor cannot build its kernels."""
    import torch._inductor.config as inductor

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 3 + 1

    notes: list[str] = []
    compiled = Compiled(fn, CUDA, notes, "model")
    x = torch.linspace(0, 1, 7)
    # no cached kernels either, or nothing would need compiling
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False,
                         "autotune_local_cache": False}):
        out = compiled(x)
    assert torch.equal(out, fn(x))
    assert len(notes) == 1 and notes[0].startswith("torch.compile failed for the model (")
    assert notes[0].endswith("ran eager")
    assert torch.equal(compiled(x), fn(x)) and len(notes) == 1  # eager from then on


@pytest.mark.parametrize(
    ("mode", "on_cuda", "short_on_cpu", "long_on_cpu"),
    [(None, True, False, True), ("1", True, False, True), ("0", False, False, False),
     ("all", True, True, True)],
)
def test_hpt_compile_picks_the_runs_that_compile(monkeypatch, mode, on_cuda, short_on_cpu,
                                                 long_on_cpu):
    """Default: CUDA, and CPU runs long enough to repay a compile (a sweep's short CPU trials
    stay eager); `all` compiles every run, `0` none."""
    if mode is None:
        monkeypatch.delenv("HPT_COMPILE", raising=False)
    else:
        monkeypatch.setenv("HPT_COMPILE", mode)
    cpu, short, long = torch.device("cpu"), CPU_COMPILE_MIN_FLOPS / 2, CPU_COMPILE_MIN_FLOPS
    assert compile_wanted(CUDA, short) is on_cuda
    assert compile_wanted(cpu, short) is short_on_cpu
    assert compile_wanted(cpu, long) is long_on_cpu
    notes: list[str] = []
    fn = torch.sin
    assert (Compiled(fn, cpu, notes, "model", long).fn is not fn) is long_on_cpu
    # a CPU trial that compiles says so (it is not the default reference path there)
    assert notes == (["the model runs under torch.compile on the CPU (HPT_COMPILE=0 keeps it "
                      "eager)"] if long_on_cpu else [])


def test_a_trials_training_flops_decide_its_cpu_compile():
    """The trainer passes the whole run's training FLOPs: small trials stay far below the CPU
    threshold, a 3M-parameter model at 20 tokens per parameter is over it."""
    small = specs_for(CASES["gpt-completep"])[0]
    data = load_trial_data(small)
    plan = plan_trial(small, data)
    expected = plan.flops.training * small.batch_size * small.seq_len * plan.total_steps
    assert plan.training_flops == pytest.approx(expected)
    assert 0 < plan.training_flops < CPU_COMPILE_MIN_FLOPS / 1000
    large = small.model_copy(update={"width": 256, "depth": 4, "head_dim": 64,
                                     "budget": Budget(tokens_per_param=20)})
    assert plan_trial(large, data).training_flops > CPU_COMPILE_MIN_FLOPS


@pytest.mark.parametrize("mode", [None, "all"])
def test_a_packs_members_flops_decide_its_cpu_compile(monkeypatch, mode):
    """A pack weighs all its members' training FLOPs as a trial weighs its own: two members
    of a shape whose single trial would compile make a pack that compiles (its loss and
    AdamW step, each with its note); a pack of tiny members stays eager unless `all`."""
    if mode is None:
        monkeypatch.delenv("HPT_COMPILE", raising=False)
    else:
        monkeypatch.setenv("HPT_COMPILE", mode)
    small = specs_for(CASES["gpt-completep"])[:2]
    large = [s.model_copy(update={"width": 256, "depth": 4, "head_dim": 64,
                                  "budget": Budget(tokens_per_param=20)}) for s in small]
    # members that alone stay under the threshold (0.6 of it), together over it
    plan = Pack(large, None, None).plan
    per_step = plan.training_flops / plan.total_steps
    steps = int(0.6 * CPU_COMPILE_MIN_FLOPS / per_step)
    halves = [s.model_copy(update={"budget": Budget(steps=steps)}) for s in large]
    for specs, compiled in ((small, mode == "all"), (large, True), (halves, True)):
        pack = Pack(specs, None, None)
        assert (pack.loss_fn.fn is not pack.loss_fn.eager) is compiled
        assert (pack.update_fn.fn is not pack.update_fn.eager) is compiled
        assert any("packed model runs under torch.compile" in n for n in pack.notes) is compiled
    assert pack.plan.training_flops < CPU_COMPILE_MIN_FLOPS < 2 * pack.plan.training_flops


def _schedule_reference(schedule, step: int, total: int, warmup: bool) -> float:
    """The LR multiplier written from its definition: linear warmup to 1, then the decay
    over the rest of the run (WSD: flat, then linear over its last fraction)."""
    warm = round(schedule.warmup_fraction * total) if warmup else 0
    if step < warm:
        return (step + 1) / warm
    p = min((step - warm) / max(total - warm, 1), 1.0)
    lo, tail = schedule.min_lr_ratio, schedule.wsd_decay_fraction
    return {"constant": 1.0,
            "cosine": lo + (1 - lo) * (1 + math.cos(math.pi * p)) / 2,
            "linear": 1 - (1 - lo) * p,
            "wsd": 1.0 if p <= 1 - tail else 1 - (1 - lo) * (p - (1 - tail)) / tail,
            }[schedule.decay]


def test_a_packs_lr_table_is_each_schedules_factors_step_for_step():
    """Pack builds its (steps, K) LR table from Schedule.factors in one pass (a table of half
    a million steps, as the large members above have, took seconds step by step): each
    step's multiplier as defined, with warmup or without (nGPT), past the run's end too,
    and `factor` of any one step the same float."""
    from hptransfer.spec.trial import Schedule

    for schedule in [Schedule(decay=d, **kw) for d in ("cosine", "linear", "wsd", "constant")
                     for kw in ({}, dict(warmup_fraction=0.3, wsd_decay_fraction=0.5,
                                         min_lr_ratio=0.1))]:
        for total, warmup, steps in ((1, True, None), (7, True, None), (400, True, None),
                                     (400, False, None), (400, True, 410), (61, True, 3)):
            table = schedule.factors(total, warmup, stop=steps)
            want = [_schedule_reference(schedule, i, total, warmup)
                    for i in range(steps or total)]
            assert table == pytest.approx(want, rel=1e-12, abs=1e-15), (schedule, total)
            assert [schedule.factor(i, total, warmup) for i in range(len(table))] == table
    pack = Pack(specs_for(CASES["ngpt"]), None, None)  # nGPT: no warmup
    assert pack.factors.tolist() == torch.tensor(
        [[m.plan.factor(i) for m in pack.members] for i in range(pack.plan.total_steps)]).tolist()


def test_an_unknown_hpt_compile_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv("HPT_COMPILE", "yes")
    with pytest.raises(ValueError, match=r"HPT_COMPILE='yes': use one of 0, 1, all"):
        compile_wanted(torch.device("cpu"))


# ---- compile failures after the first forward: the backward, later graphs, OOM -----------

TINY_RUN = dict(width=32, depth=1, head_dim=16, batch_size=2, seq_len=16, base_width=32,
                base_depth=1, data={"val_tokens": 256, "max_corpus_bytes": 200_000},
                budget={"steps": 4}, eval_every=2, lr=2**-7, device="cpu")


class _CodegenFailed(RuntimeError):
    """What a backend raises where it cannot generate a graph's code (inductor's C++ or
    Triton compile errors are plain RuntimeErrors)."""


def _compile_with(monkeypatch, backend) -> None:  # noqa: ANN001
    """HPT_COMPILE=all (the CPU compiles as CUDA does by default) with `backend`."""
    real = torch.compile
    monkeypatch.setenv("HPT_COMPILE", "all")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=backend))


def _backward_fails():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fail(gm, _inputs):  # noqa: ANN001
        raise _CodegenFailed("the backward graph's code did not compile")

    return aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=fail)


def _eager_result(specs: list[TrialSpec], tmp_path, monkeypatch):  # noqa: ANN001
    from hptransfer.workers.packed import run_trials
    from hptransfer.workers.trainer import run_trial

    with monkeypatch.context() as m:
        m.setenv("HPT_COMPILE", "0")
        return ([run_trial(specs[0], cache_dir=str(tmp_path))] if len(specs) == 1
                else run_trials(specs, cache_dir=str(tmp_path)))


@pytest.mark.parametrize("k", [1, 2])
def test_a_backward_graph_that_fails_to_compile_runs_eager_with_a_note(k, monkeypatch,
                                                                        tmp_path):
    """AOTAutograd compiles the backward graph at the first .backward(), outside Compiled's
    call: its failure ended the trial (or every member of a pack) failed, not eager."""
    from hptransfer.workers.packed import run_trials
    from hptransfer.workers.trainer import run_trial

    specs = [TrialSpec(**{**TINY_RUN, "seed": i}) for i in range(k)]
    eager = _eager_result(specs, tmp_path, monkeypatch)
    _compile_with(monkeypatch, _backward_fails())
    got = ([run_trial(specs[0], cache_dir=str(tmp_path))] if k == 1
           else run_trials(specs, cache_dir=str(tmp_path)))
    for r, ref in zip(got, eager, strict=True):
        assert r.status == "completed", r.error
        assert r.final_val_loss == pytest.approx(ref.final_val_loss, rel=1e-5)
        assert any(n.startswith("torch.compile failed for the ") and "_CodegenFailed" in n
                   for n in r.notes), r.notes


def test_a_later_graph_that_fails_to_compile_runs_eager(monkeypatch, tmp_path):
    """The training graph compiles, the evaluation's (no_grad, eval mode: a new graph) does
    not; and a pack's smaller graph after it drops a pruned member does not: eager, not
    failed."""
    from hptransfer.workers import pack
    from hptransfer.workers.packed import run_trials
    from hptransfer.workers.trainer import run_trial

    graphs = []

    def first_only(gm, _inputs):  # noqa: ANN001
        graphs.append(gm)
        if len(graphs) > 1:
            raise _CodegenFailed("a later graph's code did not compile")
        return gm.forward

    _compile_with(monkeypatch, first_only)
    r = run_trial(TrialSpec(**TINY_RUN), cache_dir=str(tmp_path))
    assert r.status == "completed" and len(r.curve) == 4, r.error
    assert sum(n.startswith("torch.compile failed for the model") for n in r.notes) == 1

    compacted = {"yes": False}
    real_compact = pack.Pack._compact

    def compact(self):  # noqa: ANN001, ANN202
        before = len(self.rows)
        real_compact(self)
        compacted["yes"] |= len(self.rows) < before

    def until_compacted(gm, _inputs):  # noqa: ANN001
        if compacted["yes"]:
            raise _CodegenFailed("the smaller pack's graph did not compile")
        return gm.forward

    dynamo.reset()
    monkeypatch.setattr(pack.Pack, "_compact", compact)
    _compile_with(monkeypatch, until_compacted)
    specs = [TrialSpec(**{**TINY_RUN, "seed": i, "eval_every": 4}) for i in range(3)]
    rs = run_trials(specs, reporter=lambda i, m: i == 1 and m["step"] == 2,
                    cache_dir=str(tmp_path))
    assert [r.status for r in rs] == ["completed", "pruned", "completed"], rs[0].error
    assert compacted["yes"] and any("torch.compile failed" in n for n in rs[0].notes)


def test_running_out_of_memory_is_not_taken_for_a_compile_failure():
    """A first compiled call that runs out of memory raised nothing: it went eager for good
    under a 'torch.compile failed' note, and a pack that should halve did not."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    notes: list[str] = []
    compiled = Compiled(fn, CUDA, notes, "packed model")
    with pytest.raises(torch.OutOfMemoryError):
        compiled(torch.ones(3))
    assert notes == [] and compiled.fn is not compiled.eager


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA A100-SXM4-40GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12),
    ("NVIDIA A10G", 125e12), ("Tesla T4", None),
])
def test_mfu_peak_by_device_name_the_longest_name_first(monkeypatch, name, peak):
    """Names matched as substrings in table order gave an L40 the L4's peak (its MFU 1.5x
    too high) and an H100 PCIe the SXM part's (24 % too low). Dense bf16, datasheets."""
    from hptransfer.workers.outcome import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(CUDA) == peak
