"""A verify that fits the run (issue 26, item 2, and the verify line of item 7)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from ringmpi import reference
from ringmpi.cli.main import main
from ringmpi.cli.make_data import make_data
from ringmpi.job import verify as verify_mod
from ringmpi.job.run import run
from ringmpi.job.verify import format_verify, rows_attention, verify
from ringmpi.mask import make_mask
from ringmpi.testing import assert_all

H, HKV, D = 2, 1, 16


@pytest.fixture
def job(tmp_path):
    (x,) = make_data(
        str(tmp_path / "in.h5"),
        seq_len=5000,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        dtype="float64",
        seed=5,
    )
    out = str(tmp_path / "out.h5")
    run([x], out, causal=True, quiet=True, output_mode="parts")
    return x, out


def test_default_samples_beyond_a_few_thousand_tokens(job):
    x, out = job
    res = verify(out, [x], quiet=True)
    assert res["ok"] and res["sampled"] == 1 and res["full"] == 0
    assert verify_mod.default_sample_rows(5000) == 256  # S / 128 within [256, 2048]
    assert verify_mod.default_sample_rows(1 << 20) == 2048
    assert res["sequences"][0]["rows_checked"] == 256 * H


def test_full_option_checks_every_row(job, capsys):
    x, out = job
    res = verify(out, [x], quiet=True, full=True)
    assert res["ok"] and res["full"] == 1 and res["sequences"][0]["rows_checked"] == 5000 * H
    assert main(["verify", out, x, "--full", "--quiet"]) == 0
    assert "full (10,000 rows)" in capsys.readouterr().out


def test_progress_lines_within_one_head(job, monkeypatch):
    """A head's check reports while it runs, not only when it ends (every LOG_EVERY s)."""
    x, out = job
    monkeypatch.setattr(verify_mod, "LOG_EVERY", 0.0)
    stream = io.StringIO()
    monkeypatch.setattr(verify_mod.sys, "stderr", stream)
    verify(out, [x], full=True)
    lines = [t for t in stream.getvalue().splitlines() if t.startswith("ringmpi verify:")]
    head0 = [t for t in lines if "head 0" in t]
    assert len(head0) > 10, lines[:5]
    pct = [int(t.split("%")[0].split()[-1]) for t in lines]
    assert pct == sorted(pct) and pct[-1] <= 100


