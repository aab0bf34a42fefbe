"""Mid-sequence checkpoints of the batch job: a rank's ring state, saved between ring steps.

A long sequence takes P ring steps; after each one every rank's running
online-softmax state (acc, m, l: :mod:`ringmpi.softmax`) is all it needs to go
on (the fused C and CUDA tiles keep their Kahan compensations inside one call
and fold them into acc and l before returning, so nothing else carries over).
``ringmpi run --checkpoint-every SECONDS`` saves that state at most every
SECONDS (default 600; ``0``: never), and ``--resume`` continues an interrupted
sequence from the last ring step every rank of its ring saved, through the
checkpoint seam of :func:`ringmpi.attention.resumable_ring_attention` (``on_state``,
``start``): the same tile calls on the same blocks in the same order, so the output is
bitwise that of an uninterrupted run.

Files, in the output's parts folder (owned by this user, not writable by others:
:func:`ringmpi.job.output.layout.open_parts_dir`), two slots per rank and sequence, used
in turn so that a kill during a save leaves the previous one:

    s000003.r00002.c0.ckpt    rank 2's state of sequence 3 (slot 0), mode 0600

    magic (16 bytes) | header length (8, little-endian) | header (JSON)
    | acc | m | l (raw, C order) | SHA-256 of everything before (32)

The header holds the sequence (index and name), the ring rank and size, the
ring steps done, the arrays' shapes and dtype, and the SHA-256 of the run's
fingerprint (inputs with their sizes and times, options, ranks, device, tile
and ISA: what the manifest holds). A file is written to an exclusive temporary
(``O_CREAT | O_EXCL | O_NOFOLLOW``), fsync'ed and renamed. On load a file that
is not a regular file of this user, is truncated, fails its checksum, or was
made by another run, sequence or rank is ignored with a warning, never trusted.

When to save is decided on the ring's rank 0 (its clock) and broadcast: one
one-byte broadcast per ring step while checkpoints are on (tens of microseconds
against steps of seconds), so every rank saves the same steps. Which step to
resume at is agreed the same way: every rank gathers the steps it holds valid
files for, the ring resumes at the latest step all of them hold, or recomputes
the sequence when there is none. A sequence's files are removed once its output
is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import sys
import time
from typing import Optional

import numpy as np

from ...runtime import faults
from ...runtime.files import check_owned, exclusive_temp, fsync_path
from ...runtime.watchdog import watch
from ..plan import InputError

__all__ = ["Checkpoints", "save", "load", "ckpt_name", "run_digest", "DEFAULT_EVERY_S"]

DEFAULT_EVERY_S = 600.0
MAGIC = b"RINGMPI-CKPT\x00v1\n"
FORMAT = 1
_HEADER_MAX = 1 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def ckpt_name(seq_index: int, rank: int, slot: int) -> str:
    """File name of one rank's checkpoint of one sequence in one slot (0 or 1)."""
    return f"s{seq_index:06d}.r{rank:05d}.c{slot}.ckpt"


