"""AttentionSpec across ranks: spec= agrees like the keywords; flops add up to the dense count."""

import numpy as np
import pytest

import ringmpi
from ringmpi.mask import make_mask
from ringmpi.reference import attention
from ringmpi.spec import AttentionSpec
from ringmpi.testing import assert_all, assert_close, raises_everywhere

pytestmark = pytest.mark.mpi

CU = np.array([0, 37, 38, 200, 301])


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_spec_call_matches_reference_and_flops_sum(comm, layout):
    rng = np.random.default_rng(11)
    mean = rng.standard_normal(16)
    q, k, v = (mean + 0.2 * rng.standard_normal((301, 4, 16)) for _ in range(3))
    spec = AttentionSpec(causal=True, window=(50, 3), cu_seqlens=CU, layout=layout)
    loc = [ringmpi.shard(x, comm, layout, cu_seqlens=CU) for x in (q, k, v)]
    st = {}
    out = ringmpi.ring_attention(*loc, comm, spec=spec, stats=st)
    full = ringmpi.gather(out, 301, comm, layout, cu_seqlens=CU)
    ref, _ = attention(q, k, v, True, window=(50, 3), cu_seqlens=CU)
    assert_close(comm, full, ref, None, f"{layout} out")
    lo, hi = make_mask(301, 301, True, (50, 3), CU).bounds(np.arange(301))
    pairs = int(np.maximum(np.minimum(hi, 300) - np.maximum(lo, 0) + 1, 0).sum())
    total = comm.allreduce(st["flops"])
    assert_all(comm, total == 4 * pairs * 16 * 4, f"flops {total} != 4 D H x {pairs} pairs")


def test_spec_disagreement_names_the_field(comm):
    if comm.size < 2:
        pytest.skip("a disagreement needs two ranks")
    q = np.ones((len(ringmpi.positions(40, comm.rank, comm.size)), 2, 8))
    spec = AttentionSpec(window=(4, 4) if comm.rank == comm.size - 1 else (4, 3))
    raises_everywhere(
        comm, lambda: ringmpi.ring_attention(q, q, q, comm, spec=spec), "disagree on window"
    )
