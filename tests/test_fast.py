"""The fast dense path equals the plain (documented) path to 1e-14, whatever the thread count."""

import os
import subprocess
import sys

import numpy as np
from hypothesis import given

from sdpa_ref import sdpa_backward, sdpa_forward

from helpers import assert_close_normwise
from strategies import variant_problem

FAST_RTOL = 1e-14


def _close(x, y, rtol=FAST_RTOL):
    assert_close_normwise(x, y, rtol)


@given(variant_problem(max_len=6))
def test_fast_equals_plain(problem):
    q, k, v, opts, _ = problem
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    out_f, res_f = sdpa_forward(q, k, v, **opts)
    _close(out_p, out_f)
    _close(res_p.probs, res_f.probs)
    np.testing.assert_array_equal(res_p.lse == -np.inf, res_f.lse == -np.inf)
    g = np.random.default_rng(0).standard_normal(out_p.shape)
    plain = sdpa_backward(res_p, g, method="plain")
    for other in (sdpa_backward(res_f, g), sdpa_backward(res_p, g, method="probs"),
                  sdpa_backward(res_f, g, method="plain")):
        for a, b in zip(plain, other):
            _close(a, b)


def test_fast_path_on_a_large_problem_uses_threads_and_agrees():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 300, 16)) for _ in range(3))
    m = rng.standard_normal((300, 300))
    out_p, res_p = sdpa_forward(q, k, v, m, is_causal=True, method="plain")
    out_f, res_f = sdpa_forward(q, k, v, m, is_causal=True)
    _close(out_p, out_f)
    g = rng.standard_normal(out_p.shape)
    for a, b in zip(sdpa_backward(res_p, g, method="plain"), sdpa_backward(res_f, g)):
        _close(a, b)


def test_results_do_not_depend_on_the_thread_count():
    code = (
        "import numpy as np, sdpa_ref as s;"
        "r=np.random.default_rng(2); q,k,v=(r.standard_normal((2,3,257,8)) for _ in range(3));"
        "o,res=s.sdpa_forward(q,k,v,is_causal=True); g=s.sdpa_backward(res,np.ones_like(o));"
        "import sys, hashlib; sys.stdout.write(hashlib.sha256(o.tobytes() + g.query.tobytes()).hexdigest())"
    )
    outs = set()
    for n in ("1", "2", "3"):
        env = dict(os.environ, SDPA_REF_NUM_THREADS=n)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1


def test_num_threads_reads_the_environment(monkeypatch):
    from sdpa_ref.fast import num_threads

    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "3")
    assert num_threads() == 3
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "1")
    assert num_threads() == 1
    monkeypatch.delenv("SDPA_REF_NUM_THREADS")
    assert num_threads() >= 1
