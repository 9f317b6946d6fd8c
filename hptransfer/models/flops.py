"""Analytic parameter counts and training FLOPs per token for the GPT and nGPT models.

Everything here is computed from a `ModelConfig` alone (no model is built), so the coordinator can
price a trial and the CLI (`hpt flops`) can print a report before anything is allocated.

Parameters
    ``embedding`` is every vocabulary-sized table: the input embedding, the x0-mixing extra
    embeddings, the value embeddings and the unembedding (untied, so counted separately).
    ``non_embedding`` is everything else, including LayerNorm gains/biases, linear biases,
    the x0 / value-embedding mixing scalars and nGPT's scale vectors (nGPT's logit scale
    ``s_z`` has vocab entries but is a scale vector, not a table, so it is non-embedding).
    This is the basis of CompleteP's tokens-per-parameter. ``non_embedding_matrices`` keeps
    only the weight matrices inside the blocks (q, k, v, proj, MLP); that is the N of the
    PaLM / nanoGPT estimate.

FLOP convention (stored verbatim in every `FlopBreakdown.convention`)
    - a multiply-add is 2 FLOPs; an (m x k) @ (k x n) matmul costs 2 m k n;
    - training = forward + backward = 3 x forward (backward = grad wrt input + grad wrt weight);
    - counted: the linear layers (attention q/k/v/proj, MLP, unembedding) and the two
      attention matmuls, scores Q K^T and the weighted sum A V;
    - not counted: embedding lookups (0 FLOPs), biases and every elementwise op (norms,
      activations, softmax, rope, residual adds, x0 / value-embedding mixing, nGPT scales);
    - causal=True (default) counts only the causal half of attention: the T(T+1)/2
      (query, key) pairs of a sequence averaged over its T tokens, i.e. (T+1)/2 keys per
      token. causal=False counts all T keys, which is what a dense kernel actually computes.

What torch's `torch.utils.flop_counter.FlopCounterMode` counts (torch 2.13, measured in
tests/test_flops.py) - it never applies the causal halving:
    - CPU, rope path (``is_causal=True``): SDPA dispatches to
      ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no FLOP formula, so the
      counter silently counts 0 for attention (forward and backward);
    - CPU, alibi path (float ``attn_mask``) or any path under ``sdpa_kernel(MATH)``: SDPA
      decomposes into two ``bmm``s over the full T x T, so the counter agrees exactly with
      ``causal=False`` here;
    - CPU, tiny heads (``layers.uses_small_head_path``): our own two ``bmm``s over the full
      T x T (four in the backward), counted like the math path;
    - CUDA flash / efficient / cuDNN kernels: full T x T forward ("We aren't accounting for
      causal attention here" in torch's source) and a backward of 2.5x forward (it counts the
      recomputed scores), i.e. 3.5x forward for attention rather than our 3x.
So counter totals equal ``training`` with ``causal=False`` on the math path; our default
``causal=True`` is lower by exactly 6 x depth x width x (T - 1) training FLOPs per token: the
masked upper triangle of QK^T and AV, i.e. (T-1)/2 of the T keys, times 2 matmuls x 3.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .config import ModelConfig

CONVENTION = (
    "2 FLOPs per multiply-add; training = fwd + bwd = 3x fwd; counted: linear layers "
    "(q/k/v/proj, MLP, unembedding) + attention QK^T and AV; embedding lookups = 0; biases "
    "and elementwise ops (norms, activations, softmax, rope, mixing, scales) ignored; "
    "attention {causal}"
)
_CAUSAL_TEXT = "causal half: (T+1)/2 keys per token"
_DENSE_TEXT = "dense: T keys per token"


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model; ``embedding`` means all vocab-sized tables."""

    embedding: int  # input + extra + value embeddings + unembedding (all V x N tables)
    non_embedding: int  # everything else: matrices, norms, biases, mixing scalars, scales
    non_embedding_matrices: int  # block weight matrices only: the N of the PaLM estimate
    total: int


