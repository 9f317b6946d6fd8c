"""`hpt`: the command line. Thin: parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import ipaddress
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# torch-free: the client commands (submit, status, fits, ...) start without importing torch
from hptransfer.contracts.status import SweepStatus, TrialStatus
from hptransfer.models.config import ACTIVATIONS, ARCHES, POSITIONS, PRESETS, ModelConfig

if TYPE_CHECKING:
    from hptransfer.config import Settings
    from hptransfer.models import Parameterization

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}
_MODEL = ModelConfig()  # the CLI's model defaults are the model's own


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


def _add_model_args(p: argparse.ArgumentParser, with_shape: bool = True) -> None:
    p.add_argument("--arch", default=_MODEL.arch, choices=ARCHES)
    if with_shape:
        p.add_argument("--width", type=int, default=_MODEL.width)
        p.add_argument("--depth", type=int, default=_MODEL.depth)
    p.add_argument("--head-dim", type=int, default=_MODEL.head_dim)
    p.add_argument("--vocab", type=int, default=_MODEL.vocab_size, help="vocabulary size")
    p.add_argument("--activation", default=_MODEL.activation, choices=ACTIVATIONS)
    p.add_argument("--position", default=_MODEL.position, choices=POSITIONS)
    p.add_argument("--bias", action="store_true", help="linear biases in the blocks")
    p.add_argument("--x0-mixing", action="store_true")
    p.add_argument("--extra-embeddings", type=int, default=_MODEL.extra_embeddings)
    p.add_argument("--value-embeddings", type=int, default=_MODEL.value_embeddings)


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


def _arch_options(a: argparse.Namespace) -> dict:
    return dict(
        activation=a.activation, position=a.position, bias=a.bias, x0_mixing=a.x0_mixing,
        extra_embeddings=a.extra_embeddings, value_embeddings=a.value_embeddings,
    )


def _model_config(a: argparse.Namespace, seq_len: int = 1024) -> ModelConfig:
    return ModelConfig(
        arch=a.arch, width=a.width, depth=a.depth, head_dim=a.head_dim, vocab_size=a.vocab,
        max_seq_len=seq_len, **_arch_options(a),
    )


def _parameterization(a: argparse.Namespace) -> Parameterization:
    from hptransfer.models import Parameterization

    name = a.param or ("ngpt" if a.arch == "ngpt" else "completep")
    return Parameterization(
        name=name, alpha=a.alpha, base_width=a.base_width, base_depth=a.base_depth, lr=a.lr,
        sigma=a.sigma, weight_decay=a.weight_decay, eps=a.eps,
    )


@command("params")
def cmd_params(a: argparse.Namespace) -> int:
    from hptransfer.models.parameterization import check_pairing

    # checked before torch is imported: a bad flag answers in a blink, not after ~1.5 CPU-s
    cfg, p = _model_config(a), _parameterization(a)
    check_pairing(cfg, p)
    from hptransfer.models.build import table_for

    table = table_for(cfg, p)
    print(json.dumps(table.to_dict(), indent=2) if a.json else table.format_text())
    return 0


@command("flops")
def cmd_flops(a: argparse.Namespace) -> int:
    cfg = _model_config(a, seq_len=a.seq_len)  # checked before flops imports torch
    from hptransfer.models.flops import flops_report, format_flops_report

    report = flops_report(cfg, a.seq_len)
    print(json.dumps(report, indent=2) if a.json else format_flops_report(report))
    return 0


@command("coordcheck")
def cmd_coordcheck(a: argparse.Namespace) -> int:
    p = _parameterization(a)
    plot = a.plot or str(_default_coordcheck_plot(a, p))
    if Path(plot).is_dir():  # found before the check runs, not after
        raise ValueError(f"--plot {plot} is a directory; give the PNG file's path")
    # torch and the models after the checks: a refusal comes at once, not ~2.5 CPU-s later
    from hptransfer.coordcheck import format_table, run_coordcheck, save_plot

    result = run_coordcheck(
        axis=a.axis, arch=a.arch, parameterization=p.name, alpha=a.alpha, sizes=a.sizes,
        fixed=a.fixed, steps=a.steps, lr=a.lr, batch_size=a.batch_size, seq_len=a.seq_len,
        seed=a.seed, head_dim=a.head_dim, base_width=a.base_width, base_depth=a.base_depth,
        sigma=a.sigma, eps=a.eps, arch_options=_arch_options(a), data=a.data,
    )
    save_plot(result, plot)
    if a.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result))
        print(f"plot written to {plot}")
    return 0 if result.verdict["passed"] or not a.strict else 1


def _default_coordcheck_plot(a: argparse.Namespace, p: Parameterization):
    """Under $HPT_HOME/coordcheck/, where the sweep dashboards pick coord-check plots up."""
    from hptransfer.config import ensure_writable_dir, get_settings

    folder = ensure_writable_dir(get_settings().home / "coordcheck")
    return folder / f"{a.arch}-{p.label()}-{a.axis}.png"


@command("train")
def cmd_train(a: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from hptransfer.client import read_spec_file
    from hptransfer.config import check_worker_settings

    check_worker_settings()
    raw = read_spec_file(a.spec)  # a missing, broken or invalid spec is refused before torch
    from hptransfer.spec.errors import spec_error
    from hptransfer.spec.trial import TrialSpec

    try:
        spec = TrialSpec.model_validate(raw)
    except ValidationError as exc:  # each field named, with "did you mean", as a sweep's
        raise ValueError(f"{a.spec} is not a valid TrialSpec: {spec_error(exc, TrialSpec)}"
                         ) from None
    from hptransfer.workers.trainer import run_trial

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
            value = out[k]
            if k == "error" and value and "\n" in value:  # its first line says what failed
                value = value.split("\n", 1)[0] + "  (--json for the traceback)"
            print(f"{k:>22}: {value}")
    return 0 if result.status != TrialStatus.FAILED else 1


def _client(a: argparse.Namespace):
    from hptransfer.client import Client

    return Client(a.url, token=a.token)


def _print_summary(s: dict) -> None:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items()) if v)
    eta = f"  eta {s['eta_s']:.0f}s" if s.get("eta_s") else ""
    print(f"{s['id']}  {s['name']:<24} {s['status']:<10} {s['done']}/{s['total']}  "
          f"[{counts}]{eta}")
    if s.get("waiting_for"):
        print(f"    waiting: {shown(str(s['waiting_for']))}")
    if s.get("error"):  # it may quote a trial's exception, which may quote a user's text
        print(f"    {s['status']}: {shown(str(s['error']))}")
    for st in s.get("stages") or []:  # a study: one line per stage, in order
        counts = ", ".join(f"{k} {v}" for k, v in sorted(st["counts"].items()) if v)
        print(f"    stage {st['stage']:<13} {st['state']:<8} {st['done']}/{st['total']}"
              + (f"  [{counts}]" if counts else ""))


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@command("serve")
def cmd_serve(a: argparse.Namespace) -> int:
    # the settings and the port are checked before the app is imported (torch, Ray: seconds)
    from hptransfer.config import get_settings, token_strength_problem
    from hptransfer.sockets import listen

    settings = get_settings()
    host, port = a.host or settings.host, a.port or settings.port
    weak = settings.api_token and token_strength_problem(settings.api_token)
    if not is_loopback(host) and weak:
        print(f"hpt serve: refusing to serve on {host}: {weak}", file=sys.stderr)
        return 2
    if not is_loopback(host) and not settings.api_token:
        if not a.insecure:
            print(f"hpt serve: refusing to serve on {host} without HPT_API_TOKEN: anyone who "
                  "can reach it could submit and cancel sweeps. Set HPT_API_TOKEN, or pass "
                  "--insecure to serve unauthenticated anyway.", file=sys.stderr)
            return 2
        print(f"warning: serving on {host} without HPT_API_TOKEN (--insecure)", file=sys.stderr)
    sock = listen(host, port)
    try:
        _check_before_serving(settings)
    except BaseException:
        sock.close()
        raise
    from hptransfer.api.server import serve_forever
    from hptransfer.coordinator.ray_join import RayUnreachable

    try:
        serve_forever(settings, host, port, a.log_level, sock=sock)
    except RayUnreachable as exc:
        print(f"hpt serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_before_serving(settings: Settings) -> None:
    """What failed after Ray had started, as tracebacks, is one line before it: the data
    directory, the checkpoint store and the app database (a SettingsError, exit 2)."""
    from hptransfer.config import SettingsError
    from hptransfer.coordinator.health import check_service, unreachable
    from hptransfer.redaction import mask_url

    check_service(settings)
    problem = unreachable(settings.database_url)
    if problem:
        raise SettingsError(f"cannot reach the app database HPT_DATABASE_URL="
                            f"{mask_url(settings.database_url)} ({problem})")


@command("doctor")
def cmd_doctor(a: argparse.Namespace) -> int:
    from hptransfer.config import client_url, get_settings

    settings = get_settings()  # a bad setting is refused before Ray and the store load
    import ray

    from hptransfer.coordinator.health import check_api, run_checks

    ours = not ray.is_initialized()  # a connection doctor opened itself, closed again below
    try:
        checks = run_checks(settings, deep=not a.quick)
        url = a.url or client_url("")
        if url:
            checks.append(check_api(url))
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()
    if a.json:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        for c in checks:
            print(c.line())
    failed = [c.name for c in checks if not c.ok]
    if failed and not a.json:
        print(f"{len(failed)} of {len(checks)} checks failed: {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed else 0


@command("plan")
def cmd_plan(a: argparse.Namespace) -> int:
    with _client(a) as c:
        plan = c.plan(a.spec, cpus=a.cpus, gpus=a.gpus, calibrate=a.calibrate)
    if a.json:
        print(json.dumps(plan, indent=2))
        return 0
    print(plan["text"])
    ceiling = plan.get("ceiling") or {}
    if ceiling.get("exceeded"):
        print(f"over the server's HPT_MAX_SWEEP_DEVICE_HOURS={ceiling['device_hours']:g}: "
              "`hpt submit` needs --confirm-cost")
    return 0


@command("submit")
def cmd_submit(a: argparse.Namespace) -> int:
    with _client(a) as c:
        s = c.submit(a.spec, confirm_cost=a.confirm_cost)
        # flushed: a script reading the output through a pipe learns the id before the wait
        print(f"submitted sweep {s['id']} ({s['total']} trials)", flush=True)
        if not a.wait:
            _print_summary(s)
            return 0
        try:
            s = c.wait(s["id"])
        except KeyboardInterrupt:
            print(f"\nstopped waiting; sweep {s['id']} goes on (`hpt status {s['id']}`, "
                  f"`hpt cancel {s['id']}`)", file=sys.stderr)
            return 130
        _print_summary(s)
    return 0 if s["status"] == SweepStatus.COMPLETED else 1  # a script can tell a sweep that failed


@command("status")
def cmd_status(a: argparse.Namespace) -> int:
    with _client(a) as c:
        sweeps = [c.get(a.id)] if a.id is not None else c.list_all()
        if a.json:
            print(json.dumps(sweeps, indent=2, default=str))
        for s in [] if a.json else sweeps:
            _print_summary(s)
    return 0


@command("trials")
def cmd_trials(a: argparse.Namespace) -> int:
    with _client(a) as c:
        df = c.trials(a.id, status=a.status, stage=a.stage)
    cols = [k for k in ("id", "stage", "arm", "width", "depth", "lr", "seed", "status",
                        "final_val_loss",
                        "attempts", "wall_time_s", "reason") if k in df.columns]
    if a.csv:
        inert(df.drop(columns=[k for k in ("spec", "result") if k in df.columns])).to_csv(
            sys.stdout, index=False)
    elif not len(df):
        print("no trials")
    else:
        if "error" in df.columns and df["error"].notna().any():  # its first line: what failed
            df = df.assign(error=df["error"].map(
                lambda e: shown(e.splitlines()[0][:120]) if isinstance(e, str) and e else ""))
            cols.append("error")
        print(df[cols].to_string(index=False))
    return 0


@command("fits")
def cmd_fits(a: argparse.Namespace) -> int:
    with _client(a) as c:
        raw = c.fits_raw(a.id, bootstrap=a.bootstrap, reference_arm=a.reference_arm)
    print(json.dumps(raw, indent=2) if a.json else raw["text"])
    return 0


@command("cancel")
def cmd_cancel(a: argparse.Namespace) -> int:
    with _client(a) as c:
        _print_summary(c.cancel(a.id))
    return 0


@command("mlflow-ui")
def cmd_mlflow_ui(a: argparse.Namespace) -> int:
    import os
    import subprocess

    from hptransfer.config import get_settings
    from hptransfer.redaction import mask_url
    from hptransfer.sockets import listen
    from hptransfer.tracking.tracking import SERVER_ENV, ui_command, ui_url

    settings = get_settings()
    if _default_mlflow_store(settings):  # MLflow would retry ~100 s on a read-only one
        settings.ensure_dirs()
    if not is_loopback(a.host):
        if not a.insecure:
            print(f"hpt mlflow-ui: refusing to serve on {a.host or 'every interface'}: the "
                  "MLflow UI has no login, so anyone who can reach it could read and delete "
                  "runs. Put it behind an authenticating proxy, or pass --insecure to serve "
                  "it anyway.", file=sys.stderr)
            return 2
        print(f"warning: the MLflow UI on {a.host} without a login (--insecure)",
              file=sys.stderr)
    listen(a.host, a.port).close()  # a port in use is one line here; MLflow's exits 0
    cmd = ui_command(settings.mlflow_uri, a.host, a.port)
    print(f"MLflow UI on {ui_url(f'http://{a.host}:{a.port}')} for {mask_url(settings.mlflow_uri)}")
    # one server worker for one person's browser unless MLFLOW_WORKERS says otherwise:
    # MLflow's default 4 each import MLflow at once, twice as slow to start on 2 cores
    return subprocess.call(cmd, env={"MLFLOW_WORKERS": "1", **os.environ, **SERVER_ENV})


def _default_mlflow_store(settings: Settings) -> bool:
    """Whether the MLflow store is a SQLite file in HPT_HOME (the default)."""
    from hptransfer.tracking.params import sqlite_store_file

    db = sqlite_store_file(settings.mlflow_uri)
    return db is not None and db.is_relative_to(settings.home)


@command("demo")
def cmd_demo(a: argparse.Namespace) -> int:
    from hptransfer.demo import run_demo

    try:
        return run_demo(spec_path=a.spec, out_dir=a.out)
    except KeyboardInterrupt:  # run_demo's own clean-up has run by now
        print("\nhpt demo: stopped", file=sys.stderr)
        return 130


def port_number(text: str) -> int:
    """A TCP port to listen on, 1-65535 (argparse type)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return port


