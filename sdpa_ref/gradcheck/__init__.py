r"""Framework-neutral gradient checking by finite differences.

Everything here takes plain callables on NumPy arrays, so it can check
anyone's gradients, not only this package's:

* ``fun(*args) -> array``
* ``vjp(g, *args) -> (grad_0, grad_1, ...)``, one gradient per arg
* ``jvp(tangents, *args) -> output tangent``, ``tangents`` a tuple with one
  entry per arg
* ``hvp(g, tangents, *args) -> (Hv_0, Hv_1, ...)``, the Hessian of
  ``<g, fun(*args)>`` times the tangents (:func:`check_hvp`)

All arithmetic is in float64 on private copies of ``args``: the caller's
arrays are never perturbed.

Comparison rule
---------------
An analytic value ``a`` and a numeric value ``n`` agree when

    |a - n| <= atol    or    |a - n| / max(tiny, |a| + |n|) <= rtol.

The relative error is the *symmetric* one, so it is bounded by 1 and
treats ``a`` and ``n`` alike; the absolute floor lets exact zeros pass
against a difference quotient of ``1e-12``. The reported
``max_rel_error`` is taken over the entries past the floor and over those
with ``|a| + |n| >= atol / rtol``, where the relative error is meaningful. Two NaNs agree (a documented NaN
gradient checked against a NaN difference: the NaN patterns are compared and
the finite parts judged); a NaN or infinity on one side only fails, and a
note names how many and the first. Entries that are NaN on both sides prove
nothing: a check with none finite on both sides fails. Inputs that are
not finite (a ``-inf`` mask entry, say) cannot be perturbed and are left out
of the comparison. A derivative's result must be a real array: a complex one
(whose imaginary part would be dropped), ``None`` or a non-numeric one is a
`TypeError` naming the callable.

What cannot fool it
-------------------
The full mode pushes one-hot vectors, then ``n_projections`` dense random
cotangents (or tangents) over every argument at once, whose results must be
the same combination of the one-hot rows (columns): a derivative right on
one-hot vectors alone (``J^T |g|``, a branch on which arguments have a
tangent) fails. In projection mode a failed projection is final (the full
check runs only to locate it), and a projection that is NaN on both sides (a
NaN output) proves nothing, so the full check judges entry by entry.

Complex step
------------
With ``method="complex"`` the derivative is taken as
:math:`f'(x)\,t = \operatorname{Im} f(x + i h t) / h` with :math:`h = 10^{-30}`.
There is no subtraction, so no cancellation: the result is exact to
rounding (about ``1e-15`` relative), which proves a gradient to ``1e-12``
where central differences stop near ``1e-9``. It needs ``fun`` to accept
complex input and to be analytic along the path (no ``abs``, no comparisons
on the perturbed values, the max-shift of a softmax taken from the real
part); :func:`sdpa_ref.sdpa_forward_complex` is such a forward.

Step size
---------
Central differences ``(f(x + h) - f(x - h)) / 2h`` have truncation error
:math:`O(h^2)` and rounding error :math:`O(\epsilon / h)`; the two balance at
:math:`h \approx \epsilon^{1/3} \approx 6\times10^{-6}`, which is scaled to
each entry as ``h_i = eps * max(1, |x_i|)``. The realised step
``(x + h) - (x - h)`` is used as the denominator, so representation error in
``x + h`` does not bias the quotient. Expect agreement to about ``1e-9``
relative on well-conditioned functions.
"""

from .checks import DEFAULT_ATOL, DEFAULT_RTOL, assert_jvp, assert_vjp, check_jvp, check_vjp
from .hessian import assert_hvp, check_hvp
from .numeric import COMPLEX_STEP, numerical_jacobian
from .report import GradcheckReport, WorstEntry
from .score_mods import check_score_mod

__all__ = [
    "COMPLEX_STEP",
    "DEFAULT_RTOL",
    "DEFAULT_ATOL",
    "GradcheckReport",
    "WorstEntry",
    "numerical_jacobian",
    "check_vjp",
    "assert_vjp",
    "check_jvp",
    "assert_jvp",
    "check_hvp",
    "assert_hvp",
    "check_score_mod",
]
