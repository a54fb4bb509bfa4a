"""The ``sdpa-ref`` command line's parser: the commands, their options and the types that check them
(each command's work is :mod:`.commands`'s, which runs the one ``args.command`` names)."""

from __future__ import annotations

import argparse

from ..harness.budget import describe_limits
from ..harness.lowp import TEST_DTYPES
from .output import _add_format

__all__ = ["build_parser"]


def _tolerance(text):
    """An argparse type: a finite number >= 0 (NaN would pass everything, a negative one nothing)."""
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be a number, but got {text!r}") from None
    if not (t >= 0 and t != float("inf")):
        raise argparse.ArgumentTypeError(f"should be a finite number >= 0, but got {text!r}")
    return t


def _lse_empty(text):
    """An argparse type: ``-inf``, ``+inf`` or a finite number (what an LSE holds on a row with no key)."""
    if text in ("-inf", "+inf", "inf"):
        return text
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if x != x or x in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"should be -inf, +inf or a finite number, but got {text!r}")
    return x


def _seconds(text):
    """An argparse type: a finite number of seconds > 0."""
    t = _tolerance(text)
    if t == 0:
        raise argparse.ArgumentTypeError(f"should be a number of seconds > 0, but got {text!r}")
    return t


def _int_at_least(lo):
    """An argparse type: an int >= ``lo`` (argparse names the flag in its error)."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < lo:
            raise argparse.ArgumentTypeError(f"should be an int >= {lo}, but got {text!r}")
        return n
    return parse


_positive = _int_at_least(1)
_seed = _int_at_least(0)                    # a non-negative seed


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="sdpa-ref",
        description=(
            "sdpa_ref: a pure-NumPy reference for softmax and scaled dot-product attention, "
            "with hand-derived gradients proven by finite differences."
        ),
        epilog="Run 'sdpa-ref COMMAND --help' for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"sdpa_ref {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "check",
        help="verify this installation: gradient checks of every backward over a grid of options",
        description=(
            "Prove every backward in the package (softmax, log-softmax, attention) over a grid "
            "of options: no/bool/float masks, bias, causal in both alignments, windows, softcap, "
            "ALiBi, per-batch lengths, GQA, dropout with an explicit keep mask, L<S, L>S, Ev!=E, "
            "broadcast batch, and each fully_masked policy. Each attention case checks the VJP and JVP "
            "against central differences (fd), the VJP and JVP against the complex step (cs), "
            "FlashAttention's lse backward against the default (lse) and <g,Jt> = <J^T g,t> (ip). "
            "Prints one line per case and exits 1 if any case fails."
        ),
    )
    from ..harness.grid import gradcheck_grid

    share = round(100 * len(gradcheck_grid(quick=True)) / len(gradcheck_grid()))
    p.add_argument("--quick", action="store_true", help=f"run a covering subset of the grid ({share}%% of its cases)")
    p.add_argument("--filter", metavar="TEXT", default=None,
                   help="run only the cases whose name contains TEXT (e.g. 'softcap' or 'mask=bool')")
    _add_format(p)
    p.add_argument("--rtol", type=_tolerance, default=None, help="relative tolerance (default: 1e-7)")
    p.add_argument("--atol", type=_tolerance, default=None, help="absolute floor (default: 1e-9)")
    p.add_argument("--complex-rtol", type=_tolerance, default=None,
                   help="relative tolerance of the complex-step checks (default: 1e-12)")

    p = sub.add_parser(
        "diagnose",
        help="measure softmax saturation, entropy and gradient norms as d_k grows, per scaling",
        description=(
            "Sweep d_k and measure, for each scaling choice (none: 1, sqrt: 1/sqrt(d_k), linear: "
            "1/d_k), the score std (beside the theory's sqrt(d_k)*scale), the softmax entropy, "
            "the top weight, the share of saturated rows (top weight > 0.9), and the norms of "
            "the gradients with respect to the scores, the queries and the keys, all computed "
            "by the reference's forward and backward on standard normal q, k."
        ),
        epilog="Example: sdpa-ref diagnose --d-k 16 64 256 --format json",
    )
    p.add_argument("--d-k", type=_positive, nargs="+", default=None, metavar="D",
                   help="key widths to sweep (default: 4 8 16 ... 1024)")
    p.add_argument("--n-keys", type=_positive, default=50, help="keys per query (default: 50)")
    p.add_argument("--n-queries", type=_positive, default=32, help="queries per trial (default: 32)")
    p.add_argument("--trials", type=_positive, default=64, help="independent draws per point (default: 64)")
    p.add_argument("--scales", nargs="+", choices=("none", "sqrt", "linear"), default=["none", "sqrt", "linear"],
                   help="scaling choices to compare (default: all three)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed; the result is deterministic (default: 0)")
    _add_format(p)
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw normalized entropy, max weight and gradient norm against d_k "
                        "(needs matplotlib: python -m pip install matplotlib)")

    p = sub.add_parser(
        "saturation",
        help="see it yourself: top-5 softmax weights of one query, raw vs scaled scores",
        description=(
            "Draw one standard normal query and N keys of width d_k and print the five largest "
            "softmax weights of the raw scores q.k and of the scaled scores q.k/sqrt(d_k)."
        ),
    )
    p.add_argument("--d-k", type=int, default=128, help="key width (default: 128)")
    p.add_argument("--n-keys", type=int, default=50, help="number of keys (default: 50)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default: 0)")
    _add_format(p)

    p = sub.add_parser(
        "vectors",
        help="write golden test vectors (.npz per case + manifest.json) for implementations outside Python",
        description=(
            "Write one .npz per case of the suite (inputs, options as JSON bytes, the reference's output, "
            "LSE, a seeded grad_out and every gradient, in float64; below float64 also the honest ensemble's "
            "error per quantity, for the relative rule) and manifest.json with the suite and package "
            "versions, each file's sha256 and the tolerance rule. The files are byte-deterministic. bfloat16 "
            "and float8 need the lowp extra (ml_dtypes); their arrays are stored as uint16/uint8 bit patterns."
        ),
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write into (created if missing)")
    p.add_argument("--suite", choices=("quick", "full"), default="quick", help="case suite (default: quick)")
    p.add_argument("--cases", metavar="FILE", default=None,
                   help="your own cases, a JSON or TOML case file, instead of --suite (see docs/guide-cases.md); the "
                        "manifest stores their definitions, so 'sdpa-ref verify' regenerates them anywhere")
    p.add_argument("--dtype", choices=TEST_DTYPES, default="float64",
                   help="dtype of the stored inputs (default: float64)")
    p.add_argument("--layout", choices=("thd", "paged", "thd_paged", "gathered"), default=None,
                   help="store the cases that have such a form as a varlen kernel (thd: packed rows with "
                        "cu_seqlens_q/k), a paged KV-cache kernel (paged: pages of 16 with cache_seqlens and "
                        "block_table) or packed queries against that cache (thd_paged: cu_seqlens_q with the "
                        "pages) takes them, results and gradients too (not with fp8); or every case with "
                        "top-k gather_kv_indices for a sparse kernel (gathered); format 4")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table",
                   help="what to print: a summary (table), or every file with its sha256 and size (json, csv)")

    p = sub.add_parser(
        "verify",
        help="re-check golden vectors against their manifest (hashes) and a fresh computation",
        description="Check every file listed in OUT_DIR/manifest.json: its sha256 (before it is parsed), "
                    "then its bytes against the case regenerated from the suite's definition (the reference is "
                    "precision='reproducible': the same bits on every machine). Only regular files inside "
                    "OUT_DIR, named plainly, are read; a set written with --cases is regenerated from the case "
                    "definitions its manifest stores. manifest.json itself must be what a fresh write would give, "
                    "byte for byte (every field a judge reads: the dtype, the rule and its k, the file list; "
                    "package_version and cases_file excepted), with no key twice. Bounded work: the cases are "
                    "regenerated one at a time in the manifest's order, and a set past the limits (VERIFY_LIMITS) "
                    "is refused before anything is computed; " + describe_limits() + ". Exit 1 on any mismatch, 2 on "
                    "a malformed or refused manifest.",
    )
    p.add_argument("out_dir", metavar="OUT_DIR")
    _add_format(p)

    p = sub.add_parser(
        "conform",
        help="judge an importable attention implementation against the reference",
        description=(
            "Run MODULE:FUNCTION (called as f(query, key, value, **options) on NumPy arrays) over the case "
            "suite at each dtype and judge it against the float64 reference. The default rule is "
            "FlashAttention's form with a fair baseline: max|impl-ref64| <= 3 * max|honest-ref64| + the "
            "dtype's rounding of the output, where honest is the worst of an ensemble of honest kernels in the "
            "test dtype (computed in a fixed order: the same on every machine). bfloat16 and float8 need the "
            "lowp extra (ml_dtypes). Options the function does not take (its keyword parameters, or a "
            "`supports` attribute) are never passed: cases that need them are skipped; a function that always "
            "applies an option (a `requires` attribute, or --requires) is judged only on cases that use it. "
            "The function runs in a child process (unless --in-process), which the harness kills with its "
            "process group at the time limit; one that dies, exits, forks and exits, hangs or never answers "
            "fails its case and the next case gets a fresh process; the reference and the verdict stay in "
            "this one. The current directory is importable, after the installed packages. "
            "Exit status: 0 conforms, 1 something failed, 2 a usage error or an implementation that cannot "
            "be loaded, 3 nothing judged (every case skipped: never a pass)."
        ),
        epilog="Example: sdpa-ref conform sdpa_ref.adapters.pytorch:forward "
               "--backward sdpa_ref.adapters.pytorch:backward --dtype float32 float16",
    )
    p.add_argument("target", metavar="MODULE:FUNCTION", help="the forward to judge")
    p.add_argument("--backward", metavar="MODULE:FUNCTION", default=None,
                   help="f(grad_out, query, key, value, **options) -> (dq, dk, dv[, dbias])")
    p.add_argument("--suite", choices=("quick", "full"), default="quick")
    p.add_argument("--cases", metavar="FILE", default=None,
                   help="judge on your own cases, a JSON or TOML case file, instead of --suite "
                        "(see docs/guide-cases.md)")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=TEST_DTYPES,
                   help="test dtypes (default: float32)")
    p.add_argument("--rule", choices=("relative", "fixed", "ulp"), default="relative",
                   help="relative (default), fixed (--rtol/--atol) or ulp (--max-ulps)")
    p.add_argument("--rtol", type=_tolerance, default=None, help="with --rule fixed (default: 1e-12)")
    p.add_argument("--atol", type=_tolerance, default=None, help="with --rule fixed (default: 1e-12)")
    p.add_argument("--max-ulps", type=_tolerance, default=None, help="with --rule ulp (default: 4)")
    p.add_argument("--supports", nargs="+", default=None, metavar="OPTION",
                   help="override the options the function understands")
    p.add_argument("--requires", nargs="+", default=None, metavar="OPTION",
                   help="options the function always applies (e.g. is_causal for a causal-only kernel): judge it "
                        "only on cases that use them (default: its `requires` attribute, else none)")
    p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="time limit per case and dtype (forward and backward together); a case that runs past "
                        "it fails and the run goes on (default: 600 in the child process, none --in-process)")
    p.add_argument("--lse", choices=("e", "2"), default=None,
                   help="the function returns (out, lse), the log-sum-exp (..., H, L) in this base (e: "
                        "FlashAttention, cuDNN; 2: FlashInfer), float32 for float32 and narrower inputs: judge it too")
    p.add_argument("--lse-empty", type=_lse_empty, default="-inf", metavar="VALUE",
                   help="with --lse, what a row with no allowed key holds: -inf (default; FlashAttention 3/4), "
                        "+inf (FlashAttention 2) or a number")
    p.add_argument("--layout", choices=("bhsd", "bshd", "gathered", "thd", "paged", "thd_paged"), default="bhsd",
                   help="how the function takes its arrays: bhsd (default; (B, H, L, E), PyTorch's), bshd "
                        "((B, L, H, E), FlashAttention's and JAX's), gathered (a top-k sparse kernel), thd (packed "
                        "varlen with cu_seqlens_q/k), paged (a paged KV cache), thd_paged (packed queries against "
                        "one); see check_implementation")
    p.add_argument("--deterministic", action="store_true",
                   help="run the forward and the backward a second time: other bits fail the case")
    p.add_argument("--no-guards", action="store_true",
                   help="skip the guarded runs (by default each case runs again with every input inside a larger "
                        "buffer, NaN then 16384 before, after and between its rows: a kernel that reads outside "
                        "its inputs fails)")
    p.add_argument("--in-process", action="store_true",
                   help="run the function in this process, as check_implementation does in Python: faster to "
                        "start, easier to debug, and defenceless against code that exits the process, "
                        "monkeypatches the harness or ignores the time limit")
    _add_format(p)

    p = sub.add_parser(
        "info",
        help="what this installation runs: version, compiled kernels and SIMD level, BLAS and threads, dtypes",
        description=(
            "Print the package's version; whether the optional compiled kernels (built when the package was "
            "installed) are in use, and if not why and what that costs; the SIMD build of the fast row passes "
            "in use and those this CPU runs; the BLAS (threadpoolctl's view) and the package's own thread "
            "count; numpy's version; and the dtypes available (bfloat16 and float8 need ml_dtypes)."
        ),
    )
    _add_format(p)
    return parser
