"""``ringmpi run`` with a mask of slices per sequence: a ``slices`` dataset beside q (issue 41).

Every group of the input carries its own mask (each builder of :mod:`ringmpi.slices`, a
random union with overlaps and rows that see nothing, a cross-attention one); the job
runs them on every layout, ``balanced`` included, at the P of the launch (the multi-rank
suite runs P = 1, 2, 3), and each output is compared with the dense float64 reference
under the explicit boolean mask (``Slices.to_dense``), within twice the error of a dense
float32 computation. The values are shaped like real activations (nonzero means, small
spreads) with a few huge keys. A malformed or conflicting slices input gives one line
and exit status 2 from ``ringmpi run``, and writes nothing.
"""

from __future__ import annotations

import glob
import os

import h5py
import numpy as np
import pytest
from cli.test_main_mpi import launch

from ringmpi import reference
from ringmpi import slices as sl
from ringmpi.job.input.scan import scan
from ringmpi.job.output.parts import fingerprint
from ringmpi.job.run import run
from ringmpi.job.verify import verify
from ringmpi.slices import Slices
from ringmpi.testing import assert_all, once

H, HKV, D = 4, 2, 16


def _union(rng, n: int) -> Slices:
    """Random slices of every kind over rows 10.. (rows 0..9 see no key), overlapping."""
    out = []
    for kind in sl.KINDS * 3:
        q0, q1 = np.sort(rng.integers(10, n + 1, 2))
        k0, k1 = np.sort(rng.integers(0, n + 1, 2))
        out.append((int(q0), int(q1), int(k0), int(k1), kind))
    out.append((10, n, 0, 3, "full"))  # every covered row sees a key or more
    return Slices(out)


def masks() -> dict:
    """{group: (Slices, queries, keys)} of the input."""
    rng = np.random.default_rng(41)
    cross = Slices(
        [(0, 200, 0, 50, "full"), (0, 200, 100, 500, "bi_causal"), (60, 200, 300, 500, "causal")]
    )
    return {
        "a_global": (sl.global_local(517, (24, 8), 5), 517, 517),
        "b_prompt": (sl.shared_prefix(120, [90, 1, 200, 60]), 471, 471),
        "c_prefix": (sl.prefix_lm(333, 100), 333, 333),
        "d_sparse": (sl.block_sparse(400, 48, seed=3, causal=True), 400, 400),
        "e_union": (_union(rng, 350), 350, 350),
        "f_cross": (cross, 200, 500),
    }


def write_input(path: str, table_dtype="i4") -> dict:
    """The input file; {group: (q, k, v, Slices)} (float32 values)."""
    rng = np.random.default_rng(7)
    got = {}
    with h5py.File(path, "w") as f:
        for g, (s, nq, nk) in masks().items():
            q = 0.5 + 0.1 * rng.standard_normal((nq, H, D))
            k = 0.3 + 0.1 * rng.standard_normal((nk, HKV, D))
            k[rng.choice(nk, 3, replace=False)] += 6.0  # a few huge keys
            v = 1.0 + 0.05 * rng.standard_normal((nk, HKV, D))
            q, k, v = (a.astype("f4") for a in (q, k, v))
            f[f"{g}/q"], f[f"{g}/k"], f[f"{g}/v"] = q, k, v
            f[f"{g}/slices"] = s.table().astype(table_dtype)
            got[g] = (q, k, v, s)
    return got


def references(path: str) -> dict:
    """{group: (ref out, ref lse, float32 out error, float32 lse error)}: the dense float64
    reference under the explicit mask, and how far a dense float32 computation is from it."""
    refs = {}
    with h5py.File(path, "r") as f:
        for g in f:
            q, k, v = (f[g][n][...] for n in ("q", "k", "v"))
            dense = Slices(f[g]["slices"][...]).to_dense(len(q), len(k))
            ref_o, ref_l = reference.attention(q, k, v, mask=dense)
            low_o, low_l = reference.attention(q, k, v, mask=dense, dtype=np.float32)
            fin = np.isfinite(ref_l)
            e_o = np.abs(low_o - ref_o).max()
            e_l = np.abs(low_l[fin] - ref_l[fin]).max()
            refs[g] = (ref_o, ref_l, e_o, e_l)
    return refs


