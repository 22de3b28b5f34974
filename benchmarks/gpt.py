"""The GPT-style decoder every benchmark trains: named sizes, a seeded builder, a loss, counts.

    python benchmarks/gpt.py                 # the sizes: layers, width, leaves, params, state bytes
    python benchmarks/gpt.py --size 1.3b --tokens 16384 --device cuda   # time one fwd+bwd

Token + position embeddings; pre-LN blocks ``blocks.N.{ln1, attn.qkv, attn.proj, ln2, mlp.fc,
mlp.proj}`` (all with biases), causal attention through
``torch.nn.functional.scaled_dot_product_attention``, GELU MLP of width 4d; a final ``ln_f``;
the LM head tied to the token embedding (so ``named_parameters()`` lists it once). The loss is
cross entropy on random tokens (``batch × seq = tokens``). 12 leaves per block plus ``wte``,
``wpe`` and ``ln_f``'s two: 24 layers give 292 leaves, 32 give 388.

Sizes follow GPT-3's widths (vocab 50,257 padded to 50,304, context 2,048), with at least 24 layers; ``6.7b``
is the largest whose fp32 host state (12 B/param for master, mu, nu; 14 with the delayed mode's
staging) fits the 128 GiB of the 1-GPU H200 box. ``tiny`` is for CPU smoke tests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    d: int
    layers: int
    heads: int
    vocab: int = 50304  # GPT-2's 50,257 tokens padded to a multiple of 128, as Megatron and
    # nanoGPT do: with an odd vocab the head's three GEMMs take ~90 ms of a 1.3b step (misaligned)
    ctx: int = 2048


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d=64, layers=2, heads=2, vocab=512, ctx=64),
    "125m": GPTConfig(d=576, layers=24, heads=9),
    "350m": GPTConfig(d=1024, layers=24, heads=16),
    "760m": GPTConfig(d=1536, layers=24, heads=16),
    "1.3b": GPTConfig(d=2048, layers=24, heads=16),
    "2.7b": GPTConfig(d=2560, layers=32, heads=32),
    "6.7b": GPTConfig(d=4096, layers=32, heads=32),
    "13b": GPTConfig(d=5120, layers=41, heads=40),  # 13.17 B (GPT-3 13B's width, a 41st layer)
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, **kw: object):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, **kw)
        self.proj = nn.Linear(cfg.d, cfg.d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, **kw: object):
        super().__init__()
        self.fc = nn.Linear(cfg.d, 4 * cfg.d, **kw)
        self.proj = nn.Linear(4 * cfg.d, cfg.d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, **kw: object):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d, **kw)
        self.attn = Attention(cfg, **kw)
        self.ln2 = nn.LayerNorm(cfg.d, **kw)
        self.mlp = MLP(cfg, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, **kw: object):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d, **kw)
        self.wpe = nn.Embedding(cfg.ctx, cfg.d, **kw)
        self.blocks = nn.ModuleList(Block(cfg, **kw) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d, **kw)

    def forward(self, idx: torch.Tensor, checkpoint: bool = False) -> torch.Tensor:
        """Logits for token ids ``idx`` of shape (batch, seq); the head is ``wte`` (tied)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpoint \
                else block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def config(size: str) -> GPTConfig:
    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return SIZES[size]


def build(size: str | GPTConfig, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
          seed: int = 0) -> GPT:
    """The model of ``size`` (a name of :data:`SIZES` or a config) on ``device`` in ``dtype``,
    initialized from ``seed`` (GPT-2's scheme: N(0, 0.02), residual projections scaled by
    1/sqrt(2·layers), LayerNorm 1/0). The same size, device, dtype and seed give the same values
    in every process. On ``meta`` the values are left out (for counting)."""
    cfg = size if isinstance(size, GPTConfig) else config(size)
    model = GPT(cfg, device="meta", dtype=dtype)
    if torch.device(device).type == "meta":
        return model
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = 0.02 / (2 * cfg.layers) ** 0.5 if name.endswith("proj.weight") else 0.02
                p.normal_(0.0, std, generator=g)
    return model


def batch(cfg: GPTConfig, tokens: int, device: torch.device | str,
          seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(inputs, targets)`` token ids of shape (tokens // seq, seq), seq = min(ctx, tokens)."""
    seq = min(cfg.ctx, tokens)
    if tokens % seq:
        raise SystemExit(f"tokens ({tokens}) must be a multiple of the sequence length {seq}")
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(cfg.vocab, (2, tokens // seq, seq), generator=g, device=device)
    return ids[0], ids[1]


def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
         checkpoint: bool = False) -> torch.Tensor:
    """Mean cross entropy (computed in fp32) of the model's logits against ``targets``;
    ``checkpoint``: every block under ``torch.utils.checkpoint`` (non-reentrant), for token
    counts whose activations would not fit."""
    logits = model(inputs, checkpoint)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def count_params(model: nn.Module) -> int:
    """Parameters, the tied head counted once."""
    return sum(p.numel() for p in model.parameters())


def count_leaves(model: nn.Module) -> int:
    """Parameter tensors, as ``named_parameters()`` lists them (the optimizers' leaves)."""
    return sum(1 for _ in model.parameters())


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", help="time forward+backward of this size (else: print the sizes)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if args.size is None:
        print(f"{'size':<6} {'layers':>6} {'d':>5} {'heads':>5} {'leaves':>6} {'params':>15} "
              f"{'host fp32 state GiB (12 B/param)':>33}")
        for name in SIZES:
            m = build(name, "meta")
            n = count_params(m)
            print(f"{name:<6} {m.cfg.layers:>6} {m.cfg.d:>5} {m.cfg.heads:>5} {count_leaves(m):>6} "
                  f"{n:>15,} {12 * n / 2**30:>33.1f}")
        return
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args.size, args.device, dtype)
    x, y = batch(model.cfg, args.tokens, args.device)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        loss(model, x, y).backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(f"{args.size}: {count_params(model):,} params, {count_leaves(model)} leaves, "
          f"fwd+bwd {statistics.median(times[1:]):.3f} s ({args.tokens} tokens, {dtype})")


if __name__ == "__main__":
    main()
