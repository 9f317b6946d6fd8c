"""The bf16 path (`precision: bf16`), run on the CPU.

The trainer autocasts to bf16 on CUDA only (`workers/plan.autocasts`; on the CPU fp32 is
faster and the reference). With no GPU in the suite, these tests let the plan autocast on
the CPU too (torch's CPU bf16 autocast), so the same model code, solo and packed, runs with
bf16 matmuls and attention: every arch and variant trains, lands near its fp32 result, and
a pack's members still give run_trial's result for their spec alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_packed import CASES, specs_for
from torch.utils._python_dispatch import TorchDispatchMode

import hptransfer.workers.plan as plan_module
from hptransfer.spec.trial import TrialSpec
from hptransfer.workers.packed import run_trials
from hptransfer.workers.trainer import run_trial

# the code paths bf16 can reach: rotary (real arithmetic in bf16), x0 mixing and value
# embeddings, ALiBi + biases + GELU, nGPT's normalisations
BF16_CASES = ["gpt-completep", "gpt-x0-ve", "gpt-alibi-bias", "ngpt"]
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


@pytest.fixture
def cpu_bf16(monkeypatch):
    monkeypatch.setattr(plan_module, "autocasts", lambda device, precision: precision == "bf16")


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes the matmuls inside the block ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATMULS:
            self.dtypes.add(out.dtype)
        return out


def _bf16(specs: list[TrialSpec], **changes) -> list[TrialSpec]:
    return [TrialSpec.model_validate({**s.model_dump(), "precision": "bf16", **changes})
            for s in specs]


@pytest.mark.parametrize("name", ["gpt-x0-ve", "ngpt"])
def test_bf16_runs_its_matmuls_in_bf16_solo_and_packed(name, cpu_bf16, tmp_path):
    specs = _bf16(specs_for(CASES[name])[:2], budget={"steps": 2}, eval_every=2)
    for train in (lambda: run_trial(specs[0], cache_dir=str(tmp_path)),
                  lambda: run_trials(specs, cache_dir=str(tmp_path))):
        with _MatmulDtypes() as seen:
            train()
        assert torch.bfloat16 in seen.dtypes, seen.dtypes
    with _MatmulDtypes() as seen:  # fp32 stays fp32 under the same swap
        run_trial(specs[0].model_copy(update={"precision": "fp32"}), cache_dir=str(tmp_path))
    assert seen.dtypes == {torch.float32}


@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_trains_near_fp32_and_packs_match_solo(name, cpu_bf16, tmp_path):
    """60 steps: a bf16 run ends within 2 % of the fp32 run of its spec, and each packed
    member within 0.5 % of its solo bf16 run. Measured over these four cases and gpt-sp and
    gpt-mup, three members each: bf16 against fp32 at most 0.36 %, packed against solo bf16
    at most 0.16 % (in fp32 packs stay within 1e-3: bf16 matmuls round a batched product
    and a single one further apart)."""
    specs = _bf16(specs_for(CASES[name]))[:2]
    packed = run_trials(specs, cache_dir=str(tmp_path))
    for spec, member in zip(specs, packed, strict=True):
        solo = run_trial(spec, cache_dir=str(tmp_path))
        assert solo.status == member.status == "completed", (solo.error, member.error)
        assert member.final_val_loss == pytest.approx(solo.final_val_loss, rel=5e-3)
        assert solo.final_val_loss < math.log(256) - 0.5  # it learned something
        fp32 = run_trial(spec.model_copy(update={"precision": "fp32"}), cache_dir=str(tmp_path))
        assert solo.final_val_loss == pytest.approx(fp32.final_val_loss, rel=2e-2)
        assert solo.final_val_loss != fp32.final_val_loss  # bf16 did change the arithmetic
