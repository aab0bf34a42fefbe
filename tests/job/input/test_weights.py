"""Projection biases and the weights convention (issue 26, item 1), on one rank in-process."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from ringmpi import reference
from ringmpi.cli.make_data import make_data
from ringmpi.job.input.scan import scan
from ringmpi.job.plan import InputError
from ringmpi.job.run import run
from ringmpi.job.verify import verify

H, HKV, D, F, S = 4, 2, 16, 24, 300


def _features(tmp_path, bias=True, dtype="float64"):
    x, w = make_data(
        str(tmp_path / "x.h5"),
        seq_len=S,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        features=F,
        bias=bias,
        dtype=dtype,
        seed=3,
    )
    return x, w


def _projected(x_path, w_path):
    """q, k, v (S, H or Hkv, D) in float64 with the biases: the test's own ground truth."""
    with h5py.File(x_path, "r") as f:
        x = f["x"][...].astype(np.float64)
    with h5py.File(w_path, "r") as f:
        out = [x @ f["w" + n][...] + f["b" + n][...] for n in "qkv"]
    return [a.reshape(S, -1, D) for a in out]


def test_make_data_biases_have_nonzero_means(tmp_path):
    _, w = _features(tmp_path)
    with h5py.File(w, "r") as f:
        assert f["bq"].shape == (H * D,) and f["bk"].shape == (HKV * D,) == f["bv"].shape
        assert abs(float(np.mean(f["bq"][...]))) > 0.1
    with pytest.raises(ValueError, match="bias needs features"):
        make_data(str(tmp_path / "y.h5"), seq_len=8, bias=True)


def test_job_and_verify_use_the_biases(tmp_path):
    x, w = _features(tmp_path)
    out = str(tmp_path / "out.h5")
    run([x], out, weights=w, causal=True, quiet=True, output_mode="parts")
    q, k, v = _projected(x, w)
    ref, _ = reference.attention(q, k, v, causal=True)
    with h5py.File(out, "r") as f:
        got = f["out"][...]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-11)
    # the result without biases differs clearly: a job dropping them would fail above
    with h5py.File(w, "r") as f:
        xw = h5py.File(x, "r")["x"][...] @ f["wq"][...]
    assert np.abs(xw.reshape(S, H, D) - q).max() > 0.1
    res = verify(out, [x], w, max_tokens=S)
    assert res["status"] == "passed", res


def test_verify_fails_an_output_made_without_the_biases(tmp_path):
    x, w = _features(tmp_path)
    out = str(tmp_path / "out.h5")
    x0, w0 = make_data(
        str(tmp_path / "x0.h5"),
        seq_len=S,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        features=F,
        bias=False,
        dtype="float64",
        seed=3,
    )
    run([x0], out, weights=w0, causal=True, quiet=True, output_mode="parts")  # no biases
    res = verify(out, [x], w, max_tokens=S)  # checked against the weights with biases
    assert res["status"] == "failed"


def _weights_file(path, **arrays):
    with h5py.File(path, "w") as f:
        f.attrs["num_heads"], f.attrs["num_kv_heads"] = H, HKV
        for name, a in arrays.items():
            f.create_dataset(name, data=a)
    return str(path)


def _arrays(rng, f=F, torch=False, bias=True):
    shapes = {"wq": (f, H * D), "wk": (f, HKV * D), "wv": (f, HKV * D)}
    out = {n: rng.standard_normal(s[::-1] if torch else s) for n, s in shapes.items()}
    if bias:
        out.update(
            bq=rng.standard_normal(H * D),
            bk=rng.standard_normal(HKV * D),
            bv=rng.standard_normal(HKV * D),
        )
    return out


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda a: a.update(extra=a["bq"]), ["'extra'", "does not use"]),
        (lambda a: a.pop("bv"), ["not all of bq, bk, bv"]),
        (lambda a: a.update(bq=a["bq"][:-1]), ["bias bq", f"({H * D},)"]),
    ],
)
def test_bad_weights_files_are_refused_in_one_line(tmp_path, rng, change, words):
    x, _ = _features(tmp_path)
    a = _arrays(rng)
    change(a)
    w = _weights_file(tmp_path / "w.h5", **a)
    with pytest.raises(InputError) as e:
        scan([x], w)
    msg = str(e.value)
    assert "\n" not in msg and all(word in msg for word in words), msg


def test_torch_out_in_weights_are_refused(tmp_path, rng):
    x, _ = _features(tmp_path)
    w = _weights_file(tmp_path / "w.h5", **_arrays(rng, torch=True))
    with pytest.raises(InputError, match=r"torch Linear weights \(out, in\).*weight\.T"):
        scan([x], w)
    # multi-head (H == Hkv) torch weights, (H*D, F) each: only the biases' length tells
    t = {n: rng.standard_normal((H * D, F)) for n in ("wq", "wk", "wv")}
    t.update({b: rng.standard_normal(H * D) for b in ("bq", "bk", "bv")})
    w2 = _weights_file(tmp_path / "w2.h5", **t)
    with h5py.File(w2, "a") as f:
        f.attrs["num_kv_heads"] = H
    with pytest.raises(InputError, match="torch Linear"):
        scan([x], w2)


def test_x_features_mismatch_names_the_convention(tmp_path, rng):
    x, _ = _features(tmp_path)
    a = _arrays(rng, f=F + 1)
    w = _weights_file(tmp_path / "w.h5", **a)
    with pytest.raises(InputError, match=r"\(in, out\)"):
        scan([x], w)