def size_list(text: str) -> list[int]:
    """Comma-separated positive integers (argparse type)."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive "
                                         "integers (e.g. 32,64,128)")
    return sizes


def log_level(text: str) -> str:
    """One of uvicorn's log levels (argparse type; uvicorn is imported by `hpt serve` only)."""
    from uvicorn.config import LOG_LEVELS

    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: use one of "
                                         f"{', '.join(LOG_LEVELS)}")
    return text.lower()


_Commands = argparse._SubParsersAction  # what add_subparsers returns: one add_parser per command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # in this order in `hpt --help`
    _add_model_commands(sub)
    _add_server_commands(sub)
    _add_sweep_commands(sub)
    _add_local_tools(sub)
    return parser


def _add_model_commands(sub: _Commands) -> None:
    """Commands on one model or trial, on this machine: params, flops, coordcheck, train."""
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
    p.add_argument("--sizes", default=None, type=size_list,
                   help="comma-separated widths or depths")
    p.add_argument("--fixed", type=int, default=None, help="the other dimension")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    # checked by run_coordcheck (coordcheck.DATA_SOURCES), which is not imported at start-up
    p.add_argument("--data", default="corpus",
                   help="the fixed batch: 'corpus' (the stdlib corpus; an error if it cannot "
                        "load) or 'random' (deterministic random tokens)")
    p.add_argument("--plot", default=None,
                   help="PNG path (default $HPT_HOME/coordcheck/ARCH-PARAM-AXIS.png, which the "
                        "dashboards show)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the verdict fails")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("train", help="run one trial from a TrialSpec YAML/JSON file")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true")


