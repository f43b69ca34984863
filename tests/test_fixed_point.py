"""Order-independent sums (``deterministic_histogram``): fixed-point pieces against float64
NumPy, bit-identical results whatever the order of the rows, and training with the accelerators'
kernels (run here on CPU) that grows the same model from permuted rows."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxboost as jb
from jaxboost import fixed_point, histogram, line_search
from jaxboost.fixed_point import (fixed_point_segment_sum, float_piece_bits, float_pieces_needed, int_piece_bits,
                                  power_of_two)

from test_histogram import histogram_case, masked_naive_histogram, train_with_patches


def rounding_bound(values: np.ndarray, kept_bits: int, terms: int) -> float:
    """The largest error of a sum of at most ``terms`` of ``values``: each rounds by at most
    ``2 max|v| 2**-kept_bits`` (the scale comes from the next power of two above max|v|), plus
    float32's rounding of the result (a few roundings of a sum of at most ``terms * max|v|``)."""
    largest = np.max(np.abs(values))
    return terms * 2 * largest * 2.0 ** -kept_bits + 4 * terms * largest * 2.0 ** -24


def most_rows_in_a_cell(X_binned, node_index, mask, num_nodes, max_bin) -> int:
    ones = np.ones(len(node_index), np.float32)
    return int(masked_naive_histogram(X_binned, node_index, ones, ones, mask, num_nodes, max_bin)[..., 0].max())


def test_int_piece_bits_keep_every_sum_inside_int32():
    for n_terms in (1, 2, 3, 1000, 2 ** 20, 2 ** 20 + 1, 10 ** 7, 2 ** 27):
        bits = int_piece_bits(n_terms)
        assert n_terms * 2 ** (bits - 1) <= 2 ** 30
        assert bits == fixed_point.MAX_PIECE_BITS or n_terms * 2 ** bits > 2 ** 30  # no bit left unused
    assert int_piece_bits(1_000_000) == 11
    with pytest.raises(ValueError, match="at most"):
        int_piece_bits(2 ** 27 + 1)


def test_float_piece_bits_keep_a_copys_sums_exact_in_float32_and_the_fold_inside_int32():
    for most_terms, n_terms in [(1, 1), (3, 3), (3907, 1_000_000), (125_000, 1_000_000), (2 ** 17, 2 ** 20),
                                (10 ** 6, 10 ** 6), (2 ** 22, 2 ** 22)]:
        bits = int(jax.jit(float_piece_bits, static_argnums=1)(most_terms, n_terms))
        assert most_terms * 2 ** (bits - 1) <= 2 ** 24 and n_terms * 2 ** (bits - 1) <= 2 ** 30
        # No bit left unused: one more would break a bound, or pass the cap.
        assert (bits == fixed_point.MAX_PIECE_BITS or most_terms * 2 ** bits > 2 ** 24
                or n_terms * 2 ** bits > 2 ** 30)
        pieces = float_pieces_needed(most_terms, n_terms)
        assert pieces % 2 == 0 and pieces * bits >= fixed_point.TARGET_BITS
    # A depth-6 tree's last level at 1M rows: 8 copies, 125k rows a copy, 8 bits: 4 pieces.
    assert float_pieces_needed(125_000, 1_000_000) == 4
    with pytest.raises(ValueError, match="rows a copy"):
        float_pieces_needed(2 ** 23 + 1, 2 ** 23 + 1)


def test_power_of_two_is_exact_over_the_normal_range():
    exponents = np.arange(-126, 128, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(power_of_two)(exponents)),
                                  np.ldexp(np.float32(1), exponents).astype(np.float32))


def test_largest_values_of_one_sign_sum_exactly_into_one_segment():
    """The worst case for overflow: every term at the largest magnitude, all in one segment
    (2**17 terms: 14 bits a piece, the first count below the cap of 15)."""
    n = 2 ** 17
    assert int_piece_bits(n) == 14
    for value in (1.0, -1.0, 3.0e-30, 7.5e20, 0.0):
        values = np.full(n, value, np.float32)
        total = fixed_point_segment_sum(jnp.asarray(values), jnp.zeros(n, jnp.int32), 2)
        np.testing.assert_allclose(np.asarray(total), [n * np.float64(np.float32(value)), 0.0], rtol=1e-6)


