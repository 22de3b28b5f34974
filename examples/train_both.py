"""A functional loop with both offload mechanisms: activations and optimizer state.

    python examples/train_both.py [--steps 60] [--budget-mib 4]

A small GPT-style decoder (token and position embeddings, pre-norm blocks with causal
``scaled_dot_product_attention`` and a GELU MLP, LayerNorms and biases; params named
``blocks.N.*``) learns a next-token rule. Each block is one activation group: the activations
planner keeps, offloads (GPU) or recomputes each block so that the step's peak stays within
``--budget-mib``, and prints its plan after the profiling steps. The AdamW state of every
leaf lives in host memory (``placement.on_host()``). On a machine without a GPU both run their
CPU path: activations are kept or recomputed (nothing to offload them to).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import functional_offload as fo


def init_params(vocab: int, d: int, layers: int, seq: int, g: torch.Generator) -> dict:
    """Params named as ``model.named_parameters()`` would name them."""
    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale
    p = {"tok_emb.weight": w(vocab, d), "pos_emb.weight": w(seq, d)}
    for i in range(layers):
        b = f"blocks.{i}."
        p |= {b + "ln1.weight": torch.ones(d), b + "ln1.bias": torch.zeros(d),
              b + "attn.qkv.weight": w(3 * d, d), b + "attn.qkv.bias": torch.zeros(3 * d),
              b + "attn.proj.weight": w(d, d, scale=0.02 / math.sqrt(2 * layers)),
              b + "attn.proj.bias": torch.zeros(d),
              b + "ln2.weight": torch.ones(d), b + "ln2.bias": torch.zeros(d),
              b + "mlp.fc.weight": w(4 * d, d), b + "mlp.fc.bias": torch.zeros(4 * d),
              b + "mlp.proj.weight": w(d, 4 * d, scale=0.02 / math.sqrt(2 * layers)),
              b + "mlp.proj.bias": torch.zeros(d)}
    return p | {"ln_f.weight": torch.ones(d), "ln_f.bias": torch.zeros(d), "head.weight": w(vocab, d)}


def block(p: dict, x: torch.Tensor, heads: int) -> torch.Tensor:
    """One pre-norm decoder block; ``p`` holds its params without the ``blocks.N.`` prefix."""
    B, T, d = x.shape
    h = F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"])
    q, k, v = F.linear(h, p["attn.qkv.weight"], p["attn.qkv.bias"]).view(
        B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
    x = x + F.linear(a, p["attn.proj.weight"], p["attn.proj.bias"])
    h = F.layer_norm(x, (d,), p["ln2.weight"], p["ln2.bias"])
    h = F.gelu(F.linear(h, p["mlp.fc.weight"], p["mlp.fc.bias"]))
    return x + F.linear(h, p["mlp.proj.weight"], p["mlp.proj.bias"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget-mib", type=float, default=4.0,
                    help="peak memory for the step's activations, loss head and grads")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    params = {k: v.to(device) for k, v in init_params(
        args.vocab, args.d, args.layers, args.seq, g).items()}
    rule = torch.randperm(args.vocab, generator=g).to(device)  # the next token follows the last
    prefixes = [f"blocks.{i}." for i in range(args.layers)]

    off = fo.ActivationOffload(args.layers, budget_bytes=int(args.budget_mib * 2**20),
                               min_bytes=1 << 12)

    def loss_fn(p: dict, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1] - 1
        x = p["tok_emb.weight"][tokens[:, :-1]] + p["pos_emb.weight"][:T]
        for i, pre in enumerate(prefixes):
            x = off.run(i, block, {k[len(pre):]: v for k, v in p.items() if k.startswith(pre)},
                        x, args.heads)
        x = F.layer_norm(x, (args.d,), p["ln_f.weight"], p["ln_f.bias"])
        logits = F.linear(x, p["head.weight"])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    value_and_grad = off.value_and_grad(loss_fn)
    opt = fo.chain(fo.clip_by_global_norm(1.0),
                   fo.adamw(3e-3, weight_decay=0.0, placement=fo.placement.on_host()))
    state = opt.init(params)
    t0 = time.perf_counter()
    for step in range(args.steps):
        first = torch.randint(args.vocab, (args.batch, 1), generator=g).to(device)
        tokens = [first]
        for _ in range(args.seq):
            tokens.append(rule[tokens[-1]])
        loss, grads = value_and_grad(params, torch.cat(tokens, dim=1))
        params, state = opt.update(grads, state)
        if step == 1:
            print(f"activation plan (from the profiling steps):\n{off.plan}\n")
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.5f}")
    print(f"\n{args.steps / (time.perf_counter() - t0):.1f} steps/s on {device}; activations: "
          f"{off.stats['recomputed_groups'] / args.steps:.1f} groups recomputed and "
          f"{off.stats['offloaded_bytes'] / args.steps / 2**20:.2f} MiB offloaded per step; "
          f"optimizer state on host: {fo.placement_report(state).host_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
