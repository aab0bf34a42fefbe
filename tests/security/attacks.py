"""Attacks by a second user on a victim's job (issue 22): each must fail closed.

Run as root by tests/security/run.sh, which creates the two throwaway users and
passes their names: ``python attacks.py VICTIM ATTACKER``. Every step runs as one of
them (setpriv), in a scratch tree like a cluster's: a shared sticky directory
(``/scratch``-like, mode 1777) and the victim's private home. One line per attack;
exit status 1 if any attack succeeded.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = Path(sys.executable)
VENV = Path(sys.prefix)

PLANTED_SO = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("attacker code ran\n", f); fclose(f); }
}
"""


class Users:
    """Run commands as the victim or the attacker, with the job's Python."""

    def __init__(self, victim: str, attacker: str, base: Path):
        self.base = base
        self.ids = {n: pwd.getpwnam(n) for n in (victim, attacker)}
        self.victim, self.attacker = victim, attacker
        self.homes = {}
        for n in (victim, attacker):
            h = base / f"home-{n}"
            h.mkdir(mode=0o700)
            os.chown(h, self.ids[n].pw_uid, self.ids[n].pw_gid)
            self.homes[n] = h
        self.py = self._python()

    def env(self, user: str, **extra) -> dict:
        site = sysconfig.get_paths()["purelib"]
        env = {
            "PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.homes[user]),
            "USER": user,
            "LD_LIBRARY_PATH": str(VENV / "lib"),
            "PYTHONPATH": f"{site}:{REPO}",
            "OMP_NUM_THREADS": "1",
            "RINGMPI_CACHE_DIR": str(self.homes[user] / ".cache" / "ringmpi"),
        }
        env.update(extra)
        return env

    def run(self, user, cmd, cwd=None, umask="022", timeout=300, **env):
        ent = self.ids[user]
        full = [
            "setpriv",
            f"--reuid={ent.pw_uid}",
            f"--regid={ent.pw_gid}",
            "--clear-groups",
            "sh",
            "-c",
            f'umask {umask}; exec "$@"',
            "sh",
            *map(str, cmd),
        ]
        return subprocess.run(
            full,
            cwd=cwd or self.homes[user],
            env=self.env(user, **env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(self, user, code, **kw):
        return self.run(user, [self.py, "-c", code], **kw)

    def _python(self) -> str:
        """The job's interpreter if the users can run it, else the system one (same version)."""
        probe = "import ringmpi, numpy, h5py, mpi4py.MPI"
        for cand in (str(PY), f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
            self.py = cand
            if os.path.exists(cand) and self.python(self.victim, probe).returncode == 0:
                return cand
        raise SystemExit("SKIP: the throwaway users cannot run a Python with ringmpi installed")


def _planted_so(users: Users, out: Path, mark: Path) -> None:
    src = users.base / "planted.c"
    src.write_text(PLANTED_SO % mark)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)


RESULTS: list = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append(ok)
    print(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""))


def attack_planted_kernel(u: Users, shared: Path) -> None:
    """Item 1: a kernel library planted in a cache the attacker controls never runs."""
    cache = shared / "kernel-cache"
    mark = shared / "pwned-kernel"
    # the attacker builds the real library in their own cache (learning its name) ...
    code = (
        "import os; from ringmpi.cpu import build, isa; "
        f"os.environ['RINGMPI_CACHE_DIR'] = {str(cache)!r}; "
        "print(build.build_library('cpu_tile.c', isa.host_isas()[-1]))"
    )
    r = u.python(u.attacker, code)
    target = Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    if target is None:
        report("planted kernel: attacker setup", False, r.stderr[-300:])
        return
    # ... then swaps in code of their own and records its hash as if built
    planted = u.base / "planted.so"
    _planted_so(u, planted, mark)
    code = (
        "import hashlib, os, shutil, sys; t, p = sys.argv[1], sys.argv[2]; "
        "shutil.copyfile(p, t + '.new'); os.replace(t + '.new', t); "
        "h = hashlib.sha256(open(t, 'rb').read()).hexdigest(); "
        "open(t + '.lock', 'w').write(h + '  x\\n'); os.chmod(os.path.dirname(t), 0o777)"
    )
    u.run(u.attacker, [u.py, "-c", code, target, planted])
    probe = (
        "from ringmpi.cpu import fused, build, isa as isas; isa = isas.host_isas()[-1]; "
        "print(fused.available(), fused.unavailable_reason())"
    )
    for label, env in (
        ("shared RINGMPI_CACHE_DIR of another user", {"RINGMPI_CACHE_DIR": str(cache)}),
    ):
        r = u.python(u.victim, probe, **env)
        ok = not mark.exists() and r.returncode == 0 and "refusing" in r.stdout
        report(f"planted kernel in a {label}", ok, (r.stdout + r.stderr)[-300:])
    # the victim's own default cache, made under a loose umask, is closed to the attacker
    r = u.python(u.victim, "from ringmpi.cpu import fused; print(fused.available())", umask="002")
    own = u.homes[u.victim] / ".cache" / "ringmpi"
    mode = own.stat().st_mode & 0o777 if own.exists() else None
    report("victim's kernel cache made 0700 under umask 002", mode == 0o700, f"mode {mode}")


def attack_planted_cubin(u: Users, shared: Path) -> None:
    """Item 2: cubins in a cache of another user are not looked up; CUPY_CACHE_DIR is private."""
    cache = shared / "cubin-cache"
    code = (
        f"import os, json; os.environ['RINGMPI_CACHE_DIR'] = {str(cache)!r}; "
        "from ringmpi.gpu import loader, tile; c = loader.source(tile.KERNEL_FILE); "
        "e = 'attn_fwd_mma<bf16_t, 64>'; cub, meta = loader._paths(c, e, 'sm_90'); "
        "os.makedirs(cub.parent, exist_ok=True); cub.write_bytes(b'\\x7fELF evil'); "
        "import hashlib; meta.write_text(json.dumps({'expr': e, 'arch': 'sm_90', "
        "'mangled': '_Z12attn_fwd_mmaIevil', 'sha256': hashlib.sha256(b'\\x7fELF evil')"
        ".hexdigest()}))"
    )
    r = u.python(u.attacker, code)
    if r.returncode != 0:
        report("planted cubin: attacker setup", False, r.stderr[-300:])
        return
    probe = (
        "from ringmpi.gpu import loader, tile; c = loader.source(tile.KERNEL_FILE)\n"
        "try:\n    print(loader._lookup(c, 'attn_fwd_mma<bf16_t, 64>', 'sm_90'))\n"
        "except PermissionError as e:\n    print('refused', e)\n"
    )
    r = u.python(u.victim, probe, RINGMPI_CACHE_DIR=str(cache))
    report("planted cubin in another user's cache", r.stdout.startswith("refused"), r.stdout)
    # jobs/pbs.sh: the default CUPY_CACHE_DIR name made first by the attacker is not used
    tmpdir = shared / "tmp"
    tmpdir.mkdir(mode=0o777)
    tmpdir.chmod(0o1777)
    vuid = u.ids[u.victim].pw_uid
    u.run(u.attacker, ["mkdir", "-m", "777", tmpdir / f"cupy-cache-{vuid}"])
    stub = u.base / "stub-mpiexec"
    stub.write_text('#!/bin/sh\necho "CUPY_CACHE_DIR=$CUPY_CACHE_DIR"\n')
    stub.chmod(0o755)
    r = u.run(
        u.victim,
        ["bash", REPO / "jobs" / "pbs.sh"],
        MPIEXEC=str(stub),
        ARGS="in.h5 -o o.h5",
        TMPDIR=str(tmpdir),
        PYTHON=u.py,
        PBS_O_WORKDIR=str(u.homes[u.victim]),
    )
    used = [x.split("=", 1)[1] for x in r.stdout.splitlines() if x.startswith("CUPY_CACHE_DIR=")]
    ok = bool(used) and used[0] != str(tmpdir / f"cupy-cache-{vuid}")
    ok = ok and os.stat(used[0]).st_uid == vuid and (os.stat(used[0]).st_mode & 0o777) == 0o700
    report("pbs.sh CUPY_CACHE_DIR pre-made by the attacker", ok, r.stdout + r.stderr)


def _victim_data(u: Users) -> tuple:
    home = u.homes[u.victim]
    code = (
        "from ringmpi.cli.make_data import make_data; "
        f"print(make_data({str(home / 'in.h5')!r}, seq_len=64, heads=2, kv_heads=1, "
        "head_dim=8, sequences=2)[0])"
    )
    r = u.python(u.victim, code)
    assert r.returncode == 0, r.stderr
    precious = home / "precious.txt"
    u.run(u.victim, ["sh", "-c", f"echo precious > {precious}"])
    return home / "in.h5", precious


def _job(u: Users, *args, ranks: int = 2):
    cmd = [VENV / "bin" / "mpiexec", "-n", ranks, u.py, "-m", "mpi4py", "-m", "ringmpi", "run"]
    return u.run(u.victim, [*cmd, *args, "--quiet", "--causal"], PYTHONSAFEPATH="1")


def attack_clobber(u: Users, shared: Path) -> None:
    """Item 3: names planted in a shared output directory neither write nor delete anything."""
    inp, precious = _victim_data(u)
    out = shared / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o1777)
    # (a) the parts folder made first by the attacker
    u.run(u.attacker, ["mkdir", out / "a.h5.parts"])
    u.run(u.attacker, ["ln", "-s", precious, out / "a.h5.parts" / "s000000.r00000.h5"])
    r = _job(u, inp, "-o", out / "a.h5", "--overwrite")
    ok = r.returncode == 2 and "owned by uid" in r.stderr and not (out / "a.h5").exists()
    report("parts folder pre-made by the attacker", ok and _intact(precious), r.stderr[-300:])
    # (b) temporaries' old fixed names planted as symlinks to the victim's file
    for name in ("b.h5.tmp", "s.json.tmp", "p.h5.tmp"):
        u.run(u.attacker, ["ln", "-s", precious, out / name])
    r = _job(u, inp, "-o", out / "b.h5", "--summary-json", out / "s.json")
    r2 = u.run(u.victim, [u.py, "-m", "ringmpi", "pack", out / "b.h5", "--to", out / "p.h5"])
    ok = r.returncode == 0 and r2.returncode == 0 and _intact(precious)
    report("planted .tmp symlinks (run, --summary-json, pack)", ok, r.stderr[-300:] + r2.stderr)
    # (c) the parts folder as a symlink to the victim's own finished results, with --overwrite
    mine = u.homes[u.victim] / "mine.h5"
    r0 = _job(u, inp, "-o", mine)
    before = sorted(p.name for p in Path(f"{mine}.parts").iterdir())
    u.run(u.attacker, ["ln", "-s", f"{mine}.parts", out / "c.h5.parts"])
    r = _job(u, inp, "-o", out / "c.h5", "--overwrite")
    after = sorted(p.name for p in Path(f"{mine}.parts").iterdir())
    ok = r0.returncode == 0 and r.returncode == 2 and "symlink" in r.stderr and before == after
    report("parts folder symlinked to the victim's results (--overwrite)", ok, r.stderr[-300:])


