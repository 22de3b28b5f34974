"""Train a small GPT with FSDP2 (``fully_shard``) and host-resident optimizer state; checkpoint
with DCP and resume, at any world size.

    torchrun --nproc_per_node=2 examples/train_fsdp2.py --device cpu --steps 20 --save ckpt
    torchrun --nproc_per_node=1 examples/train_fsdp2.py --device cpu --resume ckpt/step-20
    torchrun --nproc_per_node=4 examples/train_fsdp2.py --mode stream       # 4 GPUs (NCCL)

Each rank holds a shard of every param (a DTensor) and the optimizer state of that shard: fp32
moments (and fp32 masters for bf16 params) in host memory, updated by the host executor
(``--offload`` sets the fraction). ``clip_by_global_norm`` clips by the norm over all ranks'
shards. ``--mode`` picks how the update runs: ``plain`` (after backward), ``stream`` (each
leaf's host step starts as FSDP2 finishes reducing its grad) or ``delayed`` (the host step runs
during the next forward and backward; the next update lands it as the look-ahead of its own
grads). The data is the same
global batch at every world size (each rank takes its slice), so a run resumed at another
world size continues the same trajectory, up to the rounding of reductions in another order.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import functional_offload as fo
import functional_offload.dcp  # noqa: F401  (fo.dcp)


class Block(nn.Module):
    """Pre-LN transformer block: causal SDPA attention and a GELU MLP, with biases."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token and position embeddings, ``blocks.N``, a final LayerNorm and a linear head; the
    logits of all the batch's tokens as one ``(batch * ctx, vocab)`` tensor."""

    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        # the head on (tokens, width): a Linear of a 3-D input returns a view of its 2-D
        # result, and FSDP2 warns when a sharded module returns a view
        return self.head(self.ln_f(x).flatten(0, 1))


def setup(args: argparse.Namespace) -> tuple[torch.device, DeviceMesh]:
    """The process group for this torchrun rank and a 1-D mesh over all ranks."""
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)  # gloo: DCP's CPU side
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        # the ranks of a node share its cores (the optimizer's host threads take their share)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    return device, init_device_mesh(device.type, (dist.get_world_size(),))