def check_output(out: str, refs: dict) -> list:
    """The problems of ``out`` against the references (empty: none)."""
    bad = []
    with h5py.File(out, "r") as f:
        assert int(f.attrs["mask_slices"]) == len(refs)
        for g, (ref_o, ref_l, e_o, e_l) in refs.items():
            o, lse = f[g]["out"][...], f[g]["lse"][...]
            fin = np.isfinite(ref_l)
            if not np.array_equal(np.isfinite(lse), fin):
                bad.append(f"{g}: lse finite where the reference is not (or back)")
            if (o[~fin.all(axis=0)] != 0).any():
                bad.append(f"{g}: a row without keys is not 0")
            err_o, tol_o = np.abs(o - ref_o).max(), 2 * e_o + 1e-6
            err_l, tol_l = np.abs(lse[fin] - ref_l[fin]).max(), 2 * e_l + 1e-6
            if not (err_o <= tol_o and err_l <= tol_l):
                bad.append(
                    f"{g}: out err {err_o:.2e} (tol {tol_o:.2e}), lse {err_l:.2e} ({tol_l:.2e})"
                )
    return bad


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["balanced", "zigzag", "striped", "contiguous"])
def test_every_mask_of_slices_matches_the_dense_reference(comm, tmp_path_factory, layout):
    """issue 41: each group's slices are its whole mask, on every layout and P."""
    d = comm.bcast(str(tmp_path_factory.mktemp("sl")) if comm.rank == 0 else None)
    src, out = f"{d}/in.h5", f"{d}/out.h5"
    if comm.rank == 0:
        write_input(src)
    comm.Barrier()
    summary = run([src], out, comm=comm, layout=layout, quiet=True)
    assert_all(comm, summary["sequences"] == 6, str(summary))
    refs = once(comm, references, src)
    bad = check_output(out, refs) if comm.rank == 0 else []
    assert_all(comm, not bad, "; ".join(bad))
    res = verify(out, [src], comm=comm, quiet=True)
    assert_all(comm, res["ok"] and res["full"] == 6, str(res))
    assert_all(comm, "a mask of slices in 6 sequence(s)" in res["mask"], res["mask"])
    if comm.rank == 0:
        with h5py.File(out, "r") as f, h5py.File(src, "r") as i:
            for g in i:
                want = Slices(i[g]["slices"][...]).table()
                assert np.array_equal(f[g]["slices"][...], want), g
                assert "1 causal" in f[g]["slices"].attrs["kinds"]
            assert f.attrs["layout"] == layout and not f.attrs["causal"]
    comm.Barrier()
    # a resumed run finds every sequence done under the same masks
    again = run([src], out, comm=comm, layout=layout, quiet=True, resume=True)
    assert_all(comm, again["skipped_done"] == 6 and again["sequences"] == 0, str(again))


def test_verify_applies_the_explicit_mask(tmp_path):
    """A row of a sliced sequence off by 1e-3 fails verify, which rates it by its mask."""
    src, out = str(tmp_path / "in.h5"), str(tmp_path / "out.h5")
    write_input(src)
    run([src], out, quiet=True, output_mode="parts")
    assert verify(out, [src], quiet=True)["ok"]
    # a sequence with slices is a batch of its own: e_union (the fifth group) has its parts
    with h5py.File(out + ".parts/s000004.r00000.h5", "r+") as f:
        row = int(np.flatnonzero(f["pos"][...] == 100)[0])
        f["out"][row, 1, 3] += 1e-3
    res = verify(out, [src], quiet=True)
    bad = [r for r in res["sequences"] if not r["ok"]]
    assert [r["sequence"] for r in bad] == ["e_union"] and bad[0]["rows_failed"] == 1, res


def test_the_resume_fingerprint_holds_the_masks(tmp_path):
    src = str(tmp_path / "in.h5")
    write_input(src)
    plan = scan([src])
    got = fingerprint(plan, "zigzag", False, None, 2)
    assert sorted(got["slices"]) == sorted(masks())
    other = scan([src])
    other.sequences[0].slices = sl.global_local(517, (24, 9), 5)
    assert fingerprint(other, "zigzag", False, None, 2)["slices"] != got["slices"]
    for s in plan.sequences:  # inputs without slices: no key, the fingerprint as before
        s.slices = None
    assert "slices" not in fingerprint(plan, "zigzag", False, None, 2)