@pytest.mark.parametrize("spread", ["normal", "outlier", "tiny"])
def test_fixed_point_segment_sum_matches_numpy_within_its_rounding(spread):
    rng = np.random.default_rng(3)
    n, segments = 20_000, 37
    values = rng.normal(size=n).astype(np.float32)
    if spread == "outlier":
        values[5] = 1e4  # the others round to 2**-(2 bits) of it
    elif spread == "tiny":
        values *= np.float32(1e-20)
    ids = rng.integers(0, segments + 3, n).astype(np.int32)  # ids past the end are dropped
    expected = np.zeros(segments)
    kept = ids < segments
    np.add.at(expected, ids[kept], values[kept].astype(np.float64))
    actual = fixed_point_segment_sum(jnp.asarray(values), jnp.asarray(ids), segments)
    assert actual.dtype == jnp.float32 and actual.shape == (segments,)
    most_terms = np.bincount(ids[kept]).max()
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0,
                               atol=rounding_bound(values, 2 * int_piece_bits(n), most_terms))


def test_fixed_point_segment_sum_takes_trailing_axes():
    rng = np.random.default_rng(4)
    values = rng.normal(size=(300, 3)).astype(np.float32)
    ids = rng.integers(0, 4, 300).astype(np.int32)
    expected = np.stack([np.bincount(ids, values[:, k].astype(np.float64), minlength=4) for k in range(3)], axis=1)
    actual = fixed_point_segment_sum(jnp.asarray(values), jnp.asarray(ids), 4)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0,
                               atol=rounding_bound(values, 2 * int_piece_bits(300), np.bincount(ids).max()))


def permutations(n, count=4, seed=9):
    rng = np.random.default_rng(seed)
    return [rng.permutation(n) for _ in range(count)]


def test_fixed_point_sums_are_the_same_bits_in_any_order_and_float_sums_are_not():
    rng = np.random.default_rng(5)
    n, segments = 30_000, 5
    values = rng.normal(size=n).astype(np.float32)
    ids = rng.integers(0, segments, n).astype(np.int32)
    exact = jax.jit(partial(fixed_point_segment_sum, num_segments=segments))
    floats = jax.jit(partial(jax.ops.segment_sum, num_segments=segments))
    reference, float_reference = np.asarray(exact(values, ids)), np.asarray(floats(values, ids))
    float_orders_differ = False
    for order in permutations(n):
        np.testing.assert_array_equal(np.asarray(exact(values[order], ids[order])), reference)
        float_orders_differ |= not np.array_equal(np.asarray(floats(values[order], ids[order])), float_reference)
    # The property is not vacuous: float32 sums of these rows do depend on their order.
    assert float_orders_differ


@pytest.mark.parametrize("with_mask", [False, True])
def test_deterministic_pair_scatter_matches_numpy_and_ignores_the_rows_order(with_mask):
    """The accelerators' kernel with fixed-point pieces: the float64 histogram within the
    pieces' rounding, and the same bits for every order of the rows (rows land in other copies
    of their node's histogram and are added in another order)."""
    from jaxboost.histogram import _pair_scatter_histogram

    num_nodes, max_bin, n_features, n = 6, 16, 3, 4001
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(8, n, n_features, num_nodes, max_bin)
    node_index = node_index % 5  # 5 live nodes share the slots out
    mask = row_mask if with_mask else np.ones(n, bool)
    kernel = jax.jit(partial(_pair_scatter_histogram, num_nodes=num_nodes, max_bin=max_bin, deterministic=True))

    def run(order):
        return np.asarray(kernel(jnp.asarray(X_binned[order].T), jnp.asarray(node_index[order]),
                                 jnp.asarray(gradients[order]), jnp.asarray(hessians[order]),
                                 jnp.asarray(row_mask[order] if with_mask else np.zeros(0, bool))))

    reference = run(np.arange(n))
    expected = masked_naive_histogram(X_binned, node_index, gradients, hessians, mask, num_nodes, max_bin)
    assert reference.dtype == np.float32 and reference.shape == expected.shape
    # The scale comes from the summed rows' largest |g| and |h|: each channel within its bound.
    most_terms = most_rows_in_a_cell(X_binned, node_index, mask, num_nodes, max_bin)
    np.testing.assert_allclose(reference[..., 0], expected[..., 0], rtol=0,
                               atol=rounding_bound(gradients[mask], fixed_point.TARGET_BITS, most_terms))
    np.testing.assert_allclose(reference[..., 1], expected[..., 1], rtol=0,
                               atol=rounding_bound(hessians[mask], fixed_point.TARGET_BITS, most_terms))
    for order in permutations(n):
        np.testing.assert_array_equal(run(order), reference)


