"""The ``ringmpi`` command line: the argument parser, its help texts and exit statuses.

Kept apart from :mod:`ringmpi.cli.main` (what each command does) so that ``--help``
imports nothing heavy. The ``run`` subcommand's flags are the second half of this module.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

from ..job.output import MODES as OUTPUT_MODES
from ..job.resources import parse_size
from ..spec import AttentionSpec, cli_fields

__all__ = [
    "build_parser",
    "spec_from_args",
    "EXIT_INPUT",
    "EXIT_VERIFY",
    "EXIT_UNCHECKED",
    "add_run_command",
    "add_verify_flags",
    "positive",
    "seconds",
    "SCHEMA",
    "RUN_EXAMPLES",
    "MAX_TOKENS",
    "SAMPLE_ROWS",
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
  ringmpi make-data gl.h5 --seq-len 2048 --slices global_local:64:8   # a mask of slices
"""
VERIFY_EXAMPLES = """examples:
  ringmpi verify out.h5 data/sample/sample.h5
  mpiexec -n 4 python -m mpi4py -m ringmpi verify out.h5 'shards/seq.part*.h5'
  ringmpi verify out.h5 big.h5 --full                            # every row (slow)
  ringmpi verify out_p4.h5 --against out_p2.h5                    # bit for bit, no inputs

exit status: 0 passed (something checked, nothing failed), 3 failed, 4 nothing checked;
with --against: 0 identical, 3 different
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
    m.add_argument(
        "--value-dim",
        type=int,
        default=None,
        help="width Dv of v (default: the head dimension; e.g. 192 / 128 for multi-head latent "
        "attention)",
    )
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
        "--slices",
        metavar="NAME:ARGS",
        help="a mask of slices for each sequence (writes an int64 'slices' (n, 5)), by its "
        "builder as 'ringmpi plan --slices' takes it, over --seq-len tokens, e.g. "
        "global_local:64:8, prefix_lm:256, shared_prefix:256:128,128, block_sparse:64:0.25:1",
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
    v.add_argument(
        "inputs", nargs="*", metavar="INPUT", help="the inputs of that run (not with --against)"
    )
    v.add_argument(
        "--against",
        metavar="OTHER",
        help="compare OUTPUT with another output bit for bit instead (every out and lse): "
        "IDENTICAL, or where they first differ",
    )
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
        description="The planner; all arguments are passed to ringmpi.cli.plan.",
    )
    sub.add_parser(
        "bench",
        help="benchmarks (see 'ringmpi bench --help')",
        add_help=False,
        description="Benchmarks; all arguments are passed to ringmpi.cli.bench.",
    )
    return p


# ----------------------------------------------------------------------
# The ``ringmpi run`` command line: its flags, help texts and value types.
#
# :func:`build_parser` adds this subcommand beside the others; nothing here imports
# anything heavy, so that ``ringmpi run --help`` is fast.
# The attention flags are the fields of :class:`ringmpi.spec.AttentionSpec`
# (:func:`ringmpi.spec.cli_fields`); the job's flags are the rest.


MAX_TOKENS = 4096  # = ringmpi.job.verify.MAX_TOKENS (not imported: keeps --help fast)
SAMPLE_ROWS = 2048  # = ringmpi.job.verify.SAMPLE_ROWS

SCHEMA = """input schema (full contract: data/README.md):
  q (S, H, D), k (S, Hkv, D), v (S, Hkv, Dv; Dv = D or not), H % Hkv == 0, float16/32/64,
  token-major (not (H, S, D));
  several sequences: a batch axis q (B, S, H, D), or one group per sequence; or x + --weights
  packed sequences: integer cu_seqlens (n+1,) beside q; cross-attention: k/v of another length
  a mask of slices: integer slices (n, 5) beside q, rows (q_start, q_end, k_start, k_end, kind
  0 full 1 causal 2 inv_causal 3 bi_causal), the sequence's whole mask (--layout balanced)
output: out (S, H, Dv) and lse (H, S) per sequence: virtual datasets over OUTPUT.parts/, or
  one file written by all ranks where h5py has MPI (--output-mode)
"""

RUN_EXAMPLES = """examples:
  mpiexec -n 4 python -m mpi4py -m ringmpi run data/sample/sample.h5 -o out.h5 --causal --verify
  mpiexec -n 8 ringmpi run 'shards/seq.part*.h5' -o out.h5 --layout striped --summary-json s.json
  mpiexec -n 4 ringmpi run feats.h5 --weights feats-weights.h5 -o out.h5
  mpiexec -n 4 ringmpi run packed.h5 -o out.h5 --causal --window 128    # sliding window
  mpiexec -n 4 ringmpi run feats.h5 --weights feats-weights.h5 -o out.h5 --causal --rope
  mpiexec -n 4 ringmpi run in.h5 -o out.h5 --causal --resume     # after Ctrl-C or a crash
  ringmpi pack out.h5 -o result.h5 --compress gzip               # one self-contained file

