"""ringmpi: exact ring attention over MPI for very long sequences.

The sequence is split over the ranks of an MPI communicator; K/V blocks travel
around a ring while each rank folds them into the attention of its own queries.
numpy arrays run on the CPU, CuPy arrays on the GPU.
"""

from . import reference
from .attention import ring_attention
from .backward import ring_attention_backward
from .decode import decode_attention
from .grid import grid
from .partition import LAYOUTS, positions
from .sharding import gather, shard

__version__ = "0.1.0"
__all__ = [
    "LAYOUTS",
    "decode_attention",
    "gather",
    "grid",
    "positions",
    "reference",
    "ring_attention",
    "ring_attention_backward",
    "shard",
    "__version__",
]
