"""Hostile inputs (issue 22, items 4-7): one line, exit 2, nothing written, bounded cost.

Each file of tests/security/hostile.py goes through ``ringmpi run`` as a separate
process: it must exit 2 with one line naming the problem, leave nothing under the
output name, and stay within 10 s and 200 MiB (peak RSS of the rank).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.job.input import files as trust
from ringmpi.job.input import scan as schema

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "security"))
import hostile  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("kind", hostile.KINDS)
def test_hostile_input_fails_closed(kind, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RINGMPI_ALLOW_VDS", None)
    assert hostile.check(kind, tmp_path, env=env) == []


def test_vds_opt_in_still_refuses_missing_sources(tmp_path):
    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f["q"] = np.full((8, 2, 4), 0.5, np.float32)
    p = tmp_path / "vds.h5"
    with h5py.File(p, "w") as f:
        lay = h5py.VirtualLayout((8, 2, 4), "f4")
        lay[:] = h5py.VirtualSource(str(tmp_path / "gone.h5"), "q", shape=(8, 2, 4))
        f.create_virtual_dataset("q", lay, fillvalue=0.0)
        lay2 = h5py.VirtualLayout((8, 2, 4), "f4")
        lay2[:] = h5py.VirtualSource(str(src), "q", shape=(8, 2, 4))
        f.create_virtual_dataset("k", lay2)
        f.create_virtual_dataset("v", lay2)
    with pytest.raises(schema.InputError, match="virtual dataset"):
        schema.scan([str(p)])
    os.environ[trust.VDS_ENV] = "1"
    try:
        with pytest.raises(schema.InputError, match="missing source file .*gone.h5"):
            schema.scan([str(p)])
        (tmp_path / "gone.h5").write_bytes(src.read_bytes())
        plan = schema.scan([str(p)])  # opted in, every source present: accepted
        assert plan.sequences[0].length == 8
    finally:
        del os.environ[trust.VDS_ENV]


def test_offsets_compare_neighbours_not_differences():
    cu = np.array([0, 1 << 62, -(1 << 63) + 1, -1, 5], np.int64)
    assert (np.diff(cu) >= 0).all()  # the wrap the old check fell for
    with pytest.raises(schema.InputError, match="decreases at index 2"):
        schema.check_offsets("f.h5", "", "cu_seqlens", cu, 5)


PLUGIN = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANT_MARK"), "w");
    if (f) { fputs("loaded\n", f); fclose(f); }
}
int H5PLget_plugin_type(void) { return 0; }
const void *H5PLget_plugin_info(void) { return 0; }
"""


def test_filter_plugins_are_never_loaded(tmp_path):
    """A dataset naming an unknown filter does not make HDF5 dlopen HDF5_PLUGIN_PATH."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the planted plugin")
    plugdir = tmp_path / "plugins"
    plugdir.mkdir()
    (tmp_path / "p.c").write_text(PLUGIN)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(plugdir / "libplanted.so"), str(tmp_path / "p.c")],
        check=True,
    )
    inp = tmp_path / "in.h5"
    # a gzip dataset whose pipeline message is then edited to name filter 40123
    with h5py.File(inp, "w", libver="earliest") as f:
        for n in "qkv":
            f.create_dataset(
                n,
                data=np.full((16, 2, 4), 0.5, np.float32),
                chunks=(16, 2, 4),
                compression="gzip" if n == "q" else None,
            )
    raw = bytearray(inp.read_bytes())
    at = raw.find(b"deflate\0")
    assert at > 8 and raw[at - 8 : at - 6] == (1).to_bytes(2, "little")
    raw[at - 8 : at - 6] = (40123).to_bytes(2, "little")
    inp.write_bytes(bytes(raw))
    mark = tmp_path / "loaded"
    env = dict(os.environ, HDF5_PLUGIN_PATH=str(plugdir), PLANT_MARK=str(mark))
    env["OMP_NUM_THREADS"] = "1"
    r = hostile.run_cli(inp, tmp_path / "out.h5", env=env)
    assert not mark.exists(), "HDF5 loaded the planted filter plugin"
    # and the control: without ringmpi's guard, HDF5 does load it from that path
    probe = f"import h5py; f = h5py.File({str(inp)!r}, 'r'); f['q'][()]"
    subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    assert mark.exists(), "control failed: plain h5py did not try the plugin path"
    lines = r["err"].strip().splitlines()
    assert r["rc"] == 2 and len(lines) == 1, r["err"]
    assert "needs HDF5 filter 40123, which is not built in" in lines[0]


@pytest.mark.parametrize("kind", ["long_cu_seqlens", "cu_seqlens_bomb", "cu_seqlens_wrap"])
def test_hostile_offsets_fail_closed_on_two_ranks(kind, tmp_path):
    """The offsets no longer travel in the plan's broadcast: the refusal is still one line."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    assert hostile.check(kind, tmp_path, env=env, ranks=2) == []


def test_a_file_changed_after_its_links_were_walked_is_walked_again(tmp_path, monkeypatch):
    """open_input walks a file's links once per process (the reader reopens what the scan
    opened); a file changed since (an external link added) is walked again and refused."""
    from ringmpi.job.input import files as inputs

    p = tmp_path / "in.h5"
    with h5py.File(p, "w") as f:
        f["q"] = np.zeros((4, 2, 2), np.float32)
    walks = []
    real = trust.check_links
    monkeypatch.setattr(trust, "check_links", lambda f: walks.append(1) or real(f))
    for _ in range(3):
        inputs.open_input(str(p)).close()
    assert len(walks) == 1  # walked once, then known unchanged
    with h5py.File(p, "a") as f:
        f["elsewhere"] = h5py.ExternalLink("/etc/passwd", "/x")
    with pytest.raises(schema.InputError, match="external link"):
        inputs.open_input(str(p))
    assert len(walks) == 2
