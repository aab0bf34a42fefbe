"""The planner's rules (ringmpi.cli.plan); its predicted time against a measured one is
benchmarks/plan_accuracy.py (a timing, not a test)."""

from ringmpi.cli import plan


def test_recommendation_rules():
    kw = dict(gflops=150.0, link_gbps=100.0, causal=True)
    one = plan.recommend(32768, 32, 8, 128, ranks=64, sequences=1, **kw)
    assert one["ring_size"] == 64  # one sequence: the whole machine
    many = plan.recommend(32768, 32, 8, 128, ranks=64, sequences=640, **kw)
    assert many["ring_size"] < 64 and many["rings"] * many["ring_size"] == 64
    tight = plan.recommend(
        1 << 20, 8, 8, 64, ranks=64, sequences=64, memory_per_rank_bytes=2 << 30, **kw
    )
    assert tight["fits"] and tight["per_ring"]["memory_bytes"] <= 2 << 30
    pr = plan.predict(4096, 4, 4, 64, ranks=8, gflops=100.0, link_gbps=0.1)
    assert not pr["hidden"] and pr["step_s"] == pr["transfer_s_per_step"]
    assert plan.predict(4096, 4, 4, 64, ranks=2, gflops=100.0, link_gbps=1000.0)["hidden"]
