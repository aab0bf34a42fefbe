"""Batches of short sequences in one ring call (issue 23): packing, splitting, the job's
output, resume after a kill inside a batch, rings, shards, packed and cross members."""

from __future__ import annotations

import glob
import json
import os

import h5py
import numpy as np
import pytest
from cli.test_main_mpi import _digests, launch

from ringmpi import reference
from ringmpi.job.input.scan import scan
from ringmpi.job.resources import make_batches, split
from ringmpi.layout import LAYOUTS, positions

H, HKV, D = 2, 1, 16
# lengths of the groups (sorted names = plan order); g03 is packed, g05 is cross-attention
LENGTHS = [37, 120, 5, 64, 300, 90, 250, 18, 77, 140, 61, 33]
PACKED = [20, 1, 43]  # g03: three packed sequences (64 tokens)
CROSS_K = 211  # g05: 90 queries, 211 keys


def _groups(seed: int = 0) -> dict:
    """Real-shaped values: a mean per channel, small spreads, values with a mean."""
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal(D)
    out = {}
    for g, n in enumerate(LENGTHS):
        nk = CROSS_K if g == 5 else n
        q = (mean + 0.3 * rng.standard_normal((n, H, D))).astype("f4")
        k = (mean + 0.3 * rng.standard_normal((nk, HKV, D))).astype("f4")
        v = (1.0 + 0.1 * rng.standard_normal((nk, HKV, D))).astype("f4")
        cu = np.cumsum([0] + PACKED) if g == 3 else None
        out[f"g{g:02d}"] = (q, k, v, cu)
    return out


def _write(path: str, groups: dict, shards: int = 1) -> list:
    """One file, or ``shards`` files cutting every group's token axis (a batch spans them)."""
    paths = [path] if shards == 1 else [path.replace(".h5", f".part{j}.h5") for j in range(shards)]
    for j, p in enumerate(paths):
        with h5py.File(p, "w") as f:
            for g, (q, k, v, cu) in groups.items():
                for name, a in (("q", q), ("k", k), ("v", v)):
                    c = np.linspace(0, len(a), shards + 1).astype(int)
                    f[f"{g}/{name}"] = a[c[j] : c[j + 1]]
                if cu is not None and j == 0:
                    f[f"{g}/cu_seqlens"] = cu
    return paths


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    groups = _groups()
    return {
        "groups": groups,
        "one": _write(str(d / "in.h5"), groups),
        "shards": _write(str(d / "sh.h5"), groups, shards=2),
    }


def _outputs(path: str) -> dict:
    with h5py.File(path, "r") as f:
        return {g: (f[g]["out"][...], f[g]["lse"][...]) for g in sorted(f) if "out" in f[g]}


def _check_reference(path: str, groups: dict, causal: bool, window=None) -> None:
    """Every group against the dense float64 reference, at twice dense float32's error."""
    got = _outputs(path)
    assert sorted(got) == sorted(groups)
    for g, (q, k, v, cu) in groups.items():
        kw = dict(causal=causal, window=window, cu_seqlens=cu)
        ref_o, ref_l = reference.attention(q, k, v, **kw)
        low_o, low_l = reference.attention(q, k, v, dtype=np.float32, **kw)
        o, lse = got[g]
        fin = np.isfinite(ref_l)
        np.testing.assert_array_equal(np.isfinite(lse), fin)
        tol_o = 2 * np.abs(low_o - ref_o).max() + 1e-6
        tol_l = 2 * np.abs(low_l[fin] - ref_l[fin]).max() + 1e-6
        assert np.abs(o - ref_o).max() <= tol_o, g
        assert np.abs(lse[fin] - ref_l[fin]).max() <= tol_l, g


# -- packing ------------------------------------------------------------------------------
def test_batches_are_consecutive_runs_within_the_cap(data):
    plan = scan(data["one"])
    every = make_batches(plan, range(len(LENGTHS)), 400)
    assert [i for b in every for i in b.members] == list(range(len(LENGTHS)))
    for b in every:
        tokens = sum(max(plan.sequences[i].length, plan.sequences[i].length_k) for i in b.members)
        assert tokens <= 400 or b.single
    # a sequence at the cap or over it is alone; cap 0: one sequence per batch
    assert [b.members for b in make_batches(plan, [3, 4, 5], 300)] == [(3,), (4,), (5,)]
    assert all(b.single for b in make_batches(plan, range(12), 0))
    # rings sharing the work: every ring gets batches
    assert len(make_batches(plan, range(12), 1 << 16, rings=2)) >= 2 * 2


