"""The ``ringmpi`` command: run, make-data, verify, pack, info, bench.

Multi-rank subcommands (``run``, ``verify``) are started under MPI, e.g.

    mpiexec -n 4 python -m mpi4py -m ringmpi run data/sample/sample.h5 -o out.h5 --causal

A problem with the input or output (the same on every rank, found collectively)
prints one line on rank 0 and every rank exits with status 2. Any other error
prints one line naming the rank and aborts the whole MPI job with status 1, so
a batch job never hangs.

Ctrl-C (SIGINT) or SIGTERM, to ``mpiexec`` (which forwards it to every rank) or
to one rank, stops ``run`` and ``verify`` within seconds, also inside the
kernels (:mod:`ringmpi.runtime.interrupt`): one line "interrupted at sequence i, ring
step s", exit status 130 (SIGINT) or 143 (SIGTERM). When every rank got the
signal they leave together; when only some did, those abort the MPI job.
"""

from __future__ import annotations

import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from typing import Optional

from ..collective import CollectiveError
from ..cpu import isa as cpu_isa
from ..runtime import interrupt
from ..runtime.launch import check_launch
from .parser import ALL_RANKS_S, EXIT_INPUT, EXIT_UNCHECKED, EXIT_VERIFY, build_parser

__all__ = [
    "main",
]


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
    from .. import ring

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
    from ..job.options import options_from_args
    from ..job.output.layout import check_side_file
    from ..job.report import format_summary
    from ..job.run import run
    from ..runtime.files import write_json
    from .parser import spec_from_args

    if args.summary_json:  # refused before anything is computed, on every rank alike
        inputs = list(args.inputs) + ([args.weights] if args.weights else [])
        check_side_file(args.summary_json, "--summary-json", args.output, inputs)
    summary = run(
        args.inputs, args.output, spec_from_args(args), options_from_args(args), comm=comm
    )
    rc = 0
    rank = comm.Get_rank()
    if args.verify:
        from ..job.verify import format_verify, verify

        try:
            res = verify(
                args.output,
                args.inputs,
                args.weights,
                comm,
                max_tokens=args.verify_max_tokens,
                sample_rows=args.verify_sample_rows,
                quiet=args.quiet,
                full=args.verify_full,
            )
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
    from ..job.verify import compare, format_compare, format_verify, verify

    if args.against is not None:
        res = compare(args.output, args.against, comm)
        if comm.Get_rank() == 0:
            print(format_compare(res))
        return 0 if res["identical"] else EXIT_VERIFY
    res = verify(
        args.output,
        args.inputs,
        args.weights,
        comm,
        max_tokens=args.max_tokens,
        sample_rows=args.sample_rows,
        seed=args.seed,
        quiet=args.quiet,
        full=args.full,
    )
    if comm.Get_rank() == 0:
        print(format_verify(res))
    return _verify_status(res)


def _cmd_pack(args) -> int:
    from ..job.output.pack import pack
    from ..job.report import LOG_EVERY

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
    from .make_data import make_data

    mpi = sys.modules.get("mpi4py.MPI")
    comm = mpi.COMM_WORLD if mpi is not None and mpi.Is_initialized() else None
    if comm is None or comm.Get_rank() == 0:
        d = os.path.dirname(os.path.abspath(args.output))
        os.makedirs(d, exist_ok=True)
        try:
            paths = make_data(
                args.output,
                seq_len=args.seq_len,
                heads=args.heads,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                value_dim=args.value_dim,
                sequences=args.sequences,
                batch_axis=args.batch_axis,
                shards=args.shards,
                compression=None if args.compression == "none" else args.compression,
                dtype=args.dtype,
                features=args.features,
                weights=args.weights,
                seed=args.seed,
                packed=args.packed,
                kv_tokens=args.kv_tokens,
                bias=args.bias,
                values=args.values,
                slices=args.slices,
            )
        except ValueError as e:
            sys.stderr.write(f"ringmpi: error: make-data: {e}\n")
            paths = None
        if paths:
            print("wrote " + " ".join(paths))
    rc = 0
    if comm is None or comm.Get_rank() == 0:
        rc = 0 if paths else EXIT_INPUT
    if comm is not None:
        rc = comm.bcast(rc, root=0)
    return rc


def _cpu_kernel() -> str:
    """The CPU tile in use and its ISA path, e.g. 'fused, avx2 (host runs avx512, avx2, scalar)'."""
    try:
        from ..cpu import fused

        host = ", ".join(cpu_isa.host_isas())
        if fused.available():
            return f"fused, {fused.isa()} (host runs {host}; RINGMPI_CPU_ISA picks one)"
        return f"numpy (fused unavailable: {fused.unavailable_reason()})"
    except Exception as e:  # noqa: BLE001 - e.g. a bad RINGMPI_CPU_ISA: report it, do not fail
        return f"numpy ({type(e).__name__}: {e})"


def _cmd_info() -> int:
    import h5py
    import numpy as np

    from .. import __version__

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
        lib = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
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
    from ..job.run import gpu_probe

    ok, why = gpu_probe()
    if not ok and why.startswith("no GPU found: "):
        lines.append(f"gpu       no GPU found (CPU will be used): {why[len('no GPU found: ') :]}")
    elif not ok:
        lines.append(f"gpu       none ({why}; CPU will be used)")
    else:
        try:
            from .. import gpu

            info = gpu.info()
            if isinstance(info, dict):
                lines += [f"gpu       {k}: {v}" for k, v in info.items() if v is not None]
            else:
                lines.append(f"gpu       {info}")
            lines.append(f"cuda-aware MPI: {gpu.cuda_aware()}")
        except Exception as e:  # noqa: BLE001 - a broken driver must not break `info`
            lines.append(f"gpu       unavailable ({type(e).__name__}: {e}) (CPU will be used)")
    lines.append(f"cpu tile  {_cpu_kernel()}")
    try:
        from ..backend import select

        lines.append(f"cpu tiles {select(np.zeros(1, np.float32)).describe()}")
    except Exception as e:  # noqa: BLE001 - e.g. a bad RINGMPI_CPU_KERNEL: report it, do not fail
        lines.append(f"cpu tiles ({type(e).__name__}: {e})")
    lines.append(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}")
    from ..runtime import env

    lines += [f"env       {x}" for x in env.current()] or ["env       (no ringmpi variable set)"]
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "verify" and bool(args.inputs) == (args.against is not None):
        # the same on every rank: each exits 2 with the usage line, no collective needed
        parser.error("verify takes the run's INPUT files or --against OTHER (one of the two)")
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