def _intact(p: Path) -> bool:
    return p.read_text() == "precious\n"


def attack_inputs(u: Users, shared: Path) -> None:
    """Item 4: an input handed over by the attacker cannot read the victim's private files."""
    home = u.homes[u.victim]
    secret = home / "secret.h5"
    code = (
        "import h5py, numpy as np\n"
        f"with h5py.File({str(secret)!r}, 'w') as f:\n"
        "    [f.create_dataset(n, data=np.full((64, 2, 8), 42.0, np.float32)) for n in 'qkv']\n"
        f"open({str(home / 'secret.bin')!r}, 'wb').write(np.full(1024, 42.0, np.float32)"
        ".tobytes())\n"
    )
    u.python(u.victim, code, umask="077")
    code = (
        "import h5py, numpy as np, sys\n"
        "d, s, b = sys.argv[1], sys.argv[2], sys.argv[3]\n"
        "def good(f, skip):\n"
        "    for n in 'qkv':\n"
        "        if n != skip: f[n] = np.full((64, 2, 8), 0.5, np.float32)\n"
        "with h5py.File(d + '/link.h5', 'w') as f:\n"
        "    good(f, 'q'); f['q'] = h5py.ExternalLink(s, '/q')\n"
        "with h5py.File(d + '/raw.h5', 'w') as f:\n"
        "    good(f, 'k'); f.create_dataset('k', (64, 2, 8), 'f4', external=[(b, 0, 4096)])\n"
        "with h5py.File(d + '/vds.h5', 'w') as f:\n"
        "    good(f, 'v'); lay = h5py.VirtualLayout((64, 2, 8), 'f4')\n"
        "    lay[:] = h5py.VirtualSource(s, 'v', shape=(64, 2, 8))\n"
        "    f.create_virtual_dataset('v', lay)\n"
    )
    evil = shared / "inputs"
    evil.mkdir(mode=0o755)
    os.chown(evil, u.ids[u.attacker].pw_uid, u.ids[u.attacker].pw_gid)
    r = u.run(u.attacker, [u.py, "-c", code, evil, secret, home / "secret.bin"])
    if r.returncode != 0:
        report("crafted inputs: attacker setup", False, r.stderr[-300:])
        return
    outdir = home / "outs"
    outdir.mkdir(mode=0o700)
    os.chown(outdir, u.ids[u.victim].pw_uid, u.ids[u.victim].pw_gid)
    for name, words in (
        ("link.h5", "external link"),
        ("raw.h5", "external file"),
        ("vds.h5", "virtual dataset"),
    ):
        out = outdir / f"{name}.out.h5"
        r = _job(u, evil / name, "-o", out, ranks=2)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        ok = r.returncode == 2 and len(lines) == 1 and words in lines[0] and not out.exists()
        report(f"input with {words} to the victim's private file", ok, r.stderr[-300:])


