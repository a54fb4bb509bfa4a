"""Engines: the ways of computing attention, behind one contract (:mod:`.contract`).

* ``plain`` -- :mod:`sdpa_ref.attention`, the dense schedule as the derivation reads, with every option;
* ``fast`` -- :mod:`.fast`, dense, in place, threaded over heads;
* ``tiled`` -- :mod:`.tiled`, FlashAttention's online softmax over blocks;
* ``reproducible`` -- :mod:`.reproducible`, ``precision="reproducible"``: the core's formulas in
  double-double (or an honest fixed-order low precision), the same bits everywhere.

:mod:`sdpa_ref.api` picks one with ``method=`` (and ``precision=``). This package imports none of
them itself, so that the core can import the contract without a cycle.
"""
