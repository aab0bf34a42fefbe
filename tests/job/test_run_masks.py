"""``ringmpi run``/``verify`` with windows, packed sequences, cross-attention and RoPE.

The job is launched as ``mpiexec -n P python -m mpi4py -m ringmpi ...`` (P = 1..4,
every layout) and its output compared with the dense float64 reference
(:func:`ringmpi.reference.attention` with the same window / cu_seqlens / cross
lengths); the tolerance is 2 x the error of a dense float32 computation + 1e-6.
The reader's union-of-hyperslabs reads are checked serially against plain indexing.
"""

from __future__ import annotations

import glob
import os

import h5py
import numpy as np
import pytest
from cli.test_main_mpi import launch

from ringmpi import reference
from ringmpi.job.input.reader import Reader
from ringmpi.job.input.scan import scan
from ringmpi.layout import LAYOUTS, local_runs, positions

H, HKV, D, F = 4, 2, 16, 12
PACKED = (3, 257, 1, 439, 313)
# packed cross: a query sequence without keys (rows: out 0, lse -inf) and one without queries
PC_Q, PC_K = (5, 100, 0, 60, 40), (50, 7, 30, 0, 120)


def _cu(lengths):
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)


def _groups():
    """{group: (q, k, v, cu_seqlens or None, cu_seqlens_k or None)} of the mixed input."""
    rng = np.random.default_rng(13)

    def qkv(nq, nk):
        return (
            rng.standard_normal((nq, H, D)).astype("f4"),
            rng.standard_normal((nk, HKV, D)).astype("f4"),
            rng.standard_normal((nk, HKV, D)).astype("f4"),
        )

    return {
        "a_plain": (*qkv(211, 211), None, None),
        "b_packed": (*qkv(sum(PACKED), sum(PACKED)), _cu(PACKED), None),
        "c_cross": (*qkv(300, 1000), None, None),
        "d_pcross": (*qkv(sum(PC_Q), sum(PC_K)), _cu(PC_Q), _cu(PC_K)),
    }


# shard cuts (fractions of each dataset's own length): they split packed sequences mid-way
CUTS = (0.37, 0.81)


def _write_inputs(d, groups, shards: bool) -> list:
    """One file, or three shards: q and k/v cut at their own points; cu_seqlens in shard 0
    (b_packed: in every shard, identical)."""
    if not shards:
        path = str(d / "mix.h5")
        with h5py.File(path, "w") as f:
            for g, (q, k, v, cu, cuk) in groups.items():
                f[f"{g}/q"], f[f"{g}/k"], f[f"{g}/v"] = q, k, v
                if cu is not None:
                    f[f"{g}/cu_seqlens"] = cu
                if cuk is not None:
                    f[f"{g}/cu_seqlens_k"] = cuk
        return [path]
    paths = [str(d / f"mix.part{j}.h5") for j in range(3)]
    for j, p in enumerate(paths):
        with h5py.File(p, "w") as f:
            for g, (q, k, v, cu, cuk) in groups.items():
                for name, a in (("q", q), ("k", k), ("v", v)):
                    c = [0, *(int(x * len(a)) for x in CUTS), len(a)]
                    f[f"{g}/{name}"] = a[c[j] : c[j + 1]]
                if cu is not None and (j == 0 or g == "b_packed"):
                    f[f"{g}/cu_seqlens"] = cu
                if cuk is not None and j == 0:
                    f[f"{g}/cu_seqlens_k"] = cuk
    return paths


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    d = tmp_path_factory.mktemp("masks")
    groups = _groups()
    return {
        "groups": groups,
        "single": _write_inputs(d, groups, False),
        "shards": _write_inputs(d, groups, True),
    }


def _window(opt):
    if opt is None:
        return None
    left, _, right = opt.partition(",")
    return (int(left), int(right or left))


