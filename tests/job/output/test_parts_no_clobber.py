"""No clobbering through names (issue 22, items 3, 8, 9, 10), single-user part.

Names another user could plant (``OUT.h5.tmp``, ``F.tmp`` of ``pack -o F`` and
``--summary-json F``, a parts folder or part files as symlinks) are played here by
the user's own symlinks to a "victim" file or folder: the job must neither write
through them nor delete what they point at. The second-user versions run in
``make test-security``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.cli.main import main
from ringmpi.cli.make_data import make_data


@pytest.fixture(autouse=True)
def _one_sequence_per_call(monkeypatch):
    """These tests poke at one sequence's part file, marker or ring step: one sequence per
    ring call (RINGMPI_BATCH_TOKENS=0); batches of several: tests/job/test_resources_batches.py."""
    monkeypatch.setenv("RINGMPI_BATCH_TOKENS", "0")


ROOT = Path(__file__).resolve().parents[3]
H, HKV, D = 2, 1, 8


def _digest(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.fixture
def data(tmp_path):
    paths = make_data(
        str(tmp_path / "in.h5"), seq_len=64, sequences=2, heads=H, kv_heads=HKV, head_dim=D
    )
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return paths, tmp_path / "out.h5", victim


def _run(paths, out, *extra) -> int:
    return main(["run", *paths, "-o", str(out), "--quiet", "--causal", *extra])


def test_planted_temporaries_are_not_written_through(data, tmp_path):
    paths, out, victim = data
    summary = tmp_path / "s.json"
    packed = tmp_path / "packed.h5"
    for name in (f"{out}.tmp", f"{summary}.tmp", f"{packed}.tmp"):
        os.symlink(victim, name)
    assert _run(paths, out, "--summary-json", str(summary)) == 0
    assert main(["pack", str(out), "--to", str(packed)]) == 0
    assert victim.read_text() == "precious\n"
    outs = []
    with h5py.File(packed, "r") as f:
        f.visititems(lambda n, o: outs.append(o[()]) if n.endswith("out") else None)
    assert len(outs) == 2 and all(np.isfinite(a).all() for a in outs)
    # only the planted links are left over, no temporary of ours
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
    assert left == sorted(Path(n).name for n in (f"{out}.tmp", f"{summary}.tmp", f"{packed}.tmp"))


def test_symlinked_parts_folder_is_refused_and_its_target_untouched(data, tmp_path, capsys):
    paths, out, victim = data
    theirs = tmp_path / "their-results"
    theirs.mkdir()
    (theirs / "s000000.r00000.h5").write_text("their result\n")
    (theirs / "manifest.json").write_text("{}\n")
    os.symlink(theirs, f"{out}.parts")
    assert _run(paths, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "symlink" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in theirs.iterdir()) == ["manifest.json", "s000000.r00000.h5"]
    assert not out.exists()


def test_parts_folder_others_can_write_is_refused(data, capsys):
    paths, out, victim = data
    parts = Path(f"{out}.parts")
    parts.mkdir()
    parts.chmod(0o777)
    assert _run(paths, out) == 2
    assert "writable by group or others" in capsys.readouterr().err
    assert not out.exists()


def test_planted_part_symlinks_are_removed_not_followed(data):
    paths, out, victim = data
    assert _run(paths, out) == 0
    parts = Path(f"{out}.parts")
    part = parts / "s000000.r00000.h5"
    part.unlink()
    part.symlink_to(victim)
    assert _run(paths, out, "--overwrite") == 0
    assert victim.read_text() == "precious\n" and not part.is_symlink()


def test_resume_redoes_a_symlinked_part_and_a_malformed_marker(data, tmp_path):
    paths, out, victim = data
    assert _run(paths, out) == 0
    want = {n: _digest(p) for n, p in _files(out).items()}
    out.unlink()
    parts = Path(f"{out}.parts")
    part = parts / "s000000.r00000.h5"
    copy = tmp_path / "copy.h5"
    os.replace(part, copy)
    part.symlink_to(copy)  # same bytes, but through a link: not trusted
    (parts / "s000001.done").write_text('{"sequence": 7, "parts": "x"}\n')
    (parts / "s000099.done").write_text('{"sequence": "nope", "parts": [[1, 2]]}\n')
    assert _run(paths, out, "--resume") == 0
    assert not part.is_symlink()
    got = {n: _digest(p) for n, p in _files(out).items() if n != "s000099.done"}
    assert got == want


def _files(out) -> dict:
    parts = Path(f"{out}.parts")
    return {"out.h5": out, **{p.name: p for p in sorted(parts.iterdir())}}


def test_part_with_wrong_attributes_is_redone_on_resume(data):
    paths, out, victim = data
    assert _run(paths, out) == 0
    want = _digest(Path(f"{out}.parts") / "s000001.r00000.h5")
    out.unlink()
    parts = Path(f"{out}.parts")
    # sequence 0's part under sequence 1's name, with a marker that matches its bytes
    import json
    import zlib

    p0, p1 = parts / "s000000.r00000.h5", parts / "s000001.r00000.h5"
    p1.write_bytes(p0.read_bytes())
    data1 = p1.read_bytes()
    marker = json.loads((parts / "s000001.done").read_text())
    marker["parts"] = [[len(data1), zlib.crc32(data1)]]
    (parts / "s000001.done").write_text(json.dumps(marker))
    assert _run(paths, out, "--resume") == 0
    assert _digest(p1) == want


@pytest.mark.parametrize("where", ["input", "parts", "output"])
def test_summary_json_onto_data_is_refused_before_computing(data, where, capsys):
    paths, out, victim = data
    if where == "parts":
        assert _run(paths, out) == 0
    before = _digest(paths[0])
    target = {"input": paths[0], "parts": f"{out}.parts/s.json", "output": str(out)}[where]
    extra = ["--overwrite"] if where == "parts" else []
    assert _run(paths, out, "--summary-json", target, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--summary-json would" in err[0], err
    assert _digest(paths[0]) == before
    if where != "parts":
        assert not out.exists()


def test_pack_into_the_parts_folder_is_refused(data, capsys):
    paths, out, victim = data
    assert _run(paths, out) == 0
    assert main(["pack", str(out), "--to", f"{out}.parts/packed.h5"]) == 2
    assert "parts folder" in capsys.readouterr().err
    assert not Path(f"{out}.parts/packed.h5").exists()


def test_second_job_on_the_same_output_stops(data):
    """While one job holds the output's lock, another (even with --overwrite) stops at once."""
    paths, out, victim = data
    assert _run(paths, out) == 0
    before = {n: _digest(p) for n, p in _files(out).items()}
    fd = os.open(f"{out}.parts", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first job released it when done
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ringmpi", "run", *paths, "-o", str(out), "--overwrite"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        os.close(fd)
    assert proc.returncode == 2, proc.stderr
    assert "another job is writing this output" in proc.stderr
    assert {n: _digest(p) for n, p in _files(out).items()} == before


@pytest.mark.parametrize("name", ["run_50%.h5", "a%%b.h5", "p%b%s.h5"])
def test_percent_in_output_name_maps_the_right_parts(tmp_path, name):
    paths = make_data(str(tmp_path / "in.h5"), seq_len=40, heads=H, kv_heads=HKV, head_dim=D)
    out = tmp_path / name
    assert _run(paths, out) == 0
    ref = tmp_path / "plain.h5"
    assert _run(paths, ref) == 0
    with h5py.File(out, "r") as f, h5py.File(ref, "r") as g:
        a, b = f["out"][()], g["out"][()]
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


def test_resume_under_another_cpu_kernel_is_refused(data, capsys, monkeypatch):
    paths, out, victim = data
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    assert _run(paths, out) == 0
    out.unlink()
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "fused")
    assert _run(paths, out, "--resume") == 2
    assert "made by a different run (differs in compute)" in capsys.readouterr().err
