"""Train Megatron-Core's ``GPTModel`` (TransformerEngine layers) on one GPU with this library's
offloaded optimizer, built from Megatron's own ``OptimizerConfig``; save, load and go on.

    python examples/train_megatron.py              # 24 layers, all optimizer state on the host
    python examples/train_megatron.py --offload 0.5 --mode plain --steps 20

Needs a GPU, megatron-core and TransformerEngine. Megatron's ``GPTModel`` needs
``torch.distributed`` and Megatron's parallel state even on one GPU (world size 1); the model is
used bare, without Megatron's ``DistributedDataParallel``: the grads are the params' ``.grad``.
The optimizer options are Megatron's (``OptimizerConfig``: ``--optimizer-cpu-offload``,
``--optimizer-offload-fraction``, ``--clip-grad``, ...); ``fo.compat.optimizer_from_megatron``
turns them into ``fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(...))`` with the state placed as
the offload fraction says. ``--mode stream`` steps each param's host-resident state as soon as
backward has made its grad (``fo.stream``); ``plain`` updates after backward.
The data: random byte sequences with a repeating pattern, so the loss falls within a few steps.
"""

from __future__ import annotations

import argparse
import os

import torch

import functional_offload as fo


def build_model(layers: int, hidden: int, heads: int, seq: int, vocab: int,
                seed: int = 0) -> torch.nn.Module:
    """Megatron's parallel state for one process (``MASTER_PORT`` from the environment, else
    29512), then a bf16 GPT with the TE layer spec, initialised from ``seed`` (its
    ``TransformerConfig`` is the model's ``config``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                            params_dtype=torch.bfloat16, init_method_std=0.02)
    return GPTModel(cfg, get_gpt_layer_with_transformer_engine_spec(), vocab_size=vocab,
                    max_sequence_length=seq, position_embedding_type="rope").cuda()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--offload", type=float, default=1.0, help="--optimizer-offload-fraction")
    ap.add_argument("--mode", choices=("stream", "plain"), default="stream")
    ap.add_argument("--save", default="megatron_opt.safetensors")
    args = ap.parse_args()

    from megatron.core.optimizer import OptimizerConfig

    model = build_model(args.layers, args.hidden, args.heads, args.seq, vocab=256)
    config = OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.1, adam_beta1=0.9,
                             adam_beta2=0.95, clip_grad=1.0, bf16=True,
                             use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                             optimizer_cpu_offload=True, optimizer_offload_fraction=args.offload)
    opt = fo.compat.optimizer_from_megatron(config)
    params = dict(model.named_parameters())  # Megatron's names: its no-decay rule reads them
    state = opt.init(params)
    report = fo.placement_report(state)
    print(f"optimizer state: {report.host_bytes / 2**20:.0f} MiB on the host, "
          f"{report.device_bytes / 2**20:.0f} MiB on the GPU")

    g = torch.Generator(device="cuda").manual_seed(0)
    pattern = torch.randint(0, 256, (64,), device="cuda", generator=g)
    positions = torch.arange(args.seq, device="cuda").expand(args.batch, -1)
    for step in range(args.steps):
        starts = torch.randint(0, 64, (args.batch, 1), device="cuda", generator=g)
        rows = pattern[(starts + torch.arange(args.seq + 1, device="cuda")) % 64]
        loss = model(rows[:, :-1], positions, None, labels=rows[:, 1:]).float().mean()
        if args.mode == "stream":
            with fo.stream(opt, state) as s:
                loss.backward()
            params, state = s.finish()
        else:
            loss.backward()
            params, state = opt.update({k: p.grad for k, p in params.items()}, state)
        model.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")

    fo.save(state, args.save)
    state = fo.load(args.save, like=opt.init(params))  # a fresh state, filled from the file
    print(f"saved and loaded the optimizer state ({args.save}); the model's weights are "
          "saved apart, e.g. torch.save(model.state_dict(), ...)")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