def _check(out, g, q, k, v, causal, window, cu, cuk):
    """out/lse of group g against the dense float64 reference with the same mask."""
    kw = dict(causal=causal, window=window, cu_seqlens=cu, cu_seqlens_k=cuk)
    ref_o, ref_l = reference.attention(q, k, v, **kw)
    low_o, low_l = reference.attention(q, k, v, dtype=np.float32, **kw)
    with h5py.File(out, "r") as f:
        o, lse = f[g]["out"][...], f[g]["lse"][...]
        if cu is not None:
            np.testing.assert_array_equal(f[g]["cu_seqlens"][...], cu)
        assert ("cu_seqlens_k" in f[g]) == (cuk is not None)
    assert o.shape == q.shape and lse.shape == (H, len(q))
    fin = np.isfinite(ref_l)
    np.testing.assert_array_equal(np.isfinite(lse), fin)  # -inf exactly where no key is visible
    assert (o[~fin.all(axis=0)] == 0).all()
    err_o, tol_o = np.abs(o - ref_o).max(), 2 * np.abs(low_o - ref_o).max() + 1e-6
    err_l = np.abs(lse[fin] - ref_l[fin]).max()
    tol_l = 2 * np.abs(low_l[fin] - ref_l[fin]).max() + 1e-6
    assert err_o <= tol_o, (g, err_o, tol_o)
    assert err_l <= tol_l, (g, err_l, tol_l)


CASES = [  # (P, layout, causal, --window, shard files)
    (1, "contiguous", True, None, False),
    (2, "zigzag", False, "64", True),
    (3, "striped", True, "100", False),
    (4, "contiguous", False, None, True),
    (3, "zigzag", False, "30,70", True),
    (2, "striped", True, None, True),
    (4, "zigzag", True, "40", False),
    (3, "contiguous", True, "25", True),
]


@pytest.mark.parametrize("p, layout, causal, window, shards", CASES)
def test_masks_match_reference(mix, tmp_path, p, layout, causal, window, shards):
    out = str(tmp_path / "out.h5")
    args = ["run", *mix["shards" if shards else "single"], "-o", out, "--layout", layout]
    args += (["--causal"] if causal else []) + (["--window", window] if window else [])
    rc, so, se, _ = launch(p, *args, "--verify")
    assert rc == 0, se
    assert "ringmpi verify: PASSED (4 full" in so, so
    assert "packed" in so and "cross" in so  # the start line and verify name what they did
    win = _window(window)
    for g, (q, k, v, cu, cuk) in mix["groups"].items():
        _check(out, g, q, k, v, causal, win, cu, cuk)
    with h5py.File(out, "r") as f:
        assert list(f.attrs["window"]) == list(win or (-1, -1))
        assert bool(f.attrs["packed"]) and bool(f.attrs["cross"]) and not f.attrs["rope"]


# -- RoPE through the features path ------------------------------------------------


def _rotate(x, pos, theta, scale):
    """Independent RoPE (rotate-half as complex numbers) in float64: x (S, H, D), pos (S,)."""
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * (pos / scale)[:, None, None] * freq)
    return np.concatenate((z.real, z.imag), axis=-1)


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    d = tmp_path_factory.mktemp("rope")
    rng = np.random.default_rng(7)
    lq, lk = (40, 1, 171, 88), (64, 30, 5, 100)
    x, xk = rng.standard_normal((300, F)), rng.standard_normal((sum(lk), F))
    w = {
        n: rng.standard_normal((F, h * D)) / np.sqrt(F)
        for n, h in (("wq", H), ("wk", HKV), ("wv", HKV))
    }
    paths = [str(d / f"x.part{j}.h5") for j in range(2)]
    cut, cut_k = 130, 77  # splits the packed sequences mid-way
    for j, p in enumerate(paths):
        with h5py.File(p, "w") as f:
            f["p/x"] = (x[:cut] if j == 0 else x[cut:]).astype("f4")
            f["c/x"] = (x[:cut] if j == 0 else x[cut:]).astype("f4")
            f["c/x_kv"] = (xk[:cut_k] if j == 0 else xk[cut_k:]).astype("f4")
            if j == 0:
                f["p/cu_seqlens"] = f["c/cu_seqlens"] = _cu(lq)
                f["c/cu_seqlens_k"] = _cu(lk)
    wp = str(d / "w.h5")
    with h5py.File(wp, "w") as f:
        for n, a in w.items():
            f[n] = a.astype("f4")
        f.attrs["num_heads"], f.attrs["num_kv_heads"] = H, HKV
    return {"paths": paths, "weights": wp, "lq": lq, "lk": lk}


