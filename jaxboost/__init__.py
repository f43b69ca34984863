"""jaxboost: differentiable gradient boosting in JAX.

Write a loss once, as a per-example JAX function ``loss(raw_prediction, y) -> scalar``;
gradients and Hessians come from autodiff, and every objective goes through the same compiled
tree-growing core: raw ``X`` -> bin edges and ``X_binned`` (``binning``) -> per round ``g, h``
(``derivatives``) -> histograms (``histogram``) -> split scan (``split``) -> tree arrays
(``grower``, ``tree``) -> raw predictions (``predictor``) -> link (``link``) -> predictions.
"""

from . import devices as _devices
from . import host_memory as _host_memory

# Must run before anything initialises JAX's backends: one host device per core, and a cap on
# malloc arenas before XLA starts its threads.
_devices.configure_default_cpu_devices()
_devices.configure_compilation_cache()
_host_memory.limit_malloc_arenas()


def _load_losses_folder():
    """Make the repository's top-level ``losses/`` folder importable as ``jaxboost.losses``.

    An installed package (``pip install .`` or ``-e .``) already maps it there; running from a
    source checkout without installing does not, so load it from beside this package. A source
    checkout (its ``pyproject.toml`` beside the package) always takes its own folder: with
    another checkout installed in editable mode, the installed mapping had given this package
    that checkout's losses.
    """
    import importlib.util
    import pathlib
    import sys

    checkout = pathlib.Path(__file__).resolve().parent.parent
    in_checkout = (checkout / "pyproject.toml").is_file() and (checkout / "losses" / "__init__.py").is_file()
    if not in_checkout:
        try:
            from . import losses  # noqa: F401  (installed mapping)
            return
        except ImportError:
            pass
    folder = checkout / "losses"
    spec = importlib.util.spec_from_file_location(__name__ + ".losses", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None:
        raise ImportError(f"jaxboost.losses not found: no losses/ folder beside {pathlib.Path(__file__).parent}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_load_losses_folder()

from . import callbacks, losses, metrics  # noqa: E402
from . import differentiable  # noqa: E402
from . import regularizer as regularizers  # noqa: E402
from .binning import BinEdges  # noqa: E402
from .dataset import Dataset  # noqa: E402
from .cores import available_cpu_cores, cpu_cores  # noqa: E402
from .devices import use_cpu_cores  # noqa: E402
from .model import Model  # noqa: E402
from .interop import to_shap, to_xgboost_booster  # noqa: E402
from .treelite_export import to_treelite  # noqa: E402
from .xgboost_export import export_xgboost, to_xgboost_json  # noqa: E402
from .model_io import ModelFormatError, load  # noqa: E402
from . import importance, plotting  # noqa: E402
from .training import train  # noqa: E402
from .vmapped_training import train_many  # noqa: E402

__version__ = "0.1.0"

# The scikit-learn estimators load on first use, so importing jaxboost does not need scikit-learn.
_SKLEARN_ESTIMATORS = ("JaxBoostClassifier", "JaxBoostRegressor")


def __getattr__(name):
    if name in _SKLEARN_ESTIMATORS:
        from . import sklearn as _sklearn_estimators

        return getattr(_sklearn_estimators, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["BinEdges", "Dataset", "Model", "ModelFormatError", "importance", "load", "plotting",
           "callbacks", "differentiable", "losses", "metrics", "regularizers",
           "train", "train_many", "available_cpu_cores", "cpu_cores", "use_cpu_cores", "__version__", *_SKLEARN_ESTIMATORS,
           "export_xgboost", "to_shap", "to_treelite", "to_xgboost_booster", "to_xgboost_json"]
