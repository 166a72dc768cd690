"""Constant block masks -> BlockSparseAttention's BSR layout (computed at fuse time).

A constant mask whose allowed entries (value 0; masked <= -1e30 or -inf) form any structure other
than none / causal / sliding window (class ``block``: local + global tokens, strided layouts) is
cut into ``block x block`` tiles of the [Sq, Sk] score matrix. The layout lists, per query block,
the key blocks that hold at least one allowed key: one row shared by every head when the heads'
layouts agree, else one per head. ``causal = 1`` when no allowed key lies above the diagonal
(j > i + Sk - Sq), so the kernel masks the diagonal blocks itself. When the listed blocks (with
the causal flag) allow exactly the mask's entries, the fused node needs no bias; otherwise the
mask stays the bias and masks the partial blocks.

Exact for every row that keeps an allowed key. A mask with a row that keeps none is left to
FlashAttention with the whole mask (the unfused graph averages such a row over all keys, the
layout over the listed blocks only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mask_class import masked_below


@dataclass(frozen=True)
class BlockLayout:
    """A BSR layout over query blocks: ``offsets`` [Hl, Mb + 1], ``indices`` [Hl, nnz] (int32)."""

    offsets: np.ndarray
    indices: np.ndarray
    block: int
    causal: int  # the mask holds no key above the diagonal
    exact: bool  # the listed blocks (with causal) are exactly the mask's allowed entries
    sq: int
    sk: int

    @property
    def density(self) -> float:
        """Listed blocks over all Mb x Nb blocks, averaged over the layout's heads."""
        mb, nb = self.offsets.shape[1] - 1, -(-self.sk // self.block)
        return float(self.offsets[:, -1].sum()) / float(self.offsets.shape[0] * mb * nb)

    def key(self) -> tuple:
        """Equal layouts have equal keys (so layers with one mask share the initializers)."""
        return (self.block, self.offsets.tobytes(), self.offsets.shape, self.indices.tobytes(), self.indices.shape)


def allowed_planes(value: np.ndarray, heads: int) -> np.ndarray | None:
    """[Hm, Sq, Sk] boolean planes of a constant additive mask broadcast to [1 or B, H, Sq, Sk]
    (Hm = 1 or H), or None when the planes differ over the batch or the heads do not match."""
    a = np.asarray(value)
    if a.ndim < 2 or a.ndim > 4:
        return None
    a = a.reshape((1,) * (4 - a.ndim) + a.shape)
    allowed = a == 0
    if not np.all(allowed | (a <= masked_below(a.dtype)) | np.isneginf(a)):
        return None
    if a.shape[1] not in (1, heads):
        return None
    if not all(np.array_equal(allowed[0], allowed[b]) for b in range(1, a.shape[0])):
        return None
    return allowed[0]


def block_layout(allowed: np.ndarray, block: int) -> BlockLayout:
    """The layout of ``allowed`` [Hm, Sq, Sk] (see the module doc)."""
    hm, sq, sk = allowed.shape
    mb, nb = -(-sq // block), -(-sk // block)
    pad = np.zeros((hm, mb * block, nb * block), bool)
    pad[:, :sq, :sk] = allowed
    blocks = pad.reshape(hm, mb, block, nb, block).any(axis=(2, 4))  # [Hm, Mb, Nb]
    if all(np.array_equal(blocks[0], b) for b in blocks[1:]):
        blocks = blocks[:1]
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    causal = int(not np.any(allowed & (j > i + (sk - sq))))
    listed = np.repeat(np.repeat(blocks, block, axis=1), block, axis=2)[:, :sq, :sk]
    if causal:
        listed = listed & (j <= i + (sk - sq))
    exact = bool(np.all(np.broadcast_to(listed, allowed.shape) == allowed))
    offsets, indices = to_bsr(blocks)
    return BlockLayout(offsets, indices, block, causal, exact, sq, sk)


def to_bsr(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[Hl, Mb, Nb] block visibility -> (offsets [Hl, Mb + 1], indices [Hl, nnz]) int32, heads
    padded to one nnz with zeros past their offsets (at least one entry)."""
    hl, mb, _ = blocks.shape
    counts = blocks.sum(axis=2)
    nnz = max(1, int(counts.sum(axis=1).max()))
    offsets = np.zeros((hl, mb + 1), np.int32)
    offsets[:, 1:] = np.cumsum(counts, axis=1)
    indices = np.zeros((hl, nnz), np.int32)
    for h in range(hl):
        flat = np.nonzero(blocks[h])[1]  # row-major: ascending key blocks per query block
        indices[h, :flat.size] = flat
    return offsets, indices
