r"""FlexAttention's names: score functions, block masks and ``create_block_mask``.

A call to ``torch.nn.attention.flex_attention`` is repeated against the
reference with :func:`sdpa_ref.sdpa_forward`'s ``score_mod=``, ``mask_mod=``
and ``block_mask=`` (the score function's place and the mask's meaning are
:mod:`sdpa_ref.score_mod`'s; the tiles' layout :mod:`sdpa_ref.block_mask`'s).
``ScoreMod`` and ``BlockMask`` are also at the top level.

>>> import numpy as np
>>> from sdpa_ref import flex
>>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
>>> bm = flex.create_block_mask(causal, None, None, 256, 256)
>>> bm.tiles[0, 0]                   # 0 absent, 1 partial (the mask is evaluated), 2 full
array([[1, 0],
       [2, 1]], dtype=int8)
"""

from .block_mask import BlockMask
from .gradcheck import check_score_mod
from .score_mod import ScoreMod

__all__ = ["BlockMask", "ScoreMod", "check_score_mod", "create_block_mask"]


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False):
    r"""A :class:`BlockMask` from a mask function, with FlexAttention's ``create_block_mask`` arguments.

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``, vectorised over NumPy
        index arrays that broadcast together.
    B, H : int or None
        Batch entries and heads the mask is evaluated for; None is 1 (the
        same tiles for every batch entry or head: the function must not
        depend on that index), as in FlexAttention.
    Q_LEN, KV_LEN : int
        Query and key positions (``L`` and ``S``).
    device : object, optional
        Accepted so a FlexAttention call can be repeated as written, and
        not read (NumPy has one device).
    BLOCK_SIZE : int or (int, int)
        ``(Q_BLOCK, KV_BLOCK)``; 128 by default, as FlexAttention's.
    _compile : bool, optional
        Accepted and not read, as ``device``.

    Returns
    -------
    BlockMask
        Each tile absent, partial or full by the mask function evaluated on
        it (:meth:`BlockMask.from_mask_mod`).
    """
    return BlockMask.from_mask_mod(mask_mod, 1 if B is None else B, 1 if H is None else H, Q_LEN, KV_LEN,
                                   block_size=BLOCK_SIZE)