@pytest.mark.parametrize("kind", ["causal", "window", "packed", "cross"])
def test_rows_attention_on_visible_keys_only_matches_reference(kind):
    """Restricting each row block to its visible keys changes nothing beyond rounding."""
    rng = np.random.default_rng(7)
    n, nk = 700, 700 if kind != "cross" else 900
    q = 0.5 + 0.1 * rng.standard_normal((n, D))
    k = 0.3 + 0.1 * rng.standard_normal((nk, D))
    v = 2.0 + 0.05 * rng.standard_normal((nk, D))
    cu = np.array([0, 5, 300, 301, 700]) if kind == "packed" else None
    window = (40, 0) if kind == "window" else None
    mask = make_mask(n, nk, True, window, cu, None)
    rows = np.sort(rng.choice(n, 97, replace=False))
    got_o, got_l = rows_attention(q, k, v, rows, True, 0.25, np.float64, mask)
    ref_o, ref_l = reference.attention(
        q[:, None], k[:, None], v[:, None], True, 0.25, window=window, cu_seqlens=cu
    )
    np.testing.assert_allclose(got_o, ref_o[rows, 0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got_l, ref_l[0, rows], rtol=1e-12, atol=1e-13)


def test_failing_line_prints_the_true_operator(job):
    x, out = job
    res = verify(out, [x], quiet=True)
    r = res["sequences"][0]
    r.update(err_out=r["tol_out"] * 10, ok=False, rows_failed=1)
    res["status"], res["failed"], res["ok"] = "failed", 1, False
    line = format_verify(res).splitlines()[0]
    assert f"max|out-ref| {r['err_out']:.2e} > {r['tol_out']:.2e}," in line, line
    assert f"max|lse-ref| {r['err_lse']:.2e} <= {r['tol_lse']:.2e}" in line, line


@pytest.mark.mpi
def test_rows_split_over_the_ranks_when_heads_are_few(comm, tmp_path_factory):
    """One head on P ranks: each rank checks a share of the rows; a bad row is counted once."""
    import h5py

    d = comm.bcast(str(tmp_path_factory.mktemp("v")) if comm.rank == 0 else None)
    if comm.rank == 0:
        make_data(f"{d}/in.h5", seq_len=600, heads=1, kv_heads=1, head_dim=D, dtype="float64")
    comm.Barrier()
    run([f"{d}/in.h5"], f"{d}/out.h5", comm=comm, causal=True, quiet=True, output_mode="parts")
    res = verify(f"{d}/out.h5", [f"{d}/in.h5"], comm=comm, quiet=True)
    assert_all(comm, res["ok"] and res["sequences"][0]["rows_checked"] == 600, str(res))
    assert_all(comm, res["ranks_checking"] == comm.size, str(res))
    comm.Barrier()
    if comm.rank == 0:  # one row gets a small error, one a gross one
        import glob

        for p in sorted(glob.glob(f"{d}/out.h5.parts/s000000.r*.h5")):
            with h5py.File(p, "r+") as f:
                pos = f["pos"][...]
                for t, how in ((123, lambda r: r + 1e-6), (457, lambda r: r * 0 + 99.0)):
                    hit = np.flatnonzero(pos == t)
                    if len(hit):
                        f["out"][hit[0], 0] = how(f["out"][hit[0], 0])
    comm.Barrier()
    res = verify(f"{d}/out.h5", [f"{d}/in.h5"], comm=comm, quiet=True)
    s = res["sequences"][0]
    assert_all(comm, not res["ok"] and s["rows_failed"] == 2, str(s))


# ----------------------------------------------------------------------
# verify --against: two outputs bit for bit (issue 40)


@pytest.fixture
def two_runs(tmp_path):
    """A small input (real-shaped values) run twice, P = 1, parts mode."""
    (x,) = make_data(str(tmp_path / "in.h5"), seq_len=333, heads=H, kv_heads=HKV, head_dim=D)
    outs = [str(tmp_path / f"out{i}.h5") for i in (1, 2)]
    for out in outs:
        run([x], out, causal=True, quiet=True, output_mode="parts")
    return x, outs


def test_compare_same_run_twice_is_identical_and_a_packed_copy_too(two_runs, tmp_path, capsys):
    from ringmpi.job.output.pack import pack
    from ringmpi.job.verify import compare, format_compare

    _, (a, b) = two_runs
    res = compare(a, b)
    assert res["identical"] and res["datasets"] == 2 and not res["differ"], res
    assert res["elements"] == 333 * H * D + H * 333
    packed = str(tmp_path / "packed.h5")
    pack(a, packed)  # one file, no virtual datasets: the same bits
    assert compare(a, packed)["identical"]
    assert format_compare(res).splitlines()[-1].startswith("IDENTICAL: 2 datasets")
    assert main(["verify", a, "--against", packed]) == 0
    assert "IDENTICAL" in capsys.readouterr().out


def test_compare_finds_the_first_difference_down_to_one_bit(two_runs, tmp_path, capsys):
    import h5py

    from ringmpi.job.output.pack import pack
    from ringmpi.job.verify import compare

    _, (a, _) = two_runs
    other = str(tmp_path / "other.h5")
    pack(a, other)
    with h5py.File(other, "r+") as f:
        out = f["out"]  # one sequence: at the root
        x = out[200, 1, 7]
        up = np.nextafter(x, x.dtype.type(np.inf))  # one ulp in x's own dtype (numpy 1.x too)
        out[200, 1, 7] = up
        out_neg = out[250, 0, 3]
        out[250, 0, 3] = -out_neg
    res = compare(a, other)
    assert not res["identical"]
    (d,) = res["differ"]
    assert d["name"] == "/out" and d["first"] == (200, 1, 7) and d["count"] == 2, d
    assert d["values"][0] == x and d["values"][1] == up
    assert d["max"] == pytest.approx(2 * abs(float(out_neg)), rel=1e-6), d
    assert main(["verify", a, "--against", other]) == 3
    text = capsys.readouterr().out
    assert "/out: 2 elements differ, first at [200, 1, 7]" in text, text
    assert text.splitlines()[-1].startswith("DIFFERENT: 1 of the datasets"), text


def test_compare_bitwise_sees_signed_zero_and_nan_payloads():
    from ringmpi.job.verify import _first_difference

    a = np.zeros((3, 4), np.float32)
    b = a.copy()
    b[2, 1] = -0.0
    assert _first_difference(a, b)[:2] == ((2, 1), 1)
    n1 = np.array([np.nan], np.float64)
    n2 = n1.view(np.uint64).copy()
    n2 += 1  # another NaN payload
    assert _first_difference(n1, n2.view(np.float64))[:2] == ((0,), 1)
    assert _first_difference(a, a.copy()) == (None, 0, 0.0)


def test_compare_refuses_missing_parts_and_non_outputs(two_runs):
    import os

    from ringmpi.job.plan import InputError
    from ringmpi.job.verify import compare

    x, (a, b) = two_runs
    with pytest.raises(InputError, match="not a ringmpi output"):
        compare(a, x)
    (part,) = [p for p in os.listdir(b + ".parts") if p.endswith(".h5")][:1]
    os.remove(os.path.join(b + ".parts", part))
    with pytest.raises(InputError, match="missing"):
        compare(a, b)


def test_verify_takes_inputs_or_against_not_both(two_runs):
    x, (a, b) = two_runs
    for argv in (["verify", a], ["verify", a, x, "--against", b]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


@pytest.mark.mpi
def test_compare_on_every_rank(comm, tmp_path_factory):
    """Rank 0 reads both outputs, every rank gets the verdict (runs at P and at P = 1).

    The run on rank 0 alone (``comm=None``) once hung at P > 1: its ring was COMM_WORLD.
    """
    from ringmpi.job.verify import compare

    d = comm.bcast(str(tmp_path_factory.mktemp("c")) if comm.rank == 0 else None)
    if comm.rank == 0:
        make_data(f"{d}/in.h5", seq_len=301, heads=2, kv_heads=1, head_dim=D, dtype="float64")
    comm.Barrier()
    run([f"{d}/in.h5"], f"{d}/p.h5", comm=comm, causal=True, quiet=True, output_mode="parts")
    if comm.rank == 0:  # comm=None: this process alone, while the other ranks wait
        run([f"{d}/in.h5"], f"{d}/one.h5", causal=True, quiet=True, output_mode="parts")
    comm.Barrier()
    res = compare(f"{d}/p.h5", f"{d}/p.h5", comm)
    assert_all(comm, res["identical"], str(res))
    res = compare(f"{d}/p.h5", f"{d}/one.h5", comm)
    # float64 at P vs one rank: equal to rounding; the verdict is the same everywhere
    flags = comm.allgather(res["identical"])
    assert_all(comm, len(set(flags)) == 1, str(flags))
    worst = max([x.get("max", 0.0) for x in res["differ"]], default=0.0)
    assert_all(comm, worst < 1e-12, str(res["differ"]))
