r"""
Check your own kernel: a wrong kernel found, located and fixed
==============================================================

Your kernel's test already computes the output, the LSE and the gradients
on its own inputs. Instead of comparing them with a hand-picked ``atol``,
hand them to :func:`sdpa_ref.testing.assert_attention_close`: it computes the
reference on the same inputs (faithfully rounded float64), derives a fair
allowance for the dtype your kernel computed in (three times the worst error
of seven honest kernels in that dtype, plus the dtype's rounding), and
fails with a message that says which quantity, where and by how much.

This page writes a float32 kernel with a classic bug, watches the assertion
find it, reads the message to locate it, fixes it, and then lets the
conformance harness (:func:`sdpa_ref.check_implementation`) judge the fixed
kernel on its own cases.
"""

import numpy as np

import sdpa_ref
import sdpa_ref.testing

rng = np.random.default_rng(0)
B, H, L, E = 2, 4, 32, 16
q, k, v = (rng.standard_normal((B, H, L, E)).astype(np.float32) for _ in range(3))


# %%
# A kernel with a bug
# -------------------
# The scale is taken from the *value*'s width instead of the query's. With
# ``E == Ev`` nobody notices; a model with ``Ev != E`` (MLA, some GQA
# variants) gets the wrong softmax temperature.

def my_attention(query, key, value, is_causal=False):
    scale = np.float32(value.shape[-1] ** -0.5)          # the bug: should be query.shape[-1]
    s = (query @ np.swapaxes(key, -1, -2)) * scale
    if is_causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return (p / l) @ value, (m + np.log(l))[..., 0]


out, lse = my_attention(q, k, v, is_causal=True)
sdpa_ref.testing.assert_attention_close(out, q, k, v, lse=lse, is_causal=True)   # E == Ev: it passes
print("E == Ev: the kernel passes")

# %%
# The test that finds it
# ----------------------
# Values of another width are what the bug needs. The assertion fails;
# here we catch it to read its message.

v48 = rng.standard_normal((B, H, L, 48)).astype(np.float32)
out, lse = my_attention(q, k, v48, is_causal=True)
try:
    sdpa_ref.testing.assert_attention_close(out, q, k, v48, lse=lse, is_causal=True)
except AssertionError as err:
    message = str(err)
else:
    raise AssertionError("the wrong scale should have been caught")
print(message)
if "`out`" not in message or "`lse`" not in message:
    raise AssertionError("both the output and the LSE should be named")

# %%
# Locating it
# -----------
# Both the output and the LSE are off, so the bug is before the values are
# mixed in: in the scores or the softmax. The report (the non-raising form)
# gives each row's worst index and values; an LSE that is off in every row
# by a factor points at the scores' scale.

report = sdpa_ref.testing.check_attention_close(out, q, k, v48, lse=lse, is_causal=True)
print(report)
ref_out, res = sdpa_ref.sdpa_forward(q.astype(np.float64), k.astype(np.float64), v48.astype(np.float64),
                                     is_causal=True)
row = report.rows[1]
print("LSE row", row.worst_index, "kernel", row.impl_value, "reference", row.ref_value)
# the kernel's LSE is the reference's at the scale sqrt(E / Ev): check that guess directly
_, res_guess = sdpa_ref.sdpa_forward(q.astype(np.float64), k.astype(np.float64), v48.astype(np.float64),
                                     is_causal=True, scale=48 ** -0.5)
np.testing.assert_allclose(lse, res_guess.lse, rtol=1e-5, atol=1e-5)
print("the kernel computes attention with scale 1/sqrt(Ev): the scale reads the wrong width")

# %%
# The fix, and the verdict
# ------------------------

def my_attention_fixed(query, key, value, is_causal=False):
    scale = np.float32(query.shape[-1] ** -0.5)
    s = (query @ np.swapaxes(key, -1, -2)) * scale
    if is_causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return (p / l) @ value, (m + np.log(l))[..., 0]


out, lse = my_attention_fixed(q, k, v48, is_causal=True)
sdpa_ref.testing.assert_attention_close(out, q, k, v48, lse=lse, is_causal=True)
print("fixed: the kernel passes on its own inputs")

# %%
# The harness then judges it on problems you did not think of: its cases
# (masked rows, one key, long rows, ...) in float32, with the options its
# signature takes.

report = sdpa_ref.check_implementation(lambda query, key, value, is_causal=False:
                                       my_attention_fixed(query, key, value, is_causal)[0],
                                       dtypes="float32", suite="quick")
print(report.verdict, report.judged)
if not report.ok:
    raise AssertionError(str(report))

# %%
# Inside your own test suite
# --------------------------
# The assertion is a line in a pytest test, beside the comparison it
# replaces. Here the fixed kernel is tested in float32 and in bfloat16
# (through ``ml_dtypes``; the kernel computes in float32 and returns the
# inputs' dtype, as bfloat16 kernels do):

import pytest  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_my_attention(dtype):
    import ml_dtypes
    dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    gen = np.random.default_rng(1)
    q, k, v = (gen.standard_normal((2, 4, 64, 16)).astype(dt) for _ in range(3))
    out, lse = my_attention_fixed(*(x.astype(np.float32) for x in (q, k, v)), is_causal=True)
    sdpa_ref.testing.assert_attention_close(out.astype(dt), q, k, v, lse=lse, is_causal=True)


for dtype in ("float32", "bfloat16"):
    test_my_attention(dtype)
print("the pytest test passes in float32 and bfloat16")

# %%
# With PyTorch the same line takes the tensors themselves (the package never
# imports torch; it reads them through ``__dlpack__``, bfloat16 through
# ``float()``), gradients included:
#
# .. code-block:: python
#
#     def test_sdpa_bf16_causal():
#         q, k, v = (torch.randn(2, 4, 128, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
#         g = torch.randn(2, 4, 128, 64, dtype=torch.bfloat16)
#         out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
#         dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
#         sdpa_ref.testing.assert_attention_close(out.detach(), q.detach(), k.detach(), v.detach(),
#                                                 grads=(dq, dk, dv), grad_out=g, is_causal=True)
#
# The same test with the scale off by 1% fails and names ``out`` and its
# worst element: in bfloat16 such an error moves the worst element no
# further than bfloat16's own rounding does, so besides the largest error
# the assertion judges the spread, the error's root mean square against
# the honest kernels'. ``tests/test_testing.py`` runs exactly this test
# wherever torch is installed.
