"""Print a sha256 per quantity of the reproducible merges, LSE conversions and split-KV results.

    python tests/repro_merge_digest.py [--json]

``merge_attention``, ``merge_attention_backward``, ``combine_lse`` and ``convert_lse`` with
``precision="reproducible"`` (both bases, empty parts, a part ahead by ``e^40``, cancelling outputs), and
``split_kv_partials`` and ``method="split"`` (out, LSE, gradients) in that precision. Inputs come from
``Generator.uniform`` (the same on every machine). ``tests/test_merge.py`` runs this under several thread and
SIMD settings (``/work/shared/tools/env-matrix`` runs it under more) and compares with
``tests/data/reproducible_merge_hashes.json``; ``--json`` prints that file.
"""

import hashlib
import json
import sys

import numpy as np

import sdpa_ref
from sdpa_ref.lse import combine_lse


def _parts(seed, P=5, lead=(3, 4, 6), Ev=8):
    rng = np.random.default_rng(seed)
    lse = rng.uniform(-30.0, 30.0, (P,) + lead)
    lse[rng.uniform(0, 1, lse.shape) < 0.25] = -np.inf
    lse[:, 0, 0, 0] = -np.inf                                      # a row with no part
    lse[0, 1] = 40.0 + lse[1, 1]                                    # a part ahead by e^40
    out = rng.uniform(-1.0, 1.0, (P,) + lead + (Ev,))
    out[1, 2] = -out[0, 2] * (1 + 1e-9)                             # outputs of opposite sign
    lse[1, 2] = lse[0, 2]
    out[np.isneginf(lse)] = np.nan                                  # empty parts: never read
    return out, lse, rng.uniform(-1, 1, lead + (Ev,)), rng.uniform(-1, 1, lead)


def digests():
    """``{name: sha256 hex}``."""
    res = {}

    def put(name, *arrays):
        h = hashlib.sha256()
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
        res[name] = h.hexdigest()

    for base in ("e", 2):
        out, lse, g, g_lse = _parts(1)
        kw = dict(lse_base=base, precision="reproducible")
        put(f"merge-{base}", *sdpa_ref.merge_attention(out, lse, **kw),
            *sdpa_ref.merge_attention(np.moveaxis(out, 0, 2), np.moveaxis(lse, 0, 2), axis=2, **kw))
        put(f"merge-backward-{base}", *sdpa_ref.merge_attention_backward(out, lse, g, g_lse, **kw))
        put(f"combine-lse-{base}", *combine_lse(lse, axis=0, base=base, precision="reproducible"))
    x = np.random.default_rng(2).uniform(-1.0, 1.0, 4096) * 2.0 ** (np.arange(4096) % 1100 - 80)
    put("convert-lse", sdpa_ref.convert_lse(x, base=2, precision="reproducible"),
        sdpa_ref.convert_lse(x, from_base=2, precision="reproducible"))
    rng = np.random.default_rng(3)
    q, k, v = rng.uniform(-2, 2, (2, 4, 33, 8)), rng.uniform(-2, 2, (2, 2, 70, 8)), rng.uniform(-2, 2, (2, 2, 70, 5))
    opts = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", sinks=np.array([0.5, -1.0, 2.0, 0.0]))
    put("split-kv-partials", *sdpa_ref.split_kv_partials(q, k, v, num_splits=4, precision="reproducible", **opts))
    o, r = sdpa_ref.sdpa_forward(q, k, v, num_splits=4, precision="reproducible", **opts)
    grads = sdpa_ref.sdpa_backward(r, rng.uniform(-1, 1, o.shape), grad_lse=rng.uniform(-1, 1, r.lse.shape))
    put("split-forward-backward", o, r.lse, *[a for a in grads if a is not None])
    return res


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    d = digests()
    if "--json" in argv:
        print(json.dumps(d, indent=1, sort_keys=True))
    else:
        for name, h in d.items():
            print(name, h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
