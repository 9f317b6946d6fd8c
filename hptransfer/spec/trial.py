"""TrialSpec and TrialResult: what one trial is, and what it produced.

A TrialSpec is a plain, validated, JSON-serialisable value; its content hash identifies the
experiment (same hash + same data hash = same result), so completed trials can be reused.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from hptransfer.contracts.status import TrialStatus
from hptransfer.models import ModelConfig, Parameterization
from hptransfer.models.config import (
    MAX_DEPTH,
    MAX_EXTRA_EMBEDDINGS,
    MAX_HEAD_DIM,
    MAX_MLP_RATIO,
    MAX_SEQ_LEN,
    MAX_WIDTH,
    Activation,
    Arch,
    Position,
)
from hptransfer.models.parameterization import check_pairing
from hptransfer.spec.data import DataSpec, val_window_problem

# Frozen, no unknown keys, no coercion (a bool is not a number, 64.0 is not an int, "1" is
# not 1) and no infinities or NaNs: what every spec model and trial model validates with.
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

# Upper bounds of the training settings (the model's sizes are bounded in models/config.py):
# far past what this service trains, and small enough that a trial's cost stays a float.
MAX_BATCH_SIZE = 1 << 20
MAX_STEPS = 10**9
MAX_TOKENS = 10**15
MAX_TOKENS_PER_PARAM = 1e6
MAX_LR = 1024.0
MAX_SIGMA = 100.0
MAX_WEIGHT_DECAY = 100.0
MAX_EPS = 1.0
MAX_GRAD_CLIP = 1e6
MAX_DIVERGENCE_FACTOR = 1e12
MAX_SEED = 2**31 - 1  # the store's INTEGER column (signed 32 bits on PostgreSQL)
MAX_THREADS = 1024
MAX_PARAMETERIZATION_CHARS = 100

# Enters every trial's content hash: raised when a change to the code makes the same spec
# train to a different result, so results trained before it are not reused after it.
# 2: x0 mixing normalises x00 (models/gpt.py); at most 200 evaluations (workers/plan.py).
RESULT_REVISION = 2
# The defaults of the model's fields and of the base hyper-parameters are the model's own.
_MODEL = ModelConfig()
_BASE = Parameterization()

# Value types a sweep's grid and stages share with TrialSpec: each bound is written once.
Width = Annotated[int, Field(gt=0, le=MAX_WIDTH)]
Depth = Annotated[int, Field(gt=0, le=MAX_DEPTH)]
Lr = Annotated[float, Field(gt=0, le=MAX_LR)]
Sigma = Annotated[float, Field(gt=0, le=MAX_SIGMA)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
TokensPerParam = Annotated[float, Field(gt=0, le=MAX_TOKENS_PER_PARAM)]


class ArchOptions(BaseModel):
    """The model options a sweep arm may set: ModelConfig's fields, with its defaults."""

    model_config = STRICT

    activation: Activation = _MODEL.activation
    position: Position = _MODEL.position
    bias: bool = _MODEL.bias
    mlp_ratio: int = Field(_MODEL.mlp_ratio, gt=0, le=MAX_MLP_RATIO)
    x0_mixing: bool = _MODEL.x0_mixing
    extra_embeddings: int = Field(_MODEL.extra_embeddings, ge=0, le=MAX_EXTRA_EMBEDDINGS)
    value_embeddings: int = Field(_MODEL.value_embeddings, ge=0, le=MAX_DEPTH)


class Schedule(BaseModel):
    model_config = STRICT

    warmup_fraction: float = Field(0.1, ge=0, lt=1)
    decay: Literal["cosine", "linear", "wsd", "constant"] = "linear"
    wsd_decay_fraction: float = Field(0.2, gt=0, le=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)

    def warmup_steps(self, total: int) -> int:
        """Optimizer steps of linear warmup in a run of `total` steps."""
        return int(round(self.warmup_fraction * total))

    def factor(self, step: int, total: int, warmup: bool = True) -> float:
        """LR multiplier for optimizer step `step` (0-based) of `total`."""
        return self.factors(total, warmup, start=step, stop=step + 1)[0]

    def factors(self, total: int, warmup: bool = True, start: int = 0,
                stop: int | None = None) -> list[float]:
        """`factor(step, total, warmup)` of steps `start` .. `stop` - 1 (default: to the
        run's `total`) in one pass: a pack's table of every step and member, made with a
        call per step, took seconds."""
        stop = total if stop is None else stop
        warm = self.warmup_steps(total) if warmup else 0
        out = [(step + 1) / warm for step in range(start, min(warm, stop))]
        rest = range(max(start, warm), stop)
        if self.decay == "constant":
            return out + [1.0] * len(rest)
        span = max(total - warm, 1)
        progress = [min((step - warm) / span, 1.0) for step in rest]
        lo = self.min_lr_ratio
        if self.decay == "cosine":
            return out + [lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p)) for p in progress]
        if self.decay == "linear":
            return out + [1.0 - (1 - lo) * p for p in progress]
        # wsd: stable, then linear decay over the last wsd_decay_fraction of the run
        decay_start, fraction = 1.0 - self.wsd_decay_fraction, self.wsd_decay_fraction
        return out + [1.0 if p <= decay_start else 1.0 - (1 - lo) * (p - decay_start) / fraction
                      for p in progress]


