"""Profile: where a cold first fit's compile time goes, by program, XLA phase and source function.

Run from the repository root: ``python experiments/profile_compile.py`` (``--task``, ``--rows``,
``--depth``, ``--loss``, ``--penalty``, ``--repeats``, ``--top``, ``--output FILE.md``). It needs no package
beyond the benchmark's. ``--penalty quadratic`` or ``smooth_l1`` fits with that custom leaf penalty
(``experiments/bench_penalty.py``'s) in place of ``reg_lambda=1``.

Each repeat is a fresh process with every cache off (``JAXBOOST_CACHE_DIR=``) that fits one round
on the benchmark's data (``bench_worker.make_task``, 80% for training), as the benchmark's compile
column does, and reports:

* the first fit's wall time, and the process's CPU time over it (on 2 cores, how much of the
  compile ran side by side);
* per program: JAX's tracing and lowering (Python, under the GIL), and XLA's compile, split into
  its HLO passes (one thread), its code generation (``Compiling ... using JIT``: the LLVM IR
  emission, then the IR's modules compiled by a pool of threads) and the LLVM modules' count and
  summed compile time, from XLA's own timers (``TF_CPP_VMODULE``);
* the slowest HLO passes of the largest program.

One more process dumps the programs' LLVM IR (``--xla_dump_to``) and attributes each kernel's IR
to the innermost jaxboost function on its source stack (from the optimised HLO's stack frames).
Unlike a time, the IR's size does not vary with the host's load. The IR as emitted (the table by
function) can shrink without LLVM's time moving: code that LLVM's optimisation folds away (a
traced integer power's chain of squarings, floor division's sign fixes) had been 22% of the
depth-6 trees' IR as emitted and 4.5% after optimisation, and removing it left the compile within
the host's noise. The optimised IR's size is the closer measure of what code generation does.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {experiments!r})
import jax
import jaxboost as jb
from bench_worker import make_task, task_loss
from bench_penalty import quadratic, smooth_l1

penalty = dict(quadratic=dict(regularizer=jb.regularizers.custom(quadratic)),
               smooth_l1=dict(regularizer=jb.regularizers.custom(smooth_l1, reg_lambda=1.0)),
               none=dict(reg_lambda=1.0))[{penalty!r}]

events = []
start = [None]

def listener(name, seconds, **kwargs):
    if start[0] is not None:
        events.append((name.rsplit("/", 1)[-1], seconds, str(kwargs.get("fun_name")),
                       time.perf_counter() - start[0]))

jax.monitoring.register_event_duration_secs_listener(listener)
X, _, y, _ = make_task({task!r}, {rows})
dataset = jb.Dataset(X, y)
monotone = dict(monotone_constraints=[1, -1] + [0] * (X.shape[1] - 2)) if {monotone!r} else dict()
loss = {loss!r} or task_loss({task!r})

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

def fit():
    jb.train(dataset, loss=loss, num_rounds=1, max_depth={depth}, learning_rate=0.1,
             min_child_weight=1.0, multi_strategy={multi_strategy!r}, **penalty, **monotone)

start[0], cpu_before = time.perf_counter(), cpu()
fit()
first_s, first_cpu_s = time.perf_counter() - start[0], cpu() - cpu_before
start[0] = None
begin = time.perf_counter()
fit()
print("RESULT " + json.dumps(dict(first_s=first_s, first_cpu_s=first_cpu_s, second_s=time.perf_counter() - begin,
                                  events=events, devices=[str(d) for d in jax.devices()], training_rows=len(X))))
"""

# XLA's timers, as its log prints them ("... time: 1.12 s (1123881 us) ...").
_TIMER = r"time: [0-9.]+ \w+ \(([0-9]+) us\)"


