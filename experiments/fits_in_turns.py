"""Timing of several libraries' fits in one process, taking turns (for the real-data benchmarks).

Each fit is a function of nothing; after a warm-up call each (jaxboost compiles there), the
fits run in turns, each turn starting one library later than the last, so that a slow spell of a
shared machine falls on every library alike. The table gives each library's median wall time a
fit and a round, its ratio to XGBoost's median, and the median (range) of the ratios of fits
taken in the same turn.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_in_turns(fits: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` fits a library, the libraries taking turns."""
    for fit in fits.values():
        fit()  # warm-up
    times = {name: [] for name in fits}
    names = list(fits)
    for turn in range(repeats):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            start = time.perf_counter()
            fits[name]()
            times[name].append(time.perf_counter() - start)
    return times


def turns_table(times: dict[str, list[float]], rounds: int, reference: str = "xgboost",
                reference_label: str = "XGBoost", first_column: str = "library") -> str:
    """The markdown table of ``time_in_turns``'s result, ratios to ``reference``'s fits."""
    base = times[reference]
    lines = [f"| {first_column} | ms a fit | ms a round | vs {reference_label} | run by run: median (range) |",
             "|---|---|---|---|---|"]
    for name, spent in times.items():
        ratios = [a / b for a, b in zip(spent, base)]
        median = statistics.median(spent)
        lines.append(f"| {name} | {1000 * median:.0f} | {1000 * median / rounds:.2f} "
                     f"| {median / statistics.median(base):.2f}x | {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(lines)