def _dense_rope(feats, g, theta, scale):
    """Project in float64, rotate at positions within each packed sequence, round to f4."""
    full = {}
    for p in feats["paths"]:
        with h5py.File(p, "r") as f:
            for n in ("x", "x_kv"):
                if n in f[g]:
                    full.setdefault(n, []).append(f[g][n][...].astype(np.float64))
    x = np.concatenate(full["x"])
    xk = np.concatenate(full["x_kv"]) if "x_kv" in full else x
    with h5py.File(feats["weights"], "r") as f:
        w = {n: f[n][...].astype(np.float64) for n in ("wq", "wk", "wv")}
    lk = feats["lk"] if g == "c" else feats["lq"]
    pq = np.concatenate([np.arange(n) for n in feats["lq"]])  # position within its sequence
    pk = np.concatenate([np.arange(n) for n in lk])
    q = _rotate((x @ w["wq"]).reshape(len(x), H, D), pq, theta, scale).astype("f4")
    k = _rotate((xk @ w["wk"]).reshape(len(xk), HKV, D), pk, theta, scale).astype("f4")
    v = (xk @ w["wv"]).reshape(len(xk), HKV, D).astype("f4")
    return q, k, v, _cu(feats["lq"]), (_cu(lk) if g == "c" else None)


@pytest.mark.parametrize(
    "p, layout, rope_opts",
    [
        (2, "zigzag", []),
        (3, "striped", ["--rope-theta", "500", "--rope-scale", "2"]),
        (3, "contiguous", ["--rope-scale", "4"]),
    ],
)
def test_rope_features_match_dense(feats, tmp_path, p, layout, rope_opts):
    out = str(tmp_path / "out.h5")
    rc, so, se, _ = launch(
        p,
        "run",
        *feats["paths"],
        "--weights",
        feats["weights"],
        "-o",
        out,
        "--layout",
        layout,
        "--causal",
        "--rope",
        *rope_opts,
        "--verify",
    )
    assert rc == 0, se
    assert "PASSED (2 full" in so and "RoPE" in so, so
    opts = dict(zip(rope_opts[::2], rope_opts[1::2]))
    theta, scale = float(opts.get("--rope-theta", 10000)), float(opts.get("--rope-scale", 1))
    for g in ("p", "c"):
        q, k, v, cu, cuk = _dense_rope(feats, g, theta, scale)
        _check(out, g, q, k, v, True, None, cu, cuk)
    with h5py.File(out, "r") as f:
        assert f.attrs["rope"] and f.attrs["rope_theta"] == theta
        assert f.attrs["rope_scale"] == scale
    # the rotation mattered: unrotated q, k give another result
    q, k, v, cu, cuk = _dense_rope(feats, "p", 1.0, 1e30)  # angles ~0: no rotation
    plain, _ = reference.attention(q, k, v, causal=True, cu_seqlens=cu)
    with h5py.File(out, "r") as f:
        assert np.abs(f["p"]["out"][...] - plain).max() > 1e-2


# -- bad input, resume, verify -------------------------------------------------------


def _bad_files(d):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((50, H, D)).astype("f4"), rng.standard_normal((50, HKV, D))
    k = k.astype("f4")

    def write(name, **extra):
        p = str(d / name)
        with h5py.File(p, "w") as f:
            f["q"], f["k"], f["v"] = q, k, k
            for n, a in extra.items():
                f[n] = a
        return p

    return {
        "short": ([write("short.h5", cu_seqlens=np.array([0, 10, 49]))], [], "ends at 49"),
        "decreasing": (
            [write("dec.h5", cu_seqlens=np.array([0, 30, 20, 50]))],
            [],
            "decreases at index 2",
        ),
        "float": (
            [write("flt.h5", cu_seqlens=np.array([0.0, 20.0, 50.0]))],
            [],
            "expected integer",
        ),
        "rope without weights": ([write("rope.h5")], ["--rope"], "--rope rotates the projected"),
    }


@pytest.mark.parametrize("case", ["short", "decreasing", "float", "rope without weights"])
def test_bad_offsets_and_rope_one_line_exit_2(tmp_path, case):
    files, opts, words = _bad_files(tmp_path)[case]
    out = str(tmp_path / "out.h5")
    rc, so, se, _ = launch(2, "run", *files, "-o", out, *opts)
    lines = [ln for ln in se.splitlines() if ln.strip()]
    assert rc == 2, se
    assert len(lines) == 1 and lines[0].startswith("ringmpi: error: "), se
    assert words in lines[0] and os.path.basename(files[0]) in lines[0], lines[0]
    assert not glob.glob(out + "*")


