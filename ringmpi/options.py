"""The ``ringmpi`` command line: the argument parser, its help texts and exit statuses.

Kept apart from :mod:`ringmpi.cli` (what each command does) so that ``--help``
imports nothing heavy. The ``run`` subcommand's flags are :mod:`ringmpi.options_run`.
"""

from __future__ import annotations

import argparse
import os
import sys

from .options_run import MAX_TOKENS as MAX_TOKENS  # re-exported: they lived here
from .options_run import RUN_EXAMPLES as RUN_EXAMPLES
from .options_run import SAMPLE_ROWS as SAMPLE_ROWS
from .options_run import SCHEMA as SCHEMA
from .options_run import add_run_command, add_verify_flags
from .spec import AttentionSpec, cli_fields, parse_scale, parse_window

__all__ = [
    "build_parser",
    "spec_from_args",
    "parse_scale",
    "parse_window",
    "EXIT_INPUT",
    "EXIT_VERIFY",
    "EXIT_UNCHECKED",
]

EXIT_INPUT = 2
EXIT_VERIFY = 3  # verify found a wrong result
EXIT_UNCHECKED = 4  # verify checked nothing (every sequence skipped)
# seconds an interrupted rank waits for the others to be interrupted too before it aborts
ALL_RANKS_S = 2.0

PACK_EXAMPLES = """examples:
  ringmpi pack out.h5 -o result.h5
  ringmpi pack out.h5 -o result.h5 --compress gzip
"""
MAKE_EXAMPLES = """examples:
  ringmpi make-data data/sample/sample.h5
  ringmpi make-data big.h5 --seq-len 262144 --heads 16 --kv-heads 4 --shards 8
  ringmpi make-data multi.h5 --sequences 4 --batch-axis --compression gzip
  ringmpi make-data feats.h5 --features 256      # also writes feats-weights.h5
  ringmpi make-data packed.h5 --packed 3,257,1,439,313   # cu_seqlens: 5 packed sequences
  ringmpi make-data cross.h5 --seq-len 300 --kv-tokens 1000   # q 300 tokens, k/v 1000
"""
VERIFY_EXAMPLES = """examples:
  ringmpi verify out.h5 data/sample/sample.h5
  mpiexec -n 4 python -m mpi4py -m ringmpi verify out.h5 'shards/seq.part*.h5'
  ringmpi verify out.h5 big.h5 --full                            # every row (slow)

exit status: 0 passed (something checked, nothing failed), 3 failed, 4 nothing checked
"""
INFO_EXAMPLES = """examples:
  ringmpi info
  mpiexec -n 2 python -m mpi4py -m ringmpi info
"""


def parse_packed(text: str):
    """``--packed``: one integer N (N sequences of seeded random lengths) or a list of lengths."""
    parts = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        vals = [int(t) for t in parts]
    except ValueError:
        vals = []
    if not vals or min(vals) < 0 or (len(vals) == 1 and "," not in str(text) and vals[0] < 1):
        raise argparse.ArgumentTypeError(
            f"expected a count N >= 1 or comma-separated lengths (e.g. 3,257,1), not {text!r}"
        )
    return vals if "," in str(text) else vals[0]


def spec_from_args(args) -> AttentionSpec:
    """The job's :class:`ringmpi.spec.AttentionSpec` from parsed ``ringmpi run`` flags."""
    return AttentionSpec(**{name: getattr(args, name) for name, _flag, _kw in cli_fields()})


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

    add_run_command(sub, fmt)

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
    m.add_argument(
        "--bias", action="store_true", help="with --features: also write biases bq, bk, bv"
    )
    m.add_argument(
        "--packed",
        type=parse_packed,
        metavar="N|L1,L2,...",
        help="packed sequences (writes cu_seqlens): N sequences of seeded random lengths "
        "summing to --seq-len, or the lengths themselves (their sum replaces --seq-len)",
    )
    m.add_argument(
        "--kv-tokens",
        type=int,
        metavar="N",
        help="cross-attention: k and v (or x_kv with --features) get N tokens, q --seq-len; "
        "with --packed, cu_seqlens_k splits them in proportion to the q lengths",
    )
    m.add_argument(
        "--values",
        choices=("normal", "realistic"),
        default="normal",
        help="q, k, v standard normal, or shaped like real activations (k mean 0.5, v mean 1, "
        "spread 0.1: float32 errors do not cancel)",
    )
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
    add_verify_flags(v)
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
