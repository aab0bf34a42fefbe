"""``ringmpi run`` killed mid-sequence and resumed from its checkpoints (issue 26 item 4).

One long sequence on a ring of 4 ranks (4 ring steps), checkpoints every step,
SIGKILL of ring rank 0 after step 2 of 4 (``RINGMPI_TEST_KILL_AT_STEP``), then
``--resume``: it says where it resumes, recomputes 2 of the 4 steps (read from
the summary) and writes the same bytes as an uninterrupted run. Damaged and
foreign checkpoints are ignored with a warning and the sequence is recomputed,
still to the same bytes. Launches mpiexec as a subprocess (unmarked: runs in the
single-rank pytest).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil

import h5py
import numpy as np
import pytest
from cli.test_main_mpi import launch

from ringmpi.cli.make_data import make_data
from ringmpi.job.output import checkpoint as C
from ringmpi.reference import attention

P, S, H, HKV, D = 4, 1203, 4, 2, 32
RESUME = "resuming at ring step {s}/4 from a checkpoint"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The input, an uninterrupted run's digests and the run arguments."""
    d = tmp_path_factory.mktemp("ckpt")
    inp = make_data(
        str(d / "in.h5"), seq_len=S, heads=H, kv_heads=HKV, head_dim=D, values="realistic", seed=11
    )
    os.mkdir(d / "want")
    out = str(d / "want" / "out.h5")
    args = ["run", *inp, "--causal", "--layout", "zigzag", "--device", "cpu"]
    rc, _, se, _ = launch(P, *args, "-o", out, "--checkpoint-every", "0", "--quiet")
    assert rc == 0, se
    assert not glob.glob(out + ".parts/*.ckpt")
    with h5py.File(inp[0], "r") as f:  # the run itself is exact (dense float64 reference)
        q, k, v = (f[n][...].astype(np.float64) for n in ("q", "k", "v"))
    ref, ref_lse = attention(q, k, v, causal=True)
    with h5py.File(out, "r") as f:
        got, lse = f["out"][...], f["lse"][...]
    assert np.abs(got - ref).max() < 5e-5 * max(1.0, np.abs(ref).max())
    assert np.abs(lse - ref_lse).max() < 5e-5 * max(1.0, np.abs(ref_lse).max())
    return {"dir": d, "args": args, "want": _digests(out)}


def _digests(out: str) -> dict:
    files = [out, *sorted(glob.glob(out + ".parts/*"))]
    return {os.path.basename(f): hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files}


def _killed(job, name: str, step: int = 2, extra=()) -> str:
    """A run killed after ring step ``step`` of its one sequence, checkpointing every step."""
    os.mkdir(job["dir"] / name)
    out = str(job["dir"] / name / "out.h5")  # the same name as the reference run's
    rc, _, se, _ = launch(
        P,
        *job["args"],
        "-o",
        out,
        "--checkpoint-every",
        "1e-9",
        "--quiet",
        *extra,
        env={"RINGMPI_TEST_KILL_AT_STEP": f"0:{step}"},
    )
    assert rc != 0, se
    assert not os.path.exists(out)
    names = sorted(os.path.basename(p) for p in glob.glob(out + ".parts/*.ckpt"))
    # steps 1 and 2 saved, in slots 0 and 1, by every rank
    assert names == sorted(C.ckpt_name(0, r, s) for r in range(P) for s in (0, 1)), names
    return out


def _resume(job, out: str) -> tuple:
    summary = out + ".json"
    rc, so, se, _ = launch(
        P,
        *job["args"],
        "-o",
        out,
        "--checkpoint-every",
        "1e-9",
        "--resume",
        "--summary-json",
        summary,
    )
    assert rc == 0, se
    with open(summary) as fh:
        timing = json.load(fh)["timings"]
    assert len(timing) == 1
    assert _digests(out) == job["want"]  # bitwise the uninterrupted run's output
    assert not glob.glob(out + ".parts/*.ckpt")  # removed once the sequence is written
    return timing[0], se


def test_kill_at_half_then_resume_from_the_checkpoint(job):
    out = _killed(job, "half")
    t, err = _resume(job, out)
    assert RESUME.format(s=2) in err, err
    assert (t["ring_steps"], t["ring_steps_resumed"]) == (4, 2)
    recomputed = (t["ring_steps"] - t["ring_steps_resumed"]) / t["ring_steps"]
    assert recomputed == 0.5