@pytest.mark.parametrize("live_nodes", [256, 1])
def test_deterministic_pair_scatter_is_exact_with_a_copys_cell_at_its_most_rows(live_nodes):
    """The worst cases for the pieces: almost every row lands in one cell. With 256 live nodes a
    node has one copy (2**17 rows: 8 bits a piece, whose float32 sums reach 2**24 there); with
    one, 256 copies whose int32 fold reaches 2**30. Were any partial sum past its exact whole
    numbers, the rows' order would show in the bits."""
    from jaxboost.histogram import _pair_scatter_histogram

    n, num_nodes = 2 ** 17, 256
    rng = np.random.default_rng(12)
    codes = np.zeros((1, n), np.uint8)
    node_index = np.zeros(n, np.int32)
    node_index[-1] = live_nodes - 1
    gradients = rng.uniform(0.5, 0.99, n).astype(np.float32)
    hessians = rng.uniform(0.0, 0.25, n).astype(np.float32)
    kernel = jax.jit(partial(_pair_scatter_histogram, num_nodes=num_nodes, max_bin=4, deterministic=True))

    def run(order):
        return np.asarray(kernel(jnp.asarray(codes[:, order]), jnp.asarray(node_index[order]),
                                 jnp.asarray(gradients[order]), jnp.asarray(hessians[order]), jnp.zeros(0, bool)))

    reference = run(np.arange(n))
    in_cell = node_index == 0
    for channel, values in enumerate((gradients, hessians)):
        np.testing.assert_allclose(reference[0, 0, 0, channel], np.sum(values[in_cell], dtype=np.float64), rtol=0,
                                   atol=rounding_bound(values, fixed_point.TARGET_BITS, int(in_cell.sum())))
    for order in permutations(n, count=2):
        np.testing.assert_array_equal(run(order), reference)


def test_deterministic_pair_scatter_under_vmap():
    """``train_many`` vmaps the kernel: each model gets scales of its own rows."""
    from jaxboost.histogram import _pair_scatter_histogram

    num_nodes, max_bin, n_features = 4, 8, 2
    X_binned, node_index, gradients, hessians, row_mask = histogram_case(2, 1500, n_features, num_nodes, max_bin)
    gradient_sets = np.stack([gradients, 1e-3 * gradients])
    kernel = jax.jit(jax.vmap(partial(_pair_scatter_histogram, num_nodes=num_nodes, max_bin=max_bin,
                                      deterministic=True), in_axes=(None, None, 0, None, None)))
    actual = np.asarray(kernel(jnp.asarray(X_binned.T), jnp.asarray(node_index), jnp.asarray(gradient_sets),
                               jnp.asarray(hessians), jnp.asarray(row_mask)))
    most_terms = most_rows_in_a_cell(X_binned, node_index, row_mask, num_nodes, max_bin)
    for model in range(2):
        expected = masked_naive_histogram(X_binned, node_index, gradient_sets[model], hessians, row_mask, num_nodes,
                                          max_bin)
        np.testing.assert_allclose(actual[model][..., 0], expected[..., 0], rtol=0,
                                   atol=rounding_bound(gradient_sets[model][row_mask], fixed_point.TARGET_BITS,
                                                       most_terms))


