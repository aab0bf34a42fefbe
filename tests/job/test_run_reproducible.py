"""``ringmpi run --reproducible`` (issue 40): the job's outputs, bit for bit, whatever P.

One long and many short sequences (real-shaped values: nonzero means, small spreads, a few
huge keys), run at P = 1, 2, 3 with every layout and ring size; ``verify --against``
(:func:`ringmpi.job.verify.compare`) finds the outputs identical, and a kill in the middle
of a sequence resumes to the same bits. In this mode a batch holds one sequence (a batch's
packing would move the key blocks) and no mid-sequence checkpoint is written.
"""

from __future__ import annotations

import glob

import h5py
import numpy as np
import pytest
from cli.test_main_mpi import HKV, H, launch

from ringmpi.job.verify import compare

D = 16
LENGTHS = [700, 97, 150, 64, 33]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("repro") / "in.h5")
    with h5py.File(path, "w") as f:
        for i, n in enumerate(LENGTHS):
            rng = np.random.default_rng([40, i])
            k = (0.5 + 0.1 * rng.standard_normal((n, HKV, D))).astype(np.float32)
            k[rng.integers(0, n, 2)] *= 30.0  # a few huge keys
            g = f.create_group(f"seq{i:03d}")
            g["q"] = (0.2 + rng.standard_normal((n, H, D))).astype(np.float32)
            g["k"] = k
            g["v"] = (1.0 + 0.1 * rng.standard_normal((n, HKV, D))).astype(np.float32)
    return path


def _run(p, data, out, *flags, env=None):
    rc, so, se, _ = launch(p, "run", data, "-o", out, "--reproducible", "--quiet", *flags, env=env)
    return rc, so + se


@pytest.fixture(scope="module")
def one_rank(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one") / "p1.h5")
    rc, text = _run(1, data, out, "--causal", "--verify")
    assert rc == 0, text
    with h5py.File(out, "r") as f:
        assert bool(f.attrs["reproducible"]), dict(f.attrs)
    return out


@pytest.mark.parametrize(
    "p, flags",
    [
        (2, ()),
        (3, ("--layout", "striped")),
        (3, ("--layout", "contiguous", "--ring-size", "1")),
        (2, ("--ring-size", "auto")),
    ],
    ids=["2-zigzag", "3-striped", "3-rings-of-one", "2-auto"],
)
def test_same_bits_at_every_ring_size_and_layout(data, one_rank, tmp_path, p, flags):
    out = str(tmp_path / "out.h5")
    rc, text = _run(p, data, out, "--causal", *flags)
    assert rc == 0, text
    res = compare(one_rank, out)
    assert res["identical"] and res["datasets"] == 2 * len(LENGTHS), res


def test_a_kill_inside_a_sequence_resumes_to_the_same_bits(data, one_rank, tmp_path):
    out = str(tmp_path / "out.h5")
    rc, _ = _run(3, data, out, "--causal", env={"RINGMPI_TEST_KILL_IN_BATCH": "2"})
    assert rc != 0
    done = len(glob.glob(out + ".parts/*.done"))
    assert done == 2, done  # sequences 0 and 1 kept, 2 was being computed
    rc, text = _run(3, data, out, "--causal", "--resume")
    assert rc == 0, text
    assert compare(one_rank, out)["identical"]


def test_the_default_mode_differs_in_the_last_bits(data, one_rank, tmp_path):
    """The comparison can fail: the default mode at P = 3 is not bitwise P = 1's."""
    out = str(tmp_path / "out.h5")
    rc, se = launch(3, "run", data, "-o", out, "--causal", "--quiet")[::2]
    assert rc == 0, se
    res = compare(one_rank, out)
    assert not res["identical"] and res["differ"], res
    # the same attention, to rounding: both float32 scores (the reproducible mode computes them
    # in float32 too for float32 inputs, ringmpi.reproducible_float32)
    assert max(d["max"] for d in res["differ"]) < 3e-5


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """Raw features, the projection weights with sinks (H,): the job's way to sinks."""
    from ringmpi.cli.make_data import make_data

    d = tmp_path_factory.mktemp("feat")
    paths = make_data(str(d / "x.h5"), seq_len=300, heads=H, kv_heads=HKV, head_dim=D,
                      features=24, seed=40, values="realistic")  # fmt: skip
    with h5py.File(paths[-1], "r+") as f:
        f["sinks"] = np.linspace(-1.0, 6.0, H)  # the last above most rows' scores
    return paths[0], paths[-1]


@pytest.mark.parametrize(
    "inputs, mods",
    [
        ("qkv", ("--softcap", "4")),
        ("qkv", ("--alibi",)),
        ("features", ()),
        ("features", ("--softcap", "8", "--alibi")),
    ],
    ids=["softcap", "alibi", "sinks", "all-three"],
)
def test_score_modifiers_keep_the_bits_at_p2_and_p3(request, tmp_path, inputs, mods):
    """--softcap, --alibi (on q, k, v inputs) and the weights' sinks (on raw features with
    their projection weights, the job's one way to sinks; with the other two in the last
    case): the outputs at P = 2 (zigzag), P = 3 (striped) and P = 2 in rings of one are
    identical, and the first passes --verify (the dense float64 reference with the same
    modifiers)."""
    if inputs == "qkv":
        src, more = request.getfixturevalue("data"), ()
    else:
        src, weights = request.getfixturevalue("features")
        more = ("--weights", weights)
    outs = []
    for p, flags in ((2, ("--verify",)), (3, ("--layout", "striped")), (2, ("--ring-size", "1"))):
        out = str(tmp_path / f"p{p}-{len(outs)}.h5")
        rc, text = _run(p, src, out, "--causal", *more, *mods, *flags)
        assert rc == 0, text
        outs.append(out)
    with h5py.File(outs[0], "r") as f:
        assert bool(f.attrs["reproducible"]), dict(f.attrs)
        assert (f.attrs.get("sinks") is not None) == (inputs == "features"), dict(f.attrs)
    for other in outs[1:]:
        res = compare(outs[0], other)
        assert res["identical"] and res["datasets"] >= 2, res


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """Sequences with their masks of slices (each builder, a random union with rows that
    see nothing, a cross-attention one): tests/job/test_run_slices.py's input."""
    from job.test_run_slices import references, write_input

    path = str(tmp_path_factory.mktemp("sliced") / "in.h5")
    write_input(path)
    return path, references(path)


def test_masks_of_slices_keep_the_bits(sliced, tmp_path):
    """An input whose sequences carry masks of slices: the outputs at P = 1, at P = 2
    (zigzag) and at P = 3 (the cost-balanced layout) are identical, and the first is within
    the default mode's tolerance of the dense float64 reference under the explicit mask."""
    from job.test_run_slices import check_output

    src, refs = sliced
    outs = []
    for p, flags in ((1, ()), (2, ()), (3, ("--layout", "balanced"))):
        out = str(tmp_path / f"p{p}.h5")
        rc, text = _run(p, src, out, *flags)
        assert rc == 0, text
        outs.append(out)
    assert check_output(outs[0], refs) == []
    for other in outs[1:]:
        res = compare(outs[0], other)
        assert res["identical"] and res["datasets"] == 2 * len(refs), res