class Budget(BaseModel):
    """Exactly one of tokens, steps, tokens_per_param (non-embedding params, as the paper)."""

    model_config = STRICT

    tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    steps: int | None = Field(None, gt=0, le=MAX_STEPS)
    tokens_per_param: TokensPerParam | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Budget:
        given = [k for k in ("tokens", "steps", "tokens_per_param") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                "budget needs exactly one of tokens, steps, tokens_per_param "
                f"(got {given or 'none'})"
            )
        return self

    def tokens_for(self, non_embedding_params: int) -> float | None:
        """The tokens this budget asks for at this size; None for a budget in steps."""
        if self.steps:
            return None
        return self.tokens or self.tokens_per_param * non_embedding_params

    def steps_for(self, tokens_per_step: int, non_embedding_params: int) -> int:
        tokens = self.tokens_for(non_embedding_params)
        return self.steps if tokens is None else max(1, math.ceil(tokens / tokens_per_step))


def sequences_per_pass(batch_size: int, micro_batch_size: int | None) -> int:
    """Sequences one forward/backward pass sees: the micro-batch where it is smaller than
    the batch (the batch's gradient then accumulates over passes)."""
    return min(batch_size, micro_batch_size or batch_size)


class TrialSpec(BaseModel):
    model_config = STRICT

    arch: Arch = _MODEL.arch
    arch_options: ArchOptions = ArchOptions()
    parameterization: str = Field(_BASE.name, max_length=MAX_PARAMETERIZATION_CHARS)
    alpha: float | None = _BASE.alpha
    width: Width = _MODEL.width
    depth: Depth = _MODEL.depth
    head_dim: int = Field(_MODEL.head_dim, gt=0, le=MAX_HEAD_DIM)
    base_width: Width = _BASE.base_width
    base_depth: Depth = _BASE.base_depth
    lr: Lr = _BASE.lr  # eta_base
    sigma_base: Sigma = _BASE.sigma
    weight_decay: float = Field(_BASE.weight_decay, ge=0, le=MAX_WEIGHT_DECAY)  # lambda_base
    eps: float = Field(_BASE.eps, gt=0, le=MAX_EPS)  # epsilon_base
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    batch_size: int = Field(16, gt=0, le=MAX_BATCH_SIZE)
    # at most this many sequences per forward/backward pass: a larger batch accumulates its
    # gradient over micro-batches (the same update, up to rounding; bounded activations)
    micro_batch_size: int | None = Field(None, gt=0, le=MAX_BATCH_SIZE)
    seq_len: int = Field(128, gt=1, le=MAX_SEQ_LEN)
    budget: Budget = Budget(steps=100)
    schedule: Schedule = Schedule()
    grad_clip: float | None = Field(1.0, gt=0, le=MAX_GRAD_CLIP)
    seed: Seed = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"
    data: DataSpec = DataSpec()
    eval_every: int | None = Field(None, gt=0, le=MAX_STEPS)  # default: ~10 evaluations
    # train loss above this x initial = diverged
    divergence_factor: float = Field(2.0, gt=1, le=MAX_DIVERGENCE_FACTOR)
    num_threads: int | None = Field(None, gt=0, le=MAX_THREADS)

    @model_validator(mode="after")
    def _buildable(self) -> TrialSpec:
        # Build the config objects once so every model/parameterization error surfaces here.
        cfg = self.model_config_obj()
        check_pairing(cfg, self.parameterization_obj())
        problem = cfg.build_problem() or val_window_problem(self.data.val_tokens, self.seq_len)
        if problem:  # else the trial would fail in its first forward or evaluation
            raise ValueError(problem)
        return self

    def model_config_obj(self, vocab_size: int = 256) -> ModelConfig:
        return ModelConfig(
            arch=self.arch, width=self.width, depth=self.depth, head_dim=self.head_dim,
            vocab_size=vocab_size, max_seq_len=self.seq_len, **self.arch_options.model_dump(),
        )

    def parameterization_obj(self) -> Parameterization:
        return Parameterization(
            name=self.parameterization, alpha=self.alpha, base_width=self.base_width,
            base_depth=self.base_depth, lr=self.lr, sigma=self.sigma_base,
            weight_decay=self.weight_decay, eps=self.eps,
        )

    def content_hash(self) -> str:
        """Hash of everything that changes the result (device, threads and micro-batching
        excluded: they change only the rounding), and of RESULT_REVISION."""
        d = self.model_dump(mode="json", exclude={"device", "num_threads", "micro_batch_size"})
        blob = json.dumps({"revision": RESULT_REVISION, "spec": d}, sort_keys=True,
                          separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


def trial_field(name: str) -> FieldInfo:
    """TrialSpec's field `name` (its default and bounds), for a sweep spec section that sets
    the same trial setting: declared once, here."""
    return copy.copy(TrialSpec.model_fields[name])


class TrialResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: TrialStatus  # one a worker can produce: TrialStatus.is_result()
    final_val_loss: float | None = None
    final_train_loss: float | None = None
    curve: list[dict[str, Any]] = []  # {step, tokens, train_loss, lr, val_loss?}
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0  # analytic training FLOPs actually spent
    flops_per_token: float = 0.0
    flops_convention: str = ""  # how `flops` was counted (hptransfer.models.flops)
    params_embedding: int = 0
    params_non_embedding: int = 0
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float | None = None
    device: str = "cpu"
    param_table: dict[str, Any] = {}
    data_hash: str | None = None
    spec_hash: str | None = None
    error: str | None = None
    notes: list[str] = []
    # resumed from a checkpoint: the steps it had done, and the tokens an earlier attempt
    # had trained past it (trained again by this one)
    resumed_from_step: int | None = None
    retrained_tokens: int = 0
    workers: int = 1  # data-parallel workers it trained on

    @field_validator("status")
    @classmethod
    def _outcome(cls, value: TrialStatus) -> TrialStatus:
        if not value.is_result():
            raise ValueError(f"a trial result cannot be {value.value!r}")
        return value