def build_model(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh) -> GPT:
    """The model (the same values on every rank), sharded per block, then the root."""
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.ctx, args.width, args.layers, args.heads).to(device, args.dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_optimizer(args: argparse.Namespace) -> fo.Optimizer:
    """Clipping by the global norm, then AdamW (no weight decay on vectors: biases, norms) with
    warmup and cosine decay; ``--offload`` of the state in host memory."""
    schedule = fo.schedules.warmup_cosine(args.lr, args.warmup, max(args.warmup, args.total_steps),
                                          end=args.lr / 10)
    return fo.chain(
        fo.clip_by_global_norm(args.clip),
        fo.adamw(lr=schedule, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 weight_decay_mask=lambda ps: {n: p.ndim >= 2 for n, p in ps.items()},
                 placement=fo.placement.offload_fraction(args.offload),
                 delayed=args.mode == "delayed"),
    )


def batch(args: argparse.Namespace, step: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``: sequences where each token is
    ``(5 * previous + 3) % vocab``, from random first tokens (a rule the model can learn)."""
    g = torch.Generator().manual_seed(10_000 + step)
    first = torch.randint(args.vocab, (args.batch, 1), generator=g)
    seq = [first]
    for _ in range(args.ctx):
        seq.append((5 * seq[-1] + 3) % args.vocab)
    ids = torch.cat(seq, dim=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the world size ({world})")
    mine = ids[rank::world]  # the global batch split among the ranks
    return mine[:, :-1].to(device), mine[:, 1:].to(device)


def save(path: str, model: nn.Module, state: Any) -> None:
    """Model and optimizer state in one DCP checkpoint (every rank writes its shards). A delayed
    step in flight lands first, so params and state are of the same step (the next forward then
    sees the new params: a save restarts the delay)."""
    fo.flush(state)
    dcp.save({"model": get_model_state_dict(model), "optim": fo.dcp.state_dict(state)},
             checkpoint_id=path)


def resume(path: str, model: nn.Module, like: Any) -> None:
    """Load a checkpoint saved at any world size into ``model`` and, in place, into ``like``."""
    sd = {"model": get_model_state_dict(model), "optim": fo.dcp.state_dict(like, loading=True)}
    dcp.load(sd, checkpoint_id=path, planner=fo.dcp.StrictLoadPlanner())
    set_model_state_dict(model, sd["model"])


def mean_over_ranks(x: torch.Tensor) -> float:
    x = x.detach().float().clone()
    dist.all_reduce(x)  # gloo has no AVG
    return x.item() / dist.get_world_size()


def main() -> None:
    args = parse()
    device, mesh = setup(args)
    rank = dist.get_rank()
    model = build_model(args, device, mesh)
    params = dict(model.named_parameters())  # DTensor nn.Parameters: this rank's shards
    opt = build_optimizer(args)
    state = opt.init(params)
    if args.resume:
        resume(args.resume, model, state)
    start = int(state[1].count)  # updates applied so far: where the data continues
    if rank == 0:
        report = fo.placement_report(state)
        print(f"{dist.get_world_size()} rank(s) ({args.device}), mode {args.mode}, "
              f"{sum(p.numel() for p in params.values()):,} params, {len(params)} leaves, "
              f"optimizer state of rank 0: {report.host_bytes / 2**20:.2f} MiB in host memory, "
              f"{report.device_bytes / 2**20:.2f} MiB on the device"
              + (f"; resumed from {args.resume} at step {start}" if args.resume else ""),
              flush=True)

    t0 = time.perf_counter()
    for step in range(start, start + args.steps):
        inputs, targets = batch(args, step, device)
        loss = F.cross_entropy(model(inputs).float(), targets.flatten())
        if args.mode == "stream":
            with fo.stream(opt, state) as s:  # hooks on the sharded params, after reduce-scatter
                loss.backward()
            _, state = s.finish()
        else:
            loss.backward()
            _, state = opt.update({n: p.grad for n, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
        value = mean_over_ranks(loss)
        if rank == 0:
            print(f"step {step + 1} loss {value:.5f}", flush=True)
        last = step + 1 == start + args.steps
        if args.save and (last or (args.save_every and (step + 1) % args.save_every == 0)):
            path = os.path.join(args.save, f"step-{step + 1}")
            save(path, model, state)
            if rank == 0:
                print(f"saved {path}", flush=True)
    fo.flush(state)  # delayed: the last step lands in the params
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - t0:.2f} s", flush=True)
    dist.destroy_process_group()


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--mode", choices=["plain", "stream", "delayed"], default="delayed")
    ap.add_argument("--steps", type=int, default=50, help="steps to run (after the resumed ones)")
    ap.add_argument("--total-steps", type=int, default=200, help="length of the LR schedule")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                    help="params' dtype (bf16 ones get fp32 masters); default: bf16 on cuda, "
                         "fp32 on cpu")
    ap.add_argument("--offload", type=float, default=1.0,
                    help="fraction of the state in host memory")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=10, help="warmup steps")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=8,
                    help="global batch (sequences), split among the ranks")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", help="write DCP checkpoints SAVE/step-N at the end (and every "
                                   "--save-every steps)")
    ap.add_argument("--save-every", type=int, default=0,
                    help="steps between checkpoints (0: at the end only)")
    ap.add_argument("--resume", help="a checkpoint (SAVE/step-N) to start from, saved at any "
                                     "world size")
    args = ap.parse_args()
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    return args


if __name__ == "__main__":
    main()
    # The sharded model and state lie in reference cycles: collected now, while the interpreter
    # is whole, not in its teardown, where freeing tensors that gloo's threads still reference
    # now and then aborts the process ("terminate called without an active exception").
    gc.collect()