def test_a_plain_sequence_beside_sliced_ones_keeps_its_mask(tmp_path):
    """A group without 'slices' gets the job's (full) mask, bitwise as alone."""
    src, alone = str(tmp_path / "in.h5"), str(tmp_path / "alone.h5")
    write_input(src)
    rng = np.random.default_rng(3)
    q, k, v = (0.5 + 0.1 * rng.standard_normal((260, n, D)).astype("f4") for n in (H, HKV, HKV))
    for path in (src, alone):
        with h5py.File(path, "a") as f:
            f["z_plain/q"], f["z_plain/k"], f["z_plain/v"] = q, k, v
    run([src], str(tmp_path / "o.h5"), quiet=True, output_mode="parts")
    run([alone], str(tmp_path / "a.h5"), quiet=True, output_mode="parts")
    with h5py.File(tmp_path / "o.h5", "r") as f, h5py.File(tmp_path / "a.h5", "r") as a:
        assert "slices" not in f["z_plain"] and f.attrs["mask_slices"] == 6
        assert "mask_slices" not in a.attrs
        # the sliced groups are batches of their own: z_plain is computed alone either way
        np.testing.assert_array_equal(f["z_plain/out"][...], a["z_plain/out"][...])
        ref, _ = reference.attention(q, k, v)
        assert np.abs(f["z_plain/out"][...] - ref).max() < 1e-5


# -- refused: one line, exit status 2, nothing written ----------------------------------


def _refusals(d) -> dict:
    """case: (input files, options, words of the line)."""

    def sliced(name, table, **extra):
        p = str(d / name)
        rng = np.random.default_rng(0)
        with h5py.File(p, "w") as f:
            f["q"] = (0.5 + 0.1 * rng.standard_normal((60, H, D))).astype("f4")
            f["k"] = f["v"] = (0.3 + 0.1 * rng.standard_normal((60, HKV, D))).astype("f4")
            if table is not None:
                f["slices"] = table
            for n, a in extra.items():
                f[n] = a
        return p

    ok = np.array([[0, 60, 0, 60, 1]])
    return {
        "NaN": ([sliced("nan.h5", np.array([[0, 60, 0, np.nan, 1]]))], [], "has dtype float64"),
        "unknown kind": ([sliced("kind.h5", np.array([[0, 60, 0, 60, 9]]))], [], "kind code 9"),
        "inverted": ([sliced("inv.h5", np.array([[0, 60, 50, 40, 0]]))], [], "k_end < k_start"),
        "beyond": ([sliced("far.h5", np.array([[0, 61, 0, 60, 0]]))], [], "reaches beyond"),
        "cu_seqlens": (
            [sliced("cu.h5", ok, cu_seqlens=np.array([0, 30, 60]))],
            [],
            "cannot be combined with 'cu_seqlens'",
        ),
        "--causal": ([sliced("causal.h5", ok)], ["--causal"], "--causal cannot be combined"),
        "--window": ([sliced("window.h5", ok)], ["--window", "8"], "--window cannot be combined"),
        "balanced without": (
            [sliced("bare.h5", None)],
            ["--layout", "balanced"],
            "has no 'slices' dataset",
        ),
    }


@pytest.mark.parametrize("p", [2, 3])
def test_refused_inputs_give_one_line_and_exit_2(tmp_path, p):
    for case, (files, opts, words) in _refusals(tmp_path).items():
        out = str(tmp_path / f"{case}.h5")
        rc, _, se, _ = launch(p, "run", *files, "-o", out, *opts)
        lines = [ln for ln in se.splitlines() if ln.strip()]
        assert rc == 2, (case, se)
        assert len(lines) == 1 and lines[0].startswith("ringmpi: error: "), (case, se)
        assert words in lines[0] and os.path.basename(files[0]) in lines[0], (case, lines[0])
        assert not glob.glob(out + "*"), case


def test_pack_keeps_each_mask_of_slices(tmp_path):
    from ringmpi.job.output.pack import pack

    src, out, packed = (str(tmp_path / n) for n in ("in.h5", "out.h5", "packed.h5"))
    got = write_input(src)
    run([src], out, quiet=True, output_mode="parts")
    pack(out, packed)
    with h5py.File(packed, "r") as f, h5py.File(out, "r") as o:
        for g, (_, _, _, s) in got.items():
            assert np.array_equal(f[g]["slices"][...], s.table()), g
            assert f[g]["slices"].attrs["kinds"] == o[g]["slices"].attrs["kinds"]
            assert np.array_equal(f[g]["out"][...], o[g]["out"][...]), g
