"""Link: raw predictions (margins) -> predictions (``y_pred``), the inverse link of a loss."""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import losses
from .devices import compiler_options
from .program_store import ready, store_folder, stored_program


# Module-level functions (not lambdas or jitted callables), so that a Model holding one pickles.
def identity(raw_prediction):
    return raw_prediction


def sigmoid(raw_prediction):
    return jax.nn.sigmoid(raw_prediction)


def sigmoid_2x(raw_prediction):
    # AdaBoost's exponential loss estimates half the log-odds.
    return jax.nn.sigmoid(2.0 * raw_prediction)


def softmax(raw_prediction):
    return jax.nn.softmax(raw_prediction, axis=-1)


def exp(raw_prediction):
    return jnp.exp(raw_prediction)


def step(raw_prediction):
    return (raw_prediction > 0).astype(jnp.float32)


LINKS: dict[str, Callable] = {
    "identity": identity,
    "sigmoid": sigmoid,
    "sigmoid_2x": sigmoid_2x,
    "softmax": softmax,
    "exp": exp,
    "step": step,
    # Distributional losses: raw (mu, log_sigma) -> (mu, sigma).
    "location_scale": losses.location_scale,
}

Link = Union[str, Callable]


def resolve_link(link: Link) -> Callable:
    """A link function from its name or a JAX function of the raw prediction array."""
    if callable(link):
        return link
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; known links: {sorted(LINKS)} (or pass a JAX function)")
    return LINKS[link]


# Rows per call when a link is applied to predictions: applied to the whole array, a link
# compiled once per number of rows predicted on (about 40 ms for each new batch size, a hundred
# times the prediction itself on 1000 rows); on chunks of fixed sizes it compiles once for each,
# and every row's result is the same whatever batch it comes in (programs of other sizes differ
# in the last bit; a chunk of one step and a chunk of several run the same step program: the
# built-in links gave the same bits for AVX-512, AVX2 and SSE4.2 code). Inside a chunk the link
# runs on LINK_STEP_ROWS rows at a time: XLA's CPU backend splits a larger transcendental loop
# over its thread pool, and waking the pool made one row's sigmoid 90 us of a 110 us prediction
# (30 us in steps of 256 rows; 1M rows 4.1 -> 4.5 ms).
LINK_CHUNK_ROWS = 2048
LINK_STEP_ROWS = 256
# Up to this many rows go in a chunk of their own, without steps, on CPU: XLA's CPU client runs a
# program on the calling thread when its cost analysis counts fewer than 1000 flops, and hands it
# to a worker thread otherwise. A softmax of 3 outputs on a step of 256 rows counts 2816 (on 16
# rows, 176): one row's prediction took 0.18-0.22 ms, 0.08 ms on 16 rows (3 classes, 100
# rounds). The same bits as the steps' program (softmax of 2 to 100 outputs, sigmoid, exp).
LINK_INLINE_ROWS = 16
# Where the CPU backend is off (JAX_PLATFORMS without "cpu"), links run on the accelerator, where
# each loop step would be a kernel launch of its own: on whole chunks there, larger ones.
ACCELERATOR_LINK_CHUNK_ROWS = 16384


def _link_function(link: Callable, in_steps: bool) -> Callable:
    """``link`` on a chunk: as it is, or in steps of ``LINK_STEP_ROWS`` rows."""
    if not in_steps:
        return link

    def stepped(raw_prediction):
        steps = jax.lax.map(link, raw_prediction.reshape((-1, LINK_STEP_ROWS) + raw_prediction.shape[1:]))
        return steps.reshape((raw_prediction.shape[0],) + steps.shape[2:])

    return stepped


def _jit_options(platform: str) -> dict:
    # The training rounds' compiler options: without XLA's YNNPACK fusions a softmax over 10
    # outputs of one chunk took 0.087 ms instead of 0.133.
    return dict(compiler_options=compiler_options(platform))


@lru_cache(maxsize=32)
def _compiled_link(link: Callable, in_steps: bool, platform: str) -> Callable:
    return jax.jit(_link_function(link, in_steps), **_jit_options(platform))


