"""A small test runner for machines without pytest (the GPU image of jobs/gpu_check.sh).

    python tests/gpu_runner.py [-m mpi | -m "not mpi"] [-k WORD] tests/gpu/test_tile_device.py ...
    mpiexec -n 2 python -m mpi4py tests/gpu_runner.py -m mpi tests/gpu/test_tile_device.py

It installs a minimal ``pytest`` stand-in (``importorskip``, ``skip``, ``fail``,
``raises``, ``fixture``, ``mark.parametrize``/``skipif``/any marker), imports
each test module, expands the parametrize marks and calls every ``test_*``
function with the fixtures it names: ``comm``, ``rng`` (tests/conftest.py),
``monkeypatch`` (setenv, delenv, setattr), ``tmp_path``, ``tmp_path_factory``
and fixtures defined in the module or in tests/conftest.py (any scope,
generator fixtures finalised, autouse honoured). It prints one PASS / FAIL /
SKIP line per test (from rank 0 under MPI; failures from every rank) and
exits 1 if anything failed, or if nothing ran with ``--require-run``.
The stand-in is always used, so the runner behaves the same with or without
pytest installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import os
import re
import shutil
import sys
import tempfile
import traceback
import types
from pathlib import Path


# ---------------------------------------------------------------------------
# the pytest stand-in
# ---------------------------------------------------------------------------
class Skipped(Exception):
    """A test (or a whole module) skipped itself."""


class Failed(AssertionError):
    """pytest.fail was called."""


class _Mark:
    def __init__(self, name, args=(), kwargs=None):
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs and not self.args:
            func = args[0]  # used bare as a decorator: @pytest.mark.mpi
            func.__dict__.setdefault("marks", []).append(self)
            return func
        return _MarkDecorator(_Mark(self.name, args, kwargs))


class _MarkDecorator:
    def __init__(self, mark):
        self.mark = mark

    def __call__(self, func):
        func.__dict__.setdefault("marks", []).append(self.mark)
        return func


class _MarkFactory:
    def __getattr__(self, name):
        return _Mark(name)


class _Raises:
    def __init__(self, exc, match=None):
        self.exc, self.match, self.value = exc, match, None

    def __enter__(self):
        return self

    def __exit__(self, typ, val, tb):
        if typ is None:
            raise AssertionError(f"DID NOT RAISE {self.exc}")
        if not issubclass(typ, self.exc):
            return False
        if self.match is not None and not re.search(self.match, str(val)):
            raise AssertionError(f"{str(val)!r} does not match {self.match!r}")
        self.value = val
        return True


def _fixture(func=None, *, scope="function", autouse=False, **_):
    def wrap(f):
        f._fixture = {"scope": scope, "autouse": autouse}
        return f

    return wrap(func) if callable(func) else wrap


def _skip(reason="", allow_module_level=False):
    raise Skipped(reason)


def _fail(reason=""):
    raise Failed(reason)


def _importorskip(name, reason=None, **_):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise Skipped(reason or f"could not import {name}: {exc}") from None


def make_shim() -> types.ModuleType:
    """The stand-in ``pytest`` module."""
    shim = types.ModuleType("pytest")
    shim.__doc__ = "ringmpi tests/gpu_runner.py stand-in for pytest"
    shim.mark = _MarkFactory()
    shim.fixture = _fixture
    shim.skip = _skip
    shim.fail = _fail
    shim.raises = _Raises
    shim.importorskip = _importorskip
    shim.skip.Exception = Skipped
    return shim


# ---------------------------------------------------------------------------
# built-in fixtures
# ---------------------------------------------------------------------------
class MonkeyPatch:
    """setenv / delenv / setattr, undone after the test."""

    def __init__(self):
        self._env, self._attrs = [], []

    def setenv(self, name, value):
        self._env.append((name, os.environ.get(name)))
        os.environ[name] = str(value)

    def delenv(self, name, raising=True):
        if name not in os.environ and raising:
            raise KeyError(name)
        self._env.append((name, os.environ.get(name)))
        os.environ.pop(name, None)

    def setattr(self, obj, name, value):
        self._attrs.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self):
        for name, old in reversed(self._env):
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        for obj, name, old in reversed(self._attrs):
            setattr(obj, name, old)
        self._env, self._attrs = [], []


class TmpPathFactory:
    def __init__(self, base: Path):
        self.base, self.n = base, 0

    def mktemp(self, name: str) -> Path:
        self.n += 1
        p = self.base / f"{name}{self.n}"
        p.mkdir()
        return p


class Fixtures:
    """Resolves fixtures by argument name, caching module-scoped ones until ``close``."""

    def __init__(self, defs: dict, base: Path):
        self.defs, self.base = defs, base
        self.factory = TmpPathFactory(base)
        self.module_cache: dict = {}
        self.module_final: list = []

    def _builtin(self, name, final):
        if name == "monkeypatch":
            mp = MonkeyPatch()
            final.append(mp.undo)
            return mp
        if name == "tmp_path":
            return self.factory.mktemp("tmp")
        if name == "tmp_path_factory":
            return self.factory
        raise LookupError(f"unknown fixture {name!r}")

    def get(self, name, final):
        f = self.defs.get(name)
        if f is None:
            return self._builtin(name, final)
        scope = f._fixture["scope"]
        if scope != "function" and name in self.module_cache:
            return self.module_cache[name]
        where = final if scope == "function" else self.module_final
        args = {p: self.get(p, where) for p in inspect.signature(f).parameters}
        value = f(**args)
        if inspect.isgenerator(value):
            gen, value = value, next(value)
            where.append(lambda g=gen: next(g, None))
        if scope != "function":
            self.module_cache[name] = value
        return value

    def close(self):
        for fn in reversed(self.module_final):
            fn()
        self.module_final, self.module_cache = [], {}


# ---------------------------------------------------------------------------
# collection and running
# ---------------------------------------------------------------------------
def _marks(func) -> list:
    return list(getattr(func, "marks", []))


def expand(func) -> list:
    """[(id, kwargs)] for every combination of the function's parametrize marks."""
    axes = []
    for m in reversed(_marks(func)):  # the mark nearest the function first, like pytest
        if m.name != "parametrize":
            continue
        names, values = m.args[0], m.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = [v if len(names) > 1 else (v,) for v in values]
        axes.append([(dict(zip(names, r)), "-".join(map(_id, r))) for r in rows])
    out = []
    for combo in itertools.product(*axes):
        kw, ids = {}, []
        for d, i in combo:
            kw.update(d)
            ids.append(i)
        out.append(("[" + "-".join(ids) + "]" if ids else "", kw))
    return out


