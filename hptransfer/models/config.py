"""Model configuration: the model fields of a trial spec, validated once here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

# The model's choices, defined once: the sweep spec, the CLI and build_model use these.
Arch = Literal["gpt", "ngpt"]
Activation = Literal["relu2", "gelu"]
Position = Literal["rope", "alibi"]
ARCHES: tuple[str, ...] = get_args(Arch)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
POSITIONS: tuple[str, ...] = get_args(Position)
# the parameterization presets by name (their rules: parameterization.py)
PRESETS = ("sp", "mup", "depth_mup", "completep", "depth_alpha", "ngpt")

# Upper bounds of the model's sizes: far past anything a sweep of this service trains, and
# small enough that parameter and FLOP arithmetic never overflows a float.
MAX_WIDTH = 65536
MAX_DEPTH = 1024
MAX_HEAD_DIM = 4096
MAX_SEQ_LEN = 1 << 20
MAX_MLP_RATIO = 64
MAX_VOCAB_SIZE = 1 << 16  # tokens are stored as uint16
MAX_EXTRA_EMBEDDINGS = 16
BOUNDS = {
    "width": MAX_WIDTH, "depth": MAX_DEPTH, "head_dim": MAX_HEAD_DIM,
    "vocab_size": MAX_VOCAB_SIZE, "max_seq_len": MAX_SEQ_LEN, "mlp_ratio": MAX_MLP_RATIO,
}


class ModelConfigError(ValueError):
    """A model field has a value the model cannot be built with."""


@dataclass(frozen=True)
class ForwardMultipliers:
    """Plain numbers the forward pass multiplies by; computed by the parameterization."""

    residual: float = 1.0  # branch multiplier: x + residual * F(LN x)
    logits: float = 1.0  # unembedding forward multiplier (1/m_N under muP)
    attn_scale: float | None = None  # softmax scale; None means 1/sqrt(d_head)


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt"
    width: int = 256
    depth: int = 2
    head_dim: int = 64
    vocab_size: int = 256
    max_seq_len: int = 1024
    mlp_ratio: int = 4
    activation: str = "relu2"
    position: str = "rope"
    bias: bool = False
    # modded-nanogpt x0 mixing: k extra RMS-normed input embeddings mixed before every block
    x0_mixing: bool = False
    extra_embeddings: int = 0
    # value embeddings: k tables, table j feeds the values of block j and block L-1-j
    value_embeddings: int = 0
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ARCHES:
            problems.append(f"arch must be one of {ARCHES}, got {self.arch!r}")
        for name, bound in BOUNDS.items():
            if not 0 < int(getattr(self, name)) <= bound:
                problems.append(f"{name} must be in [1, {bound}], got {getattr(self, name)}")
        if self.head_dim > 0 and self.width % self.head_dim:
            problems.append(
                f"width {self.width} is not divisible by head_dim {self.head_dim}; "
                f"use a multiple of {self.head_dim}"
            )
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.position not in POSITIONS:
            problems.append(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.extra_embeddings < 0 or self.value_embeddings < 0:
            problems.append("extra_embeddings and value_embeddings must be >= 0")
        if self.extra_embeddings > MAX_EXTRA_EMBEDDINGS:
            problems.append(f"extra_embeddings must be <= {MAX_EXTRA_EMBEDDINGS}, "
                            f"got {self.extra_embeddings}")
        if self.extra_embeddings > 0 and not self.x0_mixing:
            problems.append("extra_embeddings > 0 needs x0_mixing: true (they are mixed by it)")
        if self.value_embeddings > (self.depth + 1) // 2:
            # table j feeds blocks j and depth-1-j (models/gpt.py): beyond half the depth a
            # table would feed no block, a parameter that never gets a gradient
            problems.append(
                f"value_embeddings ({self.value_embeddings}) cannot exceed half the depth, "
                f"rounded up ({(self.depth + 1) // 2} at depth {self.depth}): table j feeds "
                f"blocks j and depth-1-j"
            )
        if self.arch == "ngpt":
            if self.x0_mixing or self.extra_embeddings or self.value_embeddings:
                problems.append("x0 mixing and value embeddings are gpt options, not ngpt ones")
            if self.position != "rope":
                problems.append("ngpt supports position 'rope' only")
            if self.bias:
                problems.append("ngpt has no biases (bias must be false)")
        if problems:
            raise ModelConfigError("; ".join(problems))

    def build_problem(self) -> str | None:
        """Why a model of this config cannot be built, where counting its parameters still
        can (parameter counts depend on neither the head size nor the position scheme)."""
        if self.position == "rope" and self.head_dim % 2:
            # RoPE rotates pairs of a head's dimensions: an odd one has a dimension left over
            return (f"head_dim must be even with position 'rope' (it rotates pairs of "
                    f"dimensions), got {self.head_dim}; use an even head_dim"
                    + (" or position 'alibi'" if self.arch == "gpt" else ""))
        return None

    @property
    def n_heads(self) -> int:
        return self.width // self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)


# Which attention path a shape takes (layers.py; here, torch-free, for the memory estimate the
# coordinator prices trials with, workers/memory.py). Tiny heads on the CPU: at head_dim 8 and
# 64 tokens, torch's fused CPU kernel is slower than the explicit T x T products
# (layers._small_head_attention), which made a whole training step
# (run_trial) 1.12-1.21x faster at the demo's shapes. From head_dim 16 or 128 tokens on, the
# fused kernel was as fast or faster, and it keeps no T x T matrix for the backward
# (benchmarks/attention.py measures both, the op alone and whole steps). On two threads the
# fused kernel hardly speeds up and the explicit path does: 1.2-2.6x for the op alone up to
# head_dim 64 and T 128 (0.53x at T 256). But a whole step at head_dim 32 (64x2, 128x2) gained
# only 1.01-1.03x, too little for a rule that would change the path, and the rounding, with
# the thread count, so the rule stays as it is.
SMALL_HEAD_DIM = 8
SMALL_HEAD_MAX_SEQ = 64


def small_heads(head_dim: int, seq_len: int) -> bool:
    """Whether heads of this size take the explicit small-head path on the CPU."""
    return head_dim <= SMALL_HEAD_DIM and seq_len <= SMALL_HEAD_MAX_SEQ
