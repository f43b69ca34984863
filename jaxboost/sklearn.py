"""scikit-learn estimators: ``JaxBoostRegressor`` and ``JaxBoostClassifier`` around ``jb.train``.

The estimators validate input the scikit-learn way (``validate_data``: feature counts, feature
names, dtypes, NaN allowed as missing), map class labels to ``0..K-1``, call ``jb.train`` and
keep the trained ``Model`` (``get_booster()``). Parameter names follow XGBoost's scikit-learn
API: ``n_estimators`` is ``num_rounds``, ``random_state`` is ``seed``, ``n_jobs`` caps the CPU
cores of a fit and its predictions (``jb.cpu_cores``), ``deterministic_histogram`` is
``jb.train``'s (repeatable GPU fits), and early stopping is set in the constructor
(``early_stopping_rounds``, ``eval_metric``) with ``eval_set`` passed to ``fit``.

Two choices that make ``sample_weight`` mean "repeat this row that many times":
rows with zero weight are dropped before training, so they move neither the bin edges nor
anything else; and all-zero weights are an error. Sparse input is rejected with a TypeError:
densifying it would turn the implicit zeros into values, while XGBoost reads them as missing.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils import check_random_state
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import _check_sample_weight, check_is_fitted, column_or_1d, validate_data

from . import losses
from .cores import cpu_cores
from .link import LINKS, resolve_link
from .training import train

__all__ = ["JaxBoostClassifier", "JaxBoostRegressor"]


def _is_builtin_loss(loss) -> bool:
    """Whether ``loss`` is a built-in name or function (possibly with bound parameters)."""
    if isinstance(loss, str):
        return True
    function = loss.func if isinstance(loss, functools.partial) else loss
    return any(record.function is function for record in losses.BUILTINS.values())


def _seed(random_state) -> int:
    """``random_state`` as ``jb.train``'s integer seed (None -> 0, as XGBoost)."""
    if random_state is None:
        return 0
    if isinstance(random_state, numbers.Integral):
        return int(random_state)
    return int(check_random_state(random_state).randint(np.iinfo(np.int32).max))


def _link_name(link) -> str | None:
    return next((name for name, function in LINKS.items() if function is link), None)


