"""Study: how many copies of the histogram the accelerators' scatter should spread its atomic adds
over, and other forms of that scatter, measured as whole trees on a GPU; and whether XLA's
command buffers (CUDA graphs) help.

Run from the repository root on a machine with a GPU: ``python experiments/gpu_level_copies.py``
(``--rows``, ``--repeats``, ``--output``). On a CPU it runs too (the copies do not matter there:
the CPU kernels are native), to check the script.

The float32 scatter (``histogram._pair_scatter_histogram``) spreads each node's atomic adds over
copies of its histogram, so that fewer of them wait on one address, and folds the copies after.
A tree's levels run in a loop over buffers of the widest level's size (32 node slots at depth 6).
The library's kernel scatters into ``histogram.scatter_slots(nodes)`` node slots (256 at depth 6)
shared out among the level's live nodes (the root gets 256 copies, the last level's 32 nodes 8).
Before, every node slot of every level got the same copies (``CELLS_PER_COPY // nodes``, at most
``MAX_COPIES``): with the 64 cells a copy of the first such kernel every level below the root got
2 copies, even the first, whose smaller child holds up to half the rows in one node.

Configurations (``--configs``, by name): the library's kernel and the kernels of
``scatter_variants.py`` in place of it (other slot counts, the fixed copies it replaced, a scatter
skipped when no row is summed, order-independent fixed-point sums in one int32 or in whole-number
float32 pieces), the library's
``deterministic_histogram=True`` (two int32 fixed-point pieces a value, ``jaxboost.fixed_point``),
and the library under XLA flags: deterministic (repeatable) scatters, and two that may shorten
the first fit's compile.

Each configuration runs in its own process (fresh compile), the configurations alternating,
``--repeats`` turns. In a process: the benchmark's task, ``jb.Dataset`` once, a 1-round fit (the
compile), then ms a tree by the benchmark's difference method, ``(t(41 rounds) - t(1 round)) / 40``,
the median of 3 such pairs; the test metric of the 41-round model (the copies change the
order of float additions, so the models may differ in the last bits, not more); and whether the
three 41-round fits of the process grew the same trees bit for bit (float atomic adds sum in a
varying order on a GPU; fixed-point sums do not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "experiments"))

# name -> (XLA_FLAGS added, kernel: None for the library's, else a name in
# scatter_variants.VARIANTS, jb.train settings added); the first is the library's. Earlier runs (see the results file)
# timed the fixed copies at other sizes (64/8, 512/16, 2048/64), and "--xla_gpu_enable_command_buffer="
# (no command buffers) with 64/8: the same ms a tree as with command buffers.
CONFIGS = {
    "library (256 slots)": ("", None, {}),
    "live copies 128": ("", "live copies 128", {}),
    "live copies 512": ("", "live copies 512", {}),
    "fixed copies 1024/32": ("", "fixed copies 1024/32", {}),
    "skip empty": ("", "skip empty", {}),
    "fixed point": ("", "fixed point", {}),
    "deterministic histogram": ("", None, {"deterministic_histogram": True}),
    "float pieces 2": ("", "float pieces 2", {}),
    "float pieces 4": ("", "float pieces 4", {}),
    # XLA's flags: repeatable scatters (their cost in ms a tree), and the compile.
    "deterministic ops": ("--xla_gpu_deterministic_ops=true", None, {}),
    "compile parallelism 16": ("--xla_gpu_force_compilation_parallelism=16", None, {}),
    "autotune off": ("--xla_gpu_autotune_level=0", None, {}),
}
# The next run's: the library's slots against fewer, more, and the kernel it replaced.
DEFAULT_CONFIGS = ("library (256 slots)", "live copies 128", "live copies 512", "fixed copies 1024/32")

ROUNDS = 41


def child(config: str, task: str, rows: int, data_file: Path) -> dict:
    import numpy as np

    import jaxboost as jb
    from bench_worker import LEARNING_RATE, MIN_HESSIAN, REG_LAMBDA, score

    kernel = CONFIGS[config][1]
    if kernel is not None:
        import scatter_variants
        variant = scatter_variants.VARIANTS[kernel]

        def swapped(*args, deterministic=False, **sizes):
            del deterministic  # the variants sum in their own way
            return variant(*args, **sizes)

        jb.histogram._pair_scatter_histogram = swapped
    data = np.load(data_file)
    X_train, X_test, y_train, y_test = (data[name] for name in ("X_train", "X_test", "y_train", "y_test"))
    params = dict(loss="logistic" if task == "classification" else "squared_error", max_depth=6,
                  learning_rate=LEARNING_RATE, reg_lambda=REG_LAMBDA, min_child_weight=MIN_HESSIAN, max_bin=256,
                  **CONFIGS[config][2])
    dataset = jb.Dataset(X_train, y_train, max_bin=256)

    def fit(rounds):
        start = time.perf_counter()
        model = jb.train(dataset, num_rounds=rounds, **{k: v for k, v in params.items() if k != "max_bin"})
        return time.perf_counter() - start, model

    compile_s = fit(1)[0]
    per_tree, models = [], []
    for _ in range(3):
        one = fit(1)[0]
        many, model = fit(ROUNDS)
        per_tree.append(1000 * (many - one) / (ROUNDS - 1))
        models.append(model)
    repeatable = all(np.array_equal(np.asarray(a), np.asarray(b))
                     for other in models[1:] for a, b in zip(models[0].trees, other.trees))
    return dict(config=config, task=task, ms_per_tree=statistics.median(per_tree), first_fit_s=compile_s,
                metric=score(task, y_test, model.predict(X_test)), repeatable=repeatable)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="the benchmark's --rows")
    parser.add_argument("--tasks", default="classification,regression")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated names among: {', '.join(CONFIGS)}")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if args.child:
        config, task, rows, data_file = args.child
        print("RESULT " + json.dumps(child(config, task, int(rows), Path(data_file))))
        return

    import numpy as np

    from bench_worker import make_task, task_samples

    results = []
    for task in args.tasks.split(","):
        data_file = Path(tempfile.gettempdir()) / f"jaxboost_gpu_level_copies_{task}_{args.rows}.npz"
        if not data_file.exists():
            X_train, X_test, y_train, y_test = make_task(task, args.rows)
            np.savez(data_file, X_train=X_train, X_test=X_test, y_train=y_train, y_test=y_test)
        for turn in range(args.repeats):
            names = args.configs.split(",")
            names = names[turn % len(names):] + names[:turn % len(names)]
            for config in names:
                env = dict(os.environ, JAXBOOST_CACHE_DIR="")  # first fit = compile
                extra = CONFIGS[config][0]
                if extra:
                    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra).strip()
                out = subprocess.run([sys.executable, __file__, "--child", config, task, str(args.rows), str(data_file)],
                                     env=env, capture_output=True, text=True, timeout=300)
                lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                if out.returncode or not lines:
                    print(f"{task} {config}: failed\n{out.stderr[-2000:]}", flush=True)
                    continue
                result = json.loads(lines[-1][len("RESULT "):])
                print(f"{task} {config} turn {turn + 1}: {result['ms_per_tree']:.2f} ms a tree, "
                      f"first fit {result['first_fit_s']:.2f} s, metric {result['metric']:.5f}, "
                      f"3 fits same bits: {result['repeatable']}", flush=True)
                results.append(result)

    import jax
    lines = [f"# GPU study: the accelerators' histogram scatter (its copies, its variants), whole trees",
             "", f"- command: `python experiments/gpu_level_copies.py --rows {args.rows} --repeats {args.repeats} "
             f"--configs '{args.configs}'`",
             f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; devices: {jax.devices()}",
             f"- JAX {jax.__version__}; every cell the median of {args.repeats} processes (each the median of 3 "
             f"difference-method measurements of {ROUNDS - 1} trees)", "",
             "| task | configuration | ms a tree | first fit s | test metric | ms a tree, by turn | a process's 3 fits "
             "the same bits, by turn |", "|---|---|---|---|---|---|---|"]
    for task in args.tasks.split(","):
        for config in args.configs.split(","):
            mine = [r for r in results if r["task"] == task and r["config"] == config]
            if not mine:
                continue
            lines.append(f"| {task} | {config} | {statistics.median(r['ms_per_tree'] for r in mine):.2f} | "
                         f"{statistics.median(r['first_fit_s'] for r in mine):.2f} | "
                         f"{statistics.median(r['metric'] for r in mine):.5f} | "
                         f"{', '.join('%.2f' % r['ms_per_tree'] for r in mine)} | "
                         f"{', '.join('yes' if r['repeatable'] else 'no' for r in mine)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