def test_a_damaged_checkpoint_on_one_rank_falls_back_to_the_step_before(job):
    out = _killed(job, "damaged")
    # rank 2's step-2 checkpoint (slot 1) loses a byte of its state: its step 1 still holds
    p = os.path.join(out + ".parts", C.ckpt_name(0, 2, 1))
    raw = bytearray(open(p, "rb").read())
    raw[-1000] ^= 0x10
    with open(p, "wb") as fh:
        fh.write(raw)
    t, err = _resume(job, out)
    assert f"{p}: checkpoint ignored (checksum mismatch (damaged))" in err, err
    assert RESUME.format(s=1) in err, err
    assert t["ring_steps_resumed"] == 1


def test_damaged_and_foreign_checkpoints_are_recomputed(job):
    out = _killed(job, "bad")
    parts = out + ".parts"
    for slot in (0, 1):  # rank 1: both slots cut short
        p = os.path.join(parts, C.ckpt_name(0, 1, slot))
        with open(p, "r+b") as fh:
            fh.truncate(os.path.getsize(p) - 64)
    t, err = _resume(job, out)
    assert "checkpoint ignored (truncated or padded)" in err, err
    assert "resuming at ring step" not in err and t["ring_steps_resumed"] == 0
    # checkpoints of a run with other settings (another scale), planted under this run's names
    other = _killed(job, "other", extra=("--scale", "0.25"))
    mine = _killed(job, "foreign")
    for r in range(P):
        for slot in (0, 1):
            name = C.ckpt_name(0, r, slot)
            shutil.copyfile(
                os.path.join(other + ".parts", name), os.path.join(mine + ".parts", name)
            )
    t, err = _resume(job, mine)
    assert "made by another run or for another place (run differs)" in err, err
    assert "resuming at ring step" not in err and t["ring_steps_resumed"] == 0


def test_two_rings_resume_their_own_sequences(tmp_path):
    """--ring-size 2 on 4 ranks: the ring of sequence 0 is killed after step 1 of 2 and resumes."""
    inp = make_data(
        str(tmp_path / "in.h5"),
        seq_len=601,
        heads=H,
        kv_heads=HKV,
        head_dim=D,
        sequences=2,
        values="realistic",
        seed=12,
    )
    args = ["run", *inp, "--causal", "--device", "cpu", "--ring-size", "2"]
    outs = {}
    for name in ("want", "killed"):
        os.mkdir(tmp_path / name)
        outs[name] = str(tmp_path / name / "out.h5")
    rc, _, se, _ = launch(P, *args, "-o", outs["want"], "--quiet")
    assert rc == 0, se
    env = {"RINGMPI_TEST_KILL_AT_STEP": "0:1"}
    rc, _, se, _ = launch(
        P, *args, "-o", outs["killed"], "--checkpoint-every", "1e-9", "--quiet", env=env
    )
    assert rc != 0, se
    held = glob.glob(outs["killed"] + ".parts/s000000.r*.c0.ckpt")
    assert sorted(os.path.basename(p) for p in held) == [C.ckpt_name(0, r, 0) for r in (0, 1)]
    rc, _, se, _ = launch(P, *args, "-o", outs["killed"], "--resume")
    assert rc == 0, se
    assert "sequence seq000: resuming at ring step 1/2 from a checkpoint" in se, se
    assert _digests(outs["killed"]) == _digests(outs["want"])
    assert not glob.glob(outs["killed"] + ".parts/*.ckpt")


def test_sigterm_mid_sequence_then_resume(job):
    """SIGTERM to every rank after step 3 of 4 (a wall-time limit): exit 143, then resume at 3/4."""
    os.mkdir(job["dir"] / "term")
    out = str(job["dir"] / "term" / "out.h5")
    rc, _, se, _ = launch(
        P,
        *job["args"],
        "-o",
        out,
        "--checkpoint-every",
        "1e-9",
        env={"RINGMPI_TEST_KILL_AT_STEP": "0:3:TERM"},
    )
    assert rc == 143, se
    assert "interrupted (SIGTERM) at sequence 1/1" in se, se
    assert not os.path.exists(out)
    t, err = _resume(job, out)
    assert RESUME.format(s=3) in err, err
    assert (t["ring_steps"], t["ring_steps_resumed"]) == (4, 3)
