"""The ``ringmpi run`` command line: its flags, help texts and value types.

:func:`ringmpi.options.build_parser` adds this subcommand beside the others; like
:mod:`ringmpi.options` it imports nothing heavy, so that ``ringmpi run --help`` is fast.
The attention flags are the fields of :class:`ringmpi.spec.AttentionSpec`
(:func:`ringmpi.spec.cli_fields`); the job's flags are the rest.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from .job.budget import parse_size
from .spec import cli_fields

__all__ = ["add_run_command", "add_verify_flags", "positive", "seconds", "SCHEMA",
           "RUN_EXAMPLES", "MAX_TOKENS", "SAMPLE_ROWS"]  # fmt: skip

MAX_TOKENS = 4096  # = ringmpi.job.verify.MAX_TOKENS (not imported: keeps --help fast)
SAMPLE_ROWS = 2048  # = ringmpi.job.verify.SAMPLE_ROWS

SCHEMA = """input schema (full contract: data/README.md):
  q (S, H, D), k and v (S, Hkv, D), H % Hkv == 0, float16/32/64, token-major (not (H, S, D));
  several sequences: a batch axis q (B, S, H, D), or one group per sequence; or x + --weights
  packed sequences: integer cu_seqlens (n+1,) beside q; cross-attention: k/v of another length
output: out (S, H, D) and lse (H, S) per sequence: virtual datasets over OUTPUT.parts/, or
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
        choices=("auto", "parts", "single"),
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