def _add_server_commands(sub: _Commands) -> None:
    """The coordinator: serve it, check it (doctor)."""
    p = sub.add_parser("serve", help="API + dispatcher + Ray + MLflow tracking")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=port_number, default=None)
    p.add_argument("--log-level", default="info", type=log_level,
                   help="uvicorn's: critical, error, warning, info, debug or trace")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without HPT_API_TOKEN (unauthenticated)")

    p = sub.add_parser("doctor", help="check every component the coordinator's settings name: "
                       "databases, MLflow, Ray nodes, package version and data on each node")
    p.add_argument("--quick", action="store_true",
                   help="skip the per-node probe (package version, data roots)")
    p.add_argument("--url", default=None, help="also check the API (default $HPT_URL)")
    p.add_argument("--json", action="store_true")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="API URL (default $HPT_URL or "
                   "http://127.0.0.1:8600)")
    p.add_argument("--token", default=None, help="bearer token (default $HPT_API_TOKEN)")


def _add_sweep_commands(sub: _Commands) -> None:
    """The API client's commands on sweeps: plan, submit, status, trials, fits, cancel."""
    p = sub.add_parser("plan", help="price a sweep spec on the server's cluster (trials, "
                       "FLOPs, memory, device-hours, wall time per stage); queues nothing")
    p.add_argument("spec")
    p.add_argument("--cpus", type=float, default=None,
                   help="plan for a cluster of this many CPUs (default: the server's)")
    p.add_argument("--gpus", type=float, default=None,
                   help="plan for a cluster of this many GPUs (default: the server's)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the throughput again instead of the cached figures")
    p.add_argument("--json", action="store_true")
    _add_client_args(p)

    p = sub.add_parser("submit", help="submit a sweep spec (YAML or JSON file)")
    p.add_argument("spec")
    p.add_argument("--wait", action="store_true",
                   help="wait with a progress bar; exit 1 unless the sweep completes")
    p.add_argument("--confirm-cost", action="store_true",
                   help="queue it even if its estimate (`hpt plan`) exceeds the server's "
                        "HPT_MAX_SWEEP_DEVICE_HOURS")
    _add_client_args(p)

    p = sub.add_parser("status", help="one sweep, or all")
    p.add_argument("id", nargs="?")
    p.add_argument("--json", action="store_true")
    _add_client_args(p)

    p = sub.add_parser("trials", help="the trials of a sweep")
    p.add_argument("id")
    p.add_argument("--status", default=None)
    p.add_argument("--stage", default=None, help="a study's stage (tune, transfer, ...)")
    p.add_argument("--csv", action="store_true")
    _add_client_args(p)

    p = sub.add_parser("fits", help="the fit report of a sweep")
    p.add_argument("id")
    p.add_argument("--bootstrap", type=int, default=100, help="bootstrap resamples for CIs")
    p.add_argument("--reference-arm", default=None, help="arm the FLOP savings compare to")
    p.add_argument("--json", action="store_true")
    _add_client_args(p)

    p = sub.add_parser("cancel", help="cancel a sweep")
    p.add_argument("id")
    _add_client_args(p)