class _JaxBoostEstimator(BaseEstimator):
    """Shared parameters, validation, training and pickling of the two estimators."""

    def __init__(self, *, n_estimators=100, max_depth=6, learning_rate=0.1, reg_lambda=1.0, reg_alpha=0.0,
                 gamma=0.0, min_child_weight=1.0, max_bin=256, subsample=1.0, colsample_bytree=1.0,
                 colsample_bylevel=1.0, colsample_bynode=1.0, max_delta_step=0.0, scale_pos_weight=1.0,
                 loss=None, early_stopping_rounds=None, eval_metric=None, importance_type="gain",
                 random_state=None, multi_strategy="one_output_per_tree", n_jobs=None,
                 deterministic_histogram=False):
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.reg_lambda = reg_lambda
        self.reg_alpha = reg_alpha
        self.gamma = gamma
        self.min_child_weight = min_child_weight
        self.max_bin = max_bin
        self.subsample = subsample
        self.colsample_bytree = colsample_bytree
        self.colsample_bylevel = colsample_bylevel
        self.colsample_bynode = colsample_bynode
        self.max_delta_step = max_delta_step
        self.scale_pos_weight = scale_pos_weight
        self.loss = loss
        self.early_stopping_rounds = early_stopping_rounds
        self.eval_metric = eval_metric
        self.importance_type = importance_type
        self.random_state = random_state
        self.multi_strategy = multi_strategy
        self.n_jobs = n_jobs
        self.deterministic_histogram = deterministic_histogram

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.input_tags.sparse = False
        return tags

    def _validate_X(self, X, *, reset: bool):
        # accept_sparse=False: scikit-learn's own TypeError says that sparse input is not supported.
        return validate_data(self, X, reset=reset, ensure_all_finite="allow-nan", accept_sparse=False,
                             dtype=[np.float32, np.float64])

    def _fit_booster(self, X, encoded_y, sample_weight, eval_set, verbose, loss_arguments: dict):
        """Shared tail of ``fit``: weights, eval sets, ``jb.train`` and the fitted attributes."""
        if sample_weight is not None:
            # Zero weight means "not in the data": such rows must not shape the bin edges either.
            kept = sample_weight > 0
            X, encoded_y, sample_weight = X[kept], encoded_y[kept], sample_weight[kept]
        eval_pairs = None
        if eval_set is not None:
            eval_pairs = [(self._validate_X(X_eval, reset=False), self._encode_eval_labels(y_eval))
                          for X_eval, y_eval in eval_set]
        with cpu_cores(self.n_jobs):  # the fit's devices and threads
            booster = train(
                X, encoded_y, **loss_arguments, num_rounds=self.n_estimators, max_depth=self.max_depth,
                learning_rate=self.learning_rate, reg_lambda=self.reg_lambda, reg_alpha=self.reg_alpha,
                gamma=self.gamma, min_child_weight=self.min_child_weight, max_bin=self.max_bin,
                subsample=self.subsample, colsample_bytree=self.colsample_bytree,
                colsample_bylevel=self.colsample_bylevel, colsample_bynode=self.colsample_bynode,
                max_delta_step=self.max_delta_step, scale_pos_weight=self.scale_pos_weight,
                sample_weight=sample_weight, eval_set=eval_pairs, eval_metric=self.eval_metric,
                early_stopping_rounds=self.early_stopping_rounds, verbose=verbose, seed=_seed(self.random_state),
                multi_strategy=self.multi_strategy, deterministic_histogram=self.deterministic_histogram)
        if hasattr(self, "feature_names_in_"):
            booster = dataclasses.replace(booster, feature_names=tuple(str(name) for name in self.feature_names_in_))
        self._booster = booster
        self.best_iteration_ = booster.best_iteration
        self.evals_result_ = booster.evals_result
        return self

    def _encode_eval_labels(self, y_eval):
        return column_or_1d(y_eval)

    @staticmethod
    def _check_weights(sample_weight, X):
        """Weights as float64 (n,): non-negative, not all zero (scikit-learn's own checks), or None."""
        if sample_weight is None:
            return None
        return _check_sample_weight(sample_weight, X, dtype=np.float64, ensure_non_negative=True)

    def _raw(self, X) -> np.ndarray:
        return self._predicted(X, raw=True)

    def _predicted(self, X, *, raw: bool) -> np.ndarray:
        """The booster's raw predictions or predictions (after the link) of ``X``, with ``n_jobs``."""
        check_is_fitted(self)
        X = self._validate_X(X, reset=False)
        with cpu_cores(self.n_jobs):
            return self._booster.predict_raw(X) if raw else self._booster.predict(X)

    def get_booster(self):
        """The trained ``jaxboost.Model``."""
        check_is_fitted(self)
        return self._booster

    @property
    def feature_importances_(self) -> np.ndarray:
        """Importance of each feature normalised to sum to 1 (all zeros when no tree splits).

        ``importance_type`` picks the kind, as in XGBoost: ``"gain"`` (average loss reduction
        of the splits on the feature, the default), ``"total_gain"``, ``"weight"`` (number of
        splits), ``"cover"`` or ``"total_cover"``, over the rounds ``predict`` uses.
        """
        check_is_fitted(self)
        booster = self._booster
        scores = booster.feature_importance(kind=self.importance_type)
        names = booster.feature_names or tuple(f"f{index}" for index in range(booster.n_features))
        importance = np.array([scores.get(name, 0.0) for name in names], dtype=np.float64)
        total = importance.sum()
        return importance / total if total > 0 else importance

    # A Model's built-in links are JAX functions that do not pickle; store them by name.
    def __getstate__(self):
        state = dict(super().__getstate__())
        booster = state.get("_booster")
        if booster is not None:
            name = _link_name(booster.link)
            if name is not None:
                state["_booster"] = dataclasses.replace(booster, link=name)
        return state

    def __setstate__(self, state):
        booster = state.get("_booster")
        if booster is not None and isinstance(booster.link, str):
            state["_booster"] = dataclasses.replace(booster, link=resolve_link(booster.link))
        super().__setstate__(state)


