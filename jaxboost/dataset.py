"""Dataset: raw ``X`` binned once (bin edges + ``X_binned``), with labels and weights.

Build it once and reuse it: ``jb.train`` takes a Dataset in place of ``X, y``, eval sets and
test sets are binned with the training set's edges (pass ``reference=``), and a model keeps the
edges so it predicts on raw ``X``.
"""

from __future__ import annotations

import numpy as np

from .binning import BinEdges, apply_bins, fit_bin_edges, has_missing_code
from .devices import code_table_width
from .host_memory import release_free_memory_after
from .validation import check_base_margin, check_features, check_labels, check_sample_weight


class Dataset:
    """Binned features with optional labels, sample weights and base margins.

    Args:
      X: (n, d) numeric array or DataFrame; NaN marks missing values.
      y: labels (n,), or None for data only predicted on.
      sample_weight: non-negative per-row weights.
      max_bin: codes per feature, the missing-value code included (at most 256).
      reference: a Dataset whose bin edges to reuse (eval and test sets).
      base_margin: per-row offsets of the raw prediction, (n,) or (n, K).

    Attributes: ``y``, the labels as the Dataset's own float32 array (training computes in
    float32); ``sample_weight``, float32, a read-only broadcast of 1 when none were given (no
    memory per row); ``bin_edges``, ``max_bin``, ``X_binned`` (n, d) uint8,
    ``X_binned_T``: the same codes as the read-only feature-major table the training kernels
    read (``(d, width)``, columns past ``n_rows`` zero; ``X_binned`` is its transposed view, so
    the codes are held once), and ``has_missing_values``: whether any value is missing
    (training on data without any scans one missing-value direction only; the trees are the
    same).
    """

    def __init__(self, X, y=None, sample_weight=None, max_bin: int = 256, *, reference: "Dataset | None" = None,
                 bin_edges: BinEdges | None = None, base_margin=None):
        features, self.feature_names = check_features(
            X, n_features=None if reference is None else reference.n_features,
            expected_names=None if reference is None else reference.feature_names, blockwise=True)
        self.n_rows, self.n_features = features.shape
        self.y = None if y is None else check_labels(y, self.n_rows)
        self.sample_weight = check_sample_weight(sample_weight, self.n_rows)
        self.base_margin = None if base_margin is None else np.asarray(base_margin, dtype=np.float32)
        if self.base_margin is not None:
            check_base_margin(self.base_margin, self.n_rows, 1 if self.base_margin.ndim == 1 else
                              self.base_margin.shape[1])
        if reference is not None:
            bin_edges = reference.bin_edges
        if bin_edges is None:
            bin_edges = fit_bin_edges(features, max_bin=max_bin, sample_weight=sample_weight)
        self.bin_edges = bin_edges
        self.max_bin = bin_edges.max_bin
        self.X_binned_T = apply_bins(features, bin_edges, table_width=code_table_width(self.n_rows))
        # CPU devices train on this buffer in place: it must not change under them.
        self.X_binned_T.flags.writeable = False
        # Without missing values the split scan need not try sending them either way.
        self.has_missing_values = has_missing_code(self.X_binned_T[:, :self.n_rows], bin_edges.missing_bin)
        # Binning's temporaries (edge fitting's sorted samples, the search's blocks) leave free pages
        # in the binning threads' malloc arenas, 13 MB for a 1M x 28 Dataset: they go back to the
        # system rather than stay with a Dataset that may be kept a while. (Training's peak is set
        # later and did not move: 530-542 MB with and without, in alternating runs.)
        release_free_memory_after(self.n_rows)

    @property
    def X_binned(self) -> np.ndarray:
        """The codes ``(n_rows, n_features)`` uint8: a read-only view of ``X_binned_T``."""
        return self.X_binned_T[:, :self.n_rows].T

    def __repr__(self) -> str:
        return f"Dataset(n_rows={self.n_rows}, n_features={self.n_features}, max_bin={self.max_bin})"
