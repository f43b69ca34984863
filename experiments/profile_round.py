"""Profile: where a boosting round's time goes, op by op, on JAX's default backend (CPU or GPU).

Run from the repository root: ``python experiments/profile_round.py`` (``--rows``, ``--depth``,
``--rounds``, ``--top``, ``--output FILE.md``; ``--task multiclass`` with ``--vector-leaves
diagonal`` or ``full`` for one tree of vector leaves a round). It needs no package beyond the
benchmark's: the trace is JAX's own profiler's, written as a Perfetto trace (JSON).

It trains on the benchmark's data (``bench_worker.make_task``: classification 1M x 28, or 10
classes on a fifth of the rows; 80% for training, 256 bins, depth 6), compiles and warms up,
then traces one fit of ``--rounds`` rounds and tabulates:

* the wall time a round, and for each device in the trace (a GPU, or the CPU's XLA threads) its
  busy time a round: the union of the intervals in which one of its ops ran. On a GPU, wall
  time minus busy time is time the GPU sat idle: waiting on kernel launches, or on the host (a
  ``while`` loop whose length is traced reads its condition back to the host every step);
* per device, and for the host's Python thread, the ops that took most time, summed over the
  rounds (inclusive: an op's time includes the ops nested in it), with how often each ran a round.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "experiments"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxboost as jb  # noqa: E402
from bench_worker import make_task, task_loss  # noqa: E402


def trace_events(trace_dir: Path) -> list[dict]:
    """The Perfetto trace's events (the newest trace under ``trace_dir``)."""
    files = sorted(trace_dir.glob("**/*.trace.json.gz"))
    if not files:
        raise RuntimeError(f"the profiler wrote no Perfetto trace under {trace_dir}")
    with gzip.open(files[-1]) as stream:
        data = json.load(stream)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, reach = 0.0, -np.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


FIT_ANNOTATION = "traced fit"


