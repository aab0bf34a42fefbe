"""The environment registry (the docs' table, info, every RINGMPI_* name) and the lazy imports."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringmpi.runtime import env

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"<!-- env-table: [^>]*-->\n(.*?)\n<!-- /env-table -->", re.S)


def test_docs_table_is_the_registry():
    """The table of docs/environment.md is generated: `python -m ringmpi.runtime.env` prints it."""
    found = _BLOCK.findall((ROOT / "docs" / "environment.md").read_text())
    assert len(found) == 1, "docs/environment.md needs one env-table block"
    assert found[0] == env.table_block(), (
        "docs table differs: paste `python -m ringmpi.runtime.env`"
    )
    assert "env-table" not in (ROOT / "README.md").read_text(), "the table lives in docs/ only"


def test_every_ringmpi_variable_in_the_sources_is_registered():
    names = set()
    folders = ("ringmpi", "tests", "jobs", "benchmarks", "data", ".ci")
    for folder in folders:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".sbatch", ".pbs"):
                names |= set(re.findall(r"RINGMPI_[A-Z0-9_]*[A-Z0-9]", path.read_text("latin-1")))
    names |= set(re.findall(r"RINGMPI_[A-Z0-9_]*[A-Z0-9]", (ROOT / "Makefile").read_text()))
    assert len(names) > 15  # the scan found the sources
    missing = sorted(names - set(env.REGISTRY))
    assert not missing, f"read in the sources but not in ringmpi/runtime/env.py: {missing}"


def test_get_parses_and_names_the_variable(monkeypatch):
    monkeypatch.delenv("RINGMPI_WATCHDOG_S", raising=False)
    assert env.get("RINGMPI_WATCHDOG_S") == 600.0
    monkeypatch.setenv("RINGMPI_WATCHDOG_S", "0")
    assert env.get("RINGMPI_WATCHDOG_S") is None
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", " Fused ")
    assert env.get("RINGMPI_CPU_KERNEL") == "fused"
    for name, bad in (
        ("RINGMPI_CPU_KERNEL", "gpu"),
        ("RINGMPI_BUILD_LOCK_S", "-1"),
        ("RINGMPI_WATCHDOG_S", "soon"),
    ):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            env.get(name)
    with pytest.raises(KeyError):
        env.get("RINGMPI_" + "UNKNOWN")  # (split: the source scan must not find it)


def test_info_lists_the_variables_that_are_set():
    e = dict(os.environ, RINGMPI_POLL="0", RINGMPI_BUILD_LOCK_S="25")
    out = subprocess.run(
        [sys.executable, "-m", "ringmpi", "info"],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "env       RINGMPI_BUILD_LOCK_S=25" in lines and "env       RINGMPI_POLL=0" in lines
    tiles = [x for x in lines if x.startswith("cpu tiles ")]
    assert len(tiles) == 1 and "forward" in tiles[0] and "backward" in tiles[0], lines


_PROBE = """
import sys
from ringmpi.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print("MPI-INITIALISED" if "mpi4py.MPI" in sys.modules else "MPI-UNTOUCHED", rc)
"""


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--help"],
        ["run", "--help"],
        ["make-data", "{tmp}/s.h5", "--seq-len", "64", "--heads", "2", "--kv-heads", "1"],
        ["pack", "{tmp}/missing.h5", "-o", "{tmp}/p.h5"],
    ],
)
def test_import_help_make_data_pack_never_load_mpi(tmp_path, argv):
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = "import sys, ringmpi; print(ringmpi.LAYOUTS)\n" if not argv else _PROBE
    if not argv:
        code += 'print("MPI-INITIALISED" if "mpi4py.MPI" in sys.modules else "MPI-UNTOUCHED", 0)'
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("MPI-UNTOUCHED"), (argv, out.stdout[-500:], out.stderr[-500:])
    want = {"make-data": "0", "pack": "2"}.get(argv[0] if argv else "", "0")
    assert last.split()[1] == want, (argv, out.stdout[-300:], out.stderr[-300:])


def test_public_names_load_on_use():
    code = (
        "import sys, ringmpi\n"
        "assert 'ringmpi.attention' not in sys.modules\n"
        "f = ringmpi.ring_attention\n"
        "assert f.__module__ == 'ringmpi.attention' and 'mpi4py.MPI' in sys.modules\n"
        "assert callable(ringmpi.grid)  # not shadowed by the submodule the loops import\n"
        "assert sorted(ringmpi.__all__) == ringmpi.__all__ and all(hasattr(ringmpi, n) "
        "for n in ringmpi.__all__)\n"
        "print(ringmpi.layout.counts(10, 2).tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[5, 5]", out.stderr[-800:]
