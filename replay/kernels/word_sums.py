"""Two wrapping 64-bit sums of each tensor's words, the words and their squares, for many tensors in one kernel
launch per word width: the state digest of a rank's tensors on a GPU (recorder/digest.py).

Each tensor is read as integer words of its element's width (1 byte unsigned; 2, 4 and 8 bytes signed) widened
to 64 bits. A table lists every block of `BLOCK` words of every tensor (its address, first word and count); one
program sums one block, and a cumulative sum over the blocks, in tensor order, gives each tensor's sums. Integer
sums wrap modulo 2**64 whatever their order, so the result is a function of the bits alone and equals
`words.to(int64).sum()` and `(words * words).sum()` taken tensor by tensor (tests/kernels/test_word_sums.py).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 4096
_WORD_TYPES = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _block_sums(table_ptr, partial_ptr, stride, WORD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    address = tl.load(table_ptr + 3 * row)
    first = tl.load(table_ptr + 3 * row + 1)
    count = tl.load(table_ptr + 3 * row + 2)
    words = address.to(tl.pointer_type(WORD), bitcast=True)
    offsets = tl.arange(0, BLOCK)
    x = tl.load(words + first + offsets, mask=offsets < count, other=0).to(tl.int64)
    tl.store(partial_ptr + row, tl.sum(x, axis=0))
    tl.store(partial_ptr + stride + row, tl.sum(x * x, axis=0))


class WordSums:
    """The sums of a fixed list of contiguous tensors on one device, `__call__` taking them again from the same
    memory: the tables are built once, so the caller makes a new one when a tensor moves (a new storage, a
    resize). `__call__` returns an int64 tensor of shape (len(tensors), 2) on the tensors' device."""

    def __init__(self, tensors: list[torch.Tensor]):
        if not tensors:
            raise ValueError("WordSums needs at least one tensor")
        self.device = tensors[0].device
        for t in tensors:
            if t.device != self.device or not t.is_contiguous():
                raise ValueError(f"WordSums takes contiguous tensors on one device; got {t.device}, "
                                 f"contiguous={t.is_contiguous()}")
        self.count = len(tensors)
        self.groups: list[tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
        for width in sorted({t.element_size() for t in tensors}):
            members = [k for k, t in enumerate(tensors) if t.element_size() == width]
            words = np.array([tensors[k].numel() for k in members], dtype=np.int64)
            blocks = -(-words // BLOCK)
            ends = np.concatenate([[0], np.cumsum(blocks)])
            owner = np.repeat(np.arange(len(members)), blocks)
            first = (np.arange(int(ends[-1])) - ends[owner]) * BLOCK
            rows = np.stack([np.array([tensors[k].data_ptr() for k in members], dtype=np.int64)[owner], first,
                             np.minimum(BLOCK, words[owner] - first)], axis=1)
            table = torch.from_numpy(rows).to(self.device) if len(rows) else None
            self.groups.append((width, table, torch.from_numpy(ends).to(self.device),
                                torch.tensor(members, dtype=torch.int64, device=self.device)))

    def __call__(self) -> torch.Tensor:
        out = torch.zeros(self.count, 2, dtype=torch.int64, device=self.device)
        for width, table, ends, positions in self.groups:
            if table is None:
                continue   # only empty tensors: their sums are zero
            # (2, blocks + 1): torch's scan along the inner dimension is fast, along the outer one sequential
            running = torch.zeros(2, table.shape[0] + 1, dtype=torch.int64, device=self.device)
            _block_sums[(table.shape[0],)](table, running[:, 1:], running.shape[1], WORD=_WORD_TYPES[width],
                                           BLOCK=BLOCK)
            running = running.cumsum(1)   # column c: the sums of the first c blocks
            out[positions] = (running[:, ends[1:]] - running[:, ends[:-1]]).T
        return out
