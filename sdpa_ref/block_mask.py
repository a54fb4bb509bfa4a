r"""Block-sparse masks: FlexAttention's ``BlockMask`` and cuDNN's bit-packed tiles.

The scores are cut into tiles of ``Q_BLOCK x KV_BLOCK`` (128 x 128 by
default). Each tile of each (batch, head) is one of

* **absent**: no key of it takes part; a kernel never visits it;
* **partial**: the mask function decides entry by entry (no mask function:
  every entry takes part);
* **full**: every entry takes part, and the mask function is not evaluated.

FlexAttention stores this as ``kv_num_blocks (B, H, nQ)`` and ``kv_indices
(B, H, nQ, nK)`` (the partial tiles of each row of tiles: the first
``kv_num_blocks`` indices), and ``full_kv_num_blocks`` / ``full_kv_indices``
for the full ones (:class:`BlockMask`, :meth:`BlockMask.from_mask_mod`, which
is ``create_block_mask``). cuDNN takes one bit per tile, packed along the key
tiles (:meth:`BlockMask.from_bits`).

A block mask is a claim about its mask function, and a kernel that trusts it
computes something else where the claim is false: a tile marked absent that
holds an allowed entry drops it, a tile marked full that holds a masked entry
reads it. :func:`validate` checks the claim once, when the problem is built,
and a disagreement is a ``ValueError`` naming the tile, not a silent
difference. The tiled engine then takes its blocks to be the tiles: it skips
the absent ones without evaluating anything and does not call the mask
function on the full ones; :class:`TileCounts` counts both. The results are
those of the mask function alone, on every engine.
"""

from __future__ import annotations

import numbers
from typing import Callable, Optional

import numpy as np

from . import _validate as V

__all__ = ["BlockMask", "TileCounts", "tile_status", "validate"]

ABSENT, PARTIAL, FULL = 0, 1, 2


class TileCounts(dict):
    """How many (row block, key block) tiles the tiled engine skipped (``"absent"``), visited without the mask
    function (``"full"``) and visited with it (``"partial"``), over every pass run on a problem."""

    def __init__(self):
        super().__init__(absent=0, full=0, partial=0)


def _block(size):
    if isinstance(size, (tuple, list)) and len(size) == 2:
        pair = tuple(size)
    else:
        pair = (size, size)
    for b in pair:
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)) or b < 1:
            raise TypeError(f"`block_size` should be an int >= 1 or a pair (Q_BLOCK, KV_BLOCK) of them, "
                            f"but got {size!r}")
    return int(pair[0]), int(pair[1])


def _index_array(x, name, ndim):
    a = np.asarray(x)
    if a.dtype.kind not in "iu" or a.ndim != ndim:
        raise TypeError(f"`{name}` should be an int array with {ndim} dims, but got {V.describe(x)}")
    return a.astype(np.int64)


