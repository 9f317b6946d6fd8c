"""`hpt`: the command line. Thin: parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from hptransfer.models import ModelConfig, Parameterization
from hptransfer.models.parameterization import PRESETS

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


def _add_model_args(p: argparse.ArgumentParser, with_shape: bool = True) -> None:
    p.add_argument("--arch", default="gpt", choices=["gpt", "ngpt"])
    if with_shape:
        p.add_argument("--width", type=int, default=256)
        p.add_argument("--depth", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--activation", default="relu2", choices=["relu2", "gelu"])
    p.add_argument("--position", default="rope", choices=["rope", "alibi"])
    p.add_argument("--bias", action="store_true", help="linear biases in the blocks")
    p.add_argument("--x0-mixing", action="store_true")
    p.add_argument("--extra-embeddings", type=int, default=0)
    p.add_argument("--value-embeddings", type=int, default=0)


def _add_param_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--param", default=None, choices=PRESETS,
                   help="parameterization (default: completep for gpt, ngpt for ngpt)")
    p.add_argument("--alpha", type=float, default=None, help="with --param depth_alpha")
    p.add_argument("--base-width", type=int, default=256)
    p.add_argument("--base-depth", type=int, default=2)
    p.add_argument("--lr", type=float, default=2.0**-8, help="eta_base")
    p.add_argument("--sigma", type=float, default=0.02, help="sigma_base")
    p.add_argument("--weight-decay", type=float, default=0.0, help="lambda_base")
    p.add_argument("--eps", type=float, default=1e-12, help="AdamW epsilon_base")


def _model_config(a: argparse.Namespace, seq_len: int = 1024) -> ModelConfig:
    return ModelConfig(
        arch=a.arch, width=a.width, depth=a.depth, head_dim=a.head_dim, vocab_size=a.vocab,
        max_seq_len=seq_len, activation=a.activation, position=a.position, bias=a.bias,
        x0_mixing=a.x0_mixing, extra_embeddings=a.extra_embeddings,
        value_embeddings=a.value_embeddings,
    )


def _parameterization(a: argparse.Namespace) -> Parameterization:
    name = a.param or ("ngpt" if a.arch == "ngpt" else "completep")
    return Parameterization(
        name=name, alpha=a.alpha, base_width=a.base_width, base_depth=a.base_depth, lr=a.lr,
        sigma=a.sigma, weight_decay=a.weight_decay, eps=a.eps,
    )


@command("params")
def cmd_params(a: argparse.Namespace) -> int:
    from hptransfer.models.build import table_for

    table = table_for(_model_config(a), _parameterization(a))
    print(json.dumps(table.to_dict(), indent=2) if a.json else table.format_text())
    return 0


@command("flops")
def cmd_flops(a: argparse.Namespace) -> int:
    from hptransfer.models.flops import flops_report, format_flops_report

    report = flops_report(_model_config(a, seq_len=a.seq_len), a.seq_len)
    print(json.dumps(report, indent=2) if a.json else format_flops_report(report))
    return 0


@command("coordcheck")
def cmd_coordcheck(a: argparse.Namespace) -> int:
    from hptransfer.workers.coordcheck import run_coordcheck

    p = _parameterization(a)
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else None
    result = run_coordcheck(
        axis=a.axis, arch=a.arch, parameterization=p.name, alpha=a.alpha, sizes=sizes,
        fixed=a.fixed, steps=a.steps, lr=a.lr, batch_size=a.batch_size, seq_len=a.seq_len,
        seed=a.seed, head_dim=a.head_dim, base_width=a.base_width, base_depth=a.base_depth,
    )
    if a.plot:
        result.save_plot(a.plot)
    if a.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format_table())
        if a.plot:
            print(f"plot written to {a.plot}")
    return 0 if result.verdict["passed"] or not a.strict else 1


@command("train")
def cmd_train(a: argparse.Namespace) -> int:
    from hptransfer.workers.trainer import run_trial
    from hptransfer.workers.trial import TrialSpec

    with open(a.spec) as f:
        raw = f.read()
    import yaml

    spec = TrialSpec.model_validate(yaml.safe_load(raw))

    def report(m: dict) -> None:
        if not a.json:
            print(json.dumps(m), file=sys.stderr)

    result = run_trial(spec, reporter=report)
    out = result.model_dump(mode="json")
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        keep = ("status", "final_val_loss", "steps", "tokens", "flops", "tokens_per_s",
                "wall_time_s", "params_non_embedding", "error")
        for k in keep:
            print(f"{k:>22}: {out[k]}")
    return 0 if result.status != "failed" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("params", help="print the parameterization group table")
    _add_model_args(p)
    _add_param_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("flops", help="analytic FLOPs per token and parameter counts")
    _add_model_args(p)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("coordcheck", help="coordinate check across width or depth")
    _add_model_args(p, with_shape=False)
    _add_param_args(p)
    p.set_defaults(lr=1e-3)
    p.add_argument("--axis", default="depth", choices=["width", "depth"])
    p.add_argument("--sizes", default=None, help="comma-separated widths or depths")
    p.add_argument("--fixed", type=int, default=None, help="the other dimension")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write a PNG here")
    p.add_argument("--strict", action="store_true", help="exit 1 when the verdict fails")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("train", help="run one trial from a TrialSpec YAML/JSON file")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as exc:  # user errors: one clear line, no traceback
        print(f"hpt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