def test_batch_offsets_and_positions_are_the_members(data):
    """The batch's cu_seqlens(_k) nest the members' own; each rank's tokens of the batch are
    its tokens of each member in order (so reads concatenate and outputs split back)."""
    plan = scan(data["one"])
    (b,) = make_batches(plan, [2, 3, 4, 5], 1 << 16)
    assert b.cu_seqlens == (0, 5, 25, 26, 69, 369, 459)
    assert b.cu_seqlens_k == (0, 5, 25, 26, 69, 369, 580)
    assert (b.length, b.length_k) == (459, 580)
    for layout in LAYOUTS:
        for size in (1, 2, 3, 4):
            for r in range(size):
                want, off = [], 0
                for i in b.members:
                    s = plan.sequences[i]
                    want.append(positions(s.length, r, size, layout, cu_seqlens=s.cu_seqlens) + off)
                    off += s.length
                got = positions(b.length, r, size, layout, cu_seqlens=b.cu_seqlens)
                np.testing.assert_array_equal(got, np.concatenate(want))


def test_split_gives_each_member_its_rows():
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((n, 2, 3)) for n in (4, 0, 7)]
    out = np.concatenate(parts)  # the batch's rows, member after member (as the loop reads)
    lse = np.moveaxis(out[..., 0], 0, 1)
    back = split(out, lse, [4, 0, 7])
    for (o, ls), p in zip(back, parts):
        np.testing.assert_array_equal(o, p)
        np.testing.assert_array_equal(ls, np.moveaxis(p[..., 0], 0, 1))
    assert split(out, lse, [11])[0][0] is out


# -- the job --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "p,layout,ring", [(2, "zigzag", "1"), (3, "striped", None), (2, "contiguous", None)]
)
def test_batched_job_matches_the_reference_and_one_by_one(data, tmp_path, p, layout, ring):
    out, one = str(tmp_path / "b.h5"), str(tmp_path / "one.h5")
    args = ["--causal", "--layout", layout, "--quiet", "--output-mode", "parts"]
    args += ["--ring-size", ring] if ring else []
    js = str(tmp_path / "s.json")
    rc, _, se, _ = launch(
        p,
        "run",
        *data["one"],
        "-o",
        out,
        *args,
        "--summary-json",
        js,
        env={"RINGMPI_BATCH_TOKENS": "500"},
    )
    assert rc == 0, se
    rc, _, se, _ = launch(
        p, "run", *data["one"], "-o", one, *args, env={"RINGMPI_BATCH_TOKENS": "0"}
    )
    assert rc == 0, se
    _check_reference(out, data["groups"], causal=True)
    a, b = _outputs(out), _outputs(one)
    for g in a:  # the same tiles and keys, other block boundaries: equal to rounding
        np.testing.assert_allclose(a[g][0], b[g][0], rtol=0, atol=2e-6)
    markers = [json.load(open(m)) for m in sorted(glob.glob(out + ".parts/*.done"))]
    members = [i for m in markers for i in m.get("members", [None])]
    assert len(members) == len(LENGTHS) and len(markers) < len(LENGTHS)
    ranks_per_ring = p if ring is None else int(ring)
    # one part file per rank of the ring and one marker per batch
    assert len(glob.glob(out + ".parts/s*.r*.h5")) == len(markers) * ranks_per_ring
    # the summary's timings are rank 0's ring's batches
    timings = json.load(open(js))["timings"]
    assert 0 < sum(t["sequences"] for t in timings) <= len(LENGTHS)
    rc, so, se, _ = launch(p, "verify", out, *data["one"], "--quiet")
    assert rc == 0 and "PASSED" in so, so + se


def test_kill_inside_a_batch_then_resume_is_bitwise(data, tmp_path):
    """Batch 1 (of several) is read, then rank 0 dies: batch 0 stays done, batch 1 and the
    rest are computed again by the resumed run, bit for bit as an uninterrupted run."""
    out = str(tmp_path / "o.h5")
    args = [
        "run",
        *data["shards"],
        "-o",
        out,
        "--causal",
        "--window",
        "50",
        "--output-mode",
        "parts",
    ]
    env = {"RINGMPI_BATCH_TOKENS": "400"}
    rc, _, se, _ = launch(2, *args, "--quiet", env=env)
    assert rc == 0, se
    want = _digests(out)
    _check_reference(out, data["groups"], causal=True, window=(50, 0))
    kill = {**env, "RINGMPI_TEST_KILL_IN_BATCH": "1"}
    rc, _, _, _ = launch(2, *args, "--overwrite", "--quiet", env=kill)
    assert rc != 0 and not os.path.exists(out)
    assert len(glob.glob(out + ".parts/*.done")) == 1  # batch 0 only
    rc, so, se, _ = launch(2, *args, "--resume", env=env)
    assert rc == 0, se
    assert "already done" in so
    assert _digests(out) == want
    # another batch size changes how the sums round: a resume with it is refused
    rc, _, se, _ = launch(2, *args, "--resume", "--quiet", env={"RINGMPI_BATCH_TOKENS": "100"})
    assert rc == 2 and "batch_tokens" in se, se


