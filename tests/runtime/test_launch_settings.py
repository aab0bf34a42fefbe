"""Safety settings are validated before anything runs (issue 22, item 11)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.runtime import launch, watchdog

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "-0.5", "soon", "1e400"])
def test_watchdog_setting_refused(monkeypatch, text):
    monkeypatch.setenv(watchdog.ENV, text)
    with pytest.raises(ValueError, match="finite number of seconds"):
        watchdog.limit()
    assert "RINGMPI_WATCHDOG_S" in launch.settings_problem({watchdog.ENV: text})


@pytest.mark.parametrize(
    "text, want", [("", 600.0), ("0", None), ("2.5", 2.5), ("1e10", watchdog.MAX_S)]
)
def test_watchdog_setting_accepted_and_clamped(monkeypatch, text, want):
    monkeypatch.setenv(watchdog.ENV, text)
    assert watchdog.limit() == want
    with watchdog.watch("nothing"):  # a clamped limit arms without overflowing the thread
        pass


def test_bad_watchdog_setting_stops_the_cli_with_one_line(tmp_path):
    env = dict(os.environ, RINGMPI_WATCHDOG_S="nan")
    r = subprocess.run(
        [sys.executable, "-m", "ringmpi", "run", "x.h5", "-o", str(tmp_path / "o.h5")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "RINGMPI_WATCHDOG_S must be a finite number" in lines[0]


def test_shared_working_directory_is_refused_unless_safe_path(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    cmd = [sys.executable, "-m", "ringmpi", "run", "x.h5", "-o", str(tmp_path / "o.h5")]
    r = subprocess.run(cmd, cwd=shared, env=env, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "other users can write it" in lines[0] and "python -P" in lines[0]
    r = subprocess.run(
        cmd,
        cwd=shared,
        env=dict(env, PYTHONSAFEPATH="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "other users can write it" not in r.stderr
    assert "x.h5: no such file" in r.stderr


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--scale", "nan", "finite number"),
        ("--scale", "inf", "finite number"),
        ("--window", "1e23", "integers"),
        ("--window", "5,nan", "integers"),
    ],
)
def test_bad_numbers_refused_before_anything_is_created(tmp_path, flag, value, words):
    inp = tmp_path / "in.h5"
    with h5py.File(inp, "w") as f:
        for name, heads in (("q", 2), ("k", 1), ("v", 1)):
            f.create_dataset(name, data=np.ones((8, heads, 4), np.float32))
    out = tmp_path / "out.h5"
    r = subprocess.run(
        [sys.executable, "-m", "ringmpi", "run", str(inp), "-o", str(out), flag, value],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert words in r.stderr.strip().splitlines()[-1], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"], "something was created"
