"""jaxboost: differentiable gradient boosting in JAX.

Write a loss once, as a per-example JAX function ``loss(raw_prediction, y) -> scalar``;
gradients and Hessians come from autodiff, and every objective goes through the same compiled
tree-growing core: raw ``X`` -> bin edges and ``X_binned`` (``binning``) -> per round ``g, h``
(``derivatives``) -> histograms (``histogram``) -> split scan (``split``) -> tree arrays
(``grower``, ``tree``) -> raw predictions (``predictor``) -> link (``link``) -> predictions.
"""

from . import devices as _devices

# Must run before anything initialises JAX's backends: one host device per core.
_devices.configure_default_cpu_devices()
_devices.configure_compilation_cache()


def _load_losses_folder():
    """Make the repository's top-level ``losses/`` folder importable as ``jaxboost.losses``.

    An installed package (``pip install .`` or ``-e .``) already maps it there; running from a
    source checkout without installing does not, so load it from beside this package.
    """
    import importlib.util
    import pathlib
    import sys

    try:
        from . import losses  # noqa: F401  (installed mapping)
        return
    except ImportError:
        pass
    folder = pathlib.Path(__file__).resolve().parent.parent / "losses"
    spec = importlib.util.spec_from_file_location(__name__ + ".losses", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None:
        raise ImportError(f"jaxboost.losses not found: no losses/ folder beside {pathlib.Path(__file__).parent}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_load_losses_folder()

from . import callbacks, losses, metrics  # noqa: E402
from . import regularizer as regularizers  # noqa: E402
from .binning import BinEdges  # noqa: E402
from .dataset import Dataset  # noqa: E402
from .devices import use_cpu_cores  # noqa: E402
from .model import Model  # noqa: E402
from .training import train  # noqa: E402
from .vmapped_training import train_many  # noqa: E402

__version__ = "0.1.0"

__all__ = ["BinEdges", "Dataset", "Model", "callbacks", "losses", "metrics", "regularizers", "train", "train_many",
           "use_cpu_cores", "__version__"]
