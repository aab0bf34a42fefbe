"""Single-rank tests of the HDF5 input/output layer, the sample generator and verify."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from ringmpi import reference
from ringmpi.cli.make_data import make_data
from ringmpi.collective import CollectiveError
from ringmpi.collective import run_everywhere as collective
from ringmpi.job.input.reader import Reader
from ringmpi.job.input.scan import scan
from ringmpi.job.output.layout import part_name
from ringmpi.job.output.parts import OutputStore, fingerprint
from ringmpi.job.plan import InputError
from ringmpi.job.resources import check_memory, parse_size
from ringmpi.job.verify import dense_head
from ringmpi.layout import LAYOUTS, counts, positions

S, H, HKV, D = 97, 4, 2, 8


def _full(paths, name, group="", batch=None):
    """Concatenate dataset ``name`` over shard files (the whole sequence: tests only)."""
    parts = []
    for p in paths:
        with h5py.File(p, "r") as f:
            node = f[group] if group else f
            parts.append(node[name][batch] if batch is not None else node[name][...])
    return np.concatenate(parts)


def _write(path, **arrays):
    with h5py.File(path, "w") as f:
        for k, a in arrays.items():
            f[k] = a
    return str(path)


def _qkv(n=S, h=H, hkv=HKV, d=D, dt="f4"):
    rng = np.random.default_rng(5)
    return {
        "q": rng.standard_normal((n, h, d)).astype(dt),
        "k": rng.standard_normal((n, hkv, d)).astype(dt),
        "v": rng.standard_normal((n, hkv, d)).astype(dt),
    }


def test_sample_values_do_not_depend_on_shards_or_compression(tmp_path):
    one = make_data(str(tmp_path / "one.h5"), seq_len=S, heads=H, kv_heads=HKV, head_dim=D)
    three = make_data(
        str(tmp_path / "three.h5"),
        seq_len=S,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        shards=3,
        compression="gzip",
    )
    assert len(three) == 3 and all(os.path.exists(p) for p in three)
    with h5py.File(three[1], "r") as f:
        assert f["q"].compression == "gzip" and f["q"].shuffle and f["q"].fletcher32
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(_full(one, name), _full(three, name))


@pytest.mark.parametrize("kind", ["single", "batch", "groups", "features"])
def test_scan_structures(tmp_path, kind):
    kw = dict(seq_len=S, heads=H, kv_heads=HKV, head_dim=D, shards=2)
    if kind == "batch":
        kw.update(sequences=3, batch_axis=True)
    elif kind == "groups":
        kw.update(sequences=3)
    elif kind == "features":
        kw.update(features=12, sequences=2)
    paths = make_data(str(tmp_path / "in.h5"), **kw)
    weights = paths.pop() if kind == "features" else None
    plan = scan(paths, weights)
    assert plan.structure == ("groups" if kind == "features" else kind)
    assert plan.mode == ("features" if kind == "features" else "qkv")
    assert (plan.heads, plan.kv_heads, plan.head_dim) == (H, HKV, D)
    assert [s.length for s in plan.sequences] == [S] * {"single": 1, "features": 2}.get(kind, 3)
    assert plan.sequences[0].lengths == [49, 48]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strided", ["hyperslab", "blocks", "auto"])
def test_reader_reads_exactly_each_ranks_tokens(tmp_path, layout, strided):
    paths = make_data(
        str(tmp_path / "in.h5"),
        seq_len=S,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        shards=3,
        sequences=2,
        batch_axis=True,
        compression="gzip",
    )
    plan = scan(paths)
    for size in (1, 2, 3, 5):
        for b, seq in enumerate(plan.sequences):
            full = {n: _full(paths, n, batch=b) for n in ("q", "k", "v")}
            seen = np.zeros(S, dtype=int)
            for rank in range(size):
                rd = Reader(plan, rank, size, layout, strided=strided, block_bytes=700)
                q, k, v = rd.read(seq)
                rd.close()
                pos = positions(S, rank, size, layout)
                seen[pos] += 1
                np.testing.assert_array_equal(q, full["q"][pos])
                np.testing.assert_array_equal(k, full["k"][pos])
                np.testing.assert_array_equal(v, full["v"][pos])
                if strided == "hyperslab" or layout != "striped":
                    # a rank reads exactly its own rows, nothing more
                    assert rd.bytes_read == q.nbytes + k.nbytes + v.nbytes
            assert (seen == 1).all()


def test_features_projection_on_own_tokens(tmp_path):
    paths = make_data(
        str(tmp_path / "f.h5"), seq_len=S, heads=H, kv_heads=HKV, head_dim=D, features=10
    )
    plan = scan(paths[:1], paths[1])
    x = _full(paths[:1], "x").astype(np.float64)
    with h5py.File(paths[1], "r") as f:
        wq = f["wq"][...].astype(np.float64)
        wk = f["wk"][...].astype(np.float64)
    rd = Reader(plan, 1, 3, "zigzag")
    q, k, _ = rd.read(plan.sequences[0])
    pos = positions(S, 1, 3, "zigzag")
    np.testing.assert_array_equal(q, (x[pos] @ wq).astype(np.float32).reshape(-1, H, D))
    np.testing.assert_array_equal(k, (x[pos] @ wk).astype(np.float32).reshape(-1, HKV, D))
    assert rd.bytes_read == x[pos].astype(np.float32).nbytes


def _bad_inputs(tmp):
    """(name, files, weights, expected words in the message) for each kind of bad input."""
    good = _qkv()
    cases = []
    p = _write(tmp / "nok.h5", q=good["q"], v=good["v"])
    cases.append(("missing dataset", [p], None, ["nok.h5", "missing dataset 'k'"]))
    p = _write(tmp / "shape.h5", q=good["q"][:, 0], k=good["k"], v=good["v"])
    cases.append(("wrong ndim", [p], None, ["shape.h5", "'q'", "dimensions"]))
    p = _write(tmp / "dt.h5", q=good["q"], k=good["k"].astype("f8"), v=good["v"])
    cases.append(("dtype mismatch", [p], None, ["dt.h5", "dtypes differ"]))
    # q may differ in length from k and v (cross-attention), k and v may not
    p = _write(tmp / "len.h5", q=good["q"], k=good["k"][:-1], v=good["v"])
    cases.append(("length mismatch", [p], None, ["len.h5", "k has shape", "but v has shape"]))
    p = _write(tmp / "hd.h5", q=good["q"], k=good["k"][..., :-1], v=good["v"][..., :-1])
    cases.append(("head dim", [p], None, ["hd.h5", "head dim"]))
    p = _write(tmp / "gqa.h5", q=good["q"][:, :3], k=good["k"], v=good["v"])
    cases.append(("gqa", [p], None, ["gqa.h5", "multiple"]))
    p = _write(tmp / "int.h5", q=good["q"].astype("i4"), k=good["k"], v=good["v"])
    cases.append(("integer", [p], None, ["int.h5", "dtype int32"]))
    txt = tmp / "text.h5"
    txt.write_text("not hdf5\n")
    cases.append(("not hdf5", [str(txt)], None, ["text.h5", "cannot open as HDF5"]))
    ok = _write(tmp / "ok.h5", **good)
    trunc = tmp / "trunc.h5"
    trunc.write_bytes(open(ok, "rb").read()[:3000])
    cases.append(("truncated", [str(trunc)], None, ["trunc.h5", "truncated"]))
    cases.append(("no file", [str(tmp / "nope.h5")], None, ["nope.h5", "no such file"]))
    other = _write(tmp / "other.h5", **_qkv(h=2, hkv=2))
    cases.append(("shards differ", [ok, other], None, ["other.h5", "do not line up"]))
    g1, g2 = tmp / "g1.h5", tmp / "g2.h5"
    with h5py.File(g1, "w") as f, h5py.File(g2, "w") as f2:
        for name in ("a", "b"):
            for k, a in good.items():
                f[f"{name}/{k}"] = a
        for k, a in good.items():
            f2[f"a/{k}"] = a
    cases.append(("groups differ", [str(g1), str(g2)], None, ["g2.h5", "do not line up"]))
    p = _write(tmp / "x.h5", x=np.zeros((S, 6), "f4"))
    cases.append(("features, no weights", [p], None, ["x.h5", "--weights"]))
    cases.append(("weights for qkv", [ok], ok, ["weights given"]))
    with h5py.File(tmp / "w.h5", "w") as f:
        f["wq"] = np.zeros((7, H * D), "f4")
        f["wk"] = f["wv"] = np.zeros((7, HKV * D), "f4")
        f.attrs["num_heads"], f.attrs["num_kv_heads"] = H, HKV
    cases.append(("features mismatch", [p], str(tmp / "w.h5"), ["x.h5", "features"]))
    return cases


def test_bad_inputs_give_one_line_naming_the_file(tmp_path):
    for name, files, weights, words in _bad_inputs(tmp_path):
        with pytest.raises(InputError) as e:
            scan(files, weights)
        msg = str(e.value)
        assert "\n" not in msg, name
        for w in words:
            assert w in msg, f"{name}: {w!r} not in {msg!r}"


def test_nan_input_names_file_and_token(tmp_path):
    a = _qkv()
    a["k"][60, 1, 3] = np.nan
    p = _write(tmp_path / "nan.h5", **a)
    plan = scan([p])
    rd = Reader(plan, 0, 1, "contiguous")
    msg = r"nan\.h5: sequence seq: 'k' holds NaN or Inf \(token 60\)"
    with pytest.raises(InputError, match=msg):
        rd.read(plan.sequences[0])


def test_memory_budget_refuses_absurd_sizes(tmp_path, monkeypatch):
    with h5py.File(tmp_path / "huge.h5", "w") as f:
        f.create_dataset("q", shape=(1 << 34, 16, 128), dtype="f4")
        f.create_dataset("k", shape=(1 << 34, 16, 128), dtype="f4")
        f.create_dataset("v", shape=(1 << 34, 16, 128), dtype="f4")
    with pytest.raises(InputError, match="0 of its .* bytes written"):
        scan([str(tmp_path / "huge.h5")])  # declared, never allocated: refused (issue 22)
    from ringmpi.job.input import files as trust

    monkeypatch.setattr(trust, "check_written", lambda ds: "")  # the budget check alone
    plan = scan([str(tmp_path / "huge.h5")])
    with pytest.raises(InputError, match="over the budget"):
        check_memory(plan, plan.sequences[0], 4, "zigzag", 8 << 30)
    small = scan([_write(tmp_path / "s.h5", **_qkv())])
    check_memory(small, small.sequences[0], 4, "zigzag", 64 << 20)
    with h5py.File(tmp_path / "dim.h5", "w") as f:
        f.create_dataset("q", shape=(1 << 41, 1, 1), dtype="f4", chunks=(1, 1, 1))
    with pytest.raises(InputError, match="absurd shape"):
        scan([str(tmp_path / "dim.h5")])


def test_parse_size_and_collective_without_mpi():
    assert parse_size("512M") == 512 << 20 and parse_size("1.5G") == 3 << 29
    assert parse_size("100") == 100
    with pytest.raises(ValueError):
        parse_size("lots")
    assert collective(None, lambda: 7) == 7
    with pytest.raises(CollectiveError, match="ZeroDivisionError"):
        collective(None, lambda: 1 / 0)


def _store(tmp_path, paths, resume=False, layout="zigzag", size=1, overwrite=False):
    plan = scan(paths)
    meta = fingerprint(plan, layout, True, None, size)
    st = OutputStore(str(tmp_path / "out.h5"), None, plan, meta, overwrite=overwrite)
    return plan, st, st.open(resume)


def test_output_store_writes_vds_resumes_and_redoes_damaged_parts(tmp_path):
    paths = make_data(
        str(tmp_path / "in.h5"), seq_len=S, heads=H, kv_heads=HKV, head_dim=D, sequences=3
    )
    plan, st, done = _store(tmp_path, paths)
    assert done == set()
    rng = np.random.default_rng(0)
    outs = {}
    for i in range(2):  # "interrupted" after two of three sequences
        o = rng.standard_normal((S, H, D)).astype("f4")
        lse = rng.standard_normal((H, S)).astype("f4")
        st.write(i, np.arange(S), o, lse)
        outs[i] = (o, lse)
    assert not os.path.exists(st.path)  # never a final file before the end
    _, st2, done = _store(tmp_path, paths, resume=True)
    assert done == {0, 1}
    # damage a finished part: resume must redo that sequence
    with open(os.path.join(st.parts, part_name(1, 0)), "r+b") as fh:
        fh.seek(-4, 2)
        fh.write(b"\xff\xff\xff\xff")
    _, st3, done = _store(tmp_path, paths, resume=True)
    assert done == {0}
    for i in (1, 2):
        o = rng.standard_normal((S, H, D)).astype("f4")
        lse = rng.standard_normal((H, S)).astype("f4")
        st3.write(i, np.arange(S), o, lse)
        outs[i] = (o, lse)
    st3.finish()
    with h5py.File(st3.path, "r") as f:
        assert f.attrs["causal"].dtype == np.bool_ and bool(f.attrs["causal"]) is True
        assert json.loads(f.attrs["geometry"]) == [H, HKV, D]  # non-scalars: JSON
        for i, g in enumerate(["seq000", "seq001", "seq002"]):
            np.testing.assert_array_equal(f[g]["out"][...], outs[i][0])
            np.testing.assert_array_equal(f[g]["lse"][...], outs[i][1])
    with pytest.raises(InputError, match="different run"):
        _store(tmp_path, paths, resume=True, layout="striped")
    with pytest.raises(InputError, match="output exists; use --overwrite"):
        _store(tmp_path, paths)  # an existing output is never replaced unasked
    _, _, done = _store(tmp_path, paths, overwrite=True)  # start afresh
    assert done == set() and not os.path.exists(st3.path)


def test_vds_maps_every_layout_in_global_order(tmp_path):
    paths = make_data(str(tmp_path / "in.h5"), seq_len=S, heads=1, kv_heads=1, head_dim=1)
    plan = scan(paths)
    for layout in LAYOUTS:
        size = 3
        meta = fingerprint(plan, layout, False, None, size)
        stores = []
        for rank in range(size):  # emulate the three ranks' writes one after another
            st = OutputStore(str(tmp_path / f"{layout}.h5"), None, plan, meta)
            st.rank, st.size = rank, size
            if rank == 0:
                st.open()
            pos = positions(S, rank, size, layout)
            st._write_part([(0, pos, pos.reshape(-1, 1, 1).astype("f4"), -pos[None].astype("f4"))])
            stores.append(st)
        stores[0]._write_vds({0: (0,)})  # sequence 0 is its own batch
        with h5py.File(stores[0].path, "r") as f:
            np.testing.assert_array_equal(f["out"][:, 0, 0], np.arange(S))
            np.testing.assert_array_equal(f["lse"][0], -np.arange(S))
        assert counts(S, size, layout).sum() == S


@pytest.mark.parametrize("causal", [False, True])
def test_dense_head_matches_reference(causal):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((700, 1, 16)) for _ in range(3))
    ref_o, ref_l = reference.attention(q, k, v, causal=causal)
    o, lse = dense_head(q[:, 0], k[:, 0], v[:, 0], causal, 0.25, np.dtype(np.float64))
    np.testing.assert_allclose(o, ref_o[:, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_l[0], rtol=0, atol=1e-12)


def test_progress_lines_in_a_log(monkeypatch):
    import io as _io

    from ringmpi.job import report as progress

    buf = _io.StringIO()
    monkeypatch.setattr(progress, "LOG_EVERY", 0.0)
    bar = progress.Progress([100, 100], stream=buf)
    bar.header("2 sequence(s)")
    bar.start(0, "seq000", 100, nsteps=4, ticks_per_step=10)
    for _ in range(5):  # half of the first of four ring steps: 1/8 of the sequence
        bar.tick(0)
    bar.step(1, 4)
    bar.finish_seq(0.5)
    bar.close()
    quiet = progress.Progress([1, 1], enabled=False, stream=buf)
    quiet.start(1, "x", 1)
    quiet.step(1, 2)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "ringmpi: 2 sequence(s)"
    assert lines[1].startswith("ringmpi:   1% sequence 1/2 seq000 ring step 1/4, ")
    assert lines[5].startswith("ringmpi:   6% sequence 1/2 seq000 ring step 1/4, ")  # 5 ticks
    assert "ETA" in lines[5]
    assert lines[6].startswith("ringmpi:  12% sequence 1/2 seq000 ring step 2/4, ")
    assert lines[7].startswith("ringmpi: sequence 1/2 seq000: 100 tokens in 0.50 s")
    assert "50% done" in lines[7]
    assert len(lines) == 8