@dataclass(frozen=True)
class FlopBreakdown:
    """FLOPs per token: itemised forward terms, their sum, and training (= 3x forward)."""

    seq_len: int
    causal: bool
    qkv_proj: float  # forward: q, k, v and output projection matmuls, all layers
    mlp: float  # forward: MLP up (and nGPT's second up) + down matmuls, all layers
    attn_scores: float  # forward: Q K^T, all layers
    attn_values: float  # forward: softmax(.) V, all layers
    unembedding: float  # forward: the logits matmul
    forward: float
    training: float
    palm_estimate: float  # 6 * N_matrices + 12 L N T (training, dense attention)
    convention: str

    @property
    def attention(self) -> float:
        """Forward FLOPs per token of the two attention matmuls."""
        return self.attn_scores + self.attn_values


def _value_embedding_blocks(cfg: ModelConfig) -> int:
    """How many blocks mix a value embedding: table j feeds blocks j and L-1-j (may coincide)."""
    blocks = set()
    for j in range(cfg.value_embeddings):
        blocks.update((j, cfg.depth - 1 - j))
    return len(blocks)


def _block_matrices(cfg: ModelConfig) -> tuple[int, int]:
    """(attention, MLP) weight-matrix parameters of one block: also its MACs per token."""
    n, hidden = cfg.width, cfg.mlp_ratio * cfg.width
    ups = 2 if cfg.arch == "ngpt" else 1  # nGPT's gated MLP has up_u and up_v
    return 4 * n * n, (ups + 1) * n * hidden


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Count parameters analytically; equals the model's named_parameters() numel sum."""
    n, v, depth = cfg.width, cfg.vocab_size, cfg.depth
    hidden = cfg.mlp_ratio * n
    attn_w, mlp_w = _block_matrices(cfg)
    matrices = depth * (attn_w + mlp_w)
    if cfg.arch == "ngpt":
        tables = 2 * v * n  # embed + unembed
        # per block: s_qk, alpha_attn, alpha_mlp (width) + s_u, s_v (hidden); then s_z (vocab)
        other = depth * (3 * n + 2 * hidden) + v
    else:
        tables = (2 + cfg.extra_embeddings + cfg.value_embeddings) * v * n
        norms = depth * 2 * (2 * n) + 2 * n  # two LayerNorms per block + final, gain + bias
        biases = depth * (4 * n + hidden + n) if cfg.bias else 0
        x0 = depth * (2 + cfg.extra_embeddings) if cfg.x0_mixing else 0
        ve = 2 * _value_embedding_blocks(cfg)  # (lambda_v, lambda_ve) per mixing block
        other = norms + biases + x0 + ve
    non_embedding = matrices + other
    return ParamCounts(
        embedding=tables,
        non_embedding=non_embedding,
        non_embedding_matrices=matrices,
        total=tables + non_embedding,
    )


def _check_seq_len(cfg: ModelConfig, seq_len: int) -> None:
    if int(seq_len) != seq_len or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    # the rotary tables stop at max_seq_len, so such a model could not run this length
    if cfg.position == "rope" and seq_len > cfg.max_seq_len:
        raise ValueError(
            f"seq_len {seq_len} exceeds max_seq_len {cfg.max_seq_len} of this config "
            "(rope tables); raise max_seq_len"
        )


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> FlopBreakdown:
    """Analytic training FLOPs per token with an itemised forward breakdown (see module doc)."""
    _check_seq_len(cfg, seq_len)
    n, depth, t = cfg.width, cfg.depth, int(seq_len)
    attn_w, mlp_w = _block_matrices(cfg)
    # averaged over the T queries of a sequence, a causal query sees (T+1)/2 keys
    keys = (t + 1) / 2 if causal else float(t)
    qkv_proj = 2.0 * depth * attn_w
    mlp = 2.0 * depth * mlp_w
    # per layer and key: H heads x d_head MACs = width MACs, for QK^T and again for AV
    attn_scores = 2.0 * depth * n * keys
    attn_values = 2.0 * depth * n * keys
    unembedding = 2.0 * n * cfg.vocab_size
    forward = qkv_proj + mlp + attn_scores + attn_values + unembedding
    palm = 6.0 * param_counts(cfg).non_embedding_matrices + 12.0 * depth * n * t
    return FlopBreakdown(
        seq_len=t,
        causal=causal,
        qkv_proj=qkv_proj,
        mlp=mlp,
        attn_scores=attn_scores,
        attn_values=attn_values,
        unembedding=unembedding,
        forward=forward,
        training=3.0 * forward,
        palm_estimate=palm,
        convention=CONVENTION.format(causal=_CAUSAL_TEXT if causal else _DENSE_TEXT),
    )


