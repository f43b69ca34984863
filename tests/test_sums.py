"""row_sum: jnp.sum over rows, compiled without XLA's reduce-window chains on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxboost.devices import compiler_options
from jaxboost.sums import BLOCK_ROWS, row_sum, row_sums

FLOAT32_EPS = float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("shape", [(1_000_000,), (100_003,), (4099, 3), (BLOCK_ROWS + 1,)])
def test_row_sum_is_as_accurate_as_float32_allows(shape):
    # Values that cancel (a fifth of them negative on average): the error is measured against
    # the float64 sum, relative to the sum of magnitudes. A one-pass float32 sum of a million
    # values is 20-50 times further off; XLA's pairwise chain is within this bound too.
    rng = np.random.default_rng(0)
    values = (rng.random(shape, dtype=np.float32) - 0.2).astype(np.float32)
    got = np.asarray(jax.jit(row_sum)(values), np.float64)
    exact = values.astype(np.float64).sum(axis=0)
    gross = np.abs(values.astype(np.float64)).sum(axis=0)
    assert got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= 2 * FLOAT32_EPS * gross), (got - exact) / gross


def test_row_sum_of_few_rows_and_of_integers():
    values = np.arange(-7, 3 * BLOCK_ROWS + 6, dtype=np.int32)  # not a multiple of the block
    assert int(jax.jit(row_sum)(values)) == int(values.sum())
    few = np.array([1.5, -2.0, 4.25], np.float32)
    assert float(jax.jit(row_sum)(few)) == 3.75


@pytest.mark.parametrize("specials, expected", [
    ([np.nan], np.nan), ([np.inf], np.inf), ([-np.inf], -np.inf), ([np.inf, -np.inf], np.nan),
    ([3e38, 3e38], np.inf), ([-3e38, -3e38], -np.inf),
])
def test_row_sum_keeps_non_finite_sums_as_jnp_sum_does(specials, expected):
    # The round's health reads them: -inf marks a negative Hessian, NaN a non-finite value.
    values = np.ones(10 * BLOCK_ROWS, np.float32)
    values[[5, 77][:len(specials)]] = specials
    np.testing.assert_equal(float(jax.jit(row_sum)(values)), expected)
    np.testing.assert_equal(float(jnp.sum(values)), expected)


@pytest.mark.parametrize("rows", [BLOCK_ROWS, 5000, 106_497])
def test_row_sums_are_each_arrays_row_sum_bit_for_bit(rows):
    """Several arrays of the same rows summed in one compensated pass give each array's own
    ``row_sum``, bit for bit, whatever their trailing shapes (scaled apart, so that a column
    summed with another's partials would show), also with infinities."""
    rng = np.random.default_rng(rows)
    arrays = [(rng.standard_normal((rows,) + shape) * scale).astype(np.float32)
              for shape, scale in [((10,), 1e5), ((), 1.0), ((2, 3), 1e-3)]]
    arrays[1][rows // 2] = np.inf
    together = jax.jit(row_sums)(*arrays)
    for values, summed in zip(arrays, together):
        alone = np.asarray(jax.jit(row_sum)(values))
        assert summed.shape == alone.shape
        np.testing.assert_array_equal(np.asarray(summed), alone)


def test_row_sum_compiles_without_reduce_window_chains_on_cpu():
    # Per-row values computed in the program, as a loss's derivatives are. jnp.sum's chain is
    # there to show what the check looks for: were XLA to stop rewriting sums, row_sum would
    # have no purpose left, and this test says so.
    rows = jax.device_put(np.linspace(-1, 1, 53_248, dtype=np.float32), jax.devices("cpu")[0])

    def compiled(sum_rows):  # with the options jaxboost compiles its programs with
        return jax.jit(lambda x: sum_rows(jnp.exp(x) - x),
                       compiler_options=compiler_options("cpu")).lower(rows).compile().as_text()

    assert "reduce-window" in compiled(lambda values: jnp.sum(values, axis=0))
    assert "reduce-window" not in compiled(row_sum)


def test_a_custom_loss_fit_compiles_no_reduce_window_kernels_on_cpu(tmp_path):
    """The programs a new loss compiles (its derivatives, which also count its zero Hessians,
    and, in a fit of no rounds with its refit decided, its starting value's: with rounds, the
    round's derivatives find it), the trees' program and the metrics' (an eval set scored by
    the loss and by AUC): none holds the reduce-window chains that were most of their machine
    code, and no count of zero Hessians is compiled as a program of its own. XLA reads its dump
    flags when it starts, hence a process of its own."""
    import os
    import subprocess
    import sys

    from jaxboost import native

    if native.native_target(native.SORTED_AUC_SUMS_TARGET) is None:
        pytest.skip("native kernels unavailable (JAXBOOST_NATIVE=0 or no compiler): AUC runs XLA's scans")
    code = ("import numpy as np, jax, jaxboost as jb\n"
            "rng = np.random.default_rng(0)\n"
            "X = rng.normal(size=(3000, 4)).astype(np.float32)\n"
            "y = (X[:, 0] + rng.normal(size=3000) > 0).astype(np.float32)\n"
            "def softplus(raw_prediction, y):\n"
            "    return jax.nn.softplus(raw_prediction) - y * raw_prediction\n"
            "jb.train(X[:2000], y[:2000], loss=softplus, link='sigmoid', num_rounds=2, max_depth=3,\n"
            "         eval_set=[(X[2000:], y[2000:])], eval_metric=['loss', 'auc'])\n"
            "jb.train(X[:2000], y[:2000], loss=softplus, link='sigmoid', num_rounds=0, leaf_refit=False)\n")
    dump = tmp_path / "dump"
    env = dict(os.environ, JAXBOOST_CACHE_DIR="", JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    programs = {}
    for path in dump.glob("*.cpu_after_optimizations.txt"):
        name = path.name.split(".")[1]  # module_0001.jit_round_trees.cpu_after_optimizations.txt
        programs[name] = programs.get(name, "") + path.read_text()
    expected = {"jit_round_statistics", "jit_round_trees", "jit_round_metrics", "jit__coordinate_sweeps"}
    assert expected <= set(programs) and "jit_local_count" not in programs, sorted(programs)
    chains = {name: programs[name].count(" reduce-window(") for name in expected}
    assert not any(chains.values()), chains


@pytest.mark.parametrize("shape", [(100_000,), (4099, 10)])
def test_block_partials_are_the_ones_vector_products_bit_for_bit(shape):
    # The partial sums are a product with two rows of ones (see _block_partials: Eigen's, rather
    # than code generated for a matrix-vector product): the same sums as the vector's, bit for bit.
    from jaxboost.sums import _block_partials

    rng = np.random.default_rng(len(shape))
    values = (rng.standard_normal(shape) * 1e3).astype(np.float32)
    options = compiler_options("cpu")
    cpu = jax.devices("cpu")[0]  # the CPU's products (only the CPU takes row_sum's blocks)
    got = jax.jit(_block_partials, compiler_options=options)(jax.device_put(values, cpu))
    padded = np.pad(values, [(0, -len(values) % BLOCK_ROWS)] + [(0, 0)] * (values.ndim - 1))
    expected = jax.jit(lambda v: jnp.matmul(jnp.ones(BLOCK_ROWS, jnp.float32), v.reshape(BLOCK_ROWS, -1),
                                            precision=jax.lax.Precision.HIGHEST),
                       compiler_options=options)(jax.device_put(padded, cpu))
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), np.asarray(expected))
