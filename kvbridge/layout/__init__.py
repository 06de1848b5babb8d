"""KV layout: how an engine's paged KV cache is addressed, and moving blocks in and out of it.

An engine registers one tensor per attention layer. kvbridge reads what it needs from the tensors
themselves (shape for the logical roles, strides, dtype and device for addressing) and builds a
:class:`KVLayout`. Three shapes are understood:

- ``blocks_first`` — ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM >= 0.26: K and V
  side by side on the last axis; every layer a view of one shared allocation; possibly
  non-contiguous on GPU);
- ``kv_first`` — ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (older vLLM);
- ``mla`` — ``[num_blocks, block_size, head_size]``: one latent vector per token (DeepSeek's
  multi-head latent attention, ``head_size`` = the latent rank plus the rotary part), no K/V split and
  no heads: every tensor-parallel rank holds the same bytes.

The tensor's dtype is what torch allocated, not always what the bytes mean: vLLM keeps an fp8 KV
cache (``fp8_e4m3``, ``fp8_e5m2``) in ``uint8`` tensors. The engine says what they mean
(``kv_dtype``), and the fingerprint names both, so an e4m3 cache never loads e5m2 bytes.

A *block* of a layer is treated as opaque bytes: ``block_bytes`` of them, in the order torch's
``index_select`` along the block axis yields. Moving blocks is always one vectorized torch op per
layer — ``index_select`` into, or ``index_copy_`` out of, a contiguous staging buffer shaped
``[num_layers, num_blocks_moved, block_bytes]`` (uint8; :class:`kvbridge.staging.StagingPool` keeps
such buffers between calls) — and never a Python loop over blocks. A single run of consecutive ids
is copied as one slice; where blocks are contiguous, they move as rows of machine words
(:func:`block_words`).

A :class:`LayoutFingerprint` names everything that must agree for bytes to be meaningful on the
other side; every stored object and every handshake carries it, and :meth:`LayoutFingerprint.check`
raises :class:`~kvbridge.errors.LayoutMismatch` on any difference.

Modules: :mod:`.fingerprint` (what must agree, and re-slicing across tensor-parallel sizes),
:mod:`.addressing` (where blocks live, for one-sided transports), :mod:`.words` (blocks as rows of machine
words), :mod:`.kv` (:class:`KVLayout`: building one and moving blocks).
"""

from kvbridge.layout.addressing import BlockAddressing, coalesce, packed_offsets, staged_addressing
from kvbridge.layout.fingerprint import BLOCKS_FIRST, KV_FIRST, MLA, Cut, LayoutFingerprint, reslice
from kvbridge.layout.kv import KVLayout
from kvbridge.layout.words import block_words

__all__ = ["BLOCKS_FIRST", "KV_FIRST", "MLA", "BlockAddressing", "Cut", "KVLayout", "LayoutFingerprint", "block_words", "coalesce",
           "packed_offsets", "reslice", "staged_addressing"]
