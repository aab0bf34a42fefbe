"""A batch job a scientist can trust (issue 16): Ctrl-C, output that cannot be misread,
an honest verify, progress inside a sequence, typed metadata, overwrite protection and
schema help.

Unmarked tests run in the single-rank pytest (in-process on one rank, or mpiexec
subprocesses under timeouts); ``@pytest.mark.mpi`` tests run inside the multi-rank job.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import h5py
import numpy as np
import pytest

from ringmpi.cli.main import main
from ringmpi.cli.make_data import make_data
from ringmpi.job import report as progress_mod
from ringmpi.job.input.scan import scan
from ringmpi.job.output.pack import pack
from ringmpi.job.plan import InputError
from ringmpi.job.run import pick_device, run
from ringmpi.job.verify import rows_attention, sample_rows_of, verify
from ringmpi.testing import assert_all


@pytest.fixture(autouse=True)
def _one_sequence_per_call(monkeypatch):
    """These tests poke at one sequence's part file, marker or ring step: one sequence per
    ring call (RINGMPI_BATCH_TOKENS=0); batches of several: tests/job/test_resources_batches.py."""
    monkeypatch.setenv("RINGMPI_BATCH_TOKENS", "0")


H, HKV, D = 4, 2, 16


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else (shutil.which("mpiexec") or "mpiexec")


def _cmd(p: int, *args: str) -> list:
    return [_mpiexec(), "-n", str(p), sys.executable, "-m", "mpi4py", "-m", "ringmpi", *args]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", RINGMPI_CPU_KERNEL="fused")


def _digests(out: str) -> dict:
    files = [out, *sorted(glob.glob(out + ".parts/*"))]
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files}


def _small_run(tmp_path, name="out.h5", **kw):
    """One in-process run (no MPI) over three sequences of different lengths."""
    paths = make_data(
        str(tmp_path / "in.h5"), seq_len=300, sequences=3, heads=H, kv_heads=HKV, head_dim=D
    )
    out = str(tmp_path / name)
    summary = run(paths, out, causal=kw.pop("causal", True), quiet=True, **kw)
    return paths, out, summary


# -- interrupts ------------------------------------------------------------------------------


def _rank_pids(proc, p, timeout=30):
    import psutil

    end = time.time() + timeout
    while time.time() < end:
        kids = psutil.Process(proc.pid).children(recursive=True)
        ranks = [k for k in kids if k.name().startswith("python")]
        if len(ranks) >= p:
            # rank order: the launcher's environment (PMI_RANK) of each process
            return sorted(k.pid for k in ranks)
        time.sleep(0.05)
    raise AssertionError("the ranks did not start")


def _signal_and_wait(proc, pid: int, sig: int) -> tuple:
    """Send ``sig`` to ``pid``; (stdout, stderr, seconds until ``proc`` ended)."""
    t0 = time.perf_counter()
    os.kill(pid, sig)
    so, se = proc.communicate(timeout=30)
    return so, se, time.perf_counter() - t0


def _reap(proc) -> None:
    """Kill ``proc`` if a failed check left it running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def long_input(tmp_path_factory):
    """Three sequences of ~2-4 s each at P = 2 or 3: long enough to interrupt mid-sequence."""
    d = tmp_path_factory.mktemp("long")
    return make_data(str(d / "long.h5"), seq_len=12288, sequences=3, heads=8, kv_heads=2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "p, sig, whom", [(2, signal.SIGINT, "mpiexec"), (3, signal.SIGTERM, "one rank")]
)
def test_interrupt_stops_within_seconds_and_resume_is_bitwise_identical(
    long_input, tmp_path, p, sig, whom
):
    ref = str(tmp_path / "ref" / "out.h5")
    os.makedirs(os.path.dirname(ref))
    args = ["run", *long_input, "-o", "OUT", "--causal", "--device", "cpu"]
    r = subprocess.run(
        _cmd(p, *[ref if a == "OUT" else a for a in args], "--quiet"),
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr
    want = _digests(ref)

    out = str(tmp_path / "out.h5")
    cmd = _cmd(p, *[out if a == "OUT" else a for a in args])
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        pids = _rank_pids(proc, p)
        end = time.time() + 120
        while time.time() < end and not glob.glob(out + ".parts/s000000.done"):
            time.sleep(0.02)
        assert glob.glob(out + ".parts/s000000.done"), "the first sequence did not finish"
        time.sleep(0.5)  # inside the second sequence's ring
        so, se, gone = _signal_and_wait(proc, proc.pid if whom == "mpiexec" else pids[-1], sig)
    finally:
        _reap(proc)
    assert gone < 10, f"job took {gone:.1f} s to go"
    from mpi4py import MPI

    kept = None  # finished sequences the job says it kept (when a rank prints)
    if whom == "mpiexec" and "Open MPI" in MPI.Get_library_version():
        # Open MPI's mpiexec does not pass Ctrl-C on: it kills the ranks itself (exit 1),
        # so no rank prints; the job is still gone, nothing is final and resume works
        assert proc.returncode != 0, se
    else:
        assert proc.returncode == 128 + sig, (proc.returncode, se)
        lines = [ln for ln in se.splitlines() if ln.startswith("ringmpi: interrupted")]
        assert len(lines) == 1, se
        # the second sequence normally; the third when this machine was slow to look
        hit = re.search(
            r"at sequence (\d)/3 \(seq00(\d)\), ring step .*: (\d) finished "
            r"sequence\(s\) kept; rerun with --resume$",
            lines[0],
        )
        assert hit, lines[0]
        at, name, kept = map(int, hit.groups())
        assert at in (2, 3) and name == at - 1 and kept == at - 1, lines[0]
        if whom == "mpiexec":
            assert "(SIGINT)" in lines[0] and "Abort(" not in se  # every rank left cleanly
        else:
            assert f"({signal.Signals(sig).name} on rank " in lines[0]
    assert not os.path.exists(out)
    done = len(glob.glob(out + ".parts/*.done"))
    assert done in (1, 2) and (kept is None or done == kept), (done, kept)
    r = subprocess.run(
        _cmd(p, *cmd[cmd.index("run") :], "--resume"),
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr
    assert f"({done} already done)" in r.stdout
    assert _digests(out) == want


@pytest.mark.timeout(300)
def test_ctrl_c_reaches_a_rank_waiting_in_an_agreement(tmp_path):
    """A rank that finished its ring first waits for a slow one in the agreement after it;
    Ctrl-C (mpiexec forwards it to every rank) must reach it there too, so the job leaves
    cleanly: one "(SIGINT)" line from rank 0, exit 130, no abort. (A CI run caught the
    early rank sitting in a blocking allgather: the interrupted rank aborted the job.)"""
    from mpi4py import MPI

    if "Open MPI" in MPI.Get_library_version():
        pytest.skip("Open MPI's mpiexec kills the ranks itself on Ctrl-C (see above)")
    paths = make_data(
        str(tmp_path / "in.h5"), seq_len=512, sequences=2, heads=H, kv_heads=HKV, head_dim=D
    )
    out = str(tmp_path / "out.h5")
    env = dict(_env(), RINGMPI_TEST_RING_DONE_STALL="0:0:60")
    cmd = _cmd(2, "run", *paths, "-o", out, "--causal", "--device", "cpu", "--quiet")
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("ringmpi test: stalling rank 0"):
                break
        assert seen and seen[-1].startswith("ringmpi test: stalling"), "".join(seen)
        time.sleep(1.0)  # rank 1 is in the agreement by now (a 512-token ring takes ms)
        _, rest, gone = _signal_and_wait(proc, proc.pid, signal.SIGINT)
    finally:
        _reap(proc)
    se = "".join(seen) + rest
    assert proc.returncode == 130, (proc.returncode, se)
    assert gone < 10, f"job took {gone:.1f} s to go"
    lines = [ln for ln in se.splitlines() if ln.startswith("ringmpi: interrupted")]
    assert lines == [
        "ringmpi: interrupted (SIGINT) at sequence 1/2 (seq000), while writing: "
        "0 finished sequence(s) kept; rerun with --resume"
    ], se
    assert "Abort(" not in se
    assert not os.path.exists(out)


# -- output that cannot be misread -------------------------------------------------------------


def test_copied_output_alone_reads_nan_and_pack_is_bit_identical(tmp_path):
    paths, out, _ = _small_run(tmp_path)
    lone = tmp_path / "elsewhere"
    lone.mkdir()
    shutil.copy(out, lone / "out.h5")
    with h5py.File(lone / "out.h5", "r") as f, h5py.File(out, "r") as g:
        for grp in ("seq000", "seq002"):
            assert np.isnan(f[grp]["out"][...]).all() and np.isnan(f[grp]["lse"][...]).all()
            assert np.isfinite(g[grp]["out"][...]).all()
    for comp in (None, "gzip", "lzf"):
        target = str(tmp_path / f"packed-{comp}.h5")
        res = pack(out, target, compress=comp)
        assert res["datasets"] == 6
        moved = shutil.move(target, lone / "packed.h5")  # self-contained: no parts needed
        with h5py.File(moved, "r") as f, h5py.File(out, "r") as g:
            for grp in ("seq000", "seq001", "seq002"):
                for n in ("out", "lse"):
                    a, b = f[grp][n], g[grp][n]
                    assert not a.is_virtual and a.compression == comp
                    assert a.dtype == b.dtype and a[...].tobytes() == b[...].tobytes()
                    assert [d.label for d in a.dims] == [d.label for d in b.dims]
            assert f["seq001"]["out"].dims[0].label == "token"
            for k, v in g.attrs.items():
                assert np.array_equal(f.attrs[k], v), k
            assert f.attrs["packed_utc"].endswith("Z")
        os.remove(moved)
    (tmp_path / "taken.h5").write_text("")
    with pytest.raises(InputError, match="exists; use --overwrite"):
        pack(out, str(tmp_path / "taken.h5"))
    os.remove(sorted(glob.glob(out + ".parts/s000001.r*.h5"))[0])
    with pytest.raises(InputError, match="is missing"):
        pack(out, str(tmp_path / "never.h5"))
    assert not os.path.exists(tmp_path / "never.h5")


def test_pack_command_and_compressed_parts(tmp_path, capsys):
    paths, out, _ = _small_run(tmp_path, compress="gzip")
    _, plain, _ = _small_run(tmp_path, name="plain.h5")
    with h5py.File(sorted(glob.glob(out + ".parts/*.h5"))[0], "r") as f:
        assert f["out"].compression == "gzip" and f["out"].shuffle
    with h5py.File(out, "r") as f, h5py.File(plain, "r") as g:
        for grp in ("seq000", "seq001"):
            assert f[grp]["out"][...].tobytes() == g[grp]["out"][...].tobytes()
    target = str(tmp_path / "one.h5")
    assert main(["pack", out, "-o", target, "--compress", "lzf"]) == 0
    assert "-> " + target in capsys.readouterr().out
    assert main(["pack", out, "-o", target]) == 2
    assert "--overwrite" in capsys.readouterr().err


# -- an honest verify --------------------------------------------------------------------------


def test_verify_all_skipped_is_not_passed(tmp_path, capsys):
    paths, out, _ = _small_run(tmp_path)
    rc = main(["verify", out, *paths, "--max-tokens", "100", "--sample-rows", "0", "--quiet"])
    text = capsys.readouterr().out
    assert rc == 4
    assert "PASSED" not in text and "NOTHING CHECKED" in text
    assert text.count("skipped (longer than --max-tokens 100") == 3
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    help_text = capsys.readouterr().out
    assert "default 4096" in help_text and "--sample-rows" in help_text


def _corrupt(out, seq, token, head, how):
    """Change one output row (token, head) of sequence ``seq`` inside its part file, or in
    the output itself where it is one file (parallel HDF5)."""
    parts = sorted(glob.glob(out + f".parts/s{seq:06d}.r*.h5"))
    for p in parts:
        with h5py.File(p, "r+") as f:
            hit = np.flatnonzero(f["pos"][...] == token)
            if len(hit):
                row = f["out"][hit[0], head]
                f["out"][hit[0], head] = how(row)
                return
    if not parts:
        with h5py.File(out, "r+") as f:
            if "out" in f:  # batch axis
                f["out"][seq, token, head] = how(f["out"][seq, token, head])
            else:
                g = f[sorted(k for k in f if isinstance(f[k], h5py.Group))[seq]]
                g["out"][token, head] = how(g["out"][token, head])
            return
    raise AssertionError("token not found")


def test_sampled_verify_passes_a_good_output_and_catches_corrupted_rows(tmp_path):
    paths, out, _ = _small_run(tmp_path)
    res = verify(out, paths, max_tokens=100, sample_rows=40, quiet=True)
    assert res["ok"] and res["sampled"] == 3 and res["full"] == 0
    assert res["sequences"][0]["rows_checked"] == 40 * H
    # a small error in a sampled row: the comparison with float64 catches it
    rows = sample_rows_of(300, 40, 0, 1, 2)
    _corrupt(out, 1, int(rows[7]), 2, lambda r: r + 1e-3)
    res = verify(out, paths, max_tokens=100, sample_rows=40, quiet=True)
    assert not res["ok"] and res["status"] == "failed"
    bad = [r for r in res["sequences"] if not r["ok"]]
    assert [r["sequence"] for r in bad] == ["seq001"] and bad[0]["rows_failed"] == 1
    # a gross error in a row outside the sample: the range check of every row catches it
    other = int(np.setdiff1d(np.arange(300), sample_rows_of(300, 40, 0, 0, 1))[5])
    _corrupt(out, 0, other, 1, lambda r: r * 0 + 50.0)
    res = verify(out, paths, max_tokens=100, sample_rows=40, quiet=True)
    s0 = res["sequences"][0]
    assert not s0["ok"] and s0["rows_out_of_range"] == 1
    # a lost part reads NaN: every one of its rows fails
    os.remove(sorted(glob.glob(out + ".parts/s000002.r*.h5"))[0])
    res = verify(out, paths, max_tokens=100, sample_rows=40, quiet=True)
    assert res["sequences"][2]["rows_not_finite"] == 300 * H


@pytest.mark.parametrize("causal", [False, True])
def test_rows_attention_matches_reference(causal):
    from ringmpi import reference

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((257, 1, 8)) for _ in range(3))
    ref_o, ref_l = reference.attention(q, k, v, causal=causal)
    rows = np.array([0, 3, 100, 256])
    o, lse = rows_attention(q[:, 0], k[:, 0], v[:, 0], rows, causal, 8**-0.5, np.float64)
    np.testing.assert_allclose(o, ref_o[rows, 0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_l[0, rows], rtol=0, atol=1e-12)


# -- typed metadata, overwrite, schema help -----------------------------------------------------


def test_attributes_are_typed_and_complete(tmp_path):
    paths, out, summary = _small_run(tmp_path, causal=False)
    with h5py.File(out, "r") as f:
        a = f.attrs
        assert a["causal"].dtype == np.bool_ and not a["causal"]
        assert isinstance(a["scale"], np.floating) and a["scale"] == D**-0.5
        assert bool(a["scale_is_default"]) is True
        assert isinstance(a["ranks"], np.integer) and a["ranks"] == 1
        assert a["layout"] == "zigzag" and a["structure"] == "groups"
        for k in (
            "ringmpi_version",
            "numpy_version",
            "h5py_version",
            "hdf5_version",
            "mpi_version",
            "kernel",
            "isa",
            "host",
        ):
            assert isinstance(a[k], str) and a[k], k
        assert a["isa"] in ("avx512", "avx2", "scalar", "sse/neon", "numpy") or a["isa"]
        assert list(a["inputs"]) == [os.path.abspath(p) for p in paths]
        assert [d.label for d in f["seq000"]["out"].dims] == ["token", "head", "head_dim"]
        assert [d.label for d in f["seq000"]["lse"].dims] == ["head", "token"]
    assert summary["provenance"]["scale"] == D**-0.5


def test_existing_output_refused_unless_overwrite(tmp_path, capsys):
    paths, out, _ = _small_run(tmp_path)
    before = _digests(out)
    assert main(["run", *paths, "-o", out, "--quiet"]) == 2
    assert "output exists; use --overwrite" in capsys.readouterr().err
    assert _digests(out) == before
    assert main(["run", *paths, "-o", out, "--quiet", "--overwrite", "--causal"]) == 0
    os.remove(out)  # an unfinished run: its parts are not thrown away unasked either
    assert main(["run", *paths, "-o", out, "--quiet"]) == 2
    assert "unfinished run; use --resume" in capsys.readouterr().err


def test_schema_help_head_major_warning_and_listing(tmp_path, capsys):
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "hm.h5", "w") as f:  # (H, S, D) stored where (S, H, D) belongs
        f["q"] = rng.standard_normal((4, 64, 8)).astype("f4")
        f["k"] = f["v"] = rng.standard_normal((4, 64, 8)).astype("f4")
    plan = scan([str(tmp_path / "hm.h5")])
    assert len(plan.warnings) == 1 and "head-major" in plan.warnings[0]
    assert main(["run", str(tmp_path / "hm.h5"), "-o", str(tmp_path / "o.h5"), "--quiet"]) == 2
    err = capsys.readouterr().err  # issue 26: the job stops with the advice (no memory error)
    assert "ringmpi: error:" in err and "S=4 tokens but H=64 heads" in err and "swapaxes" in err
    assert not os.path.exists(tmp_path / "o.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["queries"] = np.zeros((5, 2, 3), "f4")
        f["meta/ids"] = np.arange(5)
    with pytest.raises(InputError, match=r"found: meta/ids \(5,\) int64, queries \(5, 2, 3\)"):
        scan([str(tmp_path / "other.h5")])
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    assert "q (S, H, D), k (S, Hkv, D), v (S, Hkv, Dv" in text and "--verify-max-tokens" in text
    assert "--overwrite" in text and "--compress" in text


def _fake_cupy(monkeypatch, error):
    fake = types.ModuleType("cupy")

    def count():
        raise error

    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
    monkeypatch.setitem(sys.modules, "cupy", fake)


def test_no_gpu_is_said_plainly(monkeypatch, capsys):
    class CUDARuntimeError(RuntimeError):
        pass

    why = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime"
    _fake_cupy(monkeypatch, CUDARuntimeError(why))
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "no GPU found (CPU will be used): no NVIDIA driver" in text
    assert pick_device("auto", None) == "cpu"
    with pytest.raises(InputError, match=r"--device gpu: no usable GPU on rank 0: no GPU found"):
        pick_device("gpu", None)


def test_progress_bar_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    buf = Tty()
    monkeypatch.setattr(progress_mod, "TTY_EVERY", 0.0)
    bar = progress_mod.Progress([1000], stream=buf)
    bar.start(0, "seq", 1000, nsteps=2, ticks_per_step=4)
    for _ in range(2):
        bar.tick(0)
    bar.close()
    frames = buf.getvalue().split("\r")
    assert frames[-1].startswith("[######..................]  25% sequence 1/1 seq ring step 1/2")
    assert "ETA" in frames[-1] and buf.getvalue().endswith("\n")


def test_start_line_and_progress_in_a_log(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_mod, "LOG_EVERY", 0.0)
    paths = make_data(str(tmp_path / "in.h5"), seq_len=2048, heads=H, kv_heads=HKV, head_dim=D)
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    run(paths, str(tmp_path / "out.h5"), causal=True, device="cpu")
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("ringmpi: 1 sequence(s), 2,048 tokens (H=4, Hkv=2, D=16, float32)")
    assert "GiB per rank; predicted ~" in lines[0] and "GFLOP/s per rank (measured)" in lines[0]
    pct = [int(ln.split("%")[0].split()[-1]) for ln in lines[1:-1]]
    assert len(pct) >= 2 and pct == sorted(pct) and 0 < pct[-1] <= 100
    assert lines[-1].startswith("ringmpi: sequence 1/1 seq: 2,048 tokens in ")


# -- multi-rank, in process --------------------------------------------------------------------


@pytest.mark.mpi
def test_job_output_typed_nan_filled_and_protected(comm):
    d = comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None)
    try:
        n = 41 * comm.size + 2
        if comm.rank == 0:
            make_data(f"{d}/in.h5", seq_len=n, heads=H, kv_heads=HKV, head_dim=D)
        comm.Barrier()
        # part files: one is removed below (where h5py has MPI the default is one file)
        run(
            [f"{d}/in.h5"],
            f"{d}/out.h5",
            comm=comm,
            layout="striped",
            quiet=True,
            output_mode="parts",
        )
        with pytest.raises(InputError, match="output exists"):
            run([f"{d}/in.h5"], f"{d}/out.h5", comm=comm, quiet=True)
        ok, msg = True, ""
        if comm.rank == 0:
            try:
                with h5py.File(f"{d}/out.h5", "r") as f:
                    assert int(f.attrs["ranks"]) == comm.size and not f.attrs["causal"]
                    assert f["out"].fillvalue != f["out"].fillvalue  # NaN
                    assert np.isnan(f["lse"].fillvalue)
                    good = f["out"][...]
                os.remove(sorted(glob.glob(f"{d}/out.h5.parts/*.r*.h5"))[-1])
                with h5py.File(f"{d}/out.h5", "r") as f:
                    o = f["out"][...]
                # striped: the last rank's tokens are every size-th one; they read NaN now
                lost = np.arange(comm.size - 1, n, comm.size)
                assert np.isnan(o[lost]).all() and np.isnan(o).sum() == o[lost].size
                keep = np.setdiff1d(np.arange(n), lost)
                assert np.array_equal(o[keep], good[keep])
            except Exception as e:  # any failure on rank 0 must reach assert_all, not hang
                ok, msg = False, repr(e)
        assert_all(comm, ok, msg)
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.mpi
def test_sampled_verify_on_all_ranks(comm):
    d = comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None)
    try:
        if comm.rank == 0:
            make_data(f"{d}/in.h5", seq_len=500, sequences=2, heads=H, kv_heads=HKV, head_dim=D)
        comm.Barrier()
        run([f"{d}/in.h5"], f"{d}/out.h5", comm=comm, causal=True, quiet=True)
        res = verify(
            f"{d}/out.h5", [f"{d}/in.h5"], comm=comm, max_tokens=100, sample_rows=64, quiet=True
        )
        assert_all(comm, res["ok"] and res["sampled"] == 2, str(res))
        assert_all(comm, res["sequences"][1]["rows_checked"] == 64 * H, str(res))
        ok, msg = True, ""
        if comm.rank == 0:
            try:  # any failure here must reach assert_all, not leave the others waiting
                _corrupt(
                    f"{d}/out.h5",
                    1,
                    int(sample_rows_of(500, 64, 0, 1, H - 1)[3]),
                    H - 1,
                    lambda r: r - 1e-3,
                )
            except Exception as e:
                ok, msg = False, repr(e)
        assert_all(comm, ok, msg)
        res = verify(
            f"{d}/out.h5", [f"{d}/in.h5"], comm=comm, max_tokens=100, sample_rows=64, quiet=True
        )
        assert_all(comm, res["status"] == "failed" and res["failed"] == 1, str(res))
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