def train_as_on_an_accelerator(monkeypatch, X, y, train=None, **settings):
    """``jb.train`` (or ``train``) with every platform-dependent choice of the histogram and
    line-search modules taking the accelerators' branch (their XLA kernels, not the CPU's), on CPU."""
    def accelerator_branch(*args, cpu, default):
        return default(*args)

    patches = [(module, "per_platform", accelerator_branch) for module in (histogram, line_search)]
    return train_with_patches(monkeypatch, patches, X, y, settings, train)


def same_trees(model, other) -> bool:
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(model.trees, other.trees))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs the accelerators' kernels on CPU, one device")
@pytest.mark.parametrize("loss", ["logistic", "absolute_error", "softmax vector leaves", "train_many",
                                  "column sample"])
def test_deterministic_histogram_grows_the_same_model_from_permuted_rows(monkeypatch, loss):
    """The sums of a round no longer depend on the order of the rows: a model trained on the
    rows in another order is the same bit for bit (absolute error: its leaf refit's sums too).
    The float kernel's models differ (so the comparison can tell), and the two kernels' models
    agree in their fit. The starting value is fixed (a margin of 0): its sum is a reduction
    over rows whose order would change its last bit. Absolute error gets sample weights: its
    unweighted gradients and split Hessians are whole numbers, whose float sums are exact.
    Vector leaves sum their channels a pair at a time; ``train_many`` vmaps the kernel; a
    column sample's histograms hold the sampled features alone."""
    rng = np.random.default_rng(21)
    n = 3000
    X = rng.normal(size=(n, 5)).astype(np.float32)
    signal = X[:, 0] + np.sin(2 * X[:, 1]) + 0.5 * rng.normal(size=n)
    settings = dict(loss=loss, num_rounds=8, max_depth=5, learning_rate=0.3)
    margin = np.zeros(n, np.float32)
    y = (signal > 0).astype(np.float32)
    if loss == "absolute_error":
        y = signal.astype(np.float32)
    elif loss == "softmax vector leaves":
        y = np.digitize(signal, [-0.5, 0.5]).astype(np.float32)
        settings.update(loss="softmax", multi_strategy="multi_output_tree", num_rounds=4)
        margin = np.zeros((n, 3), np.float32)
    elif loss == "column sample":
        settings.update(loss="logistic", colsample_bytree=0.6)
    elif loss == "train_many":
        settings.update(loss="logistic", train=jb.train_many, batch={"learning_rate": [0.3, 0.5]})
        del settings["learning_rate"]
    weight = rng.uniform(0.5, 2.0, n).astype(np.float32) if loss == "absolute_error" else np.ones(n, np.float32)
    order = rng.permutation(n)
    edges = jb.Dataset(X, y, max_bin=64).bin_edges  # one set of bin edges for both orders

    def fit(rows, deterministic):
        data = jb.Dataset(X[rows], y[rows], weight[rows], bin_edges=edges, base_margin=margin[rows])
        models = train_as_on_an_accelerator(monkeypatch, data, None, deterministic_histogram=deterministic,
                                            **settings)
        return models if isinstance(models, list) else [models]

    def same_models(fits, others):
        return all(same_trees(fit, other) for fit, other in zip(fits, others))

    exact = fit(np.arange(n), True)
    assert same_models(fit(order, True), exact)
    floats = fit(np.arange(n), False)
    assert not same_models(fit(order, False), floats)
    assert exact[0].params["deterministic_histogram"] and not floats[0].params["deterministic_histogram"]
    # Same fit: the pieces keep at least 24 bits of each value (of the level's largest).
    for exact_model, float_model in zip(exact, floats):
        np.testing.assert_allclose(exact_model.predict(X, base_margin=margin), float_model.predict(X, base_margin=margin),
                                   rtol=1e-4, atol=1e-4)


def test_deterministic_histogram_must_be_a_bool():
    X = np.zeros((10, 2), np.float32)
    with pytest.raises(ValueError, match="deterministic_histogram must be True or False"):
        jb.train(X, np.zeros(10, np.float32), num_rounds=1, deterministic_histogram="false")
    with pytest.raises(ValueError, match="deterministic_histogram must be True or False"):
        jb.train_many(X, np.zeros(10, np.float32), seeds=[0, 1], num_rounds=1, deterministic_histogram=1)
