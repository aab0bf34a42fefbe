"""The quick version of ``make stress`` (tests/stress.py --quick), one test per check.

Single-rank pytest tests: each launches ``mpiexec`` jobs (the one beside
sys.executable) as subprocesses with timeouts and asserts every line of its
check passed. About a minute in all on 2 cores.
"""

from __future__ import annotations

import faults  # noqa: E402
import h5py
import numpy as np
import pytest
import stress  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("check", stress.CHECKS)
def test_stress_quick(check, tmp_path):
    lines = stress.run_check(check, quick=True, tmp_root=str(tmp_path))
    assert lines, f"{check}: no result"
    text = "\n".join(f"{'PASS' if ok else 'FAIL'} {t}" for ok, t in lines)
    print(text)
    assert all(ok for ok, _ in lines), text


def test_disk_full_fallback_without_mount(tmp_path, monkeypatch):
    """Where a tmpfs cannot be mounted (CI containers), RLIMIT_FSIZE and a file in place of
    the parts directory stand in: exercise that path here too."""
    monkeypatch.setenv("STRESS_NO_MOUNT", "1")
    lines = stress.run_check("disk", quick=True, tmp_root=str(tmp_path))
    text = "\n".join(t for _, t in lines)
    assert "RLIMIT_FSIZE" in text and "replaced by a file" in text
    assert all(ok for ok, _ in lines), text


def test_overflowing_scores_are_an_error_not_nan(tmp_path):
    """Finite float32 inputs whose scores overflow float32 (found by the fuzzer: a flipped
    exponent bit in features x): one clear error, nothing written, instead of NaN output."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((64, 2, 8)).astype("f4")
    k = rng.standard_normal((64, 1, 8)).astype("f4")
    q[5] *= 1e20
    k[9] *= 1e20
    with h5py.File(tmp_path / "big.h5", "w") as f:
        f["q"], f["k"], f["v"] = q, k, k
    out = tmp_path / "out.h5"
    res = faults.run_cli(2, "run", str(tmp_path / "big.h5"), "-o", str(out), "--quiet")
    assert faults.classify(res) == "clear", res.err
    assert "not finite" in res.err and "overflow float32" in res.err
    assert not out.exists() and not list(tmp_path.glob("out.h5.parts/*.done"))
