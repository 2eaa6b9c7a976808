"""Small models the recorder's tests train: attention that calls SDPA, as a user's model does."""

from __future__ import annotations

import torch


class SelfAttention(torch.nn.Module):
    """Causal attention of 2 heads of 4 over a width of 8, calling SDPA (with `dropout` in training)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.qkv, self.n_head, self.dropout = torch.nn.Linear(8, 24), 2, dropout

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (y.view(b, t, 2, 4).transpose(1, 2) for y in self.qkv(h).split(8, dim=-1))
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return attended.transpose(1, 2).reshape(b, t, 8)


class OneBlock(torch.nn.Module):
    """An embedding of `vocab` tokens, one attention layer and a head."""

    def __init__(self, vocab: int, dropout: float = 0.0):
        super().__init__()
        self.emb, self.attn = torch.nn.Embedding(vocab, 8), SelfAttention(dropout)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, x):
        return self.head(self.attn(self.emb(x)))
