"""End-to-end tests of the ``ringmpi`` command.

Two kinds of test live here:

* unmarked tests run in the single-rank pytest and launch
  ``mpiexec -n P python -m mpi4py -m ringmpi run ...`` as a subprocess with a
  timeout (P = 2 and 3): layouts, shards, compression, multi-sequence and
  features inputs checked against ringmpi.reference, resume after a kill, and
  every kind of bad input;
* ``@pytest.mark.mpi`` tests run inside the mpiexec job (P = 1..4) and call
  ringmpi.job.run on COMM_WORLD directly.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import pytest

from ringmpi import reference
from ringmpi.cli.main import main
from ringmpi.cli.make_data import make_data
from ringmpi.job.verify import dense_head
from ringmpi.testing import assert_all

S, H, HKV, D = 240, 4, 2, 16
TIMEOUT = 120


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else (shutil.which("mpiexec") or "mpiexec")


def launch(p: int, *args: str, env: dict | None = None, timeout: float = TIMEOUT):
    """Run ``ringmpi ARGS`` on ``p`` ranks; return (returncode, stdout, stderr, seconds)."""
    cmd = [_mpiexec(), "-n", str(p), sys.executable, "-m", "mpi4py", "-m", "ringmpi", *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return r.returncode, r.stdout, r.stderr, time.perf_counter() - t0


def _read_inputs(paths, group="", batch=None, weights=None):
    """Whole-sequence q, k, v (float64) from shard files: the test's ground truth."""
    parts = {}
    for p in paths:
        with h5py.File(p, "r") as f:
            node = f[group] if group else f
            for n in ("x",) if weights else ("q", "k", "v"):
                a = node[n][batch] if batch is not None else node[n][...]
                parts.setdefault(n, []).append(a)
    full = {n: np.concatenate(a) for n, a in parts.items()}
    if weights:
        with h5py.File(weights, "r") as f:
            x = full["x"].astype(np.float64)
            dt = full["x"].dtype
            full = {n: (x @ f["w" + n][...].astype(np.float64)).astype(dt) for n in "qkv"}
            n = x.shape[0]
            full = {k: a.reshape(n, -1, D) for k, a in full.items()}
    return full["q"], full["k"], full["v"]


