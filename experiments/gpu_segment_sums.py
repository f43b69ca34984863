"""Study: the leaf refit's segment sums on a GPU, and what a step of its search costs.

Run from the repository root on a machine with a GPU: ``python experiments/gpu_segment_sums.py``
(``--rows``, ``--segments``, ``--probes``, ``--repeats``, ``--output``; on a CPU it runs too, to
check the variants). A leaf refit (``line_search.minimise_segment_offsets``) sums, at every step
of its search, each row's derivative at each probe into the row's leaf: ``(rows, probes)`` values
into ``(segments, probes)`` sums. On an H100 a step of absolute error's refit took about 0.45 ms
at 400k rows with 15 probes (``gpu_refit_probes.md``), where XGBoost's whole tree takes 3.8.
Each variant below computes the same sums, checked against a float64 NumPy sum before it is
timed (median of ``--repeats`` calls after a warm-up, each synchronised):

* ``library``: ``line_search.segment_sums`` as the platform runs it (off the CPU, XLA's
  scatter-add: every row's values added atomically into its leaf's few addresses);
* ``copies_C``: the rows scattered into C copies of the sums (row ``i`` into copy ``i % C``),
  the copies added after: C times fewer atomic adds wait on one address (the histograms' trick,
  ``gpu_level_copies.md``);
* ``sorted``: the rows permuted by leaf once (as a refit could do once a round, outside its
  loop), then a ``segment_sum`` told its indices are sorted;
* ``onehot``: a one-hot ``(segments, rows)`` matrix times the values, full float32 precision:
  matrix units instead of atomics, at the cost of writing the one-hot matrix;
* ``steps_10``: the library's sums in a ``while_loop`` of 10 steps whose test depends on the
  sums (as the search's does): the per-step cost, the loop's test on the host included.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

from jaxboost.line_search import segment_sums


def library(values, segment_ids, num_segments, order):
    return segment_sums(values, segment_ids, num_segments)


def copies(count: int):
    def scattered(values, segment_ids, num_segments, order):
        copy = jnp.arange(values.shape[0], dtype=jnp.int32) % count
        sums = jax.ops.segment_sum(values, copy * num_segments + segment_ids, count * num_segments)
        return sums.reshape((count, num_segments) + values.shape[1:]).sum(axis=0)
    scattered.__name__ = f"copies_{count}"
    return scattered


def sorted_rows(values, segment_ids, num_segments, order):
    return jax.ops.segment_sum(values[order], segment_ids[order], num_segments, indices_are_sorted=True)


def onehot(values, segment_ids, num_segments, order):
    one_hot = (segment_ids[None, :] == jnp.arange(num_segments, dtype=jnp.int32)[:, None]).astype(values.dtype)
    return jnp.matmul(one_hot, values, precision=jax.lax.Precision.HIGHEST)


def steps_10(values, segment_ids, num_segments, order):
    def step(state):
        total, shift, iteration = state
        sums = segment_sums(values + shift, segment_ids, num_segments)
        return total + sums, shift + 1e-6 * jnp.sign(sums.sum()), iteration + 1

    def unfinished(state):
        total, _, iteration = state
        # Never true, but the test reads the sums, so the loop cannot run a known count of steps.
        return (iteration < 10) | (jnp.sum(jnp.abs(total)) < 0)

    total, shift, _ = jax.lax.while_loop(unfinished, step, (jnp.zeros((num_segments,) + values.shape[1:],
                                                                      values.dtype), jnp.float32(0), 0))
    return total / 10.0  # about one step's sums, to check it


VARIANTS = [library, copies(8), copies(64), sorted_rows, onehot, steps_10]


def timed(function, arguments, repeats: int) -> float:
    jax.block_until_ready(function(*arguments))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--segments", type=int, default=127, help="a depth-6 tree's heap nodes")
    parser.add_argument("--probes", default="1,15")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    # Rows spread over the last level's leaves, as a depth-6 tree leaves them.
    leaves = np.arange(args.segments // 2, args.segments)
    segment_ids = rng.choice(leaves, size=args.rows).astype(np.int32)
    order = np.argsort(segment_ids, kind="stable").astype(np.int32)
    lines = [f"# Segment sums on {jax.devices()[0].device_kind} ({jax.default_backend()})", "",
             f"- command: `python experiments/gpu_segment_sums.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"- {args.rows:,} rows into {args.segments} segments ({len(leaves)} holding rows); median of "
             f"{args.repeats} synchronised calls after a warm-up; jax {jax.__version__}", "",
             "| variant | probes | ms a call | max relative error |", "|---|---|---|---|"]
    for probes in [int(p) for p in args.probes.split(",")]:
        values = rng.standard_normal((args.rows, probes)).astype(np.float32) * 3.0
        values = values[:, 0] if probes == 1 else values
        expected = np.zeros((args.segments,) + values.shape[1:])
        np.add.at(expected, segment_ids, values.astype(np.float64))
        device_arguments = jax.device_put((values, segment_ids, order))
        for variant in VARIANTS:
            function = jax.jit(lambda v, s, o, variant=variant: variant(v, s, args.segments, o))
            got = np.asarray(function(*device_arguments), np.float64)
            if variant is steps_10:
                scale = np.abs(expected).max()  # shifted probes: only checks its order of magnitude
                error = np.abs(got - expected).max() / scale
                check = error < 0.1
            else:
                error = np.abs(got - expected).max() / np.abs(expected).max()
                check = error < 1e-5
            if not check:
                raise AssertionError(f"{variant.__name__} with {probes} probes: relative error {error:.2e}")
            milliseconds = 1000 * timed(function, device_arguments, args.repeats)
            lines.append(f"| {variant.__name__} | {probes} | {milliseconds:.3f} | {error:.1e} |")
            print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        args.output.write_text(report)


if __name__ == "__main__":
    main()
