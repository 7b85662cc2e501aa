"""The per-sample dropout mask of raylm.models.dropout as one Triton kernel (GPUs).

Hand-written because torch has no random draw keyed per row: its generators are one
stream per device, and seeding one per row (64 seeds per dropout call) or hashing in
torch's integer operations (a dozen full-size int64 tensors per call) made a GPU step
slower than the model. The kernel computes the same hash as ``dropout._keep_torch``,
bit for bit, in 32-bit unsigned arithmetic, and writes the scaled mask once.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _hash32(x):
    # lowbias32 (C. Wellons' hash prospector); uint32 arithmetic wraps modulo 2**32.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _mask_kernel(out_ptr, lo_ptr, hi_ptr, n, thresh, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    lo = tl.load(lo_ptr + row).to(tl.uint32)
    hi = tl.load(hi_ptr + row).to(tl.uint32)
    h = _hash32(j.to(tl.uint32) ^ lo)
    h = _hash32(h ^ hi)
    keep = (h >> 8) >= thresh.to(tl.uint32)
    value = tl.where(keep, scale, 0.0)
    tl.store(out_ptr + row.to(tl.int64) * n + j, value.to(out_ptr.dtype.element_ty),
             mask=j < n)


def scaled_mask(out, lo, hi, n: int, thresh: int, scale: float):
    """Fill ``out`` (contiguous, B rows of ``n``) with ``scale`` where row b's element j
    is kept (``hash(j, lo[b], hi[b]) >> 8 >= thresh``), else 0."""
    grid = (out.shape[0], triton.cdiv(n, BLOCK))
    _mask_kernel[grid](out, lo, hi, n, thresh, scale, BLOCK=BLOCK)
    return out