class BlockMask:
    """A block-sparse mask in FlexAttention's layout.

    Parameters
    ----------
    kv_num_blocks : array_like of int, (B, H, nQ)
        The number of partial key tiles of each row of tiles.
    kv_indices : array_like of int, (B, H, nQ, nK)
        Their indices, the first ``kv_num_blocks`` of each row (the rest is
        not read).
    full_kv_num_blocks, full_kv_indices : array_like of int, optional
        The same for the full tiles (None: none).
    block_size : int or (int, int)
        ``(Q_BLOCK, KV_BLOCK)``; 128 by default, as FlexAttention's.
    mask_mod : callable, optional
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``, evaluated on the partial
        tiles (None: they are wholly allowed).

    Notes
    -----
    ``B`` and ``H`` may be 1 (the same tiles for every batch entry or head).
    The tiles of rows past ``L`` or keys past ``S`` are cut short.
    """

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None, *,
                 block_size=128, mask_mod: Optional[Callable] = None):
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"`mask_mod` should be a callable mask_mod(b, h, q_idx, kv_idx) -> bool, "
                            f"but got {V.describe(mask_mod)}")
        self.block_size, self.mask_mod = _block(block_size), mask_mod
        idx = _index_array(kv_indices, "kv_indices", 4)
        nq, nk = idx.shape[-2:]
        tiles = np.zeros(idx.shape[:2] + (nq, nk), np.int8)
        for kind, num, ind, nn, ni in ((PARTIAL, kv_num_blocks, idx, "kv_num_blocks", "kv_indices"),
                                       (FULL, full_kv_num_blocks, full_kv_indices, "full_kv_num_blocks",
                                        "full_kv_indices")):
            if num is None and ind is None:
                continue
            if (num is None) != (ind is None):
                raise ValueError(f"`{nn}` and `{ni}` should be given together, but got only one of them")
            n, ind = _index_array(num, nn, 3), _index_array(ind, ni, 4)
            if ind.shape[-2:] != (nq, nk) or n.shape[-1] != nq:
                raise ValueError(f"`{ni}` should have shape (B, H, {nq}, {nk}) and `{nn}` (B, H, {nq}), but got "
                                 f"{ind.shape} and {n.shape}")
            if np.any(n < 0) or np.any(n > nk):
                raise ValueError(f"`{nn}` should be in [0, {nk}], but got values from {n.min()} to {n.max()}")
            try:
                lead = np.broadcast_shapes(tiles.shape[:2], n.shape[:2], ind.shape[:2])
            except ValueError:
                raise ValueError(f"`{nn}` and `{ni}` should have (B, H) that broadcast with those of `kv_indices` "
                                 f"{tiles.shape[:2]}, but got {n.shape[:2]} and {ind.shape[:2]}") from None
            tiles = np.broadcast_to(tiles, lead + (nq, nk)).copy()
            n, ind = np.broadcast_to(n, lead + (nq,)), np.broadcast_to(ind, lead + (nq, nk))
            used = np.arange(nk) < n[..., None]
            if np.any(used & ((ind < 0) | (ind >= nk))):
                raise ValueError(f"`{ni}` should name key tiles in [0, {nk}), but names one outside")
            b, h, r, c = np.nonzero(used)
            cols = ind[b, h, r, c]
            seen = np.zeros(tiles.shape, np.int64)
            np.add.at(seen, (b, h, r, cols), 1)
            if np.any(seen > 1) or np.any(tiles[b, h, r, cols] != ABSENT):
                raise ValueError(f"`{ni}` should name each tile once, and not a tile the other list names, "
                                 "but names one twice")
            tiles[b, h, r, cols] = kind
        self.tiles = tiles
        self.tiles.flags.writeable = False

    @classmethod
    def from_tiles(cls, tiles, *, block_size=128, mask_mod=None):
        """From a ``(B, H, nQ, nK)`` array of 0 (absent), 1 (partial), 2 (full)."""
        t = _index_array(tiles, "tiles", 4)
        if np.any((t < 0) | (t > 2)):
            raise ValueError("`tiles` should hold 0 (absent), 1 (partial) or 2 (full), but holds other values")
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"`mask_mod` should be a callable mask_mod(b, h, q_idx, kv_idx) -> bool, "
                            f"but got {V.describe(mask_mod)}")
        self = cls.__new__(cls)
        self.block_size, self.mask_mod = _block(block_size), mask_mod
        self.tiles = t.astype(np.int8)
        self.tiles.flags.writeable = False
        return self

    @classmethod
    def from_mask_mod(cls, mask_mod, B, H, L, S, *, block_size=128):
        """FlexAttention's ``create_block_mask``: each tile absent, partial or full by the mask function
        evaluated on it (``B`` or ``H`` 1: the function must not depend on that index)."""
        from .score_mod import apply_mask_mod

        if not callable(mask_mod):
            raise TypeError(f"`mask_mod` should be a callable mask_mod(b, h, q_idx, kv_idx) -> bool, "
                            f"but got {V.describe(mask_mod)}")
        for name, x in (("B", B), ("H", H), ("L", L), ("S", S)):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)) or x < 0:
                raise TypeError(f"`{name}` should be an int >= 0, but got {V.describe(x)}")
        bq, bk = _block(block_size)
        anyv, allv = _any_all(np.broadcast_to(apply_mask_mod(mask_mod, (B, H, L, S)), (B, H, L, S)), bq, bk)
        return cls.from_tiles(np.where(allv & anyv, FULL, np.where(anyv, PARTIAL, ABSENT)), block_size=(bq, bk),
                              mask_mod=mask_mod)

    @classmethod
    def from_bits(cls, bits, n_kv_tiles, *, full_bits=None, block_size=128, mask_mod=None):
        """cuDNN's form: one bit per tile, ``bits`` uint8 ``(B, H, nQ, ceil(nK / 8))``, the tile ``(r, c)``
        in bit ``c % 8`` (least significant first) of byte ``c // 8`` of row ``r``, as
        ``numpy.packbits(..., bitorder="little")`` writes them; a set bit is a partial tile (``full_bits``: full
        ones, in the same layout)."""
        if isinstance(n_kv_tiles, (bool, np.bool_)) or not isinstance(n_kv_tiles, (numbers.Integral, np.integer)) \
                or n_kv_tiles < 0:
            raise TypeError(f"`n_kv_tiles` should be an int >= 0, but got {V.describe(n_kv_tiles)}")

        def unpack(x, name):
            a = np.asarray(x)
            if a.dtype != np.uint8 or a.ndim != 4:
                raise TypeError(f"`{name}` should be a uint8 array (B, H, nQ, ceil(nK / 8)), but got "
                                f"{V.describe(x)}")
            if a.shape[-1] != -(-int(n_kv_tiles) // 8):
                raise ValueError(f"`{name}` should have ceil({n_kv_tiles} / 8) bytes per row of tiles, but got "
                                 f"{a.shape[-1]}")
            return np.unpackbits(a, axis=-1, bitorder="little")[..., :n_kv_tiles].astype(np.int8)

        t = unpack(bits, "bits")
        if full_bits is not None:
            f = unpack(full_bits, "full_bits")
            if f.shape[-2] != t.shape[-2] or not all(a in (1, b) or b == 1 for a, b in zip(f.shape[:2], t.shape[:2])):
                raise ValueError(f"`full_bits` should have the rows of tiles and (B, H) of `bits` {np.shape(bits)}, but "
                                 f"got shape {np.shape(full_bits)}")
            t, f = np.broadcast_arrays(t, f)
            if np.any((t == 1) & (f == 1)):
                raise ValueError("`bits` and `full_bits` should not both mark a tile, but do")
            t = np.where(f == 1, FULL, t)
        return cls.from_tiles(t, block_size=block_size, mask_mod=mask_mod)

    def effective_mask_mod(self):
        """The allowed set this block mask defines, as a mask function: its ``mask_mod`` where it has one (the
        tiles agree with it, :func:`validate`), else every entry of a partial or full tile."""
        if self.mask_mod is not None:
            return self.mask_mod
        bq, bk, tiles = *self.block_size, self.tiles

        def by_tiles(b, h, i, j):
            return tiles[b if tiles.shape[0] > 1 else 0, h if tiles.shape[1] > 1 else 0, i // bq, j // bk] != ABSENT
        return by_tiles

    def __repr__(self):
        t = self.tiles
        return (f"BlockMask(block_size={self.block_size}, tiles {t.shape}: {int((t == ABSENT).sum())} absent, "
                f"{int((t == PARTIAL).sum())} partial, {int((t == FULL).sum())} full)")


def validate(bm, full, allowed):
    """Check the block mask ``bm`` against the scores' shape ``full`` ``(*batch, Hq, L, S)`` and its mask
    function's allowed set ``allowed`` (bool, broadcastable to ``full``): the tile grid covers the scores, and no
    absent tile holds an allowed entry, no full tile a masked one. Every error names the tile."""
    batch, Hq, L, S = full[:-3], full[-3], full[-2], full[-1]
    bq, bk = bm.block_size
    nq, nk = -(-L // bq), -(-S // bk)
    B = int(np.prod(batch, dtype=np.int64))
    if bm.tiles.shape[-2:] != (nq, nk):
        raise ValueError(f"`block_mask` should have ceil(L / {bq}) x ceil(S / {bk}) = {nq} x {nk} tiles for L={L}, "
                         f"S={S}, but has {bm.tiles.shape[-2]} x {bm.tiles.shape[-1]}")
    if bm.tiles.shape[0] not in (1, B) or bm.tiles.shape[1] not in (1, Hq):
        raise ValueError(f"`block_mask` should have B in (1, {B}) and H in (1, {Hq}), but has tiles of shape "
                         f"{bm.tiles.shape}")
    if bm.mask_mod is None:
        return
    anyv, allv = _any_all(np.broadcast_to(allowed, full).reshape((B, Hq, L, S)), bq, bk)
    tiles = np.broadcast_to(bm.tiles, (B, Hq, nq, nk))
    for what, bad in (("absent but its mask function allows an entry of it", (tiles == ABSENT) & anyv),
                      ("full but its mask function masks an entry of it", (tiles == FULL) & ~allv)):
        if np.any(bad):
            b, h, r, c = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(f"`block_mask` should agree with its mask function, but the tile (b={b}, h={h}, "
                             f"q tile {r}, kv tile {c}) is {what}: a kernel trusting it would compute another "
                             "attention")


def _any_all(a, bq, bk):
    """Per tile of the bool ``a`` ``(B, H, L, S)``: whether some entry is True, and whether every entry inside
    ``L x S`` is (a tile cut short at the edge counts only its own entries)."""
    B, H, L, S = a.shape
    nq, nk = -(-L // bq), -(-S // bk)
    pad = np.zeros((B, H, nq * bq, nk * bk), bool)
    pad[..., :L, :S] = a
    inside = np.zeros((nq * bq, nk * bk), bool)
    inside[:L, :S] = True
    t = pad.reshape(B, H, nq, bq, nk, bk)
    return t.any(axis=(3, 5)), (t | ~inside.reshape(nq, bq, nk, bk)).all(axis=(3, 5))


def tile_status(bm, full, rows, cols):
    """``"absent"``, ``"full"`` or ``"partial"`` for the block ``rows`` x ``cols`` when it is exactly one tile and
    every (batch, head) agrees (``"partial"`` when they do not: the block is computed with the mask function);
    None when the block is not one tile."""
    bq, bk = bm.block_size
    (i0, i1), (j0, j1) = rows, cols
    if i1 <= i0 or j1 <= j0 or i0 % bq or j0 % bk or i1 != min(i0 + bq, full[-2]) or j1 != min(j0 + bk, full[-1]):
        return None
    t = bm.tiles[..., i0 // bq, j0 // bk]
    if np.all(t == ABSENT):
        return "absent"
    if np.all(t == FULL):
        return "full"
    return "partial"
