"""The planner's predicted ring_attention time against the measured time, same run."""

import time

import numpy as np
import pytest

import ringmpi
from ringmpi.cli import plan
from ringmpi.testing import assert_all

SHAPES = [  # (N, H, D, causal)
    (4096, 4, 64, False),
    (8192, 4, 64, False),
    (4096, 4, 128, False),
    (8192, 4, 64, True),
]


@pytest.mark.mpi
def test_predicted_time_within_30_percent(comm, capsys):
    if comm.size > 2:
        pytest.skip("the model assumes one core per rank: this machine has 2 cores")
    link = plan.measure_link(comm)
    gbps, lat = link if link else (plan.DEFAULT_LINK_GBPS, plan.DEFAULT_LATENCY_S)
    rows, ok = [], True
    for n, h, d, causal in SHAPES:
        n_local = n // comm.size
        rng = np.random.default_rng(n)
        q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
        loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
        rates, times = [], []
        for _ in range(3):  # interleaved, so a burst of load hits both sides alike
            rate = plan.measure_compute(d, h=h, hkv=h, n_local=min(n_local, 8192), causal=causal,
                                        repeat=1)  # fmt: skip
            rates.append(float(np.median(comm.allgather(rate))))
            comm.Barrier()
            t0 = time.perf_counter()
            ringmpi.ring_attention(*loc, comm, causal=causal)
            times.append(comm.allreduce(time.perf_counter() - t0, op=max))
        # the best of each (the fastest call against the highest rate): on a shared machine
        # the other calls carry other processes' time, on either side
        rate, meas = float(np.max(rates)), float(np.min(times))
        pred = plan.predict(n, h, h, d, ranks=comm.size, causal=causal, gflops=rate,
                            link_gbps=gbps, latency_s=lat)["time_s"]  # fmt: skip
        ratio = pred / meas
        rows.append(
            f"N={n} H={h} D={d} causal={causal} P={comm.size}: {rate:.1f} GF/s, "
            f"predicted {pred:.3f} s, measured {meas:.3f} s, ratio {ratio:.2f}"
        )
        ok = ok and 0.7 <= ratio <= 1.3
    if comm.rank == 0:
        with capsys.disabled():
            print("\n" + "\n".join(rows))
    assert_all(comm, ok, "prediction off by more than 30%:\n" + "\n".join(rows))


def test_recommendation_rules():
    kw = dict(gflops=150.0, link_gbps=100.0, causal=True)
    one = plan.recommend(32768, 32, 8, 128, ranks=64, sequences=1, **kw)
    assert one["ring_size"] == 64  # one sequence: the whole machine
    many = plan.recommend(32768, 32, 8, 128, ranks=64, sequences=640, **kw)
    assert many["ring_size"] < 64 and many["rings"] * many["ring_size"] == 64
    tight = plan.recommend(1 << 20, 8, 8, 64, ranks=64, sequences=64,
                           memory_per_rank_bytes=2 << 30, **kw)  # fmt: skip
    assert tight["fits"] and tight["per_ring"]["memory_bytes"] <= 2 << 30
    pr = plan.predict(4096, 4, 4, 64, ranks=8, gflops=100.0, link_gbps=0.1)
    assert not pr["hidden"] and pr["step_s"] == pr["transfer_s_per_step"]
    assert plan.predict(4096, 4, 4, 64, ranks=2, gflops=100.0, link_gbps=1000.0)["hidden"]
