"""The ``ringmpi`` command: run, make-data, verify, pack, info, bench.

Multi-rank subcommands (``run``, ``verify``) are started under MPI, e.g.

    mpiexec -n 4 python -m mpi4py -m ringmpi run data/sample/sample.h5 -o out.h5 --causal

A problem with the input or output (the same on every rank, found collectively)
prints one line on rank 0 and every rank exits with status 2. Any other error
prints one line naming the rank and aborts the whole MPI job with status 1, so
a batch job never hangs.

Ctrl-C (SIGINT) or SIGTERM, to ``mpiexec`` (which forwards it to every rank) or
to one rank, stops ``run`` and ``verify`` within seconds, also inside the
kernels (:mod:`ringmpi.interrupt`): one line "interrupted at sequence i, ring
step s", exit status 130 (SIGINT) or 143 (SIGTERM). When every rank got the
signal they leave together; when only some did, those abort the MPI job.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from typing import Optional

from . import interrupt
from .collective import CollectiveError
from .job.budget import parse_size
from .launch import check_launch

__all__ = ["main", "build_parser"]

EXIT_INPUT = 2
EXIT_VERIFY = 3  # verify found a wrong result
EXIT_UNCHECKED = 4  # verify checked nothing (every sequence skipped)
# seconds an interrupted rank waits for the others to be interrupted too before it aborts
ALL_RANKS_S = 2.0
MAX_TOKENS = 65536  # = ringmpi.job.verify.MAX_TOKENS (not imported: keeps --help fast)
SAMPLE_ROWS = 2048  # = ringmpi.job.verify.SAMPLE_ROWS

SCHEMA = """input schema (full contract: data/README.md):
  q (S, H, D), k and v (S, Hkv, D), H % Hkv == 0, float16/32/64, token-major (not (H, S, D));
  several sequences: a batch axis q (B, S, H, D), or one group per sequence; or x + --weights
output: out (S, H, D) and lse (H, S) per sequence, virtual datasets over OUTPUT.parts/
"""

RUN_EXAMPLES = """examples:
  mpiexec -n 4 python -m mpi4py -m ringmpi run data/sample/sample.h5 -o out.h5 --causal --verify
  mpiexec -n 8 ringmpi run 'shards/seq.part*.h5' -o out.h5 --layout striped --summary-json s.json
  mpiexec -n 4 ringmpi run feats.h5 --weights feats-weights.h5 -o out.h5
  mpiexec -n 4 ringmpi run in.h5 -o out.h5 --causal --resume     # after Ctrl-C or a crash
  ringmpi pack out.h5 -o result.h5 --compress gzip               # one self-contained file

exit status: 0 done, 2 bad input/output, 3 verify failed, 4 verify checked nothing,
130/143 interrupted (SIGINT/SIGTERM: rerun with --resume), 1 or 124 other failures
"""
PACK_EXAMPLES = """examples:
  ringmpi pack out.h5 -o result.h5
  ringmpi pack out.h5 -o result.h5 --compress gzip
"""
MAKE_EXAMPLES = """examples:
  ringmpi make-data data/sample/sample.h5
  ringmpi make-data big.h5 --seq-len 262144 --heads 16 --kv-heads 4 --shards 8
  ringmpi make-data multi.h5 --sequences 4 --batch-axis --compression gzip
  ringmpi make-data feats.h5 --features 256      # also writes feats-weights.h5
"""
VERIFY_EXAMPLES = """examples:
  ringmpi verify out.h5 data/sample/sample.h5
  mpiexec -n 4 python -m mpi4py -m ringmpi verify out.h5 'shards/seq.part*.h5'
  ringmpi verify out.h5 big.h5 --max-tokens 262144 --sample-rows 0   # full, or nothing

exit status: 0 passed (something checked, nothing failed), 3 failed, 4 nothing checked
"""
INFO_EXAMPLES = """examples:
  ringmpi info
  mpiexec -n 2 python -m mpi4py -m ringmpi info