def summarise(events: list[dict], rounds: int, top: int) -> tuple[dict, dict]:
    """``(busy_ms_per_round, top_ops)``: per track (a device, or the host's Python thread), its
    busy time a round and its ``top`` ops as ``(name, ms a round, calls a round)``, counting
    only what ran inside the ``FIT_ANNOTATION`` span (not the profiler's start and stop)."""
    fit = [event for event in events if event.get("ph") == "X" and event.get("name") == FIT_ANNOTATION]
    if len(fit) != 1:
        raise RuntimeError(f"expected one {FIT_ANNOTATION!r} span in the trace; found {len(fit)}")
    fit_start, fit_end = fit[0]["ts"], fit[0]["ts"] + fit[0]["dur"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    intervals, time_by_op, calls_by_op = (collections.defaultdict(list), collections.defaultdict(collections.Counter),
                                          collections.defaultdict(collections.Counter))
    for event in events:
        if event.get("ph") != "X" or "dur" not in event or event["name"] == FIT_ANNOTATION:
            continue
        start, end = max(event["ts"], fit_start), min(event["ts"] + event["dur"], fit_end)
        if end <= start:
            continue
        process = processes.get(event["pid"], str(event["pid"]))
        thread = threads.get((event["pid"], event["tid"]), "")
        if process.startswith("/host"):
            # The host's XLA threads run a CPU device's ops; its Python thread dispatches.
            track = f"{process} python" if thread == "python" else (f"{process} XLA" if "XLA" in thread else None)
        else:
            track = process
        if track is None:
            continue
        intervals[track].append((start, end))
        time_by_op[track][event["name"]] += end - start
        calls_by_op[track][event["name"]] += 1
    busy = {track: union_length(spans) / 1000 / rounds for track, spans in intervals.items()}
    tops = {track: [(name, total / 1000 / rounds, calls_by_op[track][name] / rounds)
                    for name, total in time_by_op[track].most_common(top)]
            for track in intervals}
    return busy, tops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000,
                        help="rows generated (80%% train; a fifth of them for multiclass)")
    parser.add_argument("--task", choices=("classification", "regression", "wide", "multiclass"),
                        default="classification")
    parser.add_argument("--vector-leaves", choices=("diagonal", "full"),
                        help="multiclass: one tree of vector leaves a round, with this Hessian")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--colsample-bytree", type=float, default=1.0, help="fraction of the features per tree")
    parser.add_argument("--colsample-bynode", type=float, default=1.0, help="fraction of the features per node")
    parser.add_argument("--subsample", type=float, default=1.0, help="fraction of the rows per round")
    parser.add_argument("--penalty", choices=("quadratic", "smooth_l1"),
                        help="a custom leaf penalty (bench_penalty.py's) in place of reg_lambda=1")
    parser.add_argument("--rounds", type=int, default=10, help="rounds in the traced fit")
    parser.add_argument("--top", type=int, default=15, help="ops listed per track")
    parser.add_argument("--output", type=Path, help="write the tables to this Markdown file too")
    args = parser.parse_args()

    X_train, _, y_train, _ = make_task(args.task, args.rows)
    dataset = jb.Dataset(X_train, y_train, max_bin=256)
    settings = dict(loss=task_loss(args.task), max_depth=args.depth, learning_rate=0.1, reg_lambda=1.0, min_child_weight=1.0,
                    colsample_bytree=args.colsample_bytree, colsample_bynode=args.colsample_bynode,
                    subsample=args.subsample)
    if args.penalty:
        from bench_penalty import quadratic, smooth_l1
        settings.pop("reg_lambda")
        settings["regularizer"] = (jb.regularizers.custom(quadratic) if args.penalty == "quadratic"
                                   else jb.regularizers.custom(smooth_l1, reg_lambda=1.0))
    if args.vector_leaves:
        settings.update(multi_strategy="multi_output_tree", multi_output_hessian=args.vector_leaves)
    jb.train(dataset, num_rounds=2, **settings)  # compiles
    start = time.perf_counter()
    jb.train(dataset, num_rounds=args.rounds, **settings)
    untraced_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            with jax.profiler.TraceAnnotation(FIT_ANNOTATION):
                start = time.perf_counter()
                jb.train(dataset, num_rounds=args.rounds, **settings)
                traced_s = time.perf_counter() - start
        busy, tops = summarise(trace_events(Path(folder)), args.rounds, args.top)

    lines = [
        "# Where a round's time goes",
        "",
        f"- command: `python experiments/profile_round.py --task {args.task} --rows {args.rows} --depth {args.depth} "
        f"--rounds {args.rounds}" + (f" --vector-leaves {args.vector_leaves}" if args.vector_leaves else "")
        + (f" --colsample-bytree {args.colsample_bytree}" if args.colsample_bytree != 1.0 else "")
        + (f" --colsample-bynode {args.colsample_bynode}" if args.colsample_bynode != 1.0 else "")
        + (f" --subsample {args.subsample}" if args.subsample != 1.0 else "")
        + (f" --penalty {args.penalty}" if args.penalty else "") + "`",
        f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; devices: "
        f"{', '.join(str(device) for device in jax.devices())} ({jax.devices()[0].device_kind})",
        f"- versions: jax {jax.__version__}, numpy {np.__version__}, Python {platform.python_version()}",
        f"- data: the benchmark's {args.task} task, {len(X_train):,} training rows x {X_train.shape[1]} "
        f"features, 256 bins, depth {args.depth}; {settings}",
        f"- a fit of {args.rounds} rounds: {1000 * untraced_s / args.rounds:.2f} ms a round untraced, "
        f"{1000 * traced_s / args.rounds:.2f} traced (the profiler's own cost)",
        "- times are ms a round; an op's time includes the ops nested in it",
        "",
        "| track | busy ms a round | share of the traced wall time |",
        "|---|---|---|",
    ]
    wall_ms = 1000 * traced_s / args.rounds
    for track, ms in sorted(busy.items()):
        lines.append(f"| {track} | {ms:.2f} | {ms / wall_ms:.0%} |")
    for track in sorted(tops):
        lines += ["", f"## {track}", "", "| op | ms a round | calls a round |", "|---|---|---|"]
        lines += [f"| `{name[:80]}` | {ms:.3f} | {calls:g} |" for name, ms, calls in tops[track]]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
