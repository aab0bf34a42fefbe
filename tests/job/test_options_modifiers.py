"""The batch job's score modifiers: --alibi, --alibi-slopes FILE, --softcap C, weights' sinks.

End to end in one process (the numpy tiles: the fused C tiles refuse softcap/ALiBi
until they apply them): the flags reach the tiles, the output's attributes record
them, verify applies them (and fails when the recorded settings are changed), a
resume with other settings is refused, bad flags and files fail before anything
is created.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from ringmpi import reference
from ringmpi.cli.main import main
from ringmpi.cli.make_data import make_data
from ringmpi.job.options import MAX_SLOPES_BYTES, alibi_slopes, read_slopes
from ringmpi.job.plan import InputError
from ringmpi.job.run import run
from ringmpi.job.verify import verify
from ringmpi.spec import AttentionSpec

H, HKV, D = 4, 2, 16


@pytest.fixture(autouse=True)
def numpy_tiles(monkeypatch):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mods") / "p.h5")
    make_data(
        path,
        seq_len=300,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        packed=[100, 1, 199],
        values="realistic",
        seed=5,
    )
    return path


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    d = tmp_path_factory.mktemp("feat")
    paths = make_data(
        str(d / "x.h5"),
        seq_len=257,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        features=24,
        seed=6,
        values="realistic",
    )
    return paths[0], paths[-1]


def test_standard_slopes_follow_the_published_formula():
    """Press et al.: 2^(-8 i / n) for n a power of two; else p of p heads + odd ones of 2p."""
    assert alibi_slopes(8) == tuple(2.0**-i for i in range(1, 9))
    assert alibi_slopes(4) == (2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8)
    assert alibi_slopes(1) == (2.0**-8,)
    assert alibi_slopes(2) == (2.0**-4, 2.0**-8)
    # 6 heads: the 4 of 4 heads, then slopes 1 and 3 of 8 heads
    assert alibi_slopes(6) == (2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3)
    # 12 heads: the 8 of 8 heads, then slopes 1, 3, 5, 7 of 16 heads (2^-0.5 ...)
    want12 = tuple(2.0**-i for i in range(1, 9)) + tuple(2.0 ** -(i / 2) for i in (1, 3, 5, 7))
    assert np.allclose(alibi_slopes(12), want12, rtol=1e-15, atol=0)
    # the paper's closed form for powers of two: start = ratio = 2^(-2^-(log2 n - 3))
    for n in (16, 32, 64):
        start = 2 ** (-(2 ** -(np.log2(n) - 3)))
        assert np.allclose(alibi_slopes(n), [start * start**i for i in range(n)], rtol=1e-14)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            alibi_slopes(bad)


def test_read_slopes_npy_text_and_refusals(tmp_path):
    npy = tmp_path / "s.npy"
    np.save(npy, np.array([0.5, 0.25, 0.125, 1.0], np.float32))
    assert read_slopes(str(npy)) == (0.5, 0.25, 0.125, 1.0)
    txt = tmp_path / "s.txt"
    txt.write_text("# slopes\n0.5, 0.25\n0.125 1e0  # last\n")
    assert read_slopes(str(txt)) == (0.5, 0.25, 0.125, 1.0)
    cases = {
        "pickle.npy": lambda p: np.save(p, np.array([{"a": 1}], dtype=object)),
        "nan.txt": lambda p: p.write_text("0.1 nan"),
        "word.txt": lambda p: p.write_text("0.1 __import__('os')"),
        "2d.npy": lambda p: np.save(p, np.ones((2, 2))),
        "empty.txt": lambda p: p.write_text("# nothing\n"),
        "big.txt": lambda p: p.write_text("1 " * (MAX_SLOPES_BYTES // 2 + 1)),
        "binary.txt": lambda p: p.write_bytes(b"\xff\xfe\x00"),
    }
    for name, make in cases.items():
        p = tmp_path / name
        make(p)
        with pytest.raises(InputError, match=str(p)):
            read_slopes(str(p))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="regular file"):
        read_slopes(str(fifo))  # refused, not a blocking read
    with pytest.raises(InputError, match="cannot read"):
        read_slopes(str(tmp_path / "missing.txt"))


def _attrs(path):
    with h5py.File(path, "r") as f:
        return AttentionSpec.from_attrs(f.attrs), f["out"][...], f["lse"][...]


def test_alibi_softcap_end_to_end(packed, tmp_path, capsys):
    """--alibi --softcap: recorded, equal to the reference with them, verified; resume checks."""
    out = str(tmp_path / "o.h5")
    base = ["run", packed, "-o", out, "--quiet", "--device", "cpu", "--output-mode", "parts"]
    assert main(base + ["--causal", "--alibi", "--softcap", "5"]) == 0, capsys.readouterr().err
    spec, o, lse = _attrs(out)
    assert spec.alibi_slopes == alibi_slopes(H) and spec.softcap == 5.0 and spec.causal
    with h5py.File(packed, "r") as f:
        q, k, v, cu = (f[n][...] for n in ("q", "k", "v", "cu_seqlens"))
    ref, ref_lse = reference.attention(
        q, k, v, True, cu_seqlens=cu, alibi_slopes=alibi_slopes(H), softcap=5.0
    )
    plain, _ = reference.attention(q, k, v, True, cu_seqlens=cu)
    assert np.abs(o - ref).max() < 1e-4 < np.abs(plain - ref).max()
    res = verify(out, [packed], None, None, quiet=True)
    assert res["ok"] and res["status"] == "passed", res
    # a resume under other modifiers is refused (the fingerprint holds them)
    for other in (["--alibi", "--softcap", "4"], ["--softcap", "5"], []):
        assert main(base + ["--resume", "--causal"] + other) == 2
        err = capsys.readouterr().err
        assert "softcap" in err or "alibi" in err, err
    assert main(base + ["--resume", "--causal", "--alibi", "--softcap", "5"]) == 0
    # verify applies what the output records: another softcap makes it fail
    with h5py.File(out, "r+") as f:
        f.attrs["softcap"] = 2.0
    res = verify(out, [packed], None, None, quiet=True)
    assert not res["ok"], res


def test_alibi_slopes_file(packed, tmp_path, capsys):
    slopes = tmp_path / "s.txt"
    slopes.write_text("0.3 0.2 0.1 0.0\n")
    out = str(tmp_path / "o.h5")
    base = ["run", packed, "-o", out, "--quiet", "--device", "cpu"]
    assert main(base + ["--alibi-slopes", str(slopes)]) == 0, capsys.readouterr().err
    assert _attrs(out)[0].alibi_slopes == (0.3, 0.2, 0.1, 0.0)
    assert verify(out, [packed], None, None, quiet=True)["ok"]
    short = tmp_path / "short.txt"
    short.write_text("0.3 0.2\n")
    out2 = tmp_path / "o2.h5"
    assert main(["run", packed, "-o", str(out2), "--quiet", "--alibi-slopes", str(short)]) == 2
    assert "H=4" in capsys.readouterr().err
    assert not out2.exists() and not os.path.exists(str(out2) + ".parts")
    with pytest.raises(SystemExit) as e:
        main(["run", packed, "-o", str(out2), "--alibi", "--alibi-slopes", str(slopes)])
    assert e.value.code == 2
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit) as e:
            main(["run", packed, "-o", str(out2), "--softcap", bad])
        assert e.value.code == 2 and "--softcap" in capsys.readouterr().err
    assert not out2.exists()


def test_sinks_from_the_weights_file(features, tmp_path):
    x, wpath = features
    sinks = np.array([1.0, -0.5, 2.0, 0.25])
    w2 = str(tmp_path / "w.h5")
    with h5py.File(wpath, "r") as src, h5py.File(w2, "w") as dst:
        for n in src:
            dst[n] = src[n][...]
        dst.attrs.update(src.attrs)
        dst["sinks"] = sinks
    out = str(tmp_path / "o.h5")
    run([x], out, AttentionSpec(causal=True), weights=w2, device="cpu", quiet=True)
    spec, o, lse = _attrs(out)
    assert spec.sinks == tuple(sinks)
    res = verify(out, [x], w2, None, quiet=True)
    assert res["ok"] and res["status"] == "passed", res
    plain = str(tmp_path / "plain.h5")
    run([x], plain, AttentionSpec(causal=True), weights=wpath, device="cpu", quiet=True)
    assert np.abs(_attrs(plain)[2] - lse).min() > 1e-6  # every lse includes its sink
    with h5py.File(w2, "r+") as f:
        del f["sinks"]
        f["sinks"] = sinks[:3]
    with pytest.raises(InputError, match="sinks must hold num_heads=4"):
        run([x], str(tmp_path / "bad.h5"), causal=True, weights=w2, device="cpu", quiet=True)
    assert not (tmp_path / "bad.h5").exists()


def test_job_on_three_ranks_then_verify_on_two(packed, tmp_path):
    """mpiexec -n 3 ringmpi run --alibi --softcap (zigzag, packed), then ringmpi verify -n 2."""
    from cli.test_main_mpi import launch

    out = str(tmp_path / "o.h5")
    env = {"RINGMPI_CPU_KERNEL": "numpy"}
    rc, _, se, _ = launch(
        3,
        "run",
        packed,
        "-o",
        out,
        "--causal",
        "--alibi",
        "--softcap",
        "3",
        "--window",
        "50,0",
        "--quiet",
        "--device",
        "cpu",
        env=env,
    )
    assert rc == 0, se
    spec, o, _ = _attrs(out)
    assert spec.softcap == 3.0 and spec.alibi_slopes == alibi_slopes(H) and spec.window == (50, 0)
    with h5py.File(packed, "r") as f:
        q, k, v, cu = (f[n][...] for n in ("q", "k", "v", "cu_seqlens"))
    ref, _ = reference.attention(
        q, k, v, True, cu_seqlens=cu, window=(50, 0), alibi_slopes=alibi_slopes(H), softcap=3.0
    )
    assert np.abs(o - ref).max() < 1e-4
    rc, so, se, _ = launch(2, "verify", out, packed, env=env)
    assert rc == 0, so + se


def test_tiles_that_cannot_apply_them_refuse_before_any_file(packed, tmp_path, monkeypatch, capsys):
    """The fused tiles (where they do not apply softcap/ALiBi yet): exit 2, nothing created."""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "auto")
    from ringmpi.backend import select

    be = select(np.zeros(0))
    out = tmp_path / "o.h5"
    rc = main(["run", packed, "-o", str(out), "--quiet", "--device", "cpu", "--softcap", "5"])
    err = capsys.readouterr().err
    if "softcap" in be.forward_mods and "softcap" in be.backward_mods:
        assert rc == 0, err  # the tiles apply it: the run succeeds
        return
    assert rc == 2 and "--softcap" in err and "RINGMPI_CPU_KERNEL=numpy" in err, err
    assert not out.exists() and not os.path.exists(str(out) + ".parts")
