"""Hostile numerics at any P: logits scaled by 1e3, all-equal keys, one visible key.

Each case is compared with the dense float64 reference (tests/mpi_checks.py
numerics_case): finite everywhere, within 1e-12 (float64) or twice a dense
float32 computation's error (float32), and the causal row 0, which sees only
key 0, equals v[0] bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_checks import numerics_case, numerics_cases

import ringmpi
from ringmpi.testing import assert_all

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", numerics_cases())
def test_hostile_numerics_match_reference(comm, case, dtype, layout):
    r = numerics_case(comm, case, dtype, layout)
    assert_all(comm, r["finite"], f"{case}: non-finite output {r}")
    assert_all(comm, r["exact"], f"{case}: one-visible-key row differs from v[0] {r}")
    assert_all(comm, r["err"] <= r["tol"], f"{case}: out error {r['err']} > {r['tol']}")
    assert_all(comm, r["lerr"] <= r["ltol"], f"{case}: lse error {r['lerr']} > {r['ltol']}")