def _id(v) -> str:
    if isinstance(v, type):
        return v.__name__
    return getattr(v, "__name__", str(v))


def selected(func, marker: str, word: str, name: str) -> bool:
    names = {m.name for m in _marks(func)} | {m.name for m in getattr(func, "module_marks", [])}
    if marker:
        neg = marker.startswith("not ")
        want = marker[4:].strip() if neg else marker.strip()
        if (want in names) == neg:
            return False
    return not word or word in name


def load(path: Path, shim) -> types.ModuleType:
    sys.modules["pytest"] = shim
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def run_module(path: Path, shim, args, rank: int, out) -> dict:
    counts = {"pass": 0, "fail": 0, "skip": 0}
    say = (lambda s: print(s, file=out, flush=True)) if rank == 0 else (lambda s: None)
    try:
        mod = load(path, shim)
    except Skipped as exc:
        say(f"SKIP {path.name} (module): {exc}")
        counts["skip"] += 1
        return counts
    defs = {}
    conftest = path.parent / "conftest.py"
    if conftest.is_file():
        cmod = load(conftest, shim)
        defs.update({n: f for n, f in vars(cmod).items() if hasattr(f, "_fixture")})
    defs.update({n: f for n, f in vars(mod).items() if hasattr(f, "_fixture")})
    base = Path(tempfile.mkdtemp(prefix="gpu_runner."))
    fixtures = Fixtures(defs, base)
    module_marks = getattr(mod, "pytestmark", [])
    module_marks = module_marks if isinstance(module_marks, list) else [module_marks]
    module_marks = [getattr(m, "mark", m) for m in module_marks]
    try:
        auto = [n for n, f in defs.items() if f._fixture["autouse"]]
        tests = [(n, f) for n, f in vars(mod).items() if n.startswith("test_") and callable(f)]
        for name, func in tests:
            func.module_marks = module_marks
            for suffix, params in expand(func):
                full = f"{path.name}::{name}{suffix}"
                if not selected(func, args.m, args.k, full):
                    continue
                skip = [m for m in _marks(func) if m.name == "skipif" and m.args and m.args[0]]
                if skip:
                    say(f"SKIP {full}: {skip[0].kwargs.get('reason', '')}")
                    counts["skip"] += 1
                    continue
                final: list = []
                try:
                    for a in auto:
                        fixtures.get(a, final)
                    sig = inspect.signature(func).parameters
                    kw = {p: params[p] if p in params else fixtures.get(p, final) for p in sig}
                    func(**kw)
                    counts["pass"] += 1
                    say(f"PASS {full}")
                except Skipped as exc:
                    counts["skip"] += 1
                    say(f"SKIP {full}: {exc}")
                except Exception:
                    counts["fail"] += 1
                    tb = traceback.format_exc(limit=-3)
                    print(f"FAIL {full} (rank {rank})\n{tb}", file=out, flush=True)
                finally:
                    for fn in reversed(final):
                        fn()
    finally:
        fixtures.close()
        shutil.rmtree(base, ignore_errors=True)
    return counts


def _rank() -> int:
    """This process's rank from the launcher's environment (0 outside MPI)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="run test modules without pytest")
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("-m", default="", help='marker expression: "mpi" or "not mpi"')
    ap.add_argument("-k", default="", help="run only tests whose id contains this")
    ap.add_argument("--require-run", action="store_true", help="exit 1 if no test passed")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest-style imports
    shim = make_shim()
    rank = _rank()
    total = {"pass": 0, "fail": 0, "skip": 0}
    for path in args.paths:
        counts = run_module(path, shim, args, rank, sys.stdout)
        for k in total:
            total[k] += counts[k]
    if rank == 0:
        p, f, s = total["pass"], total["fail"], total["skip"]
        print(f"gpu_runner: {p} passed, {f} failed, {s} skipped")
    if total["fail"] or (args.require_run and not total["pass"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