def training_flops(cfg: ModelConfig, seq_len: int, tokens: float, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) for ``tokens`` tokens at sequence length seq_len."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return float(tokens) * flops_per_token(cfg, seq_len, causal).training


def flops_report(cfg: ModelConfig, seq_len: int, causal: bool = True) -> dict:
    """JSON-safe report: config, parameter split, FLOPs per token (both attention variants)."""
    params = param_counts(cfg)
    main = flops_per_token(cfg, seq_len, causal)
    other = flops_per_token(cfg, seq_len, not causal)
    flops = {k: v for k, v in asdict(main).items() if k not in ("convention", "seq_len")}
    flops["attention"] = main.attention
    return {
        "config": cfg.to_dict(),
        "seq_len": main.seq_len,
        "params": asdict(params),
        "flops_per_token": flops,
        # what a dense kernel (and torch's FlopCounterMode) would count, or the causal half
        "training_flops_per_token_other_attention": {
            "causal": other.causal,
            "training": other.training,
        },
        "convention": main.convention,
    }


def _si(x: float) -> str:
    """Engineering notation (1.234 M) for counts of 1000 and above."""
    for factor, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= factor:
            return f"{x / factor:.3f} {suffix}"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"


def format_flops_report(report: dict) -> str:
    """Render a `flops_report` dict as an aligned plain-text table for the CLI."""
    cfg, p, f = report["config"], report["params"], report["flops_per_token"]
    shape = (
        f"{cfg['arch']}  width={cfg['width']} depth={cfg['depth']} head_dim={cfg['head_dim']} "
        f"vocab={cfg['vocab_size']} seq_len={report['seq_len']} mlp_ratio={cfg['mlp_ratio']}"
    )
    total_p = p["total"] or 1
    fwd = f["forward"] or 1.0
    rows: list[tuple[str, float, str]] = [
        ("embedding (all vocab tables)", p["embedding"], f"{p['embedding'] / total_p:6.1%}"),
        ("non-embedding", p["non_embedding"], f"{p['non_embedding'] / total_p:6.1%}"),
        ("  of which block matrices", p["non_embedding_matrices"], ""),
        ("total", p["total"], ""),
    ]
    terms = [
        ("qkv + proj", f["qkv_proj"]),
        ("mlp", f["mlp"]),
        ("attention QK^T", f["attn_scores"]),
        ("attention AV", f["attn_values"]),
        ("unembedding (logits)", f["unembedding"]),
    ]
    lines = [shape, "", "parameters"]
    lines += [f"  {name:<30}{_si(val):>14}  {share}" for name, val, share in rows]
    lines += ["", "FLOPs per token (forward)"]
    lines += [f"  {name:<30}{_si(val):>14}  {val / fwd:6.1%}" for name, val in terms]
    other = report["training_flops_per_token_other_attention"]
    lines += [
        f"  {'forward':<30}{_si(f['forward']):>14}",
        f"  {'training (3x forward)':<30}{_si(f['training']):>14}",
        f"  {'training, ' + ('causal' if other['causal'] else 'dense') + ' attention':<30}"
        f"{_si(other['training']):>14}",
        f"  {'PaLM 6N + 12LNT':<30}{_si(f['palm_estimate']):>14}",
        "",
        f"convention: {report['convention']}",
    ]
    return "\n".join(line.rstrip() for line in lines)
