"""Validation: host-side checks of user input, raised before any work starts.

Every error names the argument and the problem (NaN labels, a wrong feature count, ...), so
bad input never turns into a silent constant model.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """A warning attributed to the first caller outside the jaxboost package: the frames between
    it and the user's call (decorators, helpers) differ from one entry point to another, so a
    fixed ``stacklevel`` named a jaxboost line for some of them."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


# The largest float32: training computes in float32, so a larger value would become infinite.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_features(X, n_features: int | None = None, what: str = "X",
                   expected_names: tuple[str, ...] | None = None,
                   blockwise: bool = False) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """``X`` as a C-contiguous float32 (n, d) array (``blockwise``: float32 and float64 arrays
    as they are), plus its column names if it had any.

    NaN marks a missing value; infinite values, values beyond float32's range and non-numeric
    columns are errors. When ``X`` has column names and ``expected_names`` (the training
    columns) are given, they must match in order: a DataFrame with its columns reordered would
    otherwise be predicted on silently wrong features.

    ``blockwise``: the caller reads the array a block of rows at a time, in any layout, and
    rounds each block of float64 values to float32 as it goes (binning, the native predictor):
    float32 and float64 arrays are returned as they are. A float64 ``X``, NumPy's and pandas'
    default, is then not copied whole to float32 first (1M x 28: 98 MB more at binning's peak
    and 0.3 s).
    """
    columns = getattr(X, "columns", None)
    feature_names = None if columns is None else tuple(str(c) for c in columns)
    if feature_names is not None and expected_names is not None and feature_names != tuple(expected_names):
        if sorted(feature_names) == sorted(expected_names):
            raise ValueError(f"{what}'s columns are in a different order than the training features "
                             f"{list(expected_names)[:10]}; select them in that order, e.g. X[model.feature_names]")
        missing = [name for name in expected_names if name not in feature_names]
        extra = [name for name in feature_names if name not in expected_names]
        raise ValueError(f"{what}'s columns do not match the training features: missing {missing[:10]}, "
                         f"unexpected {extra[:10]}")
    try:
        array = np.asarray(X)
    except Exception as error:  # pandas extension types and ragged input
        raise TypeError(f"{what} could not be converted to a numeric array: {error}") from error
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        where = ""
        if feature_names is not None and hasattr(X, "dtypes"):
            bad = [name for name, dtype in zip(feature_names, X.dtypes) if getattr(dtype, "kind", "O") not in "biuf"]
            where = f" (columns {bad[:5]})"
        raise TypeError(f"{what} must be numeric; got dtype {array.dtype}{where}. Categorical features are not "
                        "supported yet: encode them as numbers")
    if array.ndim != 2:
        raise ValueError(f"{what} must be 2-D (rows, features); got shape {array.shape}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"{what} is empty: shape {array.shape}")
    # Checked before any conversion, which would make values beyond float32's range infinite.
    # fmax/fmin skip NaN (all NaN: NaN, which compares false) and, unlike np.isinf(array), make
    # no (n, d) temporary. Integers and booleans are within the range.
    if np.issubdtype(array.dtype, np.floating) and (abs(float(np.fmax.reduce(array, axis=None))) > FLOAT32_MAX or
                                                    abs(float(np.fmin.reduce(array, axis=None))) > FLOAT32_MAX):
        row, col = np.argwhere(np.abs(array.astype(np.float64, copy=False)) > FLOAT32_MAX)[0]
        problem = "infinite values" if np.isinf(array[row, col]) else "values beyond float32's range"
        raise ValueError(f"{what} contains {problem} (first at row {row}, feature {col}); use NaN for missing "
                         "values")
    if not (blockwise and array.dtype in (np.float32, np.float64)):
        array = np.ascontiguousarray(array, dtype=np.float32)
    if n_features is not None and array.shape[1] != n_features:
        raise ValueError(f"{what} has {array.shape[1]} features but the model was trained on {n_features}")
    return array, feature_names


def check_labels(y, n_rows: int, what: str = "y") -> np.ndarray:
    """Labels as an owned float32 array (n,), finite and one per row. Training computes in
    float32, so the labels are held once, in that precision (as XGBoost holds them)."""
    try:
        with np.errstate(over="ignore"):  # overflowing labels are named below
            labels = np.array(y, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be numeric labels: {error}") from error
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise ValueError(f"{what} must be 1-D; got shape {labels.shape}")
    if labels.shape[0] != n_rows:
        raise ValueError(f"{what} has {labels.shape[0]} labels but X has {n_rows} rows")
    bad = ~np.isfinite(labels)
    if bad.any():
        first = int(np.argmax(bad))
        given = np.asarray(y, dtype=np.float64).reshape(-1)[first]
        if np.isfinite(given):
            raise ValueError(f"{what} has label(s) beyond float32's range (first at row {first}: {given:g}); "
                             "labels must be finite in float32")
        raise ValueError(f"{what} contains {int(bad.sum())} NaN or infinite label(s) (first at row "
                         f"{first}); labels must be finite")
    return labels


def check_sample_weight(sample_weight, n_rows: int, what: str = "sample_weight") -> np.ndarray:
    """Weights as float32 (n,): finite, non-negative, not all zero. None gives ones as a
    read-only broadcast of one value, which takes no memory per row."""
    if sample_weight is None:
        return np.broadcast_to(np.float32(1.0), (n_rows,))
    weights = np.asarray(sample_weight, dtype=np.float64)
    if weights.ndim != 1 or weights.shape[0] != n_rows:
        raise ValueError(f"{what} must have shape ({n_rows},); got {weights.shape}")
    if not np.isfinite(weights).all():
        raise ValueError(f"{what} contains NaN or infinite values")
    if (weights < 0).any():
        raise ValueError(f"{what} contains negative values (min {weights.min()})")
    if not (weights > 0).any():
        raise ValueError(f"{what} is zero for every row: there is nothing to fit")
    return weights.astype(np.float32)


def check_base_margin(base_margin, n_rows: int, num_outputs: int, what: str = "base_margin") -> np.ndarray | None:
    """Per-row raw-prediction offsets as float32 (n, K), or None."""
    if base_margin is None:
        return None
    margin = np.asarray(base_margin, dtype=np.float64)
    if margin.ndim == 1:
        margin = margin[:, None]
    if margin.shape != (n_rows, num_outputs):
        raise ValueError(f"{what} must have shape ({n_rows},) or ({n_rows}, {num_outputs}); got {np.shape(base_margin)}")
    if not np.isfinite(margin).all():
        raise ValueError(f"{what} contains NaN or infinite values")
    return margin.astype(np.float32)
