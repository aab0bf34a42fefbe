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


def test_plan_prints_the_layouts_imbalance_for_its_mask(capsys):
    """issue 41: --causal, --window and --slices NAME:ARGS rate every layout's balance."""
    import json

    import pytest

    from ringmpi import cost
    from ringmpi import slices as sl

    base = ["--seq-len", "4096", "--heads", "4", "--head-dim", "64", "--ranks", "4"]
    assert plan.main([*base, "--slices", "global_local:64:32"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "imbalance" in x][0]
    want = cost.imbalances(plan.plan_mask(4096, slices=sl.global_local(4096, 64, 32)), 4)
    for layout, value in want.items():
        assert f"{layout} {value:.3f}" in line
    assert want["balanced"] <= 1.1 < want["contiguous"]
    assert plan.main([*base, "--causal", "--window", "100,0", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["imbalance"]
    assert got == cost.imbalances(plan.plan_mask(4096, True, (100, 0)), 4)
    s = plan.parse_slices("shared_prefix:1024:1024,2048", 4096)
    assert s == sl.shared_prefix(1024, [1024, 2048])
    assert plan.parse_slices("block_sparse:64:0.5:3", 4096, causal=True) == sl.block_sparse(
        4096, 64, density=0.5, seed=3, causal=True
    )
    for bad in ("prefix_lm", "diagonal:3", "shared_prefix:10:20", "global_local:x"):
        with pytest.raises(SystemExit):
            plan.main([*base, "--slices", bad])
        assert "--slices" in capsys.readouterr().err


def test_value_width_in_flops_bytes_and_memory():
    """Dk != Dv (issue 42): 2 Bq Bk (Dk + Dv) H flops and Bk Hkv (Dk + Dv) elements per
    step; Dv = Dk gives what the plain call gives; the memory grows with Dv."""
    kw = dict(ranks=4, gflops=100.0, link_gbps=10.0)
    same = plan.predict(8192, 8, 2, 64, **kw)
    assert plan.predict(8192, 8, 2, 64, dv=64, **kw) == same
    mla = plan.predict(8192, 8, 2, 192, dv=128, **kw)
    block = 8192 / 4
    assert mla["flops_per_step"] == 2 * block * block * (192 + 128) * 8
    assert mla["bytes_per_step"] == block * 2 * (192 + 128) * 4
    assert mla["min_block_to_hide"] == same["min_block_to_hide"]  # the widths cancel
    wide_v = plan.memory_per_rank(2048, 8, 2, 64, "float32", dv=512)
    assert wide_v > plan.memory_per_rank(2048, 8, 2, 64, "float32")
    assert plan.memory_per_rank(2048, 8, 2, 64, "float32", dv=64) == plan.memory_per_rank(
        2048, 8, 2, 64, "float32"
    )


def test_mla_traffic_of_both_forms(capsys):
    """Absorbed MLA passes 576 + 512 numbers per token, unabsorbed H (192 + 128)."""
    got = plan.mla_traffic(65536, 128, ranks=8, dtype="float16")
    block = 65536 / 8
    assert got["unabsorbed_bytes_per_step"] == block * 128 * (192 + 128) * 2
    assert got["absorbed_bytes_per_step"] == block * (576 + 512) * 2
    assert abs(got["ratio"] - 128 * 320 / 1088) < 1e-12
    argv = "--seq-len 65536 --heads 128 --head-dim 192 --value-dim 128 --ranks 8".split()
    assert plan.main([*argv, "--mla-heads", "128", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "Dk=192 Dv=128" in out and "MLA, H=128" in out and "(37.6x less)" in out


def test_recommended_layout_is_the_least_imbalanced_for_the_mask(capsys):
    """issue 41: the recommendation takes the layout whose slowest rank has the fewest
    visible pairs; ties (within 1%) go to the mask's usual layout, balanced last."""
    from ringmpi import cost
    from ringmpi import slices as sl

    kw = dict(ranks=4, gflops=100.0, link_gbps=10.0)
    gl = plan.plan_mask(8192, slices=sl.global_local(8192, 256, 64))
    rec = plan.recommend(8192, 8, 8, 64, mask=gl, **kw)
    imb = cost.imbalances(gl, 4)
    assert rec["imbalance"] == imb and rec["layout"] == "striped"
    assert imb["striped"] == min(imb.values()) < imb["zigzag"]
    # no mask: the old rule; the plain masks keep their layouts (zigzag ties striped)
    assert plan.recommend(8192, 8, 8, 64, causal=True, **kw)["layout"] == "zigzag"
    causal = plan.recommend(8192, 8, 8, 64, causal=True, mask=plan.plan_mask(8192, True), **kw)
    assert causal["layout"] == "zigzag"
    full = plan.recommend(8192, 8, 8, 64, mask=plan.plan_mask(8192), **kw)
    assert full["layout"] == "contiguous"
    # a token every 8 of the first quarter sees all keys: only balanced deals it evenly
    n = 2048
    odd = sl.Slices(
        [(i, i + 1, 0, n, "full") for i in range(0, n // 4, 8)] + [(0, n, 0, n, "bi_causal")]
    )
    odd_rec = plan.recommend(n, 8, 8, 64, mask=plan.plan_mask(n, slices=odd), **kw)
    assert odd_rec["layout"] == "balanced", odd_rec["imbalance"]
    assert plan.pick_layout({"zigzag": 1.2, "striped": 1.005, "balanced": 1.0}) == "striped"
    assert plan.pick_layout({"zigzag": 1.2, "striped": 1.02, "balanced": 1.0}) == "balanced"
    base = ["--seq-len", "8192", "--heads", "8", "--head-dim", "64", "--ranks", "4"]
    assert plan.main([*base, "--slices", "global_local:256:64"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "recommendation" in x][0]
    assert "layout striped (lowest imbalance for this mask, 1.000)" in line, line


def test_slices_file_rates_an_inputs_mask(tmp_path, capsys):
    """--slices-file FILE[:GROUP] reads the batch job's slices dataset, with its checks."""
    import h5py
    import numpy as np
    import pytest

    from ringmpi import cost
    from ringmpi import slices as sl
    from ringmpi.cli.make_data import make_data

    path = str(tmp_path / "in.h5")
    make_data(path, seq_len=600, heads=2, kv_heads=1, head_dim=8, sequences=2,
              slices="shared_prefix:200:100,300")  # fmt: skip
    want = sl.shared_prefix(200, [100, 300])
    with h5py.File(path, "r") as f:
        for g in ("seq000", "seq001"):
            assert f[g]["slices"].dtype == np.int64
            assert sl.Slices(f[g]["slices"][...]) == want
    assert plan.read_slices_file(f"{path}:seq001", 600) == want
    base = ["--seq-len", "600", "--heads", "4", "--head-dim", "64", "--ranks", "3", "--json"]
    assert plan.main([*base, "--slices-file", f"{path}:seq000"]) == 0
    import json

    got = json.loads(capsys.readouterr().out)["imbalance"]
    assert got == cost.imbalances(plan.plan_mask(600, slices=want), 3)
    with h5py.File(path, "a") as f:
        f["seq001/slices"][0, 4] = 5
    for bad, words in (
        (f"{path}:seq001", "kind code 5"),
        (f"{path}:nowhere", "no group 'nowhere'"),
        (path, "no dataset 'slices'"),
    ):
        with pytest.raises(SystemExit):
            plan.main([*base, "--slices-file", bad])
        err = capsys.readouterr().err
        assert "--slices-file" in err and words in err, err
    with pytest.raises(ValueError, match="cannot be combined with a batch axis"):
        make_data(str(tmp_path / "b.h5"), seq_len=16, heads=2, kv_heads=1, head_dim=8,
                  sequences=2, batch_axis=True, slices="prefix_lm:4")  # fmt: skip