def run_digest(meta: dict) -> str:
    """SHA-256 of the run's fingerprint (canonical JSON): what a checkpoint must match."""
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _host(x) -> np.ndarray:
    """A C-contiguous numpy view (or device-to-host copy) of a state array."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()  # CuPy
    return np.ascontiguousarray(x)


def save(path: str, header: dict, arrays: tuple) -> None:
    """Write one checkpoint file (exclusive temporary, 0600, fsync, rename, fsync folder).

    Parameters
    ----------
    path : str
        The final name (in the parts folder).
    header : dict
        JSON-able description; ``shapes`` and ``dtype`` are added here.
    arrays : (acc (B, H, S, D), m (B, H, S), l (B, H, S))
        The state, all of one dtype (device arrays are copied to the host).
    """
    arrays = tuple(_host(a) for a in arrays)
    head = dict(
        header, format=FORMAT, shapes=[list(a.shape) for a in arrays], dtype=str(arrays[0].dtype)
    )
    text = json.dumps(head, sort_keys=True).encode()
    fd, tmp = exclusive_temp(path, 0o600)
    try:
        os.fchmod(fd, 0o600)
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as fh:
            for chunk in (MAGIC, struct.pack("<Q", len(text)), text):
                fh.write(chunk)
                digest.update(chunk)
            for a in arrays:
                mv = memoryview(a.reshape(-1).view(np.uint8))
                fh.write(mv)
                digest.update(mv)
            fh.write(digest.digest())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def load(path: str, expect: dict) -> tuple:
    """Read and check one checkpoint file: ((done, acc, m, l), None) or (None, why).

    Parameters
    ----------
    path : str
    expect : dict
        Header fields that must match exactly (sequence, name, rank, ring_size,
        run, shapes, dtype); ``done`` must lie in 1..ring_size.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot open it ({e.strerror or e})"
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        try:
            check_owned(st, path)
        except PermissionError as e:
            return None, str(e)
        digest = hashlib.sha256()
        lead = fh.read(len(MAGIC) + 8)
        if len(lead) < len(MAGIC) + 8 or not lead.startswith(MAGIC):
            return None, "not a ringmpi checkpoint"
        digest.update(lead)
        (hlen,) = struct.unpack("<Q", lead[len(MAGIC) :])
        if hlen > _HEADER_MAX:
            return None, "header too long"
        text = fh.read(hlen)
        digest.update(text)
        try:
            head = json.loads(text)
            dtype = np.dtype(head["dtype"])
            shapes = [tuple(int(n) for n in s) for s in head["shapes"]]
        except (ValueError, KeyError, TypeError):
            return None, "unreadable header"
        for key, want in expect.items():
            got = head.get(key)
            if key == "shapes":
                got = [tuple(s) for s in shapes]
                want = [tuple(s) for s in want]
            if got != want:
                return None, f"made by another run or for another place ({key} differs)"
        done = head.get("done")
        if type(done) is not int or not 1 <= done <= int(expect.get("ring_size", done)):
            return None, f"bad ring step {done!r}"
        sizes = [int(np.prod(s)) * dtype.itemsize for s in shapes]
        if st.st_size != len(lead) + hlen + sum(sizes) + 32:
            return None, "truncated or padded"
        arrays = []
        for shape in shapes:
            a = np.empty(shape, dtype=dtype)
            mv = memoryview(a.reshape(-1).view(np.uint8))
            if fh.readinto(mv) != mv.nbytes:
                return None, "truncated"
            digest.update(mv)
            arrays.append(a)
        if fh.read(33) != digest.digest():
            return None, "checksum mismatch (damaged)"
    return (done, *arrays), None


