"""The job side of the AttentionSpec (issue 21): run(inputs, output, spec, options), the
flags generated from the spec's fields, the spec recorded in the output and read by verify."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

from ringmpi.cli.main import main
from ringmpi.cli.make_data import make_data
from ringmpi.cli.parser import build_parser, spec_from_args
from ringmpi.job.options import JobOptions, split_keywords
from ringmpi.job.plan import InputError
from ringmpi.job.run import run
from ringmpi.job.verify import verify
from ringmpi.spec import AttentionSpec, cli_fields


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec") / "p.h5")
    make_data(
        path,
        seq_len=300,
        heads=4,
        kv_heads=2,
        head_dim=16,
        packed=[100, 1, 199],
        values="realistic",
        seed=3,
    )
    return path


def _datasets(path: str) -> dict:
    with h5py.File(path, "r") as f:
        return {k: f[k][...].tobytes() for k in ("out", "lse")}


def test_spec_and_options_equal_the_keyword_form(packed, tmp_path):
    spec = AttentionSpec(causal=True, window=(40, 0), layout="striped", scale=0.2)
    opts = JobOptions(device="cpu", quiet=True, output_mode="parts")
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    sa = run([packed], a, spec, opts)
    sb = run(
        [packed],
        b,
        causal=True,
        window=(40, 0),
        layout="striped",
        scale=0.2,
        device="cpu",
        quiet=True,
        output_mode="parts",
    )
    assert _datasets(a) == _datasets(b)
    assert sa["layout"] == sb["layout"] == "striped" and sa["causal"] and sb["causal"]
    with h5py.File(a, "r") as f:  # the spec the run used, readable back as one value
        got = AttentionSpec.from_attrs(f.attrs)
    assert got == dataclasses.replace(spec, scale=0.2)
    res = verify(a, [packed], None, None, quiet=True)
    assert res["ok"] and res["status"] == "passed", res


def test_spec_default_scale_is_recorded_resolved(packed, tmp_path):
    out = str(tmp_path / "o.h5")
    run([packed], out, AttentionSpec(causal=True), JobOptions(device="cpu", quiet=True))
    with h5py.File(out, "r") as f:
        got = AttentionSpec.from_attrs(f.attrs)
        assert bool(f.attrs["scale_is_default"])
    assert got == AttentionSpec(causal=True, scale=16**-0.5)


def test_every_flag_of_the_spec_comes_from_its_fields():
    names = [n for n, _f, _k in cli_fields()]
    assert names == ["causal", "window", "scale", "layout", "reproducible", "softcap"]
    run_parser = build_parser()._subparsers._group_actions[0].choices["run"]
    flags = {s for a in run_parser._actions for s in a.option_strings}
    assert {f for _n, f, _k in cli_fields()} <= flags
    args = build_parser().parse_args(
        [
            "run",
            "x.h5",
            "-o",
            "o.h5",
            "--causal",
            "--window",
            "7",
            "--scale",
            "0.5",
            "--layout",
            "contiguous",
        ]
    )
    assert spec_from_args(args) == AttentionSpec(
        causal=True, window=(7, 7), scale=0.5, layout="contiguous"
    )
    assert spec_from_args(build_parser().parse_args(["run", "x.h5", "-o", "o.h5"])) == (
        AttentionSpec()
    )


def test_the_run_flags_default_to_the_job_options_defaults():
    from ringmpi.job.options import options_from_args

    args = build_parser().parse_args(["run", "x.h5", "-o", "o.h5"])
    assert options_from_args(args) == JobOptions()
    args = build_parser().parse_args(
        [
            "run",
            "x.h5",
            "-o",
            "o.h5",
            "--no-prefetch",
            "--strided-read",
            "blocks",
            "--ring-size",
            "2",
            "--device",
            "cpu",
        ]
    )
    opts = options_from_args(args)
    assert (opts.prefetch, opts.strided, opts.ring_size, opts.device) == (False, "blocks", 2, "cpu")


def test_keywords_and_objects_do_not_mix():
    with pytest.raises(ValueError, match="either spec= or"):
        split_keywords(AttentionSpec(causal=True), None, {"window": (3, 0)})
    with pytest.raises(TypeError, match="either options= or"):
        split_keywords(None, JobOptions(), {"device": "cpu"})
    with pytest.raises(TypeError, match="unexpected keyword.*bogus"):
        split_keywords(None, None, {"bogus": 1})
    with pytest.raises(TypeError, match="cu_seqlens"):  # from the inputs, not the job
        split_keywords(None, None, {"cu_seqlens": [0, 4]})
    with pytest.raises(TypeError, match="slices"):  # slices: per sequence, from the input
        split_keywords(None, None, {"slices": [(0, 1, 0, 1, "full")]})
    with pytest.raises(InputError, match="^slices: the batch job"):
        split_keywords(AttentionSpec(slices=[(0, 1, 0, 1, "full")]), None, {})
    with pytest.raises(InputError, match="^--window: "):
        split_keywords(None, None, {"window": (-3, 2)})
    with pytest.raises(InputError, match="^--layout: "):
        split_keywords(AttentionSpec(layout="diagonal"), None, {})
    spec, opts = split_keywords(None, None, {"causal": 1, "ring_size": "auto"})
    assert spec == AttentionSpec(causal=True) and opts.ring_size == "auto"


def test_cli_refuses_a_bad_window_before_anything_is_made(packed, tmp_path, capsys):
    out = tmp_path / "o.h5"
    with pytest.raises(SystemExit) as e:
        main(["run", packed, "-o", str(out), "--window", "x", "--quiet"])
    assert e.value.code == 2
    assert "--window" in capsys.readouterr().err
    assert not out.exists()


def test_resume_refuses_another_spec(packed, tmp_path, capsys):
    out = str(tmp_path / "o.h5")
    base = ["run", packed, "-o", out, "--quiet", "--device", "cpu", "--output-mode", "parts"]
    assert main(base + ["--causal"]) == 0
    assert main(base + ["--resume", "--causal", "--window", "5"]) == 2
    err = capsys.readouterr().err
    assert "window" in err, err
    assert np.isfinite(np.frombuffer(_datasets(out)["out"], np.float32)).all()


def test_rerun_in_the_inputs_folder_with_relative_paths(packed, tmp_path, monkeypatch, capsys):
    """--overwrite and --resume with relative names (the parts folder then exists): the
    input's folder '' made samefile fail with FileNotFoundError before this was fixed."""
    import os
    import shutil

    shutil.copy(packed, tmp_path / "in.h5")
    monkeypatch.chdir(tmp_path)
    base = ["run", "in.h5", "-o", "out.h5", "--quiet", "--device", "cpu", "--output-mode", "parts"]
    assert main(base) == 0
    first = _datasets("out.h5")
    assert main(base + ["--overwrite"]) == 0, capsys.readouterr().err
    assert main(base + ["--resume"]) == 0, capsys.readouterr().err
    assert _datasets("out.h5") == first and os.path.isdir("out.h5.parts")
