"""Print a sha256 per problem of what ``precision="reproducible"``'s second order computes: the double backward
(the gradients and their tangent, with ``grad_lse`` and the cotangents' tangents) and the Hessian-vector product.

    python tests/repro_second_digest.py [--block-entries N]

The problems cover every option the first order's digest does (``tests/repro_digest.py``, whose problems are
reused), with tangents of every input; inputs from ``Generator.uniform`` (the same bits on every machine).
``--block-entries`` changes how the exact products and the element-wise passes are cut; the bits must not change.
``tests/test_engines_reproducible_second.py`` runs this under several thread, BLAS and SIMD settings.
"""

import argparse
import hashlib
import sys

import numpy as np

from sdpa_ref import sdpa_backward_jvp, sdpa_hvp
from sdpa_ref.engines import reproducible
from sdpa_ref.exact import arith, ozaki

from repro_digest import problems

#: The first order's problems that the second order takes (a fully masked "nan" row is NaN either way).
NAMES = ("plain", "gqa-causal-br", "float-mask-bias-softcap", "bool-mask-window-alibi", "dropout-uniform",
         "lengths-zero-policy", "batch-broadcast-rank3", "chunked-threaded", "honest-float32", "sinks-lengths-mask")


def digests():
    """``{name: sha256 hex}`` of each problem's reproducible second order."""
    res = {}
    for name, (q, k, v), opts, g in problems():
        if name not in NAMES:
            continue
        rng = np.random.default_rng(len(name))
        t = {"query": np.flip(q, axis=-1).copy(), "key": rng.uniform(-1, 1, k.shape).astype(k.dtype),
             "value": rng.uniform(-1, 1, v.shape).astype(v.dtype)}
        for n in ("bias", "sinks"):
            if n in opts:
                t[n] = rng.uniform(-1, 1, np.shape(opts[n]))
        gl = rng.uniform(-1, 1, g.shape[:-1])
        h = hashlib.sha256()
        grads, tan = sdpa_backward_jvp((q, k, v), t, g, rng.uniform(-1, 1, g.shape), grad_lse=gl,
                                       grad_lse_tangent=rng.uniform(-1, 1, gl.shape), precision="reproducible",
                                       **opts)
        hvp = sdpa_hvp((q, k, v), t, g, precision="reproducible", **opts)
        for a in (*grads, *tan, *hvp):
            if a is not None:
                h.update(np.ascontiguousarray(a).tobytes())
        res[name] = h.hexdigest()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-entries", type=int, default=None,
                    help="entries per block of the exact products and of the element-wise passes")
    args = ap.parse_args(argv)
    if args.block_entries is not None:
        ozaki._BLOCK_ENTRIES = args.block_entries
        reproducible._ROW_ENTRIES = args.block_entries
        arith.LowPrecision.BLOCK = args.block_entries
    for name, d in digests().items():
        print(name, d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
