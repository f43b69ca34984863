"""Benchmark: what a loss's derivatives cost a round, by how the loss is composed.

Run from the repository root: ``python experiments/bench_derivatives.py`` (``--rows``,
``--repeats``, ``--output FILE.md``). Each loss's gradients, Hessians and values are computed as a
round computes them (``derivatives.values_gradients_and_hessians`` in the round's chunks of rows,
``boosting.in_row_chunks``, the value folded into the gradient as the round's health check does)
for one device's share of the benchmark's classification rows, on one CPU device; the table gives
the median time a call, the calls of the losses taking turns. The losses: the built-in logistic loss, optax's sigmoid binary
cross-entropy, a focal loss as the README writes it, and those two composed with
``jaxboost.losses.softplus`` instead of ``jax.nn``'s log-sigmoid (the same values).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxboost import losses  # noqa: E402
from jaxboost.boosting import DERIVATIVE_CHUNK_ROWS, in_row_chunks  # noqa: E402
from jaxboost.derivatives import values_gradients_and_hessians  # noqa: E402


def focal(raw_prediction, y, gamma=2.0):
    margin = (2.0 * y - 1.0) * raw_prediction
    return -((1.0 - jax.nn.sigmoid(margin)) ** gamma) * jax.nn.log_sigmoid(margin)


def focal_with_softplus(raw_prediction, y, gamma=2.0):
    margin = (2.0 * y - 1.0) * raw_prediction
    return ((1.0 - jax.nn.sigmoid(margin)) ** gamma) * losses.softplus(-margin)


def cross_entropy_with_softplus(raw_prediction, y):
    return y * losses.softplus(-raw_prediction) + (1.0 - y) * losses.softplus(raw_prediction)


LOSSES = {
    "built-in logistic": losses.logistic,
    "optax sigmoid_binary_cross_entropy": optax.losses.sigmoid_binary_cross_entropy,
    "the same with losses.softplus": cross_entropy_with_softplus,
    "focal (README)": focal,
    "focal with losses.softplus": focal_with_softplus,
}


def round_derivatives(loss):
    """A jitted function of (raw, y): the round's derivatives of ``loss``, in its chunks of rows."""
    def chunk(raw, y):
        values, g, h = values_gradients_and_hessians(loss, raw, y)
        return g + 0.0 * values, h

    return jax.jit(lambda raw, y: in_row_chunks(chunk, (raw, y)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=13 * DERIVATIVE_CHUNK_ROWS, help="rows (one device's share)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    device = jax.devices("cpu")[0]
    raw = jax.device_put((3.0 * rng.standard_normal(args.rows)).astype(np.float32), device)
    y = jax.device_put((rng.random(args.rows) < 0.5).astype(np.float32), device)
    functions = {name: round_derivatives(loss) for name, loss in LOSSES.items()}
    for function in functions.values():
        jax.block_until_ready(function(raw, y))
    times = {name: [] for name in functions}
    for _ in range(args.repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(function(raw, y))
            times[name].append(time.perf_counter() - start)
    builtin = statistics.median(times["built-in logistic"])
    lines = [
        "| loss | ms a call | vs the built-in |",
        "|---|---|---|",
        *(f"| {name} | {1000 * statistics.median(spent):.2f} | {statistics.median(spent) / builtin:.2f}x |"
          for name, spent in times.items()),
    ]
    header = [f"- command: `python experiments/bench_derivatives.py --rows {args.rows} --repeats {args.repeats}`",
              f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; jax {jax.__version__}, Python "
              f"{platform.python_version()}; {args.rows:,} rows on one CPU device, medians of {args.repeats} calls "
              "taken in turns", ""]
    text = "\n".join(header + lines)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
