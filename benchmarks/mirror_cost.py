"""What the MLflow mirror costs per trial attempt, in MLflow calls and in CPU.

A sweep of N real trial results (one tiny trial trained here, its result given to every row)
goes through the app database (SQLite) and `Mirror` into a SQLite MLflow store, as `hpt
serve` runs it: each attempt leased and mirrored, its live curve queued by D drains of the
progress board between two passes, then finished and mirrored. Counted per attempt: MLflow
client calls (and `log_batch` calls among them), and the mirror's CPU. The baseline, measured in
the same run on the same store: one bare `log_batch` of one metric. Against a tracking server
every call is also an HTTP round trip, so calls per attempt is the figure that carries over.

    .venv/bin/python benchmarks/mirror_cost.py [--trials 40] [--drains 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from hptransfer.coordinator.plan import plan_sweep
from hptransfer.spec import load_spec
from hptransfer.store.store import Store
from hptransfer.tracking.mirror import Mirror
from hptransfer.workers.trainer import run_trial


def spec(trials: int) -> dict[str, Any]:
    return {
        "name": "mirror-cost", "arms": [{"arch": "gpt", "parameterization": "completep"}],
        "grid": {"widths": [32], "depths": [1], "seeds": [0],
                 "lrs": [2.0 ** (-4 - 8 * i / trials) for i in range(trials)]},
        "fixed": {"head_dim": 32, "seq_len": 32, "base_width": 32, "base_depth": 1,
                  "device": "cpu", "eval_every": 5},
        "budget": {"steps": 40, "batch_size": 4},
        "data": {"source": "stdlib", "val_tokens": 1024, "max_corpus_bytes": 400000},
    }


class Counting:
    """The MLflow client the mirror uses, each method call counted by name."""

    def __init__(self, client: MlflowClient) -> None:
        self._client, self.calls = client, Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


def one_round(folder: Path, trials: int, drains: int, result: dict[str, Any]) -> dict[str, Any]:
    store = Store(f"sqlite:///{folder / 'hpt.db'}")
    store.migrate()
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.search_experiments()  # the schema made here, not in the timed part
    loaded = load_spec(spec(trials))
    sweep_id = store.create_sweep(name=loaded.name, spec=loaded.model_dump(mode="json"),
                                  spec_hash="h", search="grid", planned=plan_sweep(loaded),
                                  reuse=False)
    mirror = Mirror(store, uri, str(folder / "artifacts"))
    counting = Counting(client)
    mirror._client = counting  # the client its passes use (opened lazily otherwise)
    mirror.sync()  # the sweep's experiment and parent run
    counting.calls.clear()
    curve = result["curve"]
    cut = [len(curve) * d // drains for d in range(drains + 1)]
    start = time.thread_time()
    for row in store.lease_pending("bench", trials):
        mirror.sync()  # its run created
        for d in range(drains):  # live points as the dispatcher's drains queue them
            mirror.live(row.id, row.started_at, curve[cut[d]:cut[d + 1]])
        mirror.sync()
        store.finish_trial(row.id, "completed", result)
        mirror.sync()  # its run finished
    cpu = time.thread_time() - start
    # a bare call on the same store, for scale
    run_id = client.create_run(client.get_experiment_by_name(
        f"hpt/{loaded.name}/{sweep_id}").experiment_id).info.run_id
    bare = time.thread_time()
    for step in range(trials):
        client.log_batch(run_id, metrics=[Metric("x", 1.0, step, step)], synchronous=True)
    bare = (time.thread_time() - bare) / trials
    store.close()
    return {"calls": sum(counting.calls.values()) / trials,
            "log_batch": counting.calls["log_batch"] / trials,
            "cpu_ms": 1e3 * cpu / trials, "bare_ms": 1e3 * bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--drains", type=int, default=4, help="live batches per attempt")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_spec(spec(1))
    result = run_trial(plan_sweep(loaded)[0].trial.model_dump())
    assert result.status == "completed", result.error
    payload = result.model_dump(mode="json")
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="hpt-mirror-cost-") as folder:
            rounds.append(one_round(Path(folder), args.trials, args.drains, payload))
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"mirror per attempt ({args.trials} attempts, {args.drains} live batches each, "
          f"{len(payload['curve'])} curve points, median of {args.rounds} rounds):")
    print(f"  MLflow calls {med['calls']:.1f} (log_batch {med['log_batch']:.1f})")
    print(f"  CPU {med['cpu_ms']:.1f} ms = {med['cpu_ms'] / med['bare_ms']:.1f} bare "
          f"log_batch calls of one metric ({med['bare_ms']:.1f} ms each, same store)")


if __name__ == "__main__":
    main()
