"""The GPU Python path under mpiexec at any P, on the CuPy stand-in (NOT a GPU).

ring_attention and ring_attention_backward with CuPy-typed arrays (the stand-in's,
tests/tools/fakecupy) through the GPU backend (masks, and the score modifiers softcap
and ALiBi in the backward), its GpuRing (staged through pinned
buffers, and CUDA-aware), the launch plans and every kernel launch check of
tests/tools/standin_kernels.py, against the dense float64 reference. The kernels'
arithmetic is the numpy tile's: the CUDA code runs only in tests/gpu/test_tile_device.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from tools import gpucases, standin

import ringmpi

# not at P = 4: the stand-in's host-side protocol (staging, events, buffers) is the
# same at every P >= 2, and P = 2 and 3 run it (it was a quarter of the P = 4 suite)
pytestmark = [pytest.mark.mpi, pytest.mark.max_ranks(3)]

CU = np.concatenate(([0], np.cumsum((3, 97, 1, 60))))
SLOPES = [0.5, 0.125, 2.0**-5, 0.0]  # H = 4 (gpucases), one head without ALiBi
MASKS = [
    ("window 30,0", 203, None, True, dict(window=(30, 0))),
    ("packed causal", int(CU[-1]), None, True, dict(cu_seqlens=CU)),
    ("cross 150x90 causal (empty rows)", 150, 90, True, {}),
]


@pytest.fixture(scope="module")
def cupy():
    """The CuPy stand-in, for this module only (see tests/tools/standin.py)."""
    with standin.installed() as cp:
        yield cp


@pytest.fixture(params=["0", "1"], ids=["staged", "cuda-aware"])
def ring_kind(request, monkeypatch, cupy):
    """GpuRing path: RINGMPI_CUDA_AWARE=0 (pinned staging) or 1 (device buffers to MPI)."""
    monkeypatch.setenv("RINGMPI_CUDA_AWARE", request.param)
    return request.param


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward(comm, cupy, ring_kind, layout, dtype, causal):
    before = cupy.cuda.pinned_allocations[0]
    gpucases.forward_case(cupy, comm, dtype, layout, causal)
    staged = cupy.cuda.pinned_allocations[0] > before
    assert staged == (ring_kind == "0" and comm.size > 1), "wrong GpuRing path ran"


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward(comm, cupy, ring_kind, layout, dtype, causal):
    gpucases.backward_case(cupy, comm, dtype, layout, causal, d=111)


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("case", MASKS, ids=[m[0] for m in MASKS])
def test_masks(comm, cupy, ring_kind, layout, case):
    _, n, nk, causal, mask = case
    for dtype in ("float32", "bfloat16"):
        gpucases.backward_case(cupy, comm, dtype, layout, causal, mask=mask, n=n, nk=nk, d=64)


CU_Q = (0, 3, 100, 101, 163)
CU_K = (0, 9, 70, 70, 150)  # cross-attention per sequence, one with no keys
MODS = [
    ("softcap, causal", 203, None, True, dict(softcap=2.5)),
    ("alibi, window 30,0", 203, None, True, dict(alibi_slopes=SLOPES, window=(30, 0))),
    (
        "both, packed causal",
        int(CU[-1]),
        None,
        True,
        dict(softcap=4.0, alibi_slopes=SLOPES, cu_seqlens=CU),
    ),
    (
        "both, packed cross causal",
        CU_Q[-1],
        CU_K[-1],
        True,
        dict(softcap=3.0, alibi_slopes=SLOPES, cu_seqlens=CU_Q, cu_seqlens_k=CU_K),
    ),
    ("both, window 20,6", 160, None, False, dict(softcap=5.0, alibi_slopes=SLOPES, window=(20, 6))),
]


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", MODS, ids=[m[0] for m in MODS])
def test_backward_modifiers(comm, cupy, layout, dtype, case):
    """Backward with softcap / ALiBi / both under masks (GPU path, stand-in) vs float64."""
    _, n, nk, causal, mask = case
    gpucases.backward_case(cupy, comm, dtype, layout, causal, mask=mask, n=n, nk=nk, d=64)


@pytest.mark.parametrize("reserve", [True, False], ids=["reserved", "not-reserved"])
def test_staged_start_does_not_wait_for_the_producer(cupy, monkeypatch, reserve):
    """Staged start() returns before the send buffer's producer ran, once reserve()d.

    The stand-in's producer is a copy queued on the current stream (it runs only when
    waited for); allocating pinned memory synchronises the device, as on a GPU. With
    the buffers reserved, start() allocates nothing and the producer is still queued
    after it; without, the first start() allocates and so waits for the producer:
    the overlap tests/gpu/test_tile_device.py measures would fail on a correct ring
    (issue 39). Either way the right data arrives.
    """
    from mpi4py import MPI

    from ringmpi import gpu

    monkeypatch.setenv("RINGMPI_CUDA_AWARE", "0")
    ring = gpu.GpuRing(MPI.COMM_SELF)  # a ring of one: sends to itself
    assert not ring.cuda_aware
    runtime = cupy.cuda.runtime
    try:
        send = cupy.zeros(1 << 12, dtype=cupy.float32)
        recv = cupy.empty_like(send)
        if reserve:
            ring.reserve(send.nbytes)
        src = np.full(send.size, 7.0, dtype=np.float32)
        producer = cupy.cuda.Stream(non_blocking=True)
        with producer:
            h2d = runtime.memcpyHostToDevice
            runtime.memcpyAsync(send.data.ptr, src.ctypes.data, send.nbytes, h2d, producer.ptr)
            before = cupy.cuda.pinned_allocations[0]
            ring.start(send, recv)
            waited = producer.ran == producer.enqueued
            allocated = cupy.cuda.pinned_allocations[0] - before
            ring.wait()
        assert bool((recv == 7.0).all()), "received stale data"
        assert waited == (not reserve) and (allocated == 0) == reserve, (waited, allocated)
    finally:
        ring.free()
