"""How many probes a step the leaf refit's line search should take on a GPU.

Absolute error refits every leaf by a 1-D search on the sign of the summed derivative
(``line_search.minimise_segment_offsets``). On CPU it bisects, one derivative a step. On a GPU a
step costs its kernel launches and the loop's test on the host more than its rows, so
``ACCELERATOR_PROBES`` derivatives a step (a bracket cut into that many + 1 parts) may be
cheaper. This runs ``bench_worker.py``'s absolute-error task (the same data, settings and
difference method as ``bench.py``) in a fresh process per probe count, alternating the counts
repeat by repeat, and reports the medians.

Usage: ``python experiments/gpu_refit_probes.py --probes 1,7,15,31 --repeats 3 --output F``
(``--device cpu`` runs the same on a CPU, where the line search always bisects: a dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT_PREFIX = "BENCH_RESULT "


def child(probes: int, worker_args: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    from jaxboost import line_search

    line_search.ACCELERATOR_PROBES = probes
    import bench_worker

    bench_worker.main(worker_args)


def run_one(probes: int, worker_args: list[str]) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAXBOOST_CACHE_DIR="")
    completed = subprocess.run([sys.executable, __file__, "--child", str(probes), "--", *worker_args],
                               capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if completed.returncode != 0 or not lines:
        return {"status": "failed", "probes": probes, "stderr": completed.stderr[-2000:]}
    return dict(json.loads(lines[-1][len(RESULT_PREFIX):]), probes=probes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", default="1,7,15,31")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1_000_000, help="as bench.py's --rows (absolute error takes half)")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.child is not None:
        child(args.child, [argument for argument in rest if argument != "--"])
        return
    counts = [int(count) for count in args.probes.split(",")]
    worker_args = ["--library", "jaxboost", "--task", "absolute_error", "--rows", str(args.rows),
                   "--rounds", str(args.rounds), "--device", args.device]
    runs = []
    for repeat in range(args.repeats):
        turn = counts[repeat % len(counts):] + counts[:repeat % len(counts)]
        for probes in turn:
            result = run_one(probes, worker_args)
            runs.append(result)
            print(json.dumps({key: result.get(key) for key in
                              ("probes", "status", "ms_per_tree", "compile_s", "metric", "stderr")}), flush=True)
    rows = ["| probes a step | ms/tree | compile s | test MAE | runs |", "|---|---|---|---|---|"]
    for probes in counts:
        done = [run for run in runs if run["probes"] == probes and run.get("status") == "ok"]
        if not done:
            rows.append(f"| {probes} | failed | | | 0 |")
            continue
        median = lambda key: statistics.median(run[key] for run in done)  # noqa: E731
        spread = ", ".join(f"{run['ms_per_tree']:.2f}" for run in done)
        rows.append(f"| {probes} | {median('ms_per_tree'):.2f} ({spread}) | {median('compile_s'):.2f} | "
                    f"{median('metric'):.3f} | {len(done)} |")
    device = next((run.get("gpu_name") for run in runs if run.get("gpu_name")), args.device)
    report = "\n".join([
        "# Leaf-refit line search: probes a step",
        "",
        f"- command: `python experiments/gpu_refit_probes.py {' '.join(argv or sys.argv[1:])}`",
        f"- device: {device}; absolute error, {args.rows // 2:,} rows x 50 features (bench.py's task), "
        f"{args.rounds} rounds, depth 6, 256 bins; a fresh process per run, counts alternated",
        "",
        *rows,
        "",
        "```",
        *(json.dumps(run) for run in runs),
        "```",
        "",
    ])
    print(report)
    if args.output:
        args.output.write_text(report)


if __name__ == "__main__":
    main()
