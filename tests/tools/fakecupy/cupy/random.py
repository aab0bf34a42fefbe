"""cupy.random.RandomState of the stand-in: numpy's generator, results on the "device"."""

from __future__ import annotations

import numpy as np

from ._core import ndarray

__all__ = ["RandomState"]


class RandomState:
    """Seeded generator with the methods ringmpi calls."""

    def __init__(self, seed=None):
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=np.float64):
        return ndarray(np.asarray(self._rng.standard_normal(size), dtype=dtype))

    def random_sample(self, size=None, dtype=np.float64):
        return ndarray(np.asarray(self._rng.random(size), dtype=dtype))