def run_child(args, env_extra: dict) -> tuple[dict, str]:
    """One fresh process's first fit: its result and its log (standard error)."""
    code = CHILD.format(experiments=str(REPO_ROOT / "experiments"), task=args.task, rows=args.rows, depth=args.depth,
                        loss=args.loss, multi_strategy=args.multi_strategy, penalty=args.penalty,
                        monotone=args.monotone)
    env = dict(os.environ, JAXBOOST_CACHE_DIR="", **env_extra)
    with tempfile.TemporaryDirectory() as folder:  # the repository root would shadow an installed jaxboost
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=folder,
                             timeout=900)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), run.stderr


def xla_phases(log: str) -> dict:
    """Per program (XLA's module name): HLO passes s, code generation s, LLVM modules and their
    summed compile s, and the program's pass times (a pass's total over its runs)."""
    lines = log.splitlines()
    programs: dict[str, dict] = {}
    thread_passes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    llvm_by_thread: list[tuple[str, float]] = []

    def stamp(line: str) -> float:
        hours, minutes, seconds = line.split()[1].split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)

    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        thread = parts[2]
        timer = re.search(_TIMER, line)
        if not timer:
            continue
        seconds = int(timer.group(1)) / 1e6
        passed = re.search(r"HLO pass: (\S+) time:", line)
        if passed:
            thread_passes[thread][passed.group(1)] += seconds
            continue
        hlo = re.search(r"Running HLO passes on \[(\S+)\] for CPU", line)
        if hlo:
            entry = programs.setdefault(hlo.group(1), {})
            entry["hlo_passes_s"] = seconds
            # A thread compiles one program at a time: the passes it ran since its last program.
            entry["passes"] = dict(thread_passes.pop(thread, {}))
            entry["hlo_end"] = stamp(line)
            continue
        codegen = re.search(r"Compiling \[(\S+)\] for CPU using JIT", line)
        if codegen:
            entry = programs.setdefault(codegen.group(1), {})
            entry["codegen_s"] = seconds
            entry["codegen_end"] = stamp(line)
            continue
        if "Compiled LLVM module" in line:
            llvm_by_thread.append((stamp(line), seconds))
    for entry in programs.values():
        # LLVM modules compiled while this program generated code (programs that generate code
        # at the same time share modules' counts: a bound, not an attribution).
        if "hlo_end" in entry and "codegen_end" in entry:
            inside = [seconds for at, seconds in llvm_by_thread if entry["hlo_end"] <= at <= entry["codegen_end"]]
            entry["llvm_modules"], entry["llvm_s"] = len(inside), sum(inside)
    return programs


def jax_phases(events: list) -> dict:
    """Per program (JAX's function name): tracing, lowering and XLA compile seconds."""
    phases: dict[str, dict] = collections.defaultdict(lambda: collections.defaultdict(float))
    kinds = {"jaxpr_trace_duration": "trace_s", "jaxpr_to_mlir_module_duration": "lower_s",
             "backend_compile_duration": "compile_s"}
    for name, seconds, function, _ in events:
        if name in kinds:
            program = function[4:-1] if function.startswith("jit(") else function
            phases[program][kinds[name]] += seconds
    return phases


def ir_by_source(dump: Path, top: int) -> tuple[dict, dict]:
    """Each program's LLVM IR bytes and module count, and the largest program's IR bytes by the
    innermost jaxboost function on each kernel's source stack."""
    totals, per_function = {}, {}
    for optimised in dump.glob("*.cpu_after_optimizations.txt"):
        program = optimised.name.split(".")[1]
        irs = list(dump.glob(f"{optimised.name.split('.')[0]}.{program}.*ir-no-opt.ll"))
        kernels = {}
        for ir in irs:
            current = None
            for line in ir.read_text().splitlines():
                defined = re.match(r"define .*@([\w.\-]+)\(", line)
                if defined:
                    current = defined.group(1)
                    kernels[current] = 0
                elif current is not None:
                    kernels[current] += len(line) + 1
                    if line.startswith("}"):
                        current = None
        optimised_ir = dump.glob(f"{optimised.name.split('.')[0]}.{program}.*ir-with-opt.ll")
        totals[program] = dict(ir_bytes=sum(kernels.values()), modules=len(irs),
                               optimised_ir_bytes=sum(path.stat().st_size for path in optimised_ir))
        per_function[program] = _attribute(optimised.read_text(), kernels, top)
    return totals, per_function


