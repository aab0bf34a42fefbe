"""CPU tiles: the numpy tile (the specification) and the fused C tile (kernels/cpu_tile.c).

:mod:`.numpy_tile` holds the forward and backward tiles in numpy, which every
other tile is tested against; :mod:`.fused` compiles and loads the C kernel.
"""

from .numpy_tile import compute_dtype

__all__ = ["compute_dtype"]