def attack_module_path(u: Users, shared: Path) -> None:
    """Item 11: a module planted in a shared job directory is not imported (python -P)."""
    job = shared / "jobdir"
    job.mkdir(mode=0o777)
    job.chmod(0o777)
    mark = shared / "pwned-numpy"
    u.run(u.attacker, ["mkdir", job / "numpy"])
    u.run(u.attacker, ["sh", "-c", f'echo \'open("{mark}", "w")\' > {job}/numpy/__init__.py'])
    inp = u.homes[u.victim] / "in.h5"
    r = u.run(
        u.victim,
        [u.py, "-P", "-m", "ringmpi", "run", inp, "-o", u.homes[u.victim] / "p.h5"],
        cwd=job,
    )
    report("numpy/ planted in the job directory (python -P)", not mark.exists(), r.stderr[-300:])


def hostile_set(u: Users) -> None:
    """Items 4-8: the hostile-input files, run by the victim: one line, exit 2, bounded."""
    d = u.homes[u.victim] / "hostile"
    r = u.run(u.victim, [u.py, HERE / "hostile.py", d], timeout=600)
    for line in r.stdout.splitlines():
        print("  " + line)
    report("hostile-input set", r.returncode == 0, r.stderr[-500:])


def main(argv) -> int:
    victim, attacker = argv[1], argv[2]
    base = Path(tempfile.mkdtemp(prefix="ringmpi-sec."))
    base.chmod(0o755)
    try:
        shared = base / "scratch"
        shared.mkdir()
        shared.chmod(0o1777)
        u = Users(victim, attacker, base)
        print(f"make test-security: victim {victim}, attacker {attacker}, python {u.py}")
        attack_planted_kernel(u, shared)
        attack_planted_cubin(u, shared)
        attack_clobber(u, shared)
        attack_inputs(u, shared)
        attack_module_path(u, shared)
        hostile_set(u)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    bad = RESULTS.count(False)
    print(f"make test-security: {len(RESULTS) - bad} of {len(RESULTS)} attacks fail closed")
    return 1 if bad or not RESULTS else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
