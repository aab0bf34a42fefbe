"""ringmpi: exact ring attention over MPI for very long sequences.

The sequence is split over the ranks of an MPI communicator; K/V blocks travel
around a ring while each rank folds them into the attention of its own queries.
numpy arrays run on the CPU, CuPy arrays on the GPU.

Importing the package initialises nothing: the public names are loaded on first
use (a module ``__getattr__``), so ``import ringmpi``, ``ringmpi --help``,
``ringmpi make-data`` and ``ringmpi pack`` never initialise MPI.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
# public name -> the module that defines it
_LAZY = {
    "AttentionSpec": "spec",
    "LAYOUTS": "layout",
    "Slices": "slices",
    "decode_attention": "decode",
    "gather": "layout",
    "grid": "parallel",
    "positions": "layout",
    "ring_attention": "attention",
    "ring_attention_backward": "backward",
    "shard": "layout",
}
__all__ = sorted([*_LAZY, "reference", "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once: later look-ups skip this function
        return value
    if not name.startswith("__"):  # a submodule, as `import ringmpi` used to load them all
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