def _add_local_tools(sub: _Commands) -> None:
    """The MLflow UI and the CPU demo."""
    from hptransfer.tracking.tracking import UI_HOST, UI_PORT

    p = sub.add_parser("mlflow-ui", help="the MLflow UI on the local tracking store")
    p.add_argument("--host", default=UI_HOST)
    p.add_argument("--port", type=port_number, default=UI_PORT)
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host (the UI has no login)")

    p = sub.add_parser("demo", help="a small real study on the CPU, end to end")
    p.add_argument("--spec", default=None, help="sweep spec (default examples/cpu_study.yaml)")
    p.add_argument("--out", default=None, help="where dashboards go (default $HPT_HOME/demo)")


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `hpt ... | head` ends quietly, like other Unix tools
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as exc:  # user errors: one clear line, no traceback
        # line by line: a trial spec's errors come one a line
        print(f"hpt {args.command}: error: " + "\n".join(map(shown, str(exc).split("\n"))),
              file=sys.stderr)
        return 2
    except RuntimeError as exc:  # ApiError and unreachable servers
        from hptransfer.client import ApiError

        if not isinstance(exc, ApiError):
            raise
        if not exc.errors:
            print(f"hpt {args.command}: {shown(exc.message)}", file=sys.stderr)
            return 2
        # the message joins the errors on one line: list them instead, one a line
        what = exc.message.split(": ", 1)[0] if ": " in exc.message else f"HTTP {exc.status}"
        print(f"hpt {args.command}: {shown(what)}:", file=sys.stderr)
        for e in exc.errors:
            where = _as_flag(e["field"], args)
            print(f"  {shown(where) + ': ' if where else ''}{shown(e['message'])}",
                  file=sys.stderr)
        return 2


