"""ringmpi.job.output.checkpoint on one process: the file format, its checks, save/resume rules."""

import os
import stat

import numpy as np
import pytest

from ringmpi.job.output import checkpoint as C

META = {"layout": "zigzag", "causal": True, "inputs": [["/x.h5", 10, 1, 2]], "nranks": 4}


def _state(rng, dtype=np.float32, b=1, h=3, s=40, d=8):
    # shaped like a real running state: acc of values with a mean, m around the scores, l > 1
    acc = (rng.normal(2.0, 0.1, (b, h, s, d)) * 50).astype(dtype)
    m = rng.normal(4.0, 0.5, (b, h, s)).astype(dtype)
    l = rng.uniform(20, 60, (b, h, s)).astype(dtype)
    return acc, m, l


def _expect(state, **kw):
    e = dict(
        sequence=3,
        name="seq3",
        rank=1,
        ring_size=4,
        run=C.run_digest(META),
        shapes=[list(x.shape) for x in state],
        dtype=str(state[0].dtype),
    )
    e.update(kw)
    return e


def _save(path, state, done=2, **kw):
    head = _expect(state, **kw)
    del head["shapes"], head["dtype"]
    C.save(str(path), dict(head, done=done), state)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_is_bitwise_and_private(tmp_path, dtype):
    st = _state(np.random.default_rng(0), dtype)
    p = tmp_path / C.ckpt_name(3, 1, 0)
    _save(p, st)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    got, why = C.load(str(p), _expect(st))
    assert why is None and got[0] == 2
    for a, b in zip(got[1:], st):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert [n for n in os.listdir(tmp_path)] == [p.name]  # no temporary left


def test_damaged_and_foreign_files_are_refused(tmp_path):
    st = _state(np.random.default_rng(1))
    p = tmp_path / "c.ckpt"
    _save(p, st)
    raw = p.read_bytes()
    cases = {
        "flipped payload byte": (raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:], "checksum"),
        "flipped checksum byte": (raw[:-1] + bytes([raw[-1] ^ 1]), "checksum"),
        "truncated": (raw[:-7], "truncated"),
        "padded": (raw + b"\0", "truncated or padded"),
        "not ours": (b"HDF5" + raw[4:], "not a ringmpi checkpoint"),
        "empty": (b"", "not a ringmpi checkpoint"),
    }
    for what, (data, why) in cases.items():
        q = tmp_path / f"{what}.ckpt"
        q.write_bytes(data)
        os.chmod(q, 0o600)
        got, msg = C.load(str(q), _expect(st))
        assert got is None and why in msg, (what, msg)
    # a valid file made for something else: another run, sequence, rank, ring size, shape
    other = dict(META, causal=False)
    for key, val in (
        ("run", C.run_digest(other)),
        ("sequence", 4),
        ("name", "seq4"),
        ("rank", 0),
        ("ring_size", 8),
        ("shapes", [[1, 3, 41, 8], [1, 3, 41], [1, 3, 41]]),
        ("dtype", "float64"),
    ):
        got, msg = C.load(str(p), _expect(st, **{key: val}))
        assert got is None and f"{key} differs" in msg, (key, msg)
    assert C.load(str(tmp_path / "absent.ckpt"), _expect(st)) == (None, None)


def test_symlink_and_shared_files_are_refused(tmp_path):
    st = _state(np.random.default_rng(2))
    p = tmp_path / "real.ckpt"
    _save(p, st)
    link = tmp_path / "link.ckpt"
    link.symlink_to(p)
    got, msg = C.load(str(link), _expect(st))
    assert got is None and "cannot open" in msg
    os.chmod(p, 0o622)
    got, msg = C.load(str(p), _expect(st))
    assert got is None and "writable by group or others" in msg


def test_bad_step_in_header_is_refused(tmp_path):
    st = _state(np.random.default_rng(3))
    for done in (0, 5, "2"):
        p = tmp_path / f"d{done}.ckpt"
        _save(p, st, done=done)
        got, msg = C.load(str(p), _expect(st))
        assert got is None and "bad ring step" in msg


def _ckpts(tmp_path, every=1e-9, resume=False, todo=(3,), rank=1, size=4, finished=()):
    class FakeRing:  # the one-rank stand-in of a ring communicator: rank and size only
        def Get_rank(self):
            return rank

        def Get_size(self):
            return size

        def allgather(self, x):
            return [x]

        def bcast(self, x, root=0):
            return x

        def Barrier(self):
            pass

    return C.Checkpoints(
        str(tmp_path), FakeRing(), META, every, resume, todo=list(todo), finished=finished
    )


