"""Callbacks: code run by the host training loop before and after each boosting round.

Early stopping, the evaluation log and the progress bar are callbacks themselves; ``jb.train``
builds them from ``early_stopping_rounds`` and ``verbose``, and ``callbacks=`` adds more. A
callback sees a ``TrainingState``: the round index, the evaluation history, the best round so
far, and the trees grown so far (``state.model()``). Returning True from ``before_iteration``
or ``after_iteration`` stops training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class TrainingState:
    """What the training loop shares with callbacks (mutable, host-side)."""

    num_rounds: int
    first_round: int = 0  # rounds already in the model when training continues from init_model
    round_index: int = 0  # the round about to run (before) or just run (after), counted from 0
    evals_result: dict = field(default_factory=dict)  # {eval name: {metric name: [value per round]}}
    watched: tuple | None = None  # (eval name, metric name, higher is better) used for "best"
    best_iteration: int | None = None
    best_score: float | None = None
    build_model: Callable | None = None

    def model(self):
        """The model of the rounds grown so far."""
        return self.build_model()

    def latest(self, eval_name: str, metric_name: str) -> float:
        return self.evals_result[eval_name][metric_name][-1]


class Callback:
    """Base class: override any of the four hooks."""

    def before_training(self, state: TrainingState) -> None:
        pass

    def before_iteration(self, state: TrainingState) -> bool:
        return False

    def after_iteration(self, state: TrainingState) -> bool:
        return False

    def after_training(self, state: TrainingState) -> None:
        pass


class EarlyStopping(Callback):
    """Stop when the watched metric has not improved for ``rounds`` rounds.

    By default the watched metric is the last metric of the last eval set (as XGBoost); the
    best round becomes the model's ``best_iteration``, which ``predict`` uses by default.

    Args:
      rounds: patience, in rounds.
      data_name, metric_name: watch another eval set / metric.
      maximize: whether larger is better (default: known from the metric, else False).
      min_delta: an improvement must exceed this.
    """

    def __init__(self, rounds: int, data_name: str | None = None, metric_name: str | None = None,
                 maximize: bool | None = None, min_delta: float = 0.0):
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"early stopping rounds must be a positive integer; got {rounds!r}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0; got {min_delta}")
        self.rounds, self.data_name, self.metric_name = rounds, data_name, metric_name
        self.maximize, self.min_delta = maximize, min_delta

    def before_training(self, state: TrainingState) -> None:
        if not state.evals_result:
            raise ValueError("early stopping needs an eval_set")
        data_name = self.data_name or list(state.evals_result)[-1]
        if data_name not in state.evals_result:
            raise ValueError(f"early stopping watches {data_name!r}, which is not an eval set "
                             f"({sorted(state.evals_result)})")
        metric_name = self.metric_name or list(state.evals_result[data_name])[-1]
        if metric_name not in state.evals_result[data_name]:
            raise ValueError(f"early stopping watches metric {metric_name!r}, which is not evaluated "
                             f"({list(state.evals_result[data_name])})")
        maximize = self.maximize
        if maximize is None:
            maximize = state.watched is not None and state.watched[:2] == (data_name, metric_name) and state.watched[2]
        self._watch = (data_name, metric_name, bool(maximize))
        self._best_value, self._best_round = None, None

    def after_iteration(self, state: TrainingState) -> bool:
        data_name, metric_name, maximize = self._watch
        value = state.latest(data_name, metric_name)
        best = self._best_value
        improved = best is None or (value > best + self.min_delta if maximize else value < best - self.min_delta)
        if improved:
            self._best_value, self._best_round = value, state.round_index
            state.best_iteration, state.best_score = state.round_index, value
        return state.round_index - self._best_round >= self.rounds


class EvaluationMonitor(Callback):
    """Print the eval metrics every ``period`` rounds (and at the last round)."""

    def __init__(self, period: int = 1, printer: Callable[[str], None] = print):
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"the logging period must be a positive integer; got {period!r}")
        self.period, self.printer = period, printer

    def after_iteration(self, state: TrainingState) -> bool:
        last = state.first_round + state.num_rounds - 1
        if state.evals_result and (state.round_index % self.period == 0 or state.round_index == last):
            self.printer(f"[{state.round_index}]\t" + "\t".join(
                f"{name}-{metric}:{values[-1]:.6f}"
                for name, per_metric in state.evals_result.items() for metric, values in per_metric.items()))
        return False


class ProgressBar(Callback):
    """A tqdm progress bar over the rounds (needs the optional ``tqdm`` package)."""

    def before_training(self, state: TrainingState) -> None:
        try:
            from tqdm.auto import tqdm
        except ImportError as error:
            raise ImportError("ProgressBar needs tqdm: pip install 'jaxboost-gbdt[progress]'") from error
        self._bar = tqdm(total=state.num_rounds, unit="round")

    def after_iteration(self, state: TrainingState) -> bool:
        self._bar.update(1)
        if state.evals_result:
            name, per_metric = list(state.evals_result.items())[-1]
            metric, values = list(per_metric.items())[-1]
            self._bar.set_postfix({f"{name}-{metric}": f"{values[-1]:.5g}"})
        return False

    def after_training(self, state: TrainingState) -> None:
        self._bar.close()
