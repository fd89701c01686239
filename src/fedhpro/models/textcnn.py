"""TextCNN (Kim, 2014; Zhang & Wallace, 2017) for token-id sequences (the paper's AG News model)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro.models._common import ZooModel, check_dims, check_token_shape


class TextCNNFeatures(nn.Module):
    """Embedding -> one Conv1d per kernel size -> ReLU -> masked max over time -> concat -> Linear(d)."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, kernel_sizes: Sequence[int],
                 feature_dim: int, padding_idx: int):
        super().__init__()
        self.padding_idx = padding_idx
        self.kernel_sizes = tuple(int(k) for k in kernel_sizes)
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx)
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, hidden, kernel_size=k) for k in self.kernel_sizes)
        self.fc = nn.Linear(hidden * len(self.kernel_sizes), feature_dim)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"textcnn takes a B x L tensor of token ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise TypeError(f"textcnn takes integer token ids, got dtype {tokens.dtype}")
        tokens = tokens.long()
        longest = max(self.kernel_sizes)
        if tokens.shape[1] < longest:  # too short for the widest kernel: pad (those windows are masked out)
            tokens = F.pad(tokens, (0, longest - tokens.shape[1]), value=self.padding_idx)
        embedded = self.embedding(tokens).transpose(1, 2)  # B x E x L
        is_pad = (tokens == self.padding_idx).to(embedded.dtype).unsqueeze(1)  # B x 1 x L
        pooled = []
        for k, conv in zip(self.kernel_sizes, self.convs):
            activation = F.relu(conv(embedded))  # B x H x (L - k + 1), >= 0
            # a window counts only if it holds no padding token; ReLU outputs are >= 0, so zeroing the others
            # leaves the max unchanged when at least one window is valid, and gives 0 when none is
            valid = 1.0 - F.max_pool1d(is_pad, kernel_size=k, stride=1)  # B x 1 x (L - k + 1)
            pooled.append((activation * valid).amax(dim=2))
        return self.fc(torch.cat(pooled, dim=1))


class TextCNN(ZooModel):
    """TextCNN: ``Embedding(vocab_size, embed_dim, padding_idx=0)`` -> ``Conv1d(embed_dim, hidden, k)`` for
    k in ``kernel_sizes`` (3, 4, 5) -> ReLU -> max over time -> concat (3 x 32 = 96) -> ``Linear(96, d)``
    = features; classifier ``Linear(d, C)``.

    ``hidden = 32`` channels per kernel size is the paper's "hidden dimension of
    32" for AG News. Input: a LongTensor ``B x L`` of token ids, ``input_shape =
    (L,)``; any L works at run time (max over time). Padding (token 0): its
    embedding is zero and fixed, and the max over time skips every window that
    holds a padding token, so the features of a sequence do not depend on how
    much padding follows it (sequences with fewer real tokens than a kernel's
    width give 0 for that kernel's 32 channels; an all-padding row gives
    ``fc.bias``).
    """

    input_kind = "tokens"

    def __init__(self, num_classes: int = 4, input_shape: Sequence[int] = (256,), feature_dim: int = 512, *,
                 vocab_size: int = 30000, embed_dim: int = 128, hidden: int = 32,
                 kernel_sizes: Sequence[int] = (3, 4, 5), padding_idx: int = 0):
        super().__init__()
        check_dims("textcnn", num_classes, feature_dim)
        check_token_shape("textcnn", input_shape)
        if vocab_size < 2 or not 0 <= padding_idx < vocab_size:
            raise ValueError(f"textcnn: need vocab_size >= 2 and 0 <= padding_idx < vocab_size, "
                             f"got {vocab_size}, {padding_idx}")
        if not kernel_sizes or min(kernel_sizes) < 1:
            raise ValueError(f"textcnn: kernel_sizes must be positive, got {kernel_sizes}")
        self.vocab_size = vocab_size
        self.features = TextCNNFeatures(vocab_size, embed_dim, hidden, kernel_sizes, feature_dim, padding_idx)
        self._finish(num_classes, feature_dim)
