"""``ringmpi run --output-mode single``: one output file written by all ranks (parallel HDF5).

Through the real command line under ``mpiexec`` (the one beside sys.executable):
the single file verifies and holds bitwise the values of the part-file output
(every layout, P = 2 and 3, groups and batch axis, gzip and lzf); a run killed
after a sequence, or in the middle of one, leaves nothing under the final name
and ``--resume`` then writes the same bytes as an uninterrupted run; a marker
whose data was damaged is not trusted. These need h5py built with MPI on
mpi4py's MPI (tests/cluster/site_stack.sh: Debian's python3-h5py-mpi under Open
MPI) and skip elsewhere, unless RINGMPI_REQUIRE_MPIO=1 (set by site_stack.sh)
turns the skip into a failure. Where h5py has no MPI (the PyPI venv), asking for
``single`` must fail with exit 2 and write nothing, and ``auto`` writes parts.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import faults as F  # noqa: E402
import h5py
import numpy as np
import pytest

from ringmpi.cli.make_data import make_data
from ringmpi.job.output import resolve_mode
from ringmpi.job.plan import InputError


@pytest.fixture(autouse=True)
def _one_sequence_per_call(monkeypatch):
    """These tests kill and damage the one-file output per sequence: one sequence per ring
    call (RINGMPI_BATCH_TOKENS=0); the launches inherit it (faults._env copies os.environ)."""
    monkeypatch.setenv("RINGMPI_BATCH_TOKENS", "0")


pytestmark = pytest.mark.timeout(600)

REQUIRE = os.environ.get("RINGMPI_REQUIRE_MPIO") == "1"


@functools.lru_cache(maxsize=1)
def _mpio() -> tuple:
    """(usable, reason) of parallel HDF5 inside an MPI job here (one rank)."""
    code = (
        "from mpi4py import MPI; from ringmpi.job.output import mpio_status; "
        "ok, why = mpio_status(MPI.COMM_WORLD); print('MPIO', int(ok), why)"
    )
    res = subprocess.run(
        [F.MPIEXEC, "-n", "1", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=F._env(None),
    )
    for ln in res.stdout.splitlines():
        if ln.startswith("MPIO "):
            return ln[5] == "1", ln[7:]
    return False, f"probe failed (exit {res.returncode}): {res.stderr.strip()[-300:]}"


@pytest.fixture
def mpio():
    ok, why = _mpio()
    if not ok:
        if REQUIRE:
            pytest.fail(f"RINGMPI_REQUIRE_MPIO=1 but parallel HDF5 is not usable: {why}")
        pytest.skip(f"no parallel HDF5 here: {why}")


@pytest.fixture
def no_mpio():
    ok, why = _mpio()
    if ok:
        pytest.skip(f"h5py has MPI here ({why}); the no-MPI refusal runs in the PyPI venv")


def _datasets(path) -> dict:
    """name -> (bytes, dtype, shape, fill value, dimension labels, compression) of a file."""
    out = {}
    with h5py.File(path, "r") as f:

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                a = obj[...]
                labels = tuple(d.label for d in obj.dims)
                out[name] = (a.tobytes(), a.dtype, a.shape, obj.fillvalue, labels, obj.compression)

        f.visititems(visit)
    return out


def _attrs(path) -> dict:
    with h5py.File(path, "r") as f:
        return {k: np.asarray(v).tolist() for k, v in f.attrs.items()}


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _run(p, inp, out, *extra, env=None):
    res = F.run_cli(p, "run", *inp, "-o", str(out), "--quiet", *extra, env=env, timeout=300)
    assert not res.hang, f"hang: {res.err[-2000:]}"
    return res


def _inputs(tmp, batch: bool, seqs: int = 3, seq_len: int = 203, **extra):
    return make_data(
        str(tmp / "in.h5"),
        seq_len=seq_len,
        heads=4,
        kv_heads=2,
        head_dim=16,
        sequences=seqs,
        batch_axis=batch,
        seed=5,
        **extra,
    )


CASES = [
    (2, "zigzag", False),
    (3, "zigzag", True),
    (2, "striped", True),
    (3, "striped", False),
    (2, "contiguous", False),
    (3, "contiguous", True),
]


@pytest.mark.parametrize(
    "p,layout,batch", CASES, ids=[f"P{p}-{lay}-{'batch' if b else 'groups'}" for p, lay, b in CASES]
)
def test_single_equals_parts(mpio, tmp_path, p, layout, batch):
    inp = _inputs(tmp_path, batch)
    common = ["--layout", layout, "--causal"]
    single = tmp_path / "single.h5"
    res = _run(p, inp, single, *common, "--output-mode", "single", "--verify")
    assert res.rc == 0, res.err
    parts = tmp_path / "parts.h5"
    res = _run(p, inp, parts, *common, "--output-mode", "parts")
    assert res.rc == 0, res.err
    # one file: no per-rank parts, no virtual dataset, nothing left temporary
    left = sorted(os.listdir(str(single) + ".parts"))
    assert left == ["manifest.json"] + [f"s{i:06d}.done" for i in range(3)], left
    with h5py.File(single, "r") as f:
        name = "out" if batch else "seq000/out"
        assert not f[name].is_virtual
    a, b = _datasets(single), _datasets(parts)
    assert sorted(a) == sorted(b) and len(a) == (2 if batch else 6)
    for k in a:
        assert a[k][0] == b[k][0], f"{k}: values differ between single and parts"
        assert a[k][1:3] == b[k][1:3] and a[k][4] == b[k][4], (k, a[k][1:], b[k][1:])
        assert np.isnan(a[k][3]) and np.isnan(b[k][3]), k
    assert _attrs(single) == _attrs(parts)
    # and the verifier reads it, also in a separate run on other ranks
    res = F.run_cli(p, "verify", str(single), *inp, "--quiet", timeout=300)
    assert res.rc == 0, res.err


@pytest.mark.parametrize("p,layout", [(2, "balanced"), (3, "zigzag")])
def test_single_with_slices_equals_parts(mpio, tmp_path, p, layout):
    """Masks of slices (issue 41) in the one file: the values of the part-file output, the
    slices table and its attributes written once per sequence, and a passing verify."""
    inp = _inputs(tmp_path, False, seqs=2, seq_len=301, slices="global_local:32:8")
    single, parts = tmp_path / "single.h5", tmp_path / "parts.h5"
    common = ["--layout", layout]
    res = _run(p, inp, single, *common, "--output-mode", "single", "--verify")
    assert res.rc == 0, res.err
    res = _run(p, inp, parts, *common, "--output-mode", "parts")
    assert res.rc == 0, res.err
    a, b = _datasets(single), _datasets(parts)
    assert sorted(a) == sorted(b) and "seq000/slices" in a, sorted(a)
    for k in a:
        assert a[k][0] == b[k][0], f"{k}: values differ between single and parts"
    assert _attrs(single) == _attrs(parts)
    with h5py.File(single, "r") as f, h5py.File(parts, "r") as g:
        for grp in ("seq000", "seq001"):
            assert dict(f[grp]["slices"].attrs) == dict(g[grp]["slices"].attrs), grp
    res = F.run_cli(p, "verify", str(single), *inp, "--quiet", timeout=300)
    assert res.rc == 0, res.err


@pytest.mark.parametrize("p", [2, 3])
def test_single_with_batches_equals_parts_with_batches(mpio, tmp_path, p):
    """Short sequences packed into one call: the one file gets each member's rows and a
    marker per sequence, bitwise the part-file output of the same batches."""
    inp = _inputs(tmp_path, False, seqs=5, seq_len=150)
    env = {"RINGMPI_BATCH_TOKENS": "400"}  # batches of two sequences, the last alone
    single, parts = tmp_path / "single.h5", tmp_path / "parts.h5"
    res = _run(p, inp, single, "--causal", "--output-mode", "single", "--verify", env=env)
    assert res.rc == 0, res.err
    res = _run(p, inp, parts, "--causal", "--output-mode", "parts", env=env)
    assert res.rc == 0, res.err
    assert len(list(Path(str(parts) + ".parts").glob("*.done"))) == 3  # three batches
    a, b = _datasets(single), _datasets(parts)
    assert sorted(a) == sorted(b) and len(a) == 10
    for k in a:
        assert a[k][0] == b[k][0], f"{k}: values differ between single and parts"


@pytest.mark.parametrize("codec", ["gzip", "lzf"])
def test_single_compressed(mpio, tmp_path, codec):
    inp = _inputs(tmp_path, batch=False, seqs=2, seq_len=3001)
    single, parts = tmp_path / "single.h5", tmp_path / "parts.h5"
    res = _run(3, inp, single, "--compress", codec, "--output-mode", "single", "--verify")
    assert res.rc == 0, res.err
    res = _run(3, inp, parts, "--compress", codec, "--output-mode", "parts")
    assert res.rc == 0, res.err
    a, b = _datasets(single), _datasets(parts)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k][0] == b[k][0], f"{k}: values differ"
        assert a[k][5] == codec, (k, a[k][5])
    with h5py.File(single, "r") as f:
        assert f["seq000/out"].chunks is not None and f["seq000/out"].shuffle


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("how", ["after-sequence", "mid-sequence"])
def test_single_resume_after_kill(mpio, tmp_path, p, how):
    """SIGKILL to rank 0 after sequence 1 is marked, or after its rows of sequence 2 are
    written but before the flush and marker: nothing final, then --resume is bitwise equal."""
    inp = _inputs(tmp_path, batch=False, seqs=4)
    ref = tmp_path / "ref.h5"
    assert _run(p, inp, ref, "--output-mode", "single").rc == 0
    out = tmp_path / "out.h5"
    env = {"RINGMPI_TEST_KILL_AFTER": "2"} if how == "after-sequence" else None
    env = env or {"RINGMPI_TEST_MPIO_KILL": "2"}
    res = _run(p, inp, out, "--output-mode", "single", env=env)
    assert res.rc != 0
    assert not out.exists(), "a file under the final name after an interrupted run"
    partsdir = Path(str(out) + ".parts")
    done = sorted(x.name for x in partsdir.glob("*.done"))
    assert done == ["s000000.done", "s000001.done"], done
    assert (partsdir / "single.h5.tmp").exists()
    res = _run(
        p,
        inp,
        out,
        "--output-mode",
        "single",
        "--resume",
        "--summary-json",
        str(tmp_path / "s.json"),
    )
    assert res.rc == 0, res.err
    import json

    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["skipped_done"] == 2 and summary["output_mode"] == "single"
    assert _sha(out) == _sha(ref), "resumed file differs from an uninterrupted run"
    assert not (partsdir / "single.h5.tmp").exists()
    # a finished run resumed again changes nothing
    assert _run(p, inp, out, "--output-mode", "single", "--resume").rc == 0
    assert _sha(out) == _sha(ref)


def test_single_damaged_marked_sequence_is_rewritten(mpio, tmp_path):
    """A marker certifies the bytes each rank wrote (CRC32, read back on --resume): data
    damaged after the marker is found and that sequence written again."""
    inp = _inputs(tmp_path, batch=False, seqs=3)
    ref = tmp_path / "ref.h5"
    assert _run(2, inp, ref, "--output-mode", "single").rc == 0
    out = tmp_path / "out.h5"
    res = _run(2, inp, out, "--output-mode", "single", env={"RINGMPI_TEST_KILL_AFTER": "2"})
    assert res.rc != 0 and not out.exists()
    tmp = Path(str(out) + ".parts") / "single.h5.tmp"
    with h5py.File(ref, "r") as f:  # same layout of bytes: uncompressed, created alike
        off = f["seq000/out"].id.get_offset()
    with open(tmp, "r+b") as fh:
        fh.seek(off + 4 * 17)
        fh.write(b"\x00\x00\xc0\x7f")  # a NaN in rank 0's first run of sequence 0
    res = _run(
        2,
        inp,
        out,
        "--output-mode",
        "single",
        "--resume",
        "--summary-json",
        str(tmp_path / "s.json"),
    )
    assert res.rc == 0, res.err
    import json

    assert json.loads((tmp_path / "s.json").read_text())["skipped_done"] == 1
    assert _sha(out) == _sha(ref)


def test_single_refuses_many_rings_and_mode_switch(mpio, tmp_path):
    inp = _inputs(tmp_path, batch=False, seqs=2)
    out = tmp_path / "out.h5"
    res = _run(2, inp, out, "--output-mode", "single", "--ring-size", "1")
    assert res.rc == 2 and "one ring" in res.err, res.err
    assert not out.exists() and not Path(str(out) + ".parts").exists()
    # auto with two rings: part files
    res = _run(2, inp, out, "--ring-size", "1")
    assert res.rc == 0, res.err
    assert list(Path(str(out) + ".parts").glob("*.r00000.h5"))
    # an unfinished parts run is not continued as single
    os.remove(out)
    res = _run(2, inp, out, "--output-mode", "single", "--resume")
    assert res.rc == 2 and "differs in output" in res.err, res.err


def test_auto_is_single_with_mpio(mpio, tmp_path):
    inp = _inputs(tmp_path, batch=False, seqs=1)
    out = tmp_path / "out.h5"
    res = _run(2, inp, out, "--summary-json", str(tmp_path / "s.json"))
    assert res.rc == 0, res.err
    import json

    assert json.loads((tmp_path / "s.json").read_text())["output_mode"] == "single"
    assert not list(Path(str(out) + ".parts").glob("*.r0000*.h5"))


def test_single_without_mpi_h5py_fails_cleanly(no_mpio, tmp_path):
    inp = _inputs(tmp_path, batch=False, seqs=1)
    out = tmp_path / "out.h5"
    res = _run(2, inp, out, "--output-mode", "single")
    assert res.rc == 2, res.err
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--output-mode single" in lines[0], res.err
    assert "without MPI" in lines[0] or "different MPI" in lines[0], res.err
    assert not out.exists() and not Path(str(out) + ".parts").exists()
    # auto falls back to the part files
    res = _run(2, inp, out, "--summary-json", str(tmp_path / "s.json"))
    assert res.rc == 0, res.err
    assert list(Path(str(out) + ".parts").glob("s000000.r00001.h5"))


def test_resolve_mode_without_mpi():
    assert resolve_mode("parts", None, 1) == "parts"
    assert resolve_mode("auto", None, 1) == "parts"
    with pytest.raises(InputError, match="not run under MPI"):
        resolve_mode("single", None, 1)
    with pytest.raises(InputError, match="output-mode must be one of"):
        resolve_mode("one", None, 1)


@pytest.mark.parametrize("compress", [None, "gzip"])
def test_single_on_a_full_disk_aborts_without_hanging(mpio, tmp_path, compress):
    """A write that fails on one rank inside a collective HDF5 call (the others wait in it):
    one line, non-zero exit in seconds, nothing under the final name. RLIMIT_FSIZE stands
    in for the full disk (EFBIG instead of ENOSPC); the output is ~1.3 MiB, the limit 256 KiB."""
    inp = make_data(
        str(tmp_path / "in.h5"), seq_len=1024, heads=4, kv_heads=2, head_dim=32, sequences=5, seed=2
    )
    out = tmp_path / "out.h5"
    extra = ["--compress", compress] if compress else []
    res = F.run_cli(
        2,
        "run",
        *inp,
        "-o",
        str(out),
        "--quiet",
        "--output-mode",
        "single",
        *extra,
        timeout=120,
        fsize=256 << 10,
    )
    assert not res.hang, f"hang: {res.err[-2000:]}"
    assert res.rc != 0 and res.secs < 60, (res.rc, res.secs, res.err[-2000:])
    assert "ringmpi: error on rank" in res.err and "aborting the job" in res.err, res.err[-2000:]
    assert not out.exists()
