"""What FlashAttention v2 / BlockSparseAttention's attributes say about the key blocks a tile
visits -- windows, soft-cap, block layout -- in the form both kernels specialise on (launch.py
compiles it in: Triton constexprs, kernel_sm90.cu defines; sm90/sparsity.cuh has the device side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optfuse.kernels.util import as_float32
from optfuse.spec import plugin_spec

OP = "FlashAttention"
SPEC = plugin_spec(__file__, OP)
#: Block-sparse attention: the same kernels, the key loop walking a BSR layout's blocks.
BLOCK_SPARSE = "BlockSparseAttention"
BLOCK_SPARSE_SPEC = plugin_spec(__file__, BLOCK_SPARSE)
OPS = (OP, BLOCK_SPARSE)
LAYOUT_BLOCKS = tuple(BLOCK_SPARSE_SPEC.limits["block_sizes"])


@dataclass(frozen=True)
class Sparsity:
    """What an op's attributes say about the key blocks a tile visits (compiled into the kernels):
    the window limits (-1: none), the soft-cap (0: none) and, for BlockSparseAttention, the layout
    (block size, one layout row per head or shared)."""
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    layout: bool = False
    layout_heads: bool = False
    layout_block: int = 128

    @property
    def any_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def tag(self) -> str:
        """Name parts: ``_window<l>_<r>``, ``_softcap<c>``, ``_bsr`` / ``_bsr_heads``."""
        out = ""
        if self.any_window:
            out += f"_window{self.window_left}_{self.window_right}"
        if self.softcap > 0:
            out += f"_softcap{self.softcap:g}"
        if self.layout:
            out += "_bsr_heads" if self.layout_heads else "_bsr"
        return out


def sparsity_of(op: Any, attrs: dict, static_shape: dict | None = None) -> Sparsity:
    """The Sparsity of a node: its window / softcap attributes and, for BlockSparseAttention, its
    layout (``static_shape['layout_heads']``, else ``block_offsets_shape[0] != 1``: the
    block_offsets input has a row per head)."""
    name = getattr(op, "op", op)
    if name == BLOCK_SPARSE:
        spec = BLOCK_SPARSE_SPEC
        block = int(attrs.get("block_size", spec.attr("block_size").default))
        if block not in LAYOUT_BLOCKS:
            raise ValueError(f"{BLOCK_SPARSE}: block_size {block} not in {LAYOUT_BLOCKS}")
        st = static_shape or {}
        offsets = st.get("block_offsets_shape")  # the TensorRT glue's static facts
        heads = st.get("layout_heads", offsets is not None and offsets[0] != 1)
        return Sparsity(softcap=as_float32(attrs.get("softcap", spec.attr("softcap").default) or 0.0),
                        layout=True, layout_heads=bool(heads), layout_block=block)
    wl = int(attrs.get("window_left", SPEC.attr("window_left").default))
    wr = int(attrs.get("window_right", SPEC.attr("window_right").default))
    cap = as_float32(attrs.get("softcap", SPEC.attr("softcap").default) or 0.0)
    if wl < -1 or wr < -1 or cap < 0:
        raise ValueError(f"{OP}: window_left {wl}, window_right {wr}, softcap {cap}: windows are >= -1, "
                         f"softcap >= 0")
    return Sparsity(window_left=wl, window_right=wr, softcap=cap)


def sm90_defines(sp: Sparsity, scale: float) -> dict[str, str]:
    """kernel_sm90.cu's defines for the windows, the soft-cap (SOFTCAP_IN = scale / softcap
    multiplies the raw score before tanh, SOFTCAP_LOG2 = softcap * log2(e) after it) and the
    layout; none for a dense op."""
    out: dict[str, str] = {}
    if sp.window_left >= 0:
        out["WINDOW_LEFT"] = str(sp.window_left)
    if sp.window_right >= 0:
        out["WINDOW_RIGHT"] = str(sp.window_right)
    if sp.softcap > 0:
        out["SOFTCAP_IN"] = f"{scale / sp.softcap!r}f"
        out["SOFTCAP_LOG2"] = f"{sp.softcap * 1.4426950408889634!r}f"
    if sp.layout:
        out["LAYOUT"] = "1"
        out["LAYOUT_HEADS"] = str(int(sp.layout_heads))
    return out
