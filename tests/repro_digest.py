"""Print a sha256 per problem of everything ``precision="reproducible"`` computes: out, lse, every gradient, the JVP.

    python tests/repro_digest.py [--block-entries N]

The problems cover every option (sinks included), GQA, several batch and head dims, and shapes
large enough to be cut into blocks that run in the package's thread pool.
Inputs come from ``Generator.uniform`` (integer bits scaled by IEEE
arithmetic: the same on every machine; ``standard_normal`` is not, its tail
calls the platform's ``log``). ``--block-entries`` changes how the exact
products and the element-wise passes are cut into blocks; the bits must not change. ``tests/test_engines_reproducible.py``
runs this under many thread, BLAS and SIMD settings and compares with
``tests/data/reproducible_hashes.json``.
"""

import argparse
import hashlib
import sys

import numpy as np

import sdpa_ref
from sdpa_ref.engines import reproducible
from sdpa_ref.exact import arith, ozaki


def _u(rng, shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, size=shape)


def problems():
    """``[(name, (q, k, v), options, grad_out)]``: fixed seeds, every option at least once; the last ones
    in each precision's honest arithmetic (``upcast=False``)."""
    out = []

    def add(name, seed, qs, ks, vs, dtype=np.float64, **opts):
        rng = np.random.default_rng(seed)
        q, k, v = (_u(rng, s).astype(dtype) for s in (qs, ks, vs))
        for key in ("attn_mask", "bias"):
            if isinstance(opts.get(key), str):
                opts[key] = _u(rng, (qs[-2], ks[-2]), -3.0, 3.0)
        Hq = qs[-3] if len(qs) >= 3 else 1
        if isinstance(opts.get("alibi_slopes"), str):
            opts["alibi_slopes"] = rng.uniform(0.0, 1.0, size=(Hq,))
        if isinstance(opts.get("sinks"), str):                      # one head without a sink
            opts["sinks"] = np.concatenate([[-np.inf], rng.uniform(-2.0, 3.0, size=(Hq - 1,))]).astype(dtype)
        o_shape = np.broadcast_shapes(qs[:-2], vs[:-3] + (Hq,) if len(vs) >= 3 else ()) + (qs[-2], vs[-1])
        out.append((name, (q, k, v), opts, _u(rng, o_shape).astype(dtype)))

    add("plain", 1, (2, 3, 7, 5), (2, 3, 6, 5), (2, 3, 6, 4))
    add("gqa-causal-br", 2, (1, 4, 9, 8), (1, 2, 11, 8), (1, 2, 11, 3), enable_gqa=True, is_causal=True,
        causal_alignment="bottom_right")
    add("float-mask-bias-softcap", 3, (2, 2, 6, 4), (2, 2, 7, 4), (2, 2, 7, 6), attn_mask="draw", bias="draw",
        softcap=2.5, scale=0.7)
    add("bool-mask-window-alibi", 4, (1, 3, 8, 6), (1, 3, 8, 6), (1, 3, 8, 6),
        attn_mask=np.random.default_rng(40).random((8, 8)) < 0.7, window=(3, 1), alibi_slopes="draw")
    add("dropout-uniform", 5, (2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 4), dropout_p=0.3, rng=7,
        fully_masked="uniform", attn_mask=np.random.default_rng(50).random((5, 6)) < 0.4)
    add("lengths-zero-policy", 6, (3, 2, 6, 4), (3, 2, 7, 4), (3, 2, 7, 5), q_lengths=[6, 3, 0],
        kv_lengths=[7, 2, 0], fully_masked="zero")
    add("dropout-mask-nan-policy", 7, (1, 2, 4, 3), (1, 2, 5, 3), (1, 2, 5, 3),
        dropout_mask=np.random.default_rng(70).random((1, 2, 4, 5)) < 0.8, dropout_p=0.2, fully_masked="nan",
        attn_mask=np.array([[True] * 5, [False] * 5, [True, False, True, False, True], [False] * 4 + [True]]))
    add("batch-broadcast-rank3", 8, (4, 6, 5), (1, 4, 8, 5), (1, 4, 8, 7))
    add("chunked-threaded", 9, (2, 4, 96, 8), (2, 2, 112, 8), (2, 2, 112, 8), enable_gqa=True,
        is_causal=True, softcap=20.0)
    for i, dt in enumerate((np.float64, np.float32, np.float16)):
        add(f"honest-{np.dtype(dt).name}", 10 + i, (2, 2, 9, 8), (2, 1, 11, 8), (2, 1, 11, 4), dtype=dt,
            upcast=False, enable_gqa=True, is_causal=True, attn_mask="draw", softcap=4.0, dropout_p=0.25, rng=5)
    add("sinks-lengths-mask", 13, (2, 4, 7, 5), (2, 2, 8, 5), (2, 2, 8, 3), enable_gqa=True, sinks="draw",
        q_lengths=[7, 5], kv_lengths=[8, 3], attn_mask=np.random.default_rng(130).random((7, 8)) < 0.5,
        softcap=3.0, fully_masked="nan")
    add("sinks-honest-float32", 14, (2, 3, 6, 4), (2, 3, 9, 4), (2, 3, 9, 4), dtype=np.float32, upcast=False,
        sinks="draw", is_causal=True, causal_alignment="bottom_right", dropout_p=0.2, rng=3)
    return out


def digests():
    """``{name: sha256 hex}`` of each problem's reproducible results."""
    res = {}
    for name, (q, k, v), opts, g in problems():
        h = hashlib.sha256()
        out, r = sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **opts)
        grads = sdpa_ref.sdpa_backward(r, g)
        tangents = tuple(np.flip(x, axis=-1).copy() for x in (q, k, v))
        _, tan = sdpa_ref.sdpa_jvp((q, k, v), tangents, precision="reproducible", **opts)
        keys = () if "sinks" not in opts else (r.lse_as(sink=False),)   # the sink-free LSE too
        for a in (out, r.lse, *keys, *[x for x in grads if x is not None], tan):
            h.update(np.ascontiguousarray(a).tobytes())
        res[name] = h.hexdigest()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-entries", type=int, default=None,
                    help="entries per block of the exact products and of the element-wise passes "
                         "(default: the package's)")
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