@lru_cache(maxsize=32)
def _stored_link(link: Callable, in_steps: bool, platform: str, chunk_shape: tuple, folder) -> Callable | None:
    """A built-in link's program for chunks of ``chunk_shape`` through the program store (on a
    CPU, its executable: a later process's first prediction had lowered the link, the process's
    first lowering, which imports MLIR's dialect modules: 0.078 s of a 455-row prediction);
    None where the store is off (``folder`` None) or cannot hold it (a link of the user's)."""
    if folder is None:
        return None
    stored = stored_program("link", lambda: _link_function(link, in_steps), (link, in_steps),
                            (jax.ShapeDtypeStruct(chunk_shape, jnp.float32),), platform, _jit_options(platform))
    return None if stored is None else ready(stored)


@lru_cache(maxsize=1)
def link_platform() -> str:
    """Where links run: the host's CPU, which holds the raw predictions (the native predictor
    walks host rows whatever JAX's default backend), or JAX's default backend if JAX runs
    without its CPU backend. On a GPU machine the logistic link of one row took 0.78 ms on the
    GPU (copies both ways and a launch), against 0.036 ms for a prediction without a link."""
    try:
        jax.devices("cpu")
    except RuntimeError:
        return jax.default_backend()
    return "cpu"


def link_layout(n_rows: int) -> tuple[int, bool]:
    """``(rows a chunk, whether in steps of LINK_STEP_ROWS)`` for ``n_rows`` rows on
    ``link_platform()``. On CPU, up to LINK_INLINE_ROWS rows go in a chunk of that many, and up
    to one step's rows in a chunk of one step, the same step program as a whole chunk's: the
    softmax of one row of 10 outputs took 0.109 ms on a chunk of LINK_CHUNK_ROWS, 0.062 on one
    step."""
    if link_platform() != "cpu":
        return ACCELERATOR_LINK_CHUNK_ROWS, False
    if n_rows <= LINK_INLINE_ROWS:
        return LINK_INLINE_ROWS, False
    return (LINK_STEP_ROWS if n_rows <= LINK_STEP_ROWS else LINK_CHUNK_ROWS), True


def apply_link(link: Callable, raw_prediction: np.ndarray) -> np.ndarray:
    """``link`` applied to host raw predictions ``(n,)`` or ``(n, K)``, row by row (a row's
    prediction depends on its own raw prediction only), on ``link_platform()``, in chunks of one
    size (``link_layout``), the last padded with zeros."""
    raw_prediction = np.asarray(raw_prediction, np.float32)
    if link is identity:  # nothing to compute, so nothing to compile
        return raw_prediction
    n_rows = raw_prediction.shape[0]
    chunk_rows, in_steps = link_layout(n_rows)
    padded = np.zeros((-(-n_rows // chunk_rows) * chunk_rows,) + raw_prediction.shape[1:], np.float32)
    padded[:n_rows] = raw_prediction
    platform = link_platform()
    compiled = (_stored_link(link, in_steps, platform, (chunk_rows,) + raw_prediction.shape[1:], store_folder())
                or _compiled_link(link, in_steps, platform))
    # Host arrays go in as they are, run on the platform's device by making it the default one
    # where it is not (a GPU machine's): committing each chunk there with a device_put had cost
    # 24.5 us a chunk against 7.3 (on CPU; on the default platform a device_put doubled one row's
    # prediction, 0.032 -> 0.071 ms).
    on_platform = (contextlib.nullcontext() if platform == jax.default_backend()
                   else jax.default_device(jax.devices(platform)[0]))
    with on_platform:
        if padded.shape[0] == chunk_rows:  # one chunk: no list to join (a tenth of one row's prediction)
            return np.asarray(compiled(padded))[:n_rows].copy()  # writable: not a view of the result buffer
        chunks = [compiled(padded[start:start + chunk_rows]) for start in range(0, padded.shape[0], chunk_rows)]
        return np.concatenate([np.asarray(chunk) for chunk in chunks])[:n_rows]