def test_saves_alternate_slots_and_resume_takes_the_latest(tmp_path, capsys):
    rng = np.random.default_rng(4)
    st = _state(rng)
    shapes, dt = [x.shape for x in st], str(st[0].dtype)
    ck = _ckpts(tmp_path)
    assert ck.start(3, "seq3", shapes, dt) is None
    states = {}
    for done in (1, 2, 3, 4):  # step 4 = the ring's last: never saved
        states[done] = tuple(x + done for x in st)
        ck.on_state(done, *states[done])
    assert ck.saved == 3
    names = sorted(os.listdir(tmp_path))
    assert names == [C.ckpt_name(3, 1, 0), C.ckpt_name(3, 1, 1)]
    again = _ckpts(tmp_path, resume=True)
    got = again.start(3, "seq3", shapes, dt)
    assert got[0] == 3 and all(a.tobytes() == b.tobytes() for a, b in zip(got[1:], states[3]))
    # the next save goes to the other slot: the one resumed from stays until it is replaced
    slot_of_3 = [
        s for s in (0, 1) if C.load(str(tmp_path / C.ckpt_name(3, 1, s)), again.expect)[0][0] == 3
    ][0]
    again.on_state(3, *states[3])
    assert C.load(str(tmp_path / C.ckpt_name(3, 1, slot_of_3)), again.expect)[0][0] == 3
    again.finish(3)
    assert os.listdir(tmp_path) == []
    assert "warning" not in capsys.readouterr().err


def test_damaged_latest_falls_back_to_the_older_slot_with_a_warning(tmp_path, capsys):
    st = _state(np.random.default_rng(5))
    shapes, dt = [x.shape for x in st], str(st[0].dtype)
    ck = _ckpts(tmp_path)
    ck.start(3, "seq3", shapes, dt)
    ck.on_state(1, *st)  # slot 0
    ck.on_state(2, *st)  # slot 1
    p = tmp_path / C.ckpt_name(3, 1, 1)
    raw = bytearray(p.read_bytes())
    raw[-200] ^= 0xFF  # in the payload
    p.write_bytes(bytes(raw))
    got = _ckpts(tmp_path, resume=True).start(3, "seq3", shapes, dt)
    assert got is not None and got[0] == 1
    err = capsys.readouterr().err
    assert "checkpoint ignored (checksum mismatch (damaged))" in err and str(p) in err


def test_off_never_saves_and_a_fresh_run_removes_stale_files(tmp_path):
    st = _state(np.random.default_rng(6))
    shapes, dt = [x.shape for x in st], str(st[0].dtype)
    ck = _ckpts(tmp_path, every=0)
    assert not ck.on
    ck.start(3, "seq3", shapes, dt)
    ck.on_state(1, *st)
    assert os.listdir(tmp_path) == []
    ck = _ckpts(tmp_path, every=1e-9)
    ck.start(3, "seq3", shapes, dt)
    ck.on_state(1, *st)
    (tmp_path / f".{C.ckpt_name(3, 1, 1)}.0123456789ab.tmp").write_bytes(b"half")
    (tmp_path / C.ckpt_name(5, 1, 0)).write_bytes(b"another sequence")
    _ckpts(tmp_path, resume=False, todo=(3,))  # a fresh run: this rank's files of its sequences go
    assert os.listdir(tmp_path) == [C.ckpt_name(5, 1, 0)]


def test_the_interval_is_respected(tmp_path, monkeypatch):
    st = _state(np.random.default_rng(7))
    now = [1000.0]
    monkeypatch.setattr(C.time, "monotonic", lambda: now[0])
    ck = _ckpts(tmp_path, every=60.0, size=8)
    ck.start(3, "seq3", [x.shape for x in st], str(st[0].dtype))
    for done, t in ((1, 1030.0), (2, 1061.0), (3, 1100.0), (4, 1115.0), (5, 1200.0)):
        now[0] = t
        ck.on_state(done, *st)
    assert ck.saved == 2  # at step 2 (61 s) and step 5 (139 s after step 2's)


def test_a_failed_save_warns_once_and_goes_on(tmp_path, capsys):
    st = _state(np.random.default_rng(8))
    ck = _ckpts(tmp_path / "gone")
    ck.start(3, "seq3", [x.shape for x in st], str(st[0].dtype))
    ck.on_state(1, *st)
    ck.on_state(2, *st)
    err = capsys.readouterr().err
    assert ck.saved == 0 and err.count("cannot save a checkpoint") == 1


def test_a_resumed_run_keeps_checkpoints_but_not_temporaries_or_finished_ones(tmp_path):
    st = _state(np.random.default_rng(9))
    ck = _ckpts(tmp_path, todo=(3, 5))
    for i in (3, 5):
        ck.start(i, f"seq{i}", [x.shape for x in st], str(st[0].dtype))
        ck.on_state(1, *st)
    tmp = tmp_path / f".{C.ckpt_name(3, 1, 1)}.0123456789ab.tmp"
    tmp.write_bytes(b"half")
    other_rank = tmp_path / C.ckpt_name(3, 2, 0)
    other_rank.write_bytes(b"rank 2's")
    _ckpts(tmp_path, resume=True, todo=(3,), finished={5})
    assert sorted(os.listdir(tmp_path)) == sorted([C.ckpt_name(3, 1, 0), other_rank.name])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_bad_interval_is_refused(tmp_path, bad, capsys):
    from ringmpi.cli.parser import build_parser
    from ringmpi.job.plan import InputError

    with pytest.raises(InputError, match="--checkpoint-every must be a number of seconds >= 0"):
        _ckpts(tmp_path, every=bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "in.h5", "-o", "o.h5", "--checkpoint-every", str(bad)])
    assert "--checkpoint-every: expected a number of seconds >= 0" in capsys.readouterr().err
    args = build_parser().parse_args(["run", "in.h5", "-o", "o.h5", "--checkpoint-every", "0"])
    assert args.checkpoint_every == 0.0