exit status: 0 done, 2 bad input/output, 3 verify failed, 4 verify checked nothing,
130/143 interrupted (SIGINT/SIGTERM: rerun with --resume), 1 or 124 other failures
"""


def _number(text: str, ok: Callable[[float], bool], what: str) -> float:
    """``text`` as a finite float for which ``ok`` holds, else an argparse error naming ``what``."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not (ok(x) and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}")
    return x


def positive(text: str) -> float:
    """A finite number > 0 (``--rope-theta``, ``--rope-scale``)."""
    return _number(text, lambda x: x > 0, "a positive number")


def seconds(text: str) -> float:
    """A finite number of seconds >= 0 (``--checkpoint-every``)."""
    return _number(text, lambda x: x >= 0, "a number of seconds >= 0")


def add_verify_flags(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """Add the flags that choose what verify checks: max tokens in full, sampled rows, full.

    ``ringmpi verify`` takes them as they are; ``ringmpi run`` with ``prefix``
    "verify-" (``--verify-max-tokens``, ...: what its ``--verify`` checks).

    Parameters
    ----------
    p : argparse.ArgumentParser
        The subcommand's parser.
    prefix : str
        Put before each flag's name (its help then starts with "--verify: ").
    """
    note = "--verify: " if prefix else ""
    p.add_argument(
        f"--{prefix}max-tokens",
        type=int,
        default=MAX_TOKENS,
        metavar="N",
        help=note + "check sequences up to N tokens in full (default %(default)s)",
    )
    p.add_argument(
        f"--{prefix}sample-rows",
        type=int,
        default=None,
        metavar="R",
        help=note + "check R random query rows per head of longer sequences "
        f"(default S/128 within [256, {SAMPLE_ROWS}]; 0 skips them)",
    )
    p.add_argument(
        f"--{prefix}full",
        action="store_true",
        help=note + "check every row of every sequence, whatever its length (slow: the run's "
        "flops in numpy float64)",
    )


def add_run_command(sub, fmt) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``sub`` (the subparsers of ``ringmpi``) and return it.

    Parameters
    ----------
    sub : argparse subparsers action
        What ``ArgumentParser.add_subparsers`` returned.
    fmt : type
        The help formatter class of the ``ringmpi`` parser.
    """
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
    for _name, flag, kw in cli_fields():  # the attention options: AttentionSpec's fields
        r.add_argument(flag, **kw)
    alibi = r.add_mutually_exclusive_group()
    alibi.add_argument(
        "--alibi",
        action="store_true",
        help="ALiBi with the standard geometric slopes for the input's H heads: score += "
        "-slope_h*|i-j| by global position (within packed sequences; bottom-right aligned "
        "for cross-attention)",
    )
    alibi.add_argument(
        "--alibi-slopes",
        dest="alibi_slopes_file",
        metavar="FILE",
        help="ALiBi with the H slopes of FILE (.npy, or text: numbers split by spaces/commas)",
    )
    r.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="auto: GPU when CuPy sees one on every rank (default: auto)",
    )
    r.add_argument(
        "--rope",
        action="store_true",
        help="rotary position embeddings (rotate-half, as GPT-NeoX/Llama) on the projected q "
        "and k of features inputs (x + --weights), at each token's global position within "
        "its packed sequence",
    )
    r.add_argument(
        "--rope-theta",
        type=positive,
        default=10000.0,
        metavar="T",
        help="RoPE frequency base (default %(default)s)",
    )
    r.add_argument(
        "--rope-scale",
        type=positive,
        default=1.0,
        metavar="S",
        help="RoPE linear position interpolation: positions are divided by S (default 1)",
    )
    r.add_argument("--weights", help="projection weights file for raw-feature inputs 'x'")
    r.add_argument("--resume", action="store_true", help="keep sequences an earlier run completed")
    r.add_argument(
        "--checkpoint-every",
        type=seconds,
        default=600.0,
        metavar="SECONDS",
        help="save each rank's ring state of the sequence being computed at most every SECONDS "
        "(between ring steps), so --resume continues it mid-sequence; 0: never (default 600)",
    )
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
        "--output-mode",
        choices=OUTPUT_MODES,
        default="auto",
        help="parts: per-rank part files + a virtual-dataset OUTPUT; single: one OUTPUT "
        "written collectively by all ranks (parallel HDF5: h5py built with MPI, one ring); "
        "auto: single where h5py has MPI, else parts (default: auto)",
    )
    r.add_argument(
        "--ring-size",
        metavar="R|auto",
        default=None,
        help="split the ranks into rings of R ranks, one sequence per ring at a time "
        "(default: one ring of all ranks); auto: a ring size per sequence (rings of one "
        "for short work, larger rings for long sequences)",
    )
    r.add_argument(
        "--verify", action="store_true", help="compare with the dense reference afterwards"
    )
    add_verify_flags(r, prefix="verify-")
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
    return r
