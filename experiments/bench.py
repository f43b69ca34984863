"""Side-by-side speed and memory benchmark: jaxboost vs XGBoost, LightGBM and scikit-learn.

Run from the repository root: ``python experiments/bench.py`` (full size: many minutes; run it
on a quiet machine). ``--rows 50000 --rounds 10 --repeats 1`` gives a quick smoke run.

Tasks (data generated with a fixed seed, float32, 80/20 train/test split):

* classification: ``make_classification(rows, 28 features, 14 informative, 4 redundant)``,
  binary logistic loss, scored by test AUC;
* regression: ``make_regression(rows // 2, 50 features, 20 informative, noise=10)``, squared
  error, scored by test RMSE;
* wide (only with ``--tasks wide``): ``make_classification(rows, 500 features, 50 informative,
  10 redundant)``, as classification: data whose histograms outgrow the caches.
* multiclass (only with ``--tasks multiclass``): ``make_classification(rows // 5, 28 features,
  14 informative, 4 redundant, 10 classes)``, softmax (one tree per class and round), scored by
  test log loss.
* absolute_error (only with ``--tasks absolute_error``): the regression data fitted by absolute
  error (XGBoost ``reg:absoluteerror``, LightGBM ``l1``, sklearn ``loss="absolute_error"``),
  scored by test MAE: a zero Hessian, so every library sets each leaf to a weighted median.
* missing (only with ``--tasks missing``): the classification data with a tenth of its values
  missing (NaN, completely at random, the same cells every run), scored by test AUC: every
  split also learns where missing values go.

Every library gets the same settings: ``--rounds`` trees of depth ``--depth`` (LightGBM and
sklearn: at most 2^depth leaves), learning rate 0.1, L2 lambda 1 (0 for absolute_error),
minimum leaf Hessian 1 (sklearn has none; it gets min_samples_leaf=1), ``--max-bin`` bins (LightGBM and sklearn count
the missing-value bin separately, so they get max_bin - 1), all cores, no early stopping.
``--eval-set`` makes every library evaluate the test split every round (its loss: log loss or
RMSE), as training with early stopping does; sklearn, which has no such option, is left out.
``--colsample-bytree F`` makes every tree sample F of the features (LightGBM: feature_fraction;
sklearn, which samples by split only, is left out). ``--subsample F`` makes every round sample F
of the rows (LightGBM: bagging_fraction with bagging_freq=1; sklearn, which has no row sample, is
left out). ``--deterministic-histogram`` trains jaxboost with ``deterministic_histogram=True``
(repeatable GPU fits, as XGBoost's GPU histograms are by default; on CPU it changes nothing).
``--vector-leaves full|diagonal`` (multiclass only) grows one tree of vector leaves a round for
jaxboost (its leaves from the full Hessian or its diagonal) and XGBoost
(``multi_strategy="multi_output_tree"``, whose leaves take the diagonal); LightGBM and sklearn,
which have none, are left out. ``--monotone`` gives every library monotone constraints, +1, -1
and 0 in turn over the features. ``--float64`` hands every library the features as float64
(NumPy's and pandas' default dtype; the same values as the float32 ones).

How it is measured (``bench_worker.py`` does one run):

* Each library runs in its own subprocess, ``--repeats`` times, the libraries taking turns; every table cell is the MEDIAN
  over the repeats. Separate processes keep peak RSS per library and make every repeat pay
  jaxboost's compilation again (JAX's persistent compilation cache is off in the children).
* binning s: building the library's binned dataset (``jb.Dataset``, ``xgb.QuantileDMatrix``,
  ``lgb.Dataset(...).construct()``; sklearn bins inside ``fit``: n/a).
* compile s (jaxboost): a first 1-round ``jb.train`` minus a second one on the same Dataset.
* boosting s: a ``--rounds``-round train in the warmed-up process (so without compilation).
* ms/tree, the difference method, the same for every library:
  (``--rounds``-round train - warm 1-round train) / (rounds - 1). Per-call overheads (data
  placement, starting value, sklearn's binning inside ``fit``) cancel out.
* ms/tree vs XGBoost: the ratio of the medians, and "run by run": the median (range) of the ratios
  of runs taken in the same turn, which share a busy machine's slow spells.
* predict s: predicting the test set, the median of 3 warm calls (one call could catch Python's
  first full garbage collection after training); XGBoost uses ``inplace_predict``.
  predict all s: the same on all rows (train and test: 1M on the full classification task),
  timed after the memory figures are taken. predict 1 row ms: the median latency of one-row
  predictions (serving one request at a time).
* peak RSS MB: the child's peak resident memory after data generation (the kernel's high-water
  mark is reset once the data exist; it includes the data and imported modules). A
  memory table per task splits it: RSS at start (data + imports), the peak anonymous memory
  (RssAnon sampled every 5 ms) and the mapped files at the end (RssFile: shared libraries'
  code pages, which JAX's compiler makes large).
* Quietness: load average and the CPU used by other processes are sampled before and after the
  runs, and other processes' CPU is also measured during them (machine-wide CPU from
  /proc/stat minus the children's own CPU).

``--device gpu`` runs jaxboost on JAX's GPU backend and XGBoost with ``device="cuda"`` (LightGBM and
sklearn are CPU-only and left out), and adds each library's peak GPU memory (NVML, device-wide,
above what was in use before the library started; JAX allocates on demand in these runs).
Write GPU results to their own file, e.g. ``--output experiments/results/bench_gpu.md``.

``--scaling`` adds jaxboost ms/tree vs rows and vs depth (XGBoost alongside; with jaxboost's
compile time for each depth, a distinct shape), vs depth on small data (12.5k rows, 10k of them
training rows: XGBoost alongside) and vs bins on the classification task; its row counts are
12.5k, 100k, 1M and 4M scaled by ``--rows`` / 1M.
``--warm-store`` times jaxboost as a later process sees it: an untimed run of each configuration
first fills a temporary cache folder (the program store and JAX's compilation cache), which the
timed runs then load their programs from; its compile column is that loading, and its memory
figures have no compiler at work.
The tables are printed and written, with the command line, date and machine info, to ``--output``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_worker import MULTICLASS_TASKS, NUM_CLASSES, TASK_FEATURES, available_cores, task_samples

EXPERIMENTS = Path(__file__).resolve().parent
REPO_ROOT = EXPERIMENTS.parent
WORKER = EXPERIMENTS / "bench_worker.py"
RESULT_PREFIX = "BENCH_RESULT "
LIBRARIES = ["jaxboost", "xgboost", "lightgbm", "sklearn"]
# Not run by default: jaxboost with a custom callable loss (optax / user-written), for the
# "a custom loss costs the same per round as a built-in" comparison.
OPTIONAL_LIBRARIES = ["jaxboost-custom"]
TASKS = ["classification", "regression"]
# Not run by default: "wide", classification with 500 features (``--tasks wide``),
# "multiclass", 10 classes, "absolute_error", the regression data fitted by absolute error, and
# "missing", the classification data with a tenth of its values missing (NaN) at random.
OPTIONAL_TASKS = ["wide", "multiclass", "absolute_error", "missing"]
METRIC_NAME = {"classification": "test AUC", "regression": "test RMSE", "wide": "test AUC",
               "multiclass": "test log loss", "absolute_error": "test MAE", "missing": "test AUC"}
REFERENCE_LIBRARY = "xgboost"
QUIET_LOAD = 0.5
RUN_TIMEOUT_S = 3 * 3600
FULL_ROWS = 1_000_000
SCALING_ROWS = [12_500, 100_000, 1_000_000, 4_000_000]
SCALING_DEPTHS = [4, 6, 8, 10]
# Small data, where the work per node (histogram sums, the split scan) outweighs the work per row.
SMALL_DATA_ROWS = 12_500
SCALING_BINS = [64, 256]
NUMERIC_FIELDS = ["binning_s", "compile_s", "boosting_s", "ms_per_tree", "predict_s", "predict_all_s", "predict_row_ms", "metric",
                  "peak_rss_mb", "first_round_s", "warm_round_s", "data_peak_rss_mb", "gpu_peak_mb", "rss_start_mb",
                  "peak_anonymous_mb", "file_rss_mb"]
# On a GPU only jaxboost and XGBoost run (LightGBM's wheels and scikit-learn are CPU-only).
GPU_LIBRARIES = ["jaxboost", "xgboost"]


# ----------------------------------------------------------------------------- quietness

def machine_busy_seconds() -> float | None:
    """CPU seconds used by everything on the machine since boot (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and its finished children."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


class OtherCpuMeter:
    """Accumulates the CPU used by other processes (machine-wide CPU minus this process tree's)."""

    def __init__(self):
        self.other_cpu_s = 0.0
        self.wall_s = 0.0

    def start(self):
        self._mark = (machine_busy_seconds(), own_cpu_seconds(), time.perf_counter())

    def stop(self):
        busy, own, wall = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()
        if busy is not None and self._mark[0] is not None:
            self.other_cpu_s += max((busy - self._mark[0]) - (own - self._mark[1]), 0.0)
        self.wall_s += wall - self._mark[2]

    @property
    def other_cores(self) -> float:
        return self.other_cpu_s / self.wall_s if self.wall_s else 0.0


def quietness_sample(seconds: float = 2.0) -> dict:
    """Load average and the cores used by other processes over ``seconds`` (this process sleeps)."""
    meter = OtherCpuMeter()
    meter.start()
    time.sleep(seconds)
    meter.stop()
    return {"load1": os.getloadavg()[0], "other_cores": meter.other_cores}


def describe_quietness(label: str, sample: dict) -> str:
    return (f"{label}: load average (1 min) {sample['load1']:.2f}; other processes used "
            f"{sample['other_cores']:.2f} of {os.cpu_count()} cores over 2 s")


# ----------------------------------------------------------------------------- running the workers

def child_environment(device: str = "cpu", extra: dict | None = None, cache_folder: str = "") -> dict:
    env = dict(os.environ, **(extra or {}))
    # Empty: real compilation in every repeat; a folder: the program store and JAX's cache there.
    env["JAXBOOST_CACHE_DIR"] = cache_folder
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"  # a CPU run on a machine with a GPU stays on the CPU
    else:
        # JAX takes 75% of the GPU's memory at start by default; allocate as needed instead, so
        # the peak GPU memory measured is what training uses.
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_worker(worker_args: list[str], meter: OtherCpuMeter | None = None, device: str = "cpu",
               extra_env: dict | None = None, cache_folder: str = "") -> dict:
    """Run ``bench_worker.py`` once (``extra_env`` added to its environment; ``cache_folder``:
    jaxboost's cache folder, empty for none) and return its JSON result (or a failure record)."""
    meter and meter.start()
    try:
        completed = subprocess.run([sys.executable, str(WORKER), *worker_args, "--device", device], capture_output=True,
                                   text=True, cwd=REPO_ROOT, env=child_environment(device, extra_env, cache_folder),
                                   timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: timed out after {RUN_TIMEOUT_S} s"}
    finally:
        meter and meter.stop()
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    last_error = (completed.stderr.strip().splitlines() or ["no output"])[-1]
    return {"status": f"failed (exit {completed.returncode}): {last_error[:200]}"}


class Runner:
    """Runs (library, task, size) configurations ``repeats`` times each, remembering results so a
    configuration shared by several tables runs once."""

    def __init__(self, repeats: int, rounds: int, device: str = "cpu", eval_set: bool = False,
                 colsample_bytree: float = 1.0, subsample: float = 1.0, deterministic_histogram: bool = False,
                 warm_store: bool = False, vector_leaves: str | None = None, monotone: bool = False,
                 float64: bool = False):
        self.repeats, self.rounds, self.device, self.eval_set = repeats, rounds, device, eval_set
        self.monotone, self.float64 = monotone, float64
        self.colsample_bytree, self.subsample = colsample_bytree, subsample
        self.deterministic_histogram, self.vector_leaves = deterministic_histogram, vector_leaves
        # jaxboost's cache folder, filled by an untimed run of each configuration first.
        self.store = tempfile.mkdtemp(prefix="jaxboost-bench-store-") if warm_store else ""
        self.meter = OtherCpuMeter()
        self.results: dict[tuple, list[dict]] = {}

    def run(self, library: str, task: str, rows: int, depth: int, max_bin: int, predict: bool = True,
            repeats: int | None = None) -> dict:
        """Summary of ``repeats`` runs (default: all), running only those not run yet."""
        repeats = self.repeats if repeats is None else repeats
        key = (library, task, rows, depth, max_bin)
        runs = self.results.get(key, [])
        if predict and runs and runs[0]["status"] == "ok" and "predict_s" not in runs[0]:
            runs = []  # earlier runs skipped predict; this table needs it
        if runs and runs[-1]["status"] != "ok":
            return summarize(runs)  # not installed or failing: repeating will not help
        while len(runs) < repeats:
            worker_args = ["--library", library, "--task", task, "--rows", str(rows), "--rounds", str(self.rounds),
                           "--depth", str(depth), "--max-bin", str(max_bin)] + ([] if predict else ["--no-predict"])
            worker_args += ["--eval-set"] if self.eval_set else []
            if self.colsample_bytree != 1.0:
                worker_args += ["--colsample-bytree", str(self.colsample_bytree)]
            if self.subsample != 1.0:
                worker_args += ["--subsample", str(self.subsample)]
            worker_args += ["--deterministic-histogram"] if self.deterministic_histogram else []
            worker_args += ["--monotone"] if self.monotone else []
            worker_args += ["--float64"] if self.float64 else []
            worker_args += ["--vector-leaves", self.vector_leaves] if self.vector_leaves else []
            cache_folder = self.store if library == "jaxboost" else ""
            if cache_folder and not runs:
                # Untimed: compiles the configuration's programs into the store, as a user's
                # first script would; the timed runs are later processes that load them.
                filling = run_worker(worker_args + ["--no-predict"], None, self.device, cache_folder=cache_folder)
                print(f"  {library:<9} {task:<14} rows={rows:<9} filled the program store: {filling['status']}",
                      file=sys.stderr, flush=True)
            started = time.perf_counter()
            result = run_worker(worker_args, self.meter, self.device, cache_folder=cache_folder)
            print(f"  {library:<9} {task:<14} rows={rows:<9} depth={depth:<3} bins={max_bin:<4} "
                  f"run {len(runs) + 1}/{self.repeats}: {result['status']} ({time.perf_counter() - started:.1f} s)",
                  file=sys.stderr, flush=True)
            runs.append(result)
            if result["status"] != "ok":
                break  # not installed or failing: repeating will not help
        self.results[key] = runs
        return summarize(runs)


def turn_ratios(runner: Runner, library: str, config: tuple) -> list[float]:
    """ms/tree of ``library`` over the reference library's, run by run: runs taken in turns
    share a machine's slow spells, so their ratios vary less than the times do."""
    ours, reference = runner.results.get((library,) + config, []), runner.results.get((REFERENCE_LIBRARY,) + config, [])
    return [a["ms_per_tree"] / b["ms_per_tree"] for a, b in zip(ours, reference)
            if a["status"] == b["status"] == "ok" and a.get("ms_per_tree") and b.get("ms_per_tree")]


def fmt_turn_ratios(ratios: list[float]) -> str:
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def summarize(runs: list[dict]) -> dict:
    """Medians over the successful runs; the first failure's status when none succeeded."""
    ok = [run for run in runs if run["status"] == "ok"]
    if not ok:
        return {"status": runs[0]["status"] if runs else "not run"}
    summary = {"status": "ok", "repeats": len(ok)}
    for field in NUMERIC_FIELDS:
        values = [run[field] for run in ok if run.get(field) is not None]
        summary[field] = statistics.median(values) if values else None
    return summary


# ----------------------------------------------------------------------------- formatting

def fmt_megabytes(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def fmt_seconds(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def fmt_ms(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def fmt_ratio(value, reference) -> str:
    if value is None or not reference:
        return "n/a"
    return f"{value / reference:.2f}x"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def task_table(task: str, summaries: dict[str, dict], device: str = "cpu", ratios: dict | None = None) -> str:
    """One row per library; failures and missing libraries get their status in the row.
    ``ratios``: each library's run-by-run ratios to the reference library."""
    gpu = device == "gpu"
    header = ["library", "binning s", "compile s", "boosting s", "ms/tree", "predict s", "predict all s",
              "predict 1 row ms", METRIC_NAME[task],
              "peak RSS MB"] + (["peak GPU MB"] if gpu else []) + [f"ms/tree vs {REFERENCE_LIBRARY}",
                                                                  "run by run: median (range)"]
    reference = summaries.get(REFERENCE_LIBRARY, {}).get("ms_per_tree")
    rows = []
    for library, summary in summaries.items():
        if summary["status"] != "ok":
            rows.append([library, summary["status"]] + [""] * (len(header) - 2))
            continue
        metric = summary["metric"]
        rows.append([library, fmt_seconds(summary["binning_s"]),
                     fmt_seconds(summary["compile_s"]) if library.startswith("jaxboost") else "n/a",
                     fmt_seconds(summary["boosting_s"]), fmt_ms(summary["ms_per_tree"]),
                     fmt_seconds(summary["predict_s"]), fmt_seconds(summary.get("predict_all_s")),
                     "n/a" if summary.get("predict_row_ms") is None else f"{summary['predict_row_ms']:.3f}",
                     "n/a" if metric is None else (f"{metric:.3f}" if task in ("regression", "absolute_error") else f"{metric:.4f}"),
                     f"{summary['peak_rss_mb']:.0f}"]
                    + ([fmt_megabytes(summary.get("gpu_peak_mb"))] if gpu else [])
                    + [fmt_ratio(summary["ms_per_tree"], reference),
                       fmt_turn_ratios((ratios or {}).get(library, []))])
    return markdown_table(header, rows)


def memory_table(summaries: dict[str, dict]) -> str:
    """Where each library's peak RSS comes from (medians, MB): what the process held before
    binning (the data and the imported libraries), the peak, its anonymous part (the process's
    own memory: heaps, arrays, compiled code) and the mapped files (shared libraries' code
    pages, shared with other processes and reclaimable) at the end."""
    header = ["library", "RSS at start (data + imports)", "peak RSS", "peak above start", "peak anonymous",
              "mapped files at end"]
    rows = []
    for library, summary in summaries.items():
        if summary["status"] != "ok":
            continue
        start, peak = summary.get("rss_start_mb"), summary["peak_rss_mb"]
        rows.append([library, fmt_megabytes(start), fmt_megabytes(peak),
                     fmt_megabytes(None if start is None else peak - start),
                     fmt_megabytes(summary.get("peak_anonymous_mb")), fmt_megabytes(summary.get("file_rss_mb"))])
    return markdown_table(header, rows)


def ms_cell(summary: dict) -> str:
    return fmt_ms(summary["ms_per_tree"]) if summary["status"] == "ok" else summary["status"]


# ----------------------------------------------------------------------------- benchmarks

def rotated(libraries: list[str], turn: int) -> list[str]:
    """The libraries in the order of turn ``turn``: each turn starts one library later."""
    start = turn % len(libraries) if libraries else 0
    return libraries[start:] + libraries[:start]


def run_tasks(args, runner: Runner) -> list[str]:
    sections = []
    for task in args.tasks:
        # Repeats alternate between the libraries, so a slow spell of a shared machine falls on
        # all of them rather than on whichever ran through it; each turn starts with the next
        # library, so none always runs in the same place in a turn.
        for repeat in range(1, args.repeats + 1):
            for library in rotated(args.libraries, repeat - 1):
                runner.run(library, task, args.rows, args.depth, args.max_bin, repeats=repeat)
        summaries = {library: runner.run(library, task, args.rows, args.depth, args.max_bin)
                     for library in args.libraries}
        n_samples = task_samples(task, args.rows)
        title = (f"## {task}: {n_samples:,} samples ({int(n_samples * 0.8):,} train) x {TASK_FEATURES[task]} features, "
                 f"{args.rounds} rounds, depth {args.depth}, {args.max_bin} bins")
        if task in MULTICLASS_TASKS and args.vector_leaves:
            title += f", {NUM_CLASSES} classes"
        elif task in MULTICLASS_TASKS:
            title += f", {NUM_CLASSES} classes (a round grows {NUM_CLASSES} trees: ms/tree is ms a round)"
        if args.eval_set:
            title += ", the test split as an eval set scored every round"
        if args.colsample_bytree != 1.0:
            title += f", {args.colsample_bytree:g} of the features sampled for each tree"
        if args.subsample != 1.0:
            title += f", {args.subsample:g} of the rows sampled for each round"
        if args.monotone:
            title += ", monotone constraints"
        if args.float64:
            title += ", float64 features"
        if args.deterministic_histogram:
            title += ", jaxboost with deterministic_histogram=True"
        if args.vector_leaves:
            title += f", one tree of vector leaves a round (jaxboost's from the {args.vector_leaves} Hessian)"
        config = (task, args.rows, args.depth, args.max_bin)
        ratios = {library: turn_ratios(runner, library, config) for library in args.libraries}
        section = (f"{title}\n\n{task_table(task, summaries, args.device, ratios)}\n\nMemory (MB, medians):\n\n"
                   f"{memory_table(summaries)}")
        print("\n" + section + "\n", flush=True)
        sections.append(section)
    return sections


def scaled(rows: int, args) -> int:
    return max(int(round(rows * args.rows / FULL_ROWS)), 100)


def run_scaling(args, runner: Runner) -> str:
    """jaxboost ms/tree vs rows and vs depth (with XGBoost), and vs bins, on the classification task."""
    task, base_rows = "classification", scaled(FULL_ROWS, args)
    with_reference = REFERENCE_LIBRARY in args.libraries

    def ms(library, rows=base_rows, depth=args.depth, max_bin=args.max_bin):
        return runner.run(library, task, rows, depth, max_bin, predict=False)

    libraries = ["jaxboost"] + ([REFERENCE_LIBRARY] if with_reference else [])
    reference_header = ([f"{REFERENCE_LIBRARY} ms/tree", f"jaxboost vs {REFERENCE_LIBRARY}", "run by run: median (range)"]
                        if with_reference else [])

    def compared(rows=base_rows, depth=args.depth) -> list[str]:
        """jaxboost's ms/tree and, with the reference library, its ms/tree and the ratios, from
        runs taken in turns as for the task tables."""
        for repeat in range(1, args.repeats + 1):
            for library in rotated(libraries, repeat - 1):
                runner.run(library, task, rows, depth, args.max_bin, predict=False, repeats=repeat)
        ours = ms("jaxboost", rows=rows, depth=depth)
        cells = [ms_cell(ours)]
        if with_reference:
            reference = ms(REFERENCE_LIBRARY, rows=rows, depth=depth)
            cells += [ms_cell(reference), fmt_ratio(ours.get("ms_per_tree"), reference.get("ms_per_tree")),
                      fmt_turn_ratios(turn_ratios(runner, "jaxboost", (task, rows, depth, args.max_bin)))]
        return cells

    row_counts = [scaled(r, args) for r in SCALING_ROWS]
    rows_table = [[f"{rows:,}"] + compared(rows=rows) for rows in row_counts]
    rows_header = ["rows", "jaxboost ms/tree"] + reference_header
    memory_header, memory_table_rows = growth_of_memory(libraries, row_counts, ms)
    # Each depth is a distinct shape: its compile time is the first fit's.
    depth_table = [[str(depth), f"{ms('jaxboost', depth=depth).get('compile_s') or float('nan'):.2f}"]
                   + compared(depth=depth) for depth in SCALING_DEPTHS]
    depth_header = ["depth", "jaxboost compile s", "jaxboost ms/tree"] + reference_header
    small_rows = scaled(SMALL_DATA_ROWS, args)
    small_depth_table = [[str(depth)] + compared(rows=small_rows, depth=depth) for depth in SCALING_DEPTHS]
    bins_table = [[str(max_bin), ms_cell(ms("jaxboost", max_bin=max_bin))] for max_bin in SCALING_BINS]
    section = "\n\n".join([
        f"## Scaling (classification task, {args.rounds} rounds, median ms/tree of {args.repeats} repeat(s))",
        f"### vs rows (depth {args.depth}, {args.max_bin} bins)\n\n" + markdown_table(rows_header, rows_table),
        "### peak memory vs rows (MB above the RSS at start, i.e. without the data and the imports; "
        "the last column: its growth per training row between the two largest sizes)\n\n"
        + markdown_table(memory_header, memory_table_rows),
        f"### vs depth ({base_rows:,} rows, {args.max_bin} bins)\n\n"
        + markdown_table(depth_header, depth_table),
        f"### vs depth on small data ({small_rows:,} rows, {args.max_bin} bins)\n\n"
        + markdown_table(["depth", "jaxboost ms/tree"] + reference_header, small_depth_table),
        f"### vs bins ({base_rows:,} rows, depth {args.depth})\n\n"
        + markdown_table(["max_bin", "jaxboost ms/tree"], bins_table),
    ])
    print("\n" + section + "\n", flush=True)
    return section


def growth_of_memory(libraries: list[str], row_counts: list[int], summary_of) -> tuple[list[str], list[list[str]]]:
    """Per library: peak RSS above the RSS at start for each row count (``summary_of(library,
    rows=...)`` gives the medians), and bytes per training row (80% of the rows) between the
    two largest counts: how memory grows with the data, apart from what a library holds
    whatever the data size."""
    header = ["library"] + [f"{rows:,} rows" for rows in row_counts] + ["bytes per training row"]
    table = []
    for library in libraries:
        above = []
        for rows in row_counts:
            summary = summary_of(library, rows=rows)
            ok = summary["status"] == "ok" and summary.get("rss_start_mb") is not None
            above.append(summary["peak_rss_mb"] - summary["rss_start_mb"] if ok else None)
        slope = None
        if len(row_counts) > 1 and above[-1] is not None and above[-2] is not None:
            slope = (above[-1] - above[-2]) * 2 ** 20 / (0.8 * (row_counts[-1] - row_counts[-2]))
        table.append([library] + [fmt_megabytes(value) for value in above] + [fmt_megabytes(slope)])
    return header, table


# ----------------------------------------------------------------------------- report

def machine_section(device: str = "cpu") -> str:
    info = run_worker(["--info"], device=device)
    versions = info.get("versions", {})
    lines = [f"- CPU count: {os.cpu_count()} ({available_cores()} available to this process: affinity mask "
             f"and CPU quota); processor: {platform.processor() or 'unknown'}; "
             f"platform: {platform.platform()}; Python {platform.python_version()}",
             "- versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()),
             "- JAX devices as seen by jaxboost: " + ", ".join(info.get("jax_devices", [info.get("status", "?")]))]
    return "\n".join(lines)


def method_notes(args) -> str:
    return "\n".join([
        f"- Every cell is the median of {args.repeats} run(s); each run is a fresh subprocess per library, "
        "and the tables alternate the libraries' runs (the first run of each, then the second, ...), each "
        "turn starting one library later than the last.",
        f"- ms/tree uses the difference method for every library: (time of a {args.rounds}-round train - time "
        f"of a 1-round train, both in a warmed-up process) / {args.rounds - 1}.",
        "- boosting s: the full train in the warmed-up process (jaxboost's compilation is excluded and shown as "
        "compile s = first 1-round train - second 1-round train; " + (
            "the program store warm: an untimed run of each configuration filled jaxboost's cache folder first, "
            "so every timed run is a later process that loads its programs, as a user's second script does)."
            if args.warm_store else "JAX's persistent compilation cache is off)."),
        "- binning s: jb.Dataset / xgb.QuantileDMatrix / lgb.Dataset(...).construct(); sklearn bins inside fit "
        "(its boosting s includes binning, its ms/tree does not).",
        "- predict s: the test set, the median of 3 warm calls; XGBoost: inplace_predict. predict all s: the same on all "
        "rows (train and test), timed after the memory figures are taken. predict 1 row ms: the median of "
        "200 one-row predictions (after 200 warm-up calls), the latency of serving one request at a time.",
        f"- ms/tree vs {REFERENCE_LIBRARY}: the ratio of the medians; run by run: the median (and range) of the "
        "ratios of runs taken in the same turn, which share a busy machine's slow spells.",
        "- peak RSS MB: the child's resident-memory high-water mark reset after data generation (includes the "
        "data (float32, or float64 with --float64) and imported libraries). The memory tables split it: RSS at start is what the child held "
        "once the data existed and the library was imported; peak anonymous is the highest RssAnon sampled every "
        "5 ms (the process's own memory); mapped files is RssFile at the end (mostly the libraries' machine "
        "code: shared between processes and reclaimable, but counted in RSS).",
        *(["- peak GPU MB: the GPU's memory in use (NVML, sampled every 2 ms), highest value minus the value "
           "before the library was imported; it includes the CUDA context. JAX runs with "
           "XLA_PYTHON_CLIENT_PREALLOCATE=false.",
           "- On the GPU: jaxboost on JAX's GPU backend (its XLA kernels; the native kernels are CPU-only), XGBoost "
           "with device='cuda'; inputs are NumPy arrays in host memory for both."] if args.device == "gpu" else []),
        *([f"- Eval set (--eval-set): every train, the timed ones included, evaluates the test split every round "
            f"with the task's loss (log loss, RMSE, multiclass log loss or MAE), without early stopping; ms/tree then "
            f"includes a round's prediction of the eval rows and its metric."] if args.eval_set else []),
        *([f"- Column sample (--colsample-bytree {args.colsample_bytree:g}): each tree draws that fraction of "
            f"the features (jaxboost and XGBoost colsample_bytree, LightGBM feature_fraction); scikit-learn "
            f"samples by split only and is left out."] if args.colsample_bytree != 1.0 else []),
        *([f"- Row sample (--subsample {args.subsample:g}): each round draws that fraction of the rows "
            f"(jaxboost and XGBoost subsample, LightGBM bagging_fraction with bagging_freq=1); scikit-learn has no "
            f"row sample and is left out."] if args.subsample != 1.0 else []),
        *(["- Monotone constraints (--monotone): +1, -1 and 0 in turn over the features, two thirds of them "
           "constrained (jaxboost, XGBoost and LightGBM monotone_constraints, scikit-learn monotonic_cst)."]
          if args.monotone else []),
        *(["- float64 features (--float64): every library gets the features as float64 (the float32 values "
           "widened), as NumPy and pandas hold them by default; binning and prediction read them."]
          if args.float64 else []),
        *([f"- Repeatable sums (--deterministic-histogram): jaxboost trains with deterministic_histogram=True "
            f"(on a GPU its histograms add whole-number pieces, exact in any order; XGBoost's GPU histograms are "
            f"repeatable by default; on CPU every library's are)."] if args.deterministic_histogram else []),
        *([f"- Vector leaves (--vector-leaves {args.vector_leaves}): jaxboost and XGBoost grow one tree a round "
            f"whose leaves hold all {NUM_CLASSES} classes' values (multi_strategy='multi_output_tree'; jaxboost's "
            f"leaves and gains from the {args.vector_leaves} Hessian, XGBoost's from its diagonal); LightGBM and "
            f"scikit-learn have none and are left out."] if args.vector_leaves else []),
        f"- Settings: learning rate 0.1, lambda 1 (0 for absolute_error: jaxboost's exact leaf refit "
        f"includes the penalty, the others' weighted medians do not), depth {args.depth} (LightGBM/sklearn: "
        f"at most "
        f"{2 ** args.depth} leaves), min leaf Hessian 1 (XGBoost min_child_weight, LightGBM "
        f"min_sum_hessian_in_leaf + min_data_in_leaf=1, sklearn min_samples_leaf=1), bins: jaxboost/XGBoost "
        f"{args.max_bin}, LightGBM/sklearn {args.max_bin - 1} + missing bin, {available_cores()} threads.",
    ])


def write_report(path: Path, parts: list[str]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(parts) + "\n")
    print(f"results written to {path}", file=sys.stderr)


def raw_runs_section(runner: Runner) -> str:
    lines = []
    for (library, task, rows, depth, max_bin), runs in runner.results.items():
        for run in runs:
            lines.append(json.dumps({"library": library, "task": task, "rows": rows, "depth": depth,
                                     "max_bin": max_bin, **run}))
    return "## Raw runs (one JSON object per subprocess)\n\n```\n" + "\n".join(lines) + "\n```"


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    comma_list = lambda text: [item.strip() for item in text.split(",") if item.strip()]  # noqa: E731
    parser.add_argument("--rows", type=int, default=FULL_ROWS,
                        help="classification rows (regression uses half); default %(default)s")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="runs per library; medians are reported")
    parser.add_argument("--tasks", type=comma_list, default=TASKS)
    parser.add_argument("--libraries", type=comma_list, default=None,
                        help=f"default: {','.join(LIBRARIES)} (with --device gpu: {','.join(GPU_LIBRARIES)})")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: jaxboost on JAX's GPU backend, XGBoost with device='cuda'")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--max-bin", type=int, default=256)
    parser.add_argument("--output", type=Path, default=EXPERIMENTS / "results" / "bench.md",
                        help="markdown results file (default: experiments/results/bench.md)")
    parser.add_argument("--scaling", action="store_true", help="add jaxboost ms/tree vs rows, depth and bins")
    parser.add_argument("--eval-set", action="store_true",
                        help="train with the test split as an eval set whose loss every round computes (sklearn "
                             "has none: left out by default)")
    parser.add_argument("--colsample-bytree", type=float, default=1.0,
                        help="fraction of the features each tree samples (scikit-learn, which samples by split "
                             "only, is left out by default)")
    parser.add_argument("--subsample", type=float, default=1.0,
                        help="fraction of the rows each round samples (scikit-learn, which has no row sample, is "
                             "left out by default)")
    parser.add_argument("--deterministic-histogram", action="store_true",
                        help="jaxboost with deterministic_histogram=True (repeatable GPU fits)")
    parser.add_argument("--vector-leaves", choices=["full", "diagonal"], default=None,
                        help="multiclass: one tree of vector leaves a round, jaxboost's from the full Hessian or its "
                             "diagonal (jaxboost and XGBoost only)")
    parser.add_argument("--monotone", action="store_true",
                        help="monotone constraints in every library: +1, -1 and 0 in turn over the features")
    parser.add_argument("--float64", action="store_true",
                        help="every library gets the features as float64 (the same values)")
    parser.add_argument("--warm-store", action="store_true",
                        help="jaxboost's timed runs load their programs from a cache folder that an untimed run "
                             "filled first (a later process's fit: its compile column is the programs' loading)")
    args = parser.parse_args(argv)
    for option, fraction in [("--colsample-bytree", args.colsample_bytree), ("--subsample", args.subsample)]:
        if not 0.0 < fraction <= 1.0:
            parser.error(f"{option} must be in (0, 1]")
    if args.libraries is None:
        args.libraries = GPU_LIBRARIES if args.device == "gpu" else LIBRARIES
        if args.eval_set or args.colsample_bytree != 1.0 or args.subsample != 1.0:
            args.libraries = [library for library in args.libraries if library != "sklearn"]
        if args.vector_leaves:
            args.libraries = [library for library in args.libraries if library in ("jaxboost", "xgboost")]
    if args.vector_leaves and set(args.tasks) - set(MULTICLASS_TASKS):
        parser.error("--vector-leaves applies to --tasks multiclass only")
    for name, chosen, allowed in [("--tasks", args.tasks, TASKS + OPTIONAL_TASKS),
                                  ("--libraries", args.libraries, LIBRARIES + OPTIONAL_LIBRARIES)]:
        unknown = sorted(set(chosen) - set(allowed))
        if unknown:
            parser.error(f"{name}: unknown {unknown}; choose from {allowed}")
    if args.rounds < 2 or args.repeats < 1 or args.rows < 100:
        parser.error("need --rounds >= 2, --repeats >= 1 and --rows >= 100")
    return args


def main(argv=None):
    args = parse_args(argv)
    command = "python " + shlex.join(sys.argv if argv is None else ["experiments/bench.py", *argv])
    started = datetime.datetime.now().astimezone()
    before = quietness_sample()
    print(describe_quietness("before", before), file=sys.stderr)
    warning = (f"**machine was NOT quiet: load {before['load1']:.2f}** (1-minute load average at start > "
               f"{QUIET_LOAD}); timings may be inflated" if before["load1"] > QUIET_LOAD else None)
    if warning:
        print(warning.replace("**", ""), file=sys.stderr)

    runner = Runner(args.repeats, args.rounds, args.device, args.eval_set, args.colsample_bytree, args.subsample,
                    args.deterministic_histogram, args.warm_store, args.vector_leaves, args.monotone, args.float64)
    try:
        sections = run_tasks(args, runner)
        if args.scaling:
            sections.append(run_scaling(args, runner))
    finally:
        if runner.store:
            shutil.rmtree(runner.store, ignore_errors=True)

    after = quietness_sample()
    print(describe_quietness("after", after), file=sys.stderr)
    quiet_lines = [describe_quietness("- before", before),
                   f"- during the runs: other processes used on average {runner.meter.other_cores:.2f} of "
                   f"{os.cpu_count()} cores (machine CPU from /proc/stat minus the benchmark's own)",
                   describe_quietness("- after", after)]
    if warning:
        quiet_lines.insert(0, f"- {warning}")
    print(quiet_lines[-2].lstrip("- "), file=sys.stderr)
    report = [
        "# jaxboost benchmark",
        f"- command: `{command}`\n- date: {started.isoformat(timespec='seconds')} "
        f"(took {(datetime.datetime.now().astimezone() - started).total_seconds() / 60:.1f} min)",
        "## Machine\n\n" + machine_section(args.device),
        "## Quietness\n\n" + "\n".join(quiet_lines),
        "## Method\n\n" + method_notes(args),
        *sections,
        raw_runs_section(runner),
    ]
    write_report(args.output if args.output.is_absolute() else Path.cwd() / args.output, report)


if __name__ == "__main__":
    main()
