"""The Python examples in README.md and docs/ run as written under mpiexec, with small errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (f"{page.relative_to(ROOT)}:{i}", code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")


def test_readme_and_docs_have_examples():
    assert sum(name.startswith("README.md") for name, _ in BLOCKS) >= 1
    assert sum(name.startswith("docs") for name, _ in BLOCKS) >= 4
    assert len(PAGES) >= 10  # README + the docs pages


def test_links_point_at_files():
    """Every relative link of README.md and docs/*.md names a file that exists."""
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not broken, broken
    assert "docs/batch-job.md" in (ROOT / "README.md").read_text()


def _run(tmp_path, code: str, ranks: int):
    """Run one example under ``mpiexec -n ranks``; it must exit 0. The finished process."""
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return res


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec beside this Python")
@pytest.mark.parametrize("name, code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_example_runs(tmp_path, name, code):
    res = _run(tmp_path, code, 2)
    errs = [float(x) for x in re.findall(r"err\w*.*?([0-9.]+e-?[0-9]+)", res.stdout)]
    assert errs, res.stdout
    assert max(errs) < 1e-4, res.stdout


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec beside this Python")
def test_absorbed_mla_recipe_at_three_ranks(tmp_path):
    """docs/mla.md's recipe (absorbed MLA, one latent K/V head of 576 / 512, against the
    unabsorbed form and the dense float64 reference) at P = 3; test_example_runs runs it
    at P = 2. The example asserts 1e-12 relative itself and prints both errors."""
    ((name, code),) = [(n, c) for n, c in BLOCKS if n.startswith("docs/mla.md")]
    res = _run(tmp_path, code, 3)
    errs = [float(x) for x in re.findall(r"error ([0-9.]+e-?[0-9]+)", res.stdout)]
    assert len(errs) == 2 and max(errs) < 1e-12, res.stdout
    absorbed, unabsorbed = (
        int(x.replace(",", ""))
        for x in re.search(r"absorbed ([0-9,]+), unabsorbed ([0-9,]+)", res.stdout).groups()
    )
    assert unabsorbed * 1088 == absorbed * 8 * 320  # H (192 + 128) vs 576 + 512 per token


def test_mask_pictures_are_drawn_from_the_masks():
    """docs/_static/masks/*.svg are what docs/mask_pictures.py draws now (Slices.to_svg of
    each builder), and docs/masks.md shows every one of them."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "mask_pictures.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    page = (ROOT / "docs" / "masks.md").read_text()
    drawn = {p.name for p in (ROOT / "docs" / "_static" / "masks").glob("*.svg")}
    shown = set(re.findall(r"\(_static/masks/([^)]+\.svg)\)", page))
    assert drawn and shown == drawn