class JaxBoostRegressor(RegressorMixin, _JaxBoostEstimator):
    """Gradient-boosted trees for regression, in the scikit-learn API.

    Parameters mean what ``jb.train``'s do (``n_estimators`` is ``num_rounds``,
    ``random_state`` is ``seed``; ``n_jobs``: the CPU cores of a fit and its predictions, all
    by default, see ``jb.cpu_cores``). ``loss`` is a built-in name (default ``"squared_error"``),
    a built-in function with bound parameters, or any JAX function
    ``loss(raw_prediction, y) -> scalar`` of one example; ``link`` is the inverse link
    ``predict`` applies for a custom loss (default identity).
    """

    def __init__(self, *, n_estimators=100, max_depth=6, learning_rate=0.1, reg_lambda=1.0, reg_alpha=0.0,
                 gamma=0.0, min_child_weight=1.0, max_bin=256, subsample=1.0, colsample_bytree=1.0,
                 colsample_bylevel=1.0, colsample_bynode=1.0, max_delta_step=0.0, scale_pos_weight=1.0,
                 loss="squared_error", link=None, early_stopping_rounds=None, eval_metric=None,
                 importance_type="gain", random_state=None, multi_strategy="one_output_per_tree", n_jobs=None,
                 deterministic_histogram=False):
        super().__init__(n_estimators=n_estimators, max_depth=max_depth, learning_rate=learning_rate,
                         reg_lambda=reg_lambda, reg_alpha=reg_alpha, gamma=gamma, min_child_weight=min_child_weight,
                         max_bin=max_bin, subsample=subsample, colsample_bytree=colsample_bytree,
                         colsample_bylevel=colsample_bylevel, colsample_bynode=colsample_bynode,
                         max_delta_step=max_delta_step, scale_pos_weight=scale_pos_weight, loss=loss,
                         early_stopping_rounds=early_stopping_rounds, eval_metric=eval_metric,
                         importance_type=importance_type, random_state=random_state, multi_strategy=multi_strategy,
                         n_jobs=n_jobs, deterministic_histogram=deterministic_histogram)
        self.link = link

    def fit(self, X, y, sample_weight=None, eval_set=None, verbose=False):
        """Train on ``X`` (n, d) and ``y`` (n,).

        Args:
          X: features; NaN marks a missing value. A DataFrame's column names are recorded.
          y: real targets.
          sample_weight: non-negative per-row weights (not all zero).
          eval_set: list of ``(X, y)`` pairs evaluated every round (``evals_result_``); the
            last one drives ``early_stopping_rounds``.
          verbose: print the eval metrics every round (True) or every N rounds.
        """
        X, y = validate_data(self, X, y, ensure_all_finite="allow-nan", accept_sparse=False,
                             dtype=[np.float32, np.float64], y_numeric=True)
        return self._fit_booster(X, np.asarray(y, dtype=np.float64), self._check_weights(sample_weight, X),
                                 eval_set, verbose, dict(loss=self.loss, link=self.link))

    def predict(self, X) -> np.ndarray:
        """Predictions after the loss's link (the mean for squared error)."""
        return self._predicted(X, raw=False)


