"""The campaign's models in plain PyTorch (random weights, synthetic data, nothing downloaded).

ResNet-18/50 (basic and bottleneck blocks written out), a GPT-2-style decoder LM with a KV cache and a BERT-style
encoder, both on ``torch.nn.functional.scaled_dot_product_attention``. ``torch`` is passed in: this module imports
only the standard library at module level (the orchestrator never imports torch); :func:`classes` builds the
``nn.Module`` classes once per worker.
"""

from __future__ import annotations

import functools
import types
from typing import Any


@functools.cache
def classes(torch: Any) -> types.SimpleNamespace:
    """The model classes, defined against the given torch module."""
    nn, F = torch.nn, torch.nn.functional

    class Basic(nn.Module):
        expansion = 1

        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(width)
            self.c2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(width)
            self.down = (nn.Sequential(nn.Conv2d(cin, width, 1, stride, bias=False), nn.BatchNorm2d(width))
                         if stride != 1 or cin != width else None)

        def forward(self, x: Any) -> Any:
            out = F.relu(self.b1(self.c1(x)))
            out = self.b2(self.c2(out))
            return F.relu(out + (x if self.down is None else self.down(x)))

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.c1 = nn.Conv2d(cin, width, 1, bias=False)
            self.b1 = nn.BatchNorm2d(width)
            self.c2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.b2 = nn.BatchNorm2d(width)
            self.c3 = nn.Conv2d(width, cout, 1, bias=False)
            self.b3 = nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

        def forward(self, x: Any) -> Any:
            out = F.relu(self.b1(self.c1(x)))
            out = F.relu(self.b2(self.c2(out)))
            out = self.b3(self.c3(out))
            return F.relu(out + (x if self.down is None else self.down(x)))

    class ResNet(nn.Module):
        """ResNet-18 (``Basic``, 2-2-2-2) or ResNet-50 (``Bottleneck``, 3-4-6-3), 1000 classes."""

        def __init__(self, block: Any, layers: tuple[int, ...], classes_: int = 1000) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], 64
            for i, n in enumerate(layers):
                width = 64 * 2**i
                for j in range(n):
                    blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                    cin = width * block.expansion
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, classes_)

        def forward(self, x: Any) -> Any:
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))

    class Attention(nn.Module):
        def __init__(self, d: int, heads: int, causal: bool) -> None:
            super().__init__()
            self.heads, self.causal = heads, causal
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x: Any, past: Any = None) -> tuple[Any, Any]:
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            if past is not None:  # decoding: attend to the cached keys/values as well
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and past is None)
            return self.proj(y.transpose(1, 2).reshape(b, t, d)), (k, v)

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, causal: bool) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = Attention(d, heads, causal)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: Any, past: Any = None) -> tuple[Any, Any]:
            a, kv = self.attn(self.ln1(x), past)
            x = x + a
            return x + self.mlp(self.ln2(x)), kv

    class Transformer(nn.Module):
        """GPT-2-style causal LM (``causal``, tied head) or BERT-style encoder with a pooled classifier."""

        def __init__(self, causal: bool, vocab: int = 50304, d: int = 768, layers: int = 12, heads: int = 12,
                     max_seq: int = 1024) -> None:
            super().__init__()
            self.causal = causal
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
            self.blocks = nn.ModuleList(Block(d, heads, causal) for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab if causal else 2, bias=not causal)
            if causal:
                self.head.weight = self.tok.weight

        def forward(self, ids: Any, past: Any = None, start: int = 0) -> tuple[Any, list[Any]]:
            pos = torch.arange(start, start + ids.shape[1], device=ids.device)
            x = self.tok(ids) + self.pos(pos)
            cache = []
            for i, blk in enumerate(self.blocks):
                x, kv = blk(x, None if past is None else past[i])
                cache.append(kv)
            x = self.ln(x)
            return (self.head(x) if self.causal else self.head(x[:, 0])), cache

    def resnet50() -> Any:
        return ResNet(Bottleneck, (3, 4, 6, 3))

    def resnet18() -> Any:
        return ResNet(Basic, (2, 2, 2, 2))

    return types.SimpleNamespace(ResNet=ResNet, Transformer=Transformer, resnet50=resnet50, resnet18=resnet18)