def test_a_damaged_batch_part_is_computed_again_on_resume(data, tmp_path):
    out = str(tmp_path / "o.h5")
    args = ["run", *data["one"], "-o", out, "--quiet", "--output-mode", "parts"]
    env = {"RINGMPI_BATCH_TOKENS": "400"}
    rc, _, se, _ = launch(2, *args, env=env)
    assert rc == 0, se
    want = _digests(out)
    part = sorted(glob.glob(out + ".parts/s*.r00001.h5"))[1]
    with open(part, "r+b") as fh:  # one byte of the part file changed: the CRC says so
        fh.seek(os.path.getsize(part) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    rc, so, se, _ = launch(2, *args, "--resume", env=env)
    assert rc == 0, se
    assert _digests(out) == want


@pytest.mark.parametrize("how", ["names", "order", "foreign", "too many"])
def test_a_batch_marker_that_does_not_add_up_is_not_trusted(data, tmp_path, how):
    """The marker of a batch names its members; one that does not match the plan (another
    order, names, indices past the end) is ignored and the batch computed again."""
    out = str(tmp_path / "o.h5")
    args = ["run", *data["one"], "-o", out, "--quiet", "--output-mode", "parts"]
    env = {"RINGMPI_BATCH_TOKENS": "400"}
    rc, _, se, _ = launch(2, *args, env=env)
    assert rc == 0, se
    want = _digests(out)
    path = out + ".parts/s000000.done"
    marker = json.load(open(path))
    assert marker["members"][0] == 0 and len(marker["members"]) > 1
    if how == "names":
        marker["names"][1] = "g99"
    elif how == "order":
        marker["members"][1:3] = marker["members"][2:0:-1]
    elif how == "foreign":
        marker["members"] = [0, 40]
        marker["names"] = marker["names"][:2]
    else:
        marker["members"] = list(range(len(LENGTHS) + 1))
    with open(path, "w") as fh:
        json.dump(marker, fh)
    os.remove(out)
    rc, so, se, _ = launch(2, *args, "--resume", env=env)
    assert rc == 0, se
    assert _digests(out) == want


def test_no_batch_input_is_kept_past_its_batch(tmp_path, monkeypatch):
    """Each batch's q/k/v (read by the prefetch thread) is freed once the batch is done: a
    finished read's Future held them, and the loop kept every Future, so memory grew by a
    batch's inputs per batch (measured: 0.65 -> 2.6 GB over 17 batches of 65k tokens)."""
    import gc
    import weakref

    from ringmpi.cli.make_data import make_data
    from ringmpi.job import loop as loop_mod
    from ringmpi.job.run import run

    (inp,) = make_data(
        str(tmp_path / "in.h5"), seq_len=64, heads=2, kv_heads=1, head_dim=8, sequences=24
    )
    monkeypatch.setenv("RINGMPI_BATCH_TOKENS", "128")  # 12 batches of 2 sequences
    inputs, alive = [], []
    read, one = loop_mod.SequenceLoop._read_batch, loop_mod.SequenceLoop._one

    def tracked_read(self, batch):
        rows, qkv = read(self, batch)
        inputs.append([weakref.ref(x) for x in qkv])
        return rows, qkv

    def counted_one(self, j, batch, fut):
        gc.collect()
        alive.append(sum(all(r() is not None for r in refs) for refs in inputs))
        one(self, j, batch, fut)

    monkeypatch.setattr(loop_mod.SequenceLoop, "_read_batch", tracked_read)
    monkeypatch.setattr(loop_mod.SequenceLoop, "_one", counted_one)
    summary = run([inp], str(tmp_path / "out.h5"), quiet=True, output_mode="parts")
    assert summary["sequences"] == 24 and len(inputs) == len(alive) == 12
    # entering batch j: at most batch j's own read (done or prefetched) and j - 1's, whose
    # Future the loop is just letting go of
    assert max(alive) <= 2, alive
    gc.collect()
    assert all(r() is None for refs in inputs for r in refs)