class JaxBoostClassifier(ClassifierMixin, _JaxBoostEstimator):
    """Gradient-boosted trees for classification, in the scikit-learn API.

    Any labels work (``classes_`` holds them, sorted). Two classes train the ``"logistic"``
    loss on one logit, three or more the ``"softmax"`` loss on one logit per class. ``loss``
    may name another built-in loss, or be any JAX function ``loss(raw_prediction, y)`` of one
    example on the encoded label ``y`` in ``0..K-1`` (passed as a float): a scalar logit with
    the sigmoid link for two classes, a length-K vector with the softmax link otherwise.
    ``n_jobs`` caps the CPU cores of a fit and its predictions (all by default, see
    ``jb.cpu_cores``).
    """

    def fit(self, X, y, sample_weight=None, eval_set=None, verbose=False):
        """Train on ``X`` (n, d) and class labels ``y`` (n,).

        Args:
          X: features; NaN marks a missing value. A DataFrame's column names are recorded.
          y: class labels of any sortable type (strings included).
          sample_weight: non-negative per-row weights (not all zero).
          eval_set: list of ``(X, y)`` pairs evaluated every round (``evals_result_``); the
            last one drives ``early_stopping_rounds``.
          verbose: print the eval metrics every round (True) or every N rounds.
        """
        X, y = validate_data(self, X, y, ensure_all_finite="allow-nan", accept_sparse=False,
                             dtype=[np.float32, np.float64])
        check_classification_targets(y)
        self.classes_, encoded_y = np.unique(y, return_inverse=True)
        self.n_classes_ = len(self.classes_)
        sample_weight = self._check_weights(sample_weight, X)
        weighted_classes = self.classes_ if sample_weight is None else np.unique(y[sample_weight > 0])
        if len(weighted_classes) < 2:
            where = "y" if sample_weight is None else "the rows of y with positive sample_weight"
            raise ValueError(f"{type(self).__name__} needs at least 2 classes; {where} hold 1 class "
                             f"({weighted_classes[0]!r})")
        return self._fit_booster(X, encoded_y.astype(np.float64), sample_weight, eval_set, verbose,
                                 self._loss_arguments())

    def _loss_arguments(self) -> dict:
        loss = self.loss
        if loss is None:
            loss = "logistic" if self.n_classes_ == 2 else "softmax"
        arguments = dict(loss=loss)
        if self.n_classes_ > 2:
            arguments["num_outputs"] = self.n_classes_
        if not _is_builtin_loss(loss):
            arguments["link"] = "sigmoid" if self.n_classes_ == 2 else "softmax"
        return arguments

    def _encode_eval_labels(self, y_eval):
        y_eval = column_or_1d(y_eval)
        try:
            positions = np.minimum(np.searchsorted(self.classes_, y_eval), self.n_classes_ - 1)
            unseen = self.classes_[positions] != y_eval
        except TypeError as error:  # labels that do not compare with the training classes
            raise ValueError(f"eval_set labels do not match the training classes {self.classes_.tolist()}: "
                             f"{error}") from error
        if unseen.any():
            raise ValueError(f"eval_set labels {np.unique(y_eval[unseen])[:5].tolist()} are not among the "
                             f"training classes {self.classes_.tolist()}")
        return positions.astype(np.float64)

    def decision_function(self, X) -> np.ndarray:
        """Raw scores: the logit ``(n,)`` for two classes, one score per class ``(n, K)`` otherwise."""
        return self._raw(X)

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``(n, K)``, columns in the order of ``classes_``; rows sum to 1."""
        probability = np.asarray(self._predicted(X, raw=False), dtype=np.float64)
        if probability.ndim == 1:
            probability = np.column_stack([1.0 - probability, probability])
        return probability / probability.sum(axis=1, keepdims=True)

    def predict(self, X) -> np.ndarray:
        """The class with the highest score (for two classes: the second when the logit is > 0)."""
        raw = self._raw(X)
        index = (raw > 0).astype(np.intp) if raw.ndim == 1 else np.argmax(raw, axis=1)
        return self.classes_[index]
