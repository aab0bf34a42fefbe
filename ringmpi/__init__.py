"""ringmpi: exact ring attention over MPI for very long sequences."""

from .partition import positions

__version__ = "0.1.0"
__all__ = ["positions", "__version__"]