def check_against_reference(out_path, q, k, v, causal, group="", batch=None):
    """max|ring - ref64| <= 2 max|dense float32 - ref64| + 1e-6 for out and lse."""
    ref_o, ref_l = reference.attention(q, k, v, causal=causal)
    g = q.shape[1] // k.shape[1]
    low_o = np.empty_like(ref_o)
    low_l = np.empty_like(ref_l)
    for h in range(q.shape[1]):
        o, lse = dense_head(q[:, h], k[:, h // g], v[:, h // g], causal, D**-0.5, np.dtype("f4"))
        low_o[:, h], low_l[h] = o, lse
    with h5py.File(out_path, "r") as f:
        node = f[group] if group else f
        o = node["out"][batch] if batch is not None else node["out"][...]
        lse = node["lse"][batch] if batch is not None else node["lse"][...]
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    err_o, tol_o = np.abs(o - ref_o).max(), 2 * np.abs(low_o - ref_o).max() + 1e-6
    err_l, tol_l = np.abs(lse - ref_l).max(), 2 * np.abs(low_l - ref_l).max() + 1e-6
    assert err_o <= tol_o, (err_o, tol_o)
    assert err_l <= tol_l, (err_l, tol_l)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Sample inputs shared by the tests of this module."""
    d = tmp_path_factory.mktemp("data")
    kw = dict(heads=H, kv_heads=HKV, head_dim=D)
    return {
        "dir": d,
        # one input, split over three gzip/shuffle/fletcher32 shard files, two groups
        "shards": make_data(
            str(d / "sh.h5"), seq_len=S, shards=3, sequences=2, compression="gzip", **kw
        ),
        "batch": make_data(str(d / "b.h5"), seq_len=S, sequences=3, batch_axis=True, **kw),
        "features": make_data(str(d / "f.h5"), seq_len=S, features=24, seed=4, **kw),
    }


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_run_sharded_compressed_groups(data, tmp_path, p, layout):
    out = str(tmp_path / "out.h5")
    causal = p == 3 or layout == "zigzag"
    args = ["run", os.path.join(data["dir"], "sh.part*.h5"), "-o", out, "--layout", layout]
    rc, so, se, _ = launch(p, *args, *(["--causal"] if causal else []))
    assert rc == 0, se
    assert f"{p} ranks, {layout}" in so and "tokens/s" in so and "GFLOP/s" in so
    for g in ("seq000", "seq001"):
        q, k, v = _read_inputs(data["shards"], group=g)
        check_against_reference(out, q, k, v, causal, group=g)


def test_run_batch_axis_with_verify_and_summary(data, tmp_path):
    out, js = str(tmp_path / "out.h5"), str(tmp_path / "s.json")
    args = ["run", *data["batch"], "-o", out, "--layout", "striped", "--causal", "--verify"]
    rc, so, se, _ = launch(2, *args, "--summary-json", js, "--quiet")
    assert rc == 0, se
    assert so == ""  # --quiet
    import json

    with open(js) as fh:
        summary = json.load(fh)
    assert summary["sequences"] == 3 and summary["tokens"] == 3 * S
    assert summary["verify"]["ok"] and summary["peak_rss_bytes_max"] > 0
    assert summary["verify"]["full"] == 3 and summary["verify"]["status"] == "passed"
    assert 0 <= summary["mpi_wait_share"] <= 1 and summary["gflops"] > 0
    # timings per batch (the three short sequences are one packed call) and the provenance
    # of the output file, plus the run's time
    assert [t["sequence"] for t in summary["timings"]] == ["b=0..b=2 (3 sequences)"]
    assert [t["sequences"] for t in summary["timings"]] == [3]
    assert all(t["seconds"] > 0 and t["compute_s"] > 0 for t in summary["timings"])
    prov = summary["provenance"]
    assert prov["causal"] is True and prov["ranks"] == 2 and prov["scale"] == D**-0.5
    assert prov["kernel"] in ("fused", "numpy") and prov["hdf5_version"]
    assert summary["started_utc"].endswith("Z") and len(summary["hosts"]) == 2
    with h5py.File(out, "r") as f:
        assert {k: f.attrs[k] for k in ("layout", "ranks", "kernel")} == {
            "layout": "striped",
            "ranks": 2,
            "kernel": prov["kernel"],
        }
    for b in range(3):
        q, k, v = _read_inputs(data["batch"], batch=b)
        check_against_reference(out, q, k, v, True, batch=b)


def test_run_features_with_weights(data, tmp_path):
    x, w = data["features"]
    out = str(tmp_path / "out.h5")
    rc, _, se, _ = launch(3, "run", x, "--weights", w, "-o", out, "--causal", "--quiet")
    assert rc == 0, se
    q, k, v = _read_inputs([x], weights=w)
    check_against_reference(out, q, k, v, True)


def _digests(out):
    files = [out, *sorted(glob.glob(out + ".parts/*"))]
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files}


def test_resume_after_kill_is_bitwise_identical(data, tmp_path):
    """One sequence per ring call (RINGMPI_BATCH_TOKENS=0); kills inside batches of several:
    tests/job/test_resources_batches.py."""
    out = str(tmp_path / "out.h5")
    args = ["run", *data["batch"], "-o", out, "--causal", "--quiet"]
    one = {"RINGMPI_BATCH_TOKENS": "0"}
    rc, _, se, _ = launch(2, *args, env=one)
    assert rc == 0, se
    want = _digests(out)
    rc, _, _, _ = launch(2, *args, "--overwrite", env={"RINGMPI_TEST_KILL_AFTER": "1", **one})
    assert rc != 0
    assert not os.path.exists(out)  # nothing under the final name after a kill
    assert len(glob.glob(out + ".parts/*.done")) == 1
    rc, so, se, _ = launch(2, *args[:-1], "--resume", env=one)
    assert rc == 0, se
    assert "(1 already done)" in so
    assert _digests(out) == want


def _bad_cases(d, data):
    good = {n: np.ones((S, h, D), "f4") for n, h in (("q", H), ("k", HKV), ("v", HKV))}

    def write(name, **arrays):
        p = str(d / name)
        with h5py.File(p, "w") as f:
            for k, a in arrays.items():
                f[k] = a
        return p

    trunc = str(d / "trunc.h5")
    with open(data["batch"][0], "rb") as fh, open(trunc, "wb") as out:
        out.write(fh.read()[:5000])
    txt = d / "text.h5"
    txt.write_text("hello\n")
    return {
        "missing dataset": ([write("nok.h5", q=good["q"], v=good["v"])], "missing dataset 'k'"),
        "wrong shape": ([write("shp.h5", q=good["q"][:, :, :3], k=good["k"], v=good["v"])], "D="),
        "dtype mismatch": (
            [write("dt.h5", q=good["q"].astype("f8"), k=good["k"], v=good["v"])],
            "dtypes differ",
        ),
        "length mismatch": (
            # q may be longer than k and v (cross-attention); k and v must agree
            [write("len.h5", q=good["q"], k=good["k"][:9], v=good["v"])],
            "but v has shape",
        ),
        "truncated": ([trunc], "truncated"),
        "not hdf5": ([str(txt)], "not an HDF5 file"),
        "shards misaligned": (
            [data["shards"][0], write("mis.h5", **good)],
            "do not line up",
        ),
        "more ranks than tokens": (
            [write("tiny.h5", q=good["q"][:1], k=good["k"][:1], v=good["v"][:1])],
            "fewer than 2 ranks",
        ),
        "unwritable output": ([data["batch"][0]], "does not exist"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing dataset",
        "wrong shape",
        "dtype mismatch",
        "length mismatch",
        "truncated",
        "not hdf5",
        "shards misaligned",
        "more ranks than tokens",
        "unwritable output",
    ],
)
def test_bad_input_one_line_nonzero_exit_no_output(data, tmp_path, case):
    files, words = _bad_cases(tmp_path, data)[case]
    out = str(tmp_path / ("nodir/out.h5" if case == "unwritable output" else "out.h5"))
    rc, so, se, secs = launch(2, "run", *files, "-o", out, timeout=60)
    lines = [ln for ln in se.splitlines() if ln.strip()]
    assert rc != 0
    assert secs < 30
    assert len(lines) == 1 and lines[0].startswith("ringmpi: error: "), se
    assert words in lines[0], lines[0]
    if case != "unwritable output":
        assert os.path.basename(files[-1]) in lines[0] or os.path.basename(files[0]) in lines[0]
    assert not os.path.exists(out)


def test_error_on_one_rank_aborts_job(data, tmp_path):
    out = str(tmp_path / "out.h5")
    env = {"RINGMPI_TEST_FAULT": "1:1"}
    rc, _, se, secs = launch(3, "run", *data["batch"], "-o", out, "--quiet", env=env, timeout=60)
    assert rc != 0 and secs < 30
    assert "ringmpi: error on rank 1: RuntimeError: injected fault on rank 1 at ring step 1" in se
    assert not os.path.exists(out)


def test_verify_command_passes_and_fails(data, tmp_path, capsys):
    out = str(tmp_path / "out.h5")
    # part files: the test damages one (the one-file output: tests/job/output/test_single_file.py)
    rc, _, se, _ = launch(
        2, "run", *data["batch"], "-o", out, "--causal", "--quiet", "--output-mode", "parts"
    )
    assert rc == 0, se
    assert main(["verify", out, *data["batch"]]) == 0
    assert "PASSED" in capsys.readouterr().out
    part = sorted(glob.glob(out + ".parts/s000000.r*.h5"))[0]  # the batch of all three
    with h5py.File(part, "r+") as f:
        f["out"][0, 0, 0] += 1e-3
    assert main(["verify", out, *data["batch"]]) == 3
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["run", "make-data", "verify", "pack", "info"])
def test_help_has_examples(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and f"ringmpi {cmd}" in text


def test_info_names_mpi_library(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "MPI " in text and "h5py" in text and "gpu" in text


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_job_run_in_process(comm, layout):
    from ringmpi.collective import CollectiveError, run_everywhere
    from ringmpi.job.run import run

    d = comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None)
    try:
        n = 53 * comm.size + 3
        if comm.rank == 0:
            make_data(f"{d}/in.h5", seq_len=n, heads=H, kv_heads=HKV, head_dim=D, shards=2)
        comm.Barrier()
        summary = run(
            [f"{d}/in.part*.h5"], f"{d}/out.h5", comm=comm, causal=True, layout=layout, quiet=True
        )
        assert summary["tokens"] == n and summary["ranks"] == comm.size
        ok, msg = True, ""
        if comm.rank == 0:
            try:
                q, k, v = _read_inputs(sorted(glob.glob(f"{d}/in.part*.h5")))
                check_against_reference(f"{d}/out.h5", q, k, v, True)
            except Exception as e:  # any failure must reach assert_all
                ok, msg = False, repr(e)
        assert_all(comm, ok, msg)
        # a problem seen by one rank only becomes the same error on every rank
        with pytest.raises(CollectiveError) as e:
            run_everywhere(comm, lambda: 1 / (comm.rank != comm.size - 1))
        agreed = comm.allgather(str(e.value))
        assert len(set(agreed)) == 1 and "ZeroDivisionError" in agreed[0]
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