"""


def _env_rank() -> int:
    """This process's rank from the launcher's environment (0 when not launched by MPI)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse that prints usage errors on rank 0 only (every rank still exits 2)."""

    def error(self, message):
        if _env_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_INPUT)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ringmpi`` command."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="ringmpi",
        description="Exact ring attention over MPI for sequences too long for one device.",
        epilog="run 'ringmpi COMMAND --help' for the options and examples of each command",
        formatter_class=fmt,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    r = sub.add_parser(
        "run",
        help="attention over HDF5 inputs, output to HDF5 (under mpiexec)",
        description="Compute exact attention for every sequence of the input(s), one after "
        "another; each rank reads and writes only its own tokens.\n\n" + SCHEMA,
        epilog=RUN_EXAMPLES,
        formatter_class=fmt,
    )
    r.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="input file(s) or quoted glob(s), in sequence order",
    )
    r.add_argument(
        "-o", "--output", required=True, help="output HDF5 file (parts go to OUTPUT.parts/)"
    )
    r.add_argument(
        "--causal", action="store_true", help="causal mask (key j visible to query i iff j <= i)"
    )
    r.add_argument(
        "--layout",
        choices=("zigzag", "striped", "contiguous"),
        default="zigzag",
        help="token layout over the ranks (default: zigzag)",
    )
    r.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="auto: GPU when CuPy sees one on every rank (default: auto)",
    )
    r.add_argument("--scale", type=float, default=None, help="score scale (default 1/sqrt(D))")
    r.add_argument("--weights", help="projection weights file for raw-feature inputs 'x'")
    r.add_argument("--resume", action="store_true", help="keep sequences an earlier run completed")
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUTPUT (or the parts of an unfinished run); without it "
        "an existing output is refused",
    )
    r.add_argument(
        "--compress",
        choices=("gzip", "lzf"),
        help="compress the part files (chunked, shuffle filter); default: none",
    )
    r.add_argument(
        "--verify", action="store_true", help="compare with the dense reference afterwards"
    )
    r.add_argument(
        "--verify-max-tokens",
        type=int,
        default=MAX_TOKENS,
        metavar="N",
        help="--verify: check sequences up to N tokens in full (default %(default)s)",
    )
    r.add_argument(
        "--verify-sample-rows",
        type=int,
        default=SAMPLE_ROWS,
        metavar="R",
        help="--verify: check R random query rows per head of longer sequences "
        "(default %(default)s; 0 skips them)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    r.add_argument("--summary-json", metavar="FILE", help="write the summary as JSON (rank 0)")
    r.add_argument(
        "--max-memory",
        metavar="SIZE",
        type=parse_size,
        help="per-rank memory budget, e.g. 8G (default: 80%% of free memory per rank)",
    )
    r.add_argument(
        "--strided-read",
        choices=("auto", "hyperslab", "blocks"),
        default="auto",
        help="striped layout: strided selection, subsampled blocks, or auto (by storage)",
    )
    r.add_argument("--no-prefetch", action="store_true", help="do not read the next sequence ahead")

    m = sub.add_parser(
        "make-data",
        help="write deterministic sample inputs",
        description="Write sample inputs in the ringmpi schema (see data/README.md). The values "
        "depend only on the seed, never on shards or compression.",
        epilog=MAKE_EXAMPLES,
        formatter_class=fmt,
    )
    m.add_argument("output", help="file to write (stem.partNNN.h5 with --shards > 1)")
    m.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence S (default 4096)")
    m.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    m.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv (default 2)")
    m.add_argument("--head-dim", type=int, default=64, help="head dimension D (default 64)")
    m.add_argument("--sequences", type=int, default=1, help="number of sequences (default 1)")
    m.add_argument("--batch-axis", action="store_true", help="leading batch axis instead of groups")
    m.add_argument("--shards", type=int, default=1, help="split the sequence axis over N files")
    m.add_argument(
        "--compression",
        choices=("none", "gzip"),
        default="none",
        help="gzip: chunked, gzip + shuffle + fletcher32",
    )
    m.add_argument("--dtype", choices=("float16", "float32", "float64"), default="float32")
    m.add_argument("--features", type=int, default=0, help="write raw features x (S, F) + weights")
    m.add_argument("--weights", help="weights file name (default STEM-weights.h5)")
    m.add_argument("--seed", type=int, default=0)

    v = sub.add_parser(
        "verify",
        help="compare an output with dense attention",
        description="Compare OUTPUT with dense float64 attention of the inputs. A row passes "
        "when |ring-ref64| <= 2*max|dense_lowprec-ref64| + eps for out and lse. Sequences up "
        "to --max-tokens are checked in full; longer ones on --sample-rows random query rows "
        "per head (plus finiteness and the value range on every row), or skipped with "
        "--sample-rows 0. PASSED needs something checked and nothing failed.",
        epilog=VERIFY_EXAMPLES,
        formatter_class=fmt,
    )
    v.add_argument("output", help="output file written by 'ringmpi run'")
    v.add_argument("inputs", nargs="+", metavar="INPUT", help="the inputs of that run")
    v.add_argument("--weights", help="projection weights file for raw-feature inputs")
    v.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        metavar="N",
        help="check sequences up to N tokens in full (default %(default)s)",
    )
    v.add_argument(
        "--sample-rows",
        type=int,
        default=SAMPLE_ROWS,
        metavar="R",
        help="random query rows per head checked in a longer sequence (default %(default)s; "
        "0 skips such sequences)",
    )
    v.add_argument("--seed", type=int, default=0, help="seed of the row sample (default 0)")
    v.add_argument("--quiet", action="store_true", help="no progress lines")

    pk = sub.add_parser(
        "pack",
        help="one self-contained HDF5 file from an output and its parts",
        description="OUTPUT of 'ringmpi run' reads its data from OUTPUT.parts/ (virtual "
        "datasets; alone it reads NaN). pack copies everything, slab by slab, into one "
        "ordinary HDF5 file with the same groups, attributes and dimension labels.",
        epilog=PACK_EXAMPLES,
        formatter_class=fmt,
    )
    pk.add_argument("output", help="output file written by 'ringmpi run'")
    pk.add_argument("-o", "--to", required=True, metavar="FILE", help="file to write")
    pk.add_argument("--compress", choices=("gzip", "lzf"), help="compress the datasets")
    pk.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")

    sub.add_parser(
        "info",
        help="versions, MPI library, CUDA-awareness, GPU",
        description="Print the versions of ringmpi and its stack, the MPI library and whether "
        "it is CUDA-aware, and the GPU if there is one.",
        epilog=INFO_EXAMPLES,
        formatter_class=fmt,
    )
    sub.add_parser(
        "plan",
        help="predict memory, time and overlap; recommend ring size (see 'ringmpi plan --help')",
        add_help=False,
        description="The planner; all arguments are passed to ringmpi.plan.",
    )
    sub.add_parser(
        "bench",
        help="benchmarks (see 'ringmpi bench --help')",
        add_help=False,
        description="Benchmarks; all arguments are passed to ringmpi.bench.",
    )
    return p


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _guard(fn, args, program: bool) -> int:
    """Run a collective command: a CollectiveError prints one line on rank 0, anything else aborts.

    Every rank raises the same CollectiveError, so all of them can leave cleanly:
    as a program they finalize MPI first, which keeps ``python -m mpi4py`` from
    turning the non-zero exit into an MPI_Abort with its extra noise. SIGINT and
    SIGTERM are caught as a flag for the whole command (see :func:`_interrupted`).
    """
    comm = _comm()
    stop = comm.Dup()  # only interrupted ranks ever use it: see _interrupted
    try:
        with interrupt.catching((signal.SIGINT, signal.SIGTERM)):
            return fn(args, comm)
    except KeyboardInterrupt as e:
        if not isinstance(e, interrupt.Interrupted):
            e = interrupt.Interrupted(signal.SIGINT)
        return _interrupted(e, comm, stop, args.command, program)
    except CollectiveError as e:
        if comm.Get_rank() == 0:
            sys.stderr.write(f"ringmpi: error: {e}\n")
            sys.stderr.flush()
        if program:
            from mpi4py import MPI

            comm.Barrier()
            MPI.Finalize()
        return EXIT_INPUT
    except Exception as e:  # noqa: BLE001 - one clear line, then never hang
        msg = str(e).splitlines()[0] if str(e) else ""
        sys.stderr.write(f"ringmpi: error on rank {comm.Get_rank()}: {type(e).__name__}: {msg}\n")
        sys.stderr.flush()
        # give the launcher's output forwarding a moment to drain our pipe: an abort
        # tears the job down and could otherwise drop the one line that says why
        time.sleep(0.3)
        comm.Abort(1)
        return 1  # pragma: no cover


def _interrupted(e, comm, stop, command: str, program: bool) -> int:
    """Leave after SIGINT/SIGTERM: one line, exit 128 + signal, never a hang.

    The interrupted ranks meet in a non-blocking barrier on ``stop`` (a
    communicator nothing else uses). If every rank arrives within ALL_RANKS_S
    (mpiexec forwarded the signal to all), rank 0 prints the line and all leave
    normally. Otherwise the signal reached only some ranks while the others
    compute or wait in the ring: the interrupted ones print the line naming
    their rank and abort the MPI job with the exit status.
    """
    from . import ring

    rank = comm.Get_rank()
    code = e.exit_status
    name = signal.Signals(e.signum).name
    where = f" at {e.where}" if e.where else ""
    if command == "run" and getattr(e, "finished", None) is not None:
        tail = f": {e.finished} finished sequence(s) kept; rerun with --resume"
    elif command == "run":
        tail = ": rerun with --resume"
    else:
        tail = ""
    req = stop.Ibarrier()
    end = time.monotonic() + ALL_RANKS_S
    everyone = bool(req.Test())
    while not everyone and time.monotonic() < end:
        time.sleep(0.005)
        everyone = bool(req.Test())
    if everyone:
        if rank == 0:
            sys.stderr.write(f"ringmpi: interrupted ({name}){where}{tail}\n")
            sys.stderr.flush()
        if ring.abandoned() == 0:
            if program:
                from mpi4py import MPI

                MPI.Finalize()
            return code
    else:
        sys.stderr.write(f"ringmpi: interrupted ({name} on rank {rank}){where}{tail}\n")
        sys.stderr.flush()
    time.sleep(0.3)  # let mpiexec forward the line before the abort tears the job down
    comm.Abort(code)
    return code  # pragma: no cover


def _cmd_run(args, comm) -> int:
    from .files import write_json
    from .job.run import format_summary, run

    summary = run(
        args.inputs,
        args.output,
        comm=comm,
        causal=args.causal,
        layout=args.layout,
        device=args.device,
        scale=args.scale,
        weights=args.weights,
        resume=args.resume,
        quiet=args.quiet,
        max_memory=args.max_memory,
        strided=args.strided_read,
        prefetch=not args.no_prefetch,
        overwrite=args.overwrite,
        compress=args.compress,
    )
    rc = 0
    rank = comm.Get_rank()
    if args.verify:
        from .job.verify import format_verify, verify

        try:
            res = verify(
                args.output, args.inputs, args.weights, comm, max_tokens=args.verify_max_tokens,
                sample_rows=args.verify_sample_rows, quiet=args.quiet,
            )  # fmt: skip
        except interrupt.Interrupted as e:
            e.where = "the verify step (the output is complete)"
            raise
        summary["verify"] = res
        rc = _verify_status(res)
    if rank == 0:
        if not args.quiet:
            print(format_summary(summary))
            if args.verify:
                print(format_verify(summary["verify"]))
        elif args.verify and not summary["verify"]["ok"]:
            print(format_verify(summary["verify"]), file=sys.stderr)
        if args.summary_json:
            write_json(args.summary_json, summary)
        sys.stdout.flush()
    return rc


def _verify_status(res: dict) -> int:
    if res["status"] == "nothing checked":
        return EXIT_UNCHECKED
    return 0 if res["ok"] else EXIT_VERIFY


def _cmd_verify(args, comm) -> int:
    from .job.verify import format_verify, verify

    res = verify(
        args.output, args.inputs, args.weights, comm, max_tokens=args.max_tokens,
        sample_rows=args.sample_rows, seed=args.seed, quiet=args.quiet,
    )  # fmt: skip
    if comm.Get_rank() == 0:
        print(format_verify(res))
    return _verify_status(res)


def _cmd_pack(args) -> int:
    from .job.pack import pack
    from .job.progress import LOG_EVERY

    mpi = sys.modules.get("mpi4py.MPI")
    comm = mpi.COMM_WORLD if mpi is not None and mpi.Is_initialized() else None
    rc = 0
    if comm is None or comm.Get_rank() == 0:
        last = [time.perf_counter()]

        def show(done, total):
            now = time.perf_counter()
            if now - last[0] >= LOG_EVERY:
                last[0] = now
                sys.stderr.write(f"ringmpi pack: {100 * done / max(1, total):.0f}%\n")

        try:
            with interrupt.catching((signal.SIGINT, signal.SIGTERM)):
                res = pack(args.output, args.to, args.compress, args.overwrite, show)
            print(
                f"ringmpi pack: {res['datasets']} dataset(s), {res['bytes'] / 2**20:,.1f} MiB "
                f"-> {args.to} ({res['file_bytes'] / 2**20:,.1f} MiB on disk)"
            )
        except CollectiveError as e:
            sys.stderr.write(f"ringmpi: error: {e}\n")
            rc = EXIT_INPUT
        except interrupt.Interrupted as e:
            sys.stderr.write(f"ringmpi pack: interrupted ({signal.Signals(e.signum).name})\n")
            rc = e.exit_status
    if comm is not None:
        rc = comm.bcast(rc, root=0)
    return rc


def _cmd_make_data(args) -> int:
    from .job.sample import make_data

    mpi = sys.modules.get("mpi4py.MPI")
    comm = mpi.COMM_WORLD if mpi is not None and mpi.Is_initialized() else None
    if comm is None or comm.Get_rank() == 0:
        d = os.path.dirname(os.path.abspath(args.output))
        os.makedirs(d, exist_ok=True)
        paths = make_data(
            args.output,
            seq_len=args.seq_len,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            sequences=args.sequences,
            batch_axis=args.batch_axis,
            shards=args.shards,
            compression=None if args.compression == "none" else args.compression,
            dtype=args.dtype,
            features=args.features,
            weights=args.weights,
            seed=args.seed,
        )
        print("wrote " + " ".join(paths))
    if comm is not None:
        comm.Barrier()
    return 0


def _cmd_info() -> int:
    import h5py
    import numpy as np

    from . import __version__

    lines = [
        f"ringmpi   {__version__}",
        f"python    {platform.python_version()} ({sys.executable})",
        f"numpy     {np.__version__}",
        f"h5py      {h5py.version.version} (HDF5 {h5py.version.hdf5_version})",
    ]
    try:
        import mpi4py
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        lib = MPI.Get_library_version().strip().splitlines()[0]
        levels = {
            MPI.THREAD_SINGLE: "single",
            MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple",
        }
        lines += [
            f"mpi4py    {mpi4py.__version__}",
            f"MPI       {lib} (standard {'.'.join(map(str, MPI.Get_version()))})",
            f"ranks     {comm.Get_size()} (thread level {levels.get(MPI.Query_thread(), '?')})",
        ]
        rank = comm.Get_rank()
    except ImportError as e:
        lines.append(f"mpi4py    not available ({e})")
        rank = 0
    from .job.run import gpu_probe

    ok, why = gpu_probe()
    if not ok and why.startswith("no GPU found: "):
        lines.append(f"gpu       no GPU found (CPU will be used): {why[len('no GPU found: ') :]}")
    elif not ok:
        lines.append(f"gpu       none ({why}; CPU will be used)")
    else:
        try:
            from . import gpu

            info = gpu.info()
            if isinstance(info, dict):
                lines += [f"gpu       {k}: {v}" for k, v in info.items() if v is not None]
            else:
                lines.append(f"gpu       {info}")
            lines.append(f"cuda-aware MPI: {gpu.cuda_aware()}")
        except Exception as e:  # noqa: BLE001 - a broken driver must not break `info`
            lines.append(f"gpu       unavailable ({type(e).__name__}: {e}) (CPU will be used)")
    lines.append(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}")
    if rank == 0:
        print("\n".join(lines))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``ringmpi`` console script and of ``python -m ringmpi``."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "plan":
        from .plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "run":
        check_launch(_comm(), exit=True)  # P tasks but a world of 1: one line, exit 2
        rc = _guard(_cmd_run, args, program)
    elif args.command == "verify":
        rc = _guard(_cmd_verify, args, program)
    elif args.command == "make-data":
        rc = _cmd_make_data(args)
    elif args.command == "pack":
        rc = _cmd_pack(args)
    else:
        rc = _cmd_info()
    return rc
