"""The pictures of docs/masks.md, drawn from the masks themselves (``Slices.to_svg``).

    python docs/mask_pictures.py          # (re)write docs/_static/masks/*.svg
    python docs/mask_pictures.py --check  # exit 1 when a committed picture is stale

tests/test_docs_examples.py runs the check, so a change to a builder or to the
drawing shows up as a failing test until the pictures are written again.
"""

import argparse
import sys
from pathlib import Path

from ringmpi import Slices, slices

OUT = Path(__file__).resolve().parent / "_static" / "masks"


def pictures() -> dict:
    """{file name: (Slices, nq, nk, cell, title)} of every picture on the page."""
    n = 64
    mine = Slices(
        [(0, 64, 0, 8, "full"), (16, 48, 12, 52, "bi_causal"), (32, 64, 32, 64, "causal")]
    )
    pics = {
        "global_local.svg": (slices.global_local(n, 6, 4), "global_local(64, 6, 4)"),
        "global_local_causal.svg": (
            slices.global_local(n, (6, 0), 4, causal=True),
            "global_local(64, (6, 0), 4, causal=True)",
        ),
        "prefix_lm.svg": (slices.prefix_lm(n, 16), "prefix_lm(64, 16)"),
        "shared_prefix.svg": (
            slices.shared_prefix(16, [16, 8, 24]),
            "shared_prefix(16, [16, 8, 24])",
        ),
        "block_sparse.svg": (
            slices.block_sparse(n, 8, seed=0, causal=True),
            "block_sparse(64, 8, seed=0, causal=True)",
        ),
        "mine.svg": (mine, repr(mine)),
    }
    out = {name: (s, n, n, 4, title) for name, (s, title) in pics.items()}
    for kind in slices.KINDS:  # one slice of each kind, 12 queries x 20 keys (Lk > Lq)
        out[f"kind_{kind}.svg"] = (
            Slices([(0, 12, 0, 20, kind)]),
            12,
            20,
            6,
            f'one "{kind}" slice, 12 queries x 20 keys',
        )
    return out


def render() -> dict:
    """{file name: SVG text} of every picture."""
    return {
        name: s.to_svg(nq, nk, cell=cell, title=title)
        for name, (s, nq, nk, cell, title) in pictures().items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    args = ap.parse_args()
    stale = []
    for name, svg in render().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != svg:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(svg)
    extra = sorted({p.name for p in OUT.glob("*.svg")} - set(render()))
    if stale or extra:
        print(f"stale: {stale}, not drawn here: {extra} (run python docs/mask_pictures.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