def test_resume_with_other_window_refused_and_verify_catches_a_bad_row(mix, tmp_path):
    out = str(tmp_path / "out.h5")
    # part files: the check below damages one (the site stack defaults to one file)
    base = ["run", *mix["single"], "-o", out, "--causal", "--quiet", "--output-mode", "parts"]
    rc, _, se, _ = launch(2, *base, "--window", "8")
    assert rc == 0, se
    rc, _, se, _ = launch(2, *base, "--window", "16", "--resume")
    assert rc == 2 and "differs in window" in se, se
    rc, so, se, _ = launch(2, "verify", out, *mix["single"], "--quiet")
    assert rc == 0 and "PASSED" in so, so + se
    # one query row of one head of a packed sequence, slightly off: verify must fail
    # the four short groups are one batch: rank 1's part of it holds b_packed's rows after
    # a_plain's (the part's "sequences" and "rows" attributes say where)
    part = os.path.join(out + ".parts", "s000000.r00001.h5")
    with h5py.File(part, "r+") as f:
        names = [str(n) for n in f.attrs["sequences"]]
        row0 = int(f.attrs["rows"][names.index("b_packed")])
        f["out"][row0 + 7, 1, 3] += 1e-3
    rc, so, se, _ = launch(2, "verify", out, *mix["single"], "--quiet")
    assert rc == 3 and "FAILED" in so and "b_packed" in so and "1 row(s) FAILED" in so, so + se


def test_pack_keeps_the_offsets(mix, tmp_path):
    """``ringmpi pack`` copies cu_seqlens / cu_seqlens_k beside each packed out."""
    out, packed = str(tmp_path / "out.h5"), str(tmp_path / "packed.h5")
    rc, _, se, _ = launch(2, "run", *mix["single"], "-o", out, "--quiet")
    assert rc == 0, se
    rc, _, se, _ = launch(1, "pack", out, "-o", packed)
    assert rc == 0, se
    with h5py.File(mix["single"][0], "r") as src, h5py.File(packed, "r") as dst:
        names = []
        src.visititems(
            lambda n, o: names.append(n) if n.endswith(("cu_seqlens", "cu_seqlens_k")) else None
        )  # noqa: E501
        assert names, "the mixed input holds packed groups"
        for n in names:
            np.testing.assert_array_equal(dst[n][()], src[n][()], err_msg=n)
        with h5py.File(out, "r") as o:
            for n in [x for x in o if "out" in o[x]] if "out" not in o else ["."]:
                np.testing.assert_array_equal(dst[f"{n}/out"][()], o[f"{n}/out"][()], err_msg=n)


# -- serial: the reader's union reads and the run splitter ------------------------------


def test_local_runs_cover_positions_with_few_runs():
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 40, size=300)
    cu = _cu(lengths)
    for layout in LAYOUTS:
        for size in (1, 2, 3, 4):
            for r in range(size):
                pos = positions(int(cu[-1]), r, size, layout, cu_seqlens=cu)
                runs = local_runs(pos)
                back = np.concatenate(
                    [g0 + st * np.arange(c) for g0, c, st, _ in runs] or [np.zeros(0, int)]
                )
                np.testing.assert_array_equal(back, pos)
                assert [o for *_, o in runs] == np.cumsum([0] + [c for _, c, _, _ in runs])[
                    :-1
                ].tolist()
                # about one run per packed sequence and layout chunk, never one per token
                assert len(runs) <= 2 * len(lengths) + 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reader_reads_exactly_its_tokens_across_shards(mix, layout):
    plan = scan(mix["shards"])
    by_name = {s.name: s for s in plan.sequences}
    for size in (1, 3, 4):
        for r in range(size):
            rd = Reader(plan, r, size, layout)
            try:
                for g, (q, k, v, cu, cuk) in mix["groups"].items():
                    seq = by_name[g]
                    got_q, got_k, got_v = rd.read(seq)
                    pq = positions(len(q), r, size, layout, cu_seqlens=cu)
                    pk = positions(len(k), r, size, layout, cu_seqlens=cu if cuk is None else cuk)
                    np.testing.assert_array_equal(got_q, q[pq])
                    np.testing.assert_array_equal(got_k, k[pk])
                    np.testing.assert_array_equal(got_v, v[pk])
            finally:
                rd.close()