def _attribute(hlo: str, kernels: dict, top: int) -> list:
    """``kernels`` (LLVM function name: IR bytes) by the innermost jaxboost function on the source
    stack of the HLO instruction each was emitted for (XLA names a kernel after it)."""
    lines = hlo.splitlines()

    def table(name: str) -> dict:
        try:
            begin = lines.index(name)
        except ValueError:
            return {}
        rows = {}
        for line in lines[begin + 1:]:
            row = re.match(r"^(\d+) (.*)$", line.strip())
            if not row:
                break
            rows[int(row.group(1))] = row.group(2)
        return rows

    files, functions, locations, frames = (table(name) for name in
                                           ("FileNames", "FunctionNames", "FileLocations", "StackFrames"))

    def innermost(frame_id: int) -> str:
        seen = set()
        while frame_id and frame_id not in seen and frame_id in frames:
            seen.add(frame_id)
            frame = frames[frame_id]
            location = locations[int(re.search(r"file_location_id=(\d+)", frame).group(1))]
            fields = re.search(r"file_name_id=(\d+) function_name_id=(\d+)", location)
            file_name = files[int(fields.group(1))].strip('"')
            if "/jaxboost/" in file_name:
                return f"{Path(file_name).name}:{functions[int(fields.group(2))].strip(chr(34))}"
            parent = re.search(r"parent_frame_id=(\d+)", frame)
            frame_id = int(parent.group(1)) if parent else 0
        return "(no jaxboost frame)"

    frame_of = {}
    for line in lines:
        instruction = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*stack_frame_id=(\d+)", line)
        if instruction:
            frame_of[instruction.group(1)] = int(instruction.group(2))
    by_function = collections.Counter()
    for kernel, size in kernels.items():
        instruction = re.sub(r"_kernel$", "", kernel)
        by_function[innermost(frame_of[instruction]) if instruction in frame_of else "(XLA's library code)"] += size
    return by_function.most_common(top)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["classification", "regression", "multiclass"], default="classification")
    parser.add_argument("--rows", type=int, default=1_000_000,
                        help="the task's rows at the full size (the benchmark's: multiclass takes a fifth); 80%% train")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--loss", help="a built-in loss's name (default: the task's, logistic, softmax or squared_error)")
    parser.add_argument("--multi-strategy", default="one_output_per_tree", choices=["one_output_per_tree", "multi_output_tree"],
                        help="vector leaves (multi_output_tree) for a loss of several outputs")
    parser.add_argument("--penalty", default="none", choices=["none", "quadratic", "smooth_l1"],
                        help="a custom leaf penalty (experiments/bench_penalty.py's) in place of reg_lambda=1")
    parser.add_argument("--monotone", action="store_true",
                        help="constrain the first two features (increasing, decreasing), as the compile survey does")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=15, help="rows in the source and pass tables")
    parser.add_argument("--output", help="write the tables to this Markdown file too")
    args = parser.parse_args()
    started = time.time()

    runs = []
    for _ in range(args.repeats):
        result, log = run_child(args, dict(TF_CPP_MIN_LOG_LEVEL="0",
                                           TF_CPP_VMODULE="cpu_compiler=1,ir_compiler=1,hlo_pass_pipeline=1"))
        runs.append((result, jax_phases(result["events"]), xla_phases(log)))
    with tempfile.TemporaryDirectory() as dump:
        run_child(args, dict(XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                                       "--xla_dump_hlo_as_text"))
        ir_totals, ir_sources = ir_by_source(Path(dump), args.top)

    def median(values):
        values = [value for value in values if value is not None]
        return statistics.median(values) if values else None

    def cell(value, digits=2):
        return "" if value is None else f"{value:.{digits}f}"

    programs = sorted({program for _, phases, _ in runs for program in phases},
                      key=lambda program: -(median([phases.get(program, {}).get("compile_s")
                                                    for _, phases, _ in runs]) or 0))
    out = ["# Where a cold first fit's compile time goes", "",
           f"- command: `python experiments/profile_compile.py --task {args.task} --rows {args.rows} "
           f"--depth {args.depth} --repeats {args.repeats}"
           f"{f' --loss {args.loss}' if args.loss else ''}"
           f"{f' --multi-strategy {args.multi_strategy}' if args.multi_strategy != 'one_output_per_tree' else ''}"
           f"{f' --penalty {args.penalty}' if args.penalty != 'none' else ''}"
           f"{' --monotone' if args.monotone else ''}`",
           f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')} (took {(time.time() - started) / 60:.1f} min); "
           f"devices: {', '.join(runs[0][0]['devices'])}",
           f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
           f"load average {os.getloadavg()[0]:.2f} at the end",
           f"- a 1-round fit of {args.task}{f' with {args.loss}' if args.loss else ''}"
           f"{' (vector leaves)' if args.multi_strategy == 'multi_output_tree' else ''}"
           f"{f', the custom penalty {args.penalty}' if args.penalty != 'none' else ''}"
           f"{', monotone constraints on two features' if args.monotone else ''} "
           f"({runs[0][0]['training_rows']:,} training rows, depth {args.depth}) in a fresh "
           "process, caches off; medians of the repeats (XLA's timers are its log's, which adds a little)", "",
           f"First fit: {cell(median([r['first_s'] for r, _, _ in runs]))} s wall "
           f"({', '.join(cell(r['first_s']) for r, _, _ in runs)}), "
           f"{cell(median([r['first_cpu_s'] for r, _, _ in runs]))} s of CPU; the second fit "
           f"{cell(median([r['second_s'] for r, _, _ in runs]), 3)} s.", "",
           "| program | trace s | lower s | XLA compile s | HLO passes s | code generation s | LLVM modules | "
           "LLVM modules' summed s | LLVM IR KB | optimised LLVM IR KB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for program in programs:
        xla_name = "jit_" + program.replace("<", "_").replace(">", "_")

        def xla(key):
            return median([phases.get(xla_name, {}).get(key) for _, _, phases in runs])

        ir = ir_totals.get(xla_name, {})
        out.append(f"| {program} | " + " | ".join([
            cell(median([phases.get(program, {}).get("trace_s") for _, phases, _ in runs])),
            cell(median([phases.get(program, {}).get("lower_s") for _, phases, _ in runs])),
            cell(median([phases.get(program, {}).get("compile_s") for _, phases, _ in runs])),
            cell(xla("hlo_passes_s")), cell(xla("codegen_s")), cell(xla("llvm_modules"), 0), cell(xla("llvm_s")),
            cell(ir.get("ir_bytes", 0) / 1024, 0) if ir else "",
            cell(ir.get("optimised_ir_bytes", 0) / 1024, 0) if ir else ""]) + " |")
    largest = "jit_" + programs[0]
    pass_totals = collections.defaultdict(list)
    for _, _, phases in runs:
        for name, seconds in phases.get(largest, {}).get("passes", {}).items():
            pass_totals[name].append(seconds)
    out += ["", f"The slowest HLO passes of `{largest}` (a pipeline's time includes its passes'):", "",
            "| pass | s |", "|---|---|"]
    for name, seconds in sorted(pass_totals.items(), key=lambda item: -median(item[1]))[:args.top]:
        out.append(f"| {name} | {median(seconds):.3f} |")
    out += ["", f"`{largest}`'s LLVM IR by the innermost jaxboost function of each kernel's source:", "",
            "| function | IR KB | share |", "|---|---|---|"]
    total = ir_totals.get(largest, {}).get("ir_bytes", 0) or 1
    for name, size in ir_sources.get(largest, []):
        out.append(f"| {name} | {size / 1024:.0f} | {100 * size / total:.0f}% |")
    text = "\n".join(out) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
