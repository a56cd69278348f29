"""Language models written with torch.nn, sized for CPU runs: next-token prediction over a small
vocabulary (256 byte values by default).

- :class:`LSTMLanguageModel`: embedding, stacked LSTM, linear decoder: the recurrent language
  models the papers train (the LSTM LM family of the PTB / WikiText runs). Its weights are a few
  large matrices, so gradient synchronization sees big, dense tensors.
- :class:`TransformerLanguageModel`: a small GPT-style decoder (learned positions, pre-norm
  causal self-attention blocks, final LayerNorm, linear head).

Both take a batch of token ids of shape (B, T), dtype int64, and return next-token logits of shape
(B, T, vocab_size): position t sees tokens 0..t only, so ``cross_entropy(logits[:, t], x[:, t + 1])``
is a fair training loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_tokens(tokens: torch.Tensor) -> None:
    if tokens.dim() != 2:
        raise ValueError(f"expected token ids of shape (batch, time), got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"expected integer token ids, got dtype {tokens.dtype}")


class LSTMLanguageModel(nn.Module):
    """Embedding -> ``layers``-deep LSTM (batch first) -> linear decoder over the vocabulary.

    ``dropout`` applies to the embeddings, between LSTM layers and before the decoder. With
    ``tie_weights`` the decoder reuses the embedding matrix (Press & Wolf); when ``hidden``
    differs from ``embed`` an extra bias-free ``hidden -> embed`` projection sits in front of it.
    Each call starts from a zero hidden state.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        embed: int = 128,
        hidden: int = 256,
        layers: int = 2,
        dropout: float = 0.1,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        if vocab_size < 1 or embed < 1 or hidden < 1 or layers < 1:
            raise ValueError("vocab_size, embed, hidden and layers must all be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embed)
        self.drop = nn.Dropout(dropout)
        # nn.LSTM's own dropout acts between layers only (and warns when there is a single layer).
        self.lstm = nn.LSTM(embed, hidden, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.project: nn.Module = nn.Identity()
        if tie_weights:
            if hidden != embed:
                self.project = nn.Linear(hidden, embed, bias=False)
            self.decoder = nn.Linear(embed, vocab_size)
            self.decoder.weight = self.embedding.weight
        else:
            self.decoder = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens)
        out, _ = self.lstm(self.drop(self.embedding(tokens)))
        return self.decoder(self.project(self.drop(out)))


class _CausalBlock(nn.Module):
    """Pre-norm decoder block: x + attn(ln(x)), then x + mlp(ln(x)); attention masked causally."""

    def __init__(self, dim: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (B, T, 3D) -> three (B, heads, T, D / heads) tensors
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TransformerLanguageModel(nn.Module):
    """A small GPT-style decoder: token + learned position embeddings, ``layers`` causal
    self-attention blocks (pre-norm, GELU MLP of width ``ff``), final LayerNorm, linear head.

    Inputs may be shorter than ``seq_len`` (the number of learned positions), never longer.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        ff: int = 512,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if min(vocab_size, seq_len, dim, heads, layers, ff) < 1:
            raise ValueError("vocab_size, seq_len, dim, heads, layers and ff must all be >= 1")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_CausalBlock(dim, heads, ff, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # GPT-2's scheme: small normal weights, zero biases (LayerNorm keeps its ones / zeros).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_tokens(tokens)
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"input has {t} tokens but the model was built with seq_len={self.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.tokens(tokens) + self.positions(pos))
        return self.head(self.ln(self.blocks(x)))