# a spreadsheet runs a cell that starts with one of these as a formula
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def inert(df: Any) -> Any:
    """`df` with each text cell a spreadsheet would run as a formula (an arm label
    `=HYPERLINK(...)`, an error) quoted with a leading ' (OWASP's CSV injection advice)."""
    def cell(value: Any) -> Any:
        return f"'{value}" if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value

    return df.apply(lambda column: column.map(cell))


def shown(text: str) -> str:
    """`text` safe to print to a terminal: each non-printable character as its Python
    escape (a spec's unknown key "\\x1b[2J" cleared the screen as a field path), as the
    messages' repr()s show values."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


# the query parameters the CLI sets from its flags: a 422 names them as the server sees them
_FLAGS = {"query.bootstrap": "bootstrap", "query.reference_arm": "reference_arm",
          "query.cpus": "cpus", "query.gpus": "gpus", "query.status": "status",
          "query.stage": "stage"}


def _as_flag(field: str, args: argparse.Namespace) -> str:
    """The flag the user gave for a server error's `field` ("query.bootstrap" is
    --bootstrap), where this command sent it; else `field`."""
    dest = _FLAGS.get(field)
    if dest is None or getattr(args, dest, None) is None:
        return field
    return "--" + dest.replace("_", "-")


if __name__ == "__main__":
    sys.exit(main())
