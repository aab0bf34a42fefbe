"""CPU tiles: the numpy tile (the specification) and the fused C tiles (kernels/cpu_*.c).

:mod:`.numpy_tile` holds the forward and backward tiles in numpy, which every
other tile is tested against; :mod:`.fused` (forward, kernels/cpu_tile.c) and
:mod:`.fused_backward` (kernels/cpu_backward.c) load the C kernels through one
per-ISA loader (:mod:`.loader`), built by :mod:`.build` for the paths of :mod:`.isa`.
"""

from .numpy_tile import compute_dtype

__all__ = ["compute_dtype"]