class Checkpoints:
    """One rank's checkpoints in a job: the ``on_state`` callback, resume and clean-up.

    Every method is called by every rank of the ring, in the same order.

    Parameters
    ----------
    parts : str
        The output's parts folder.
    ring : mpi4py communicator or None
        The ring computing this rank's sequences (None: one rank).
    meta : dict
        The run's fingerprint (the manifest's content).
    every_s : float or None
        Save at most every this many seconds of a sequence's ring; None or 0: never.
    resume : bool
        Look for checkpoints of the sequences this ring does (else remove stale ones).
    todo : list of int
        The sequence indices this ring will compute.
    finished : collection of int
        Sequences an earlier run completed: checkpoints of theirs left behind go.
    """

    def __init__(
        self,
        parts: str,
        ring,
        meta: dict,
        every_s: Optional[float],
        resume: bool,
        todo=(),
        finished=(),
    ):
        if every_s is not None and not 0 <= float(every_s) < float("inf"):
            raise InputError(f"--checkpoint-every must be a number of seconds >= 0, not {every_s}")
        self.parts, self.ring = parts, ring
        self.rank = 0 if ring is None else ring.Get_rank()
        self.size = 1 if ring is None else ring.Get_size()
        self.digest = run_digest(meta)
        self.every = float(every_s) if every_s else None
        self.resume = bool(resume)
        self.seq, self.count, self.saved = -1, 0, 0
        self.last = time.monotonic()
        self.warned = False
        self._sweep(set(todo), files=not self.resume, finished=set(finished))

    @property
    def on(self) -> bool:
        """Whether checkpoints are saved (``every_s`` > 0)."""
        return self.every is not None

    def _path(self, i: int, slot: int) -> str:
        return os.path.join(self.parts, ckpt_name(i, self.rank, slot))

    def _sweep(self, todo: set, files: bool, finished: set) -> None:
        """Remove this rank's stray temporaries (a save killed midway) of the sequences
        ``todo``, with ``files`` their checkpoints too (a fresh run: stale), and whatever
        is left of the ``finished`` sequences. One listing of the folder."""
        pat = re.compile(
            rf"^(\.)?s(\d{{6}})\.r{self.rank:05d}\.c[01]\.ckpt(\.[0-9a-f]{{12}}\.tmp)?$"
        )
        try:
            names = os.listdir(self.parts)
        except OSError:
            return
        for name in names:
            m = pat.match(name)
            i = int(m.group(2)) if m else -1
            if (i in todo and (files or m.group(1))) or i in finished:
                try:
                    os.unlink(os.path.join(self.parts, name))
                except OSError:
                    pass

    def _remove(self, i: int) -> None:
        """Remove this rank's checkpoint files of sequence ``i`` (both slots)."""
        for slot in (0, 1):
            try:
                os.unlink(self._path(i, slot))
            except OSError:
                pass  # best effort: a later run sweeps what is left (the output is written)

    def _warn(self, text: str) -> None:
        print(f"ringmpi: warning: {text}", file=sys.stderr, flush=True)

    def start(self, i: int, name: str, shapes: list, dtype: str) -> Optional[tuple]:
        """Begin sequence ``i``: the agreed state to resume from, or None (collective).

        Parameters
        ----------
        shapes : [acc (B, H, S, D), m (B, H, S), l (B, H, S)]
            This rank's state shapes; ``dtype`` the accumulation dtype.
        """
        self.seq, self.count = i, 0
        self.expect = dict(
            sequence=i,
            name=name,
            rank=self.rank,
            ring_size=self.size,
            run=self.digest,
            shapes=[list(s) for s in shapes],
            dtype=str(dtype),
        )
        found = {}
        if self.resume:
            for slot in (0, 1):
                path = self._path(i, slot)
                state, why = load(path, self.expect)
                if state is not None:
                    found[state[0]] = (slot, state)
                elif why:
                    self._warn(f"{path}: checkpoint ignored ({why}); not resuming from it")
        steps = set(found)
        if self.ring is not None and self.resume:
            with watch(f"agreeing on a checkpoint of sequence {name} with the other ranks"):
                every = self.ring.allgather(sorted(steps))
            for s in every:
                steps &= set(s)
        best = max(steps) if steps else 0
        self.last = time.monotonic()
        if not best:
            return None
        slot, state = found[best]
        self.count = slot + 1  # the next save goes to the other slot
        return state

    def on_state(self, done: int, acc, m, l) -> None:
        """The ``on_state`` callback: save when due (decided by the ring's rank 0)."""
        if self.every is None or done >= self.size:
            return  # the last step: the output is written next
        due = time.monotonic() - self.last >= self.every
        if self.ring is not None:
            with watch(f"ring step {done}: the checkpoint decision of the ring's rank 0"):
                due = self.ring.bcast(due, root=0)
        if due:
            slot = self.count % 2
            header = dict(self.expect, done=done)
            del header["shapes"], header["dtype"]
            try:
                save(self._path(self.seq, slot), header, (acc, m, l))
                self.count += 1
                self.saved += 1
            except OSError as e:  # a checkpoint is optional: the ring goes on
                if not self.warned:
                    self._warn(f"{self.parts}: cannot save a checkpoint ({e.strerror or e})")
                    self.warned = True
            self.last = time.monotonic()
        faults.checkpoint_step(self.ring, self.rank, self.seq, done)

    def finish(self, i: int) -> None:
        """Sequence ``i`` is written: its checkpoints go."""
        self._remove(i)
