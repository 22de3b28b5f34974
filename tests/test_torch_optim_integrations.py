"""fo.TorchOptimizer inside tools written for torch.optim: transformers.Trainer (training,
checkpoints, resume; the same as torch.optim.AdamW in the same Trainer) and accelerate's
prepare. Skipped where transformers / accelerate are not installed (`pip install -e .[compat]`).
The CUDA tests check that preparing keeps host-resident state off the GPU."""

import pytest
import torch

import functional_offload as fo


class FoAdamW(fo.TorchOptimizer):
    """What Trainer(optimizer_cls_and_kwargs=...) needs: an Optimizer class taking (params, **kw)."""

    def __init__(self, params, **kw):
        super().__init__(params, fo.adamw, **kw)


def tiny_lm():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=16):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def train(tmp, optimizer_cls, resume=None, max_steps=4):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp), max_steps=max_steps, per_device_train_batch_size=4,
        learning_rate=3e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
        max_grad_norm=1.0, save_strategy="steps", save_steps=2, logging_strategy="no",
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    kw = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if optimizer_cls is FoAdamW:
        kw["cpu_kernel"] = "torch"  # bit for bit torch.optim's math
    trainer = transformers.Trainer(model=tiny_lm(), args=args, train_dataset=Tokens(),
                                   optimizer_cls_and_kwargs=(optimizer_cls, kw))
    trainer.train(resume_from_checkpoint=resume)
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}, trainer


def test_trainer_trains_checkpoints_and_resumes_like_torch_adamw(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ours, trainer = train(tmp_path / "ours", FoAdamW)
    assert isinstance(trainer.optimizer.optimizer, FoAdamW)  # wrapped by accelerate
    assert len(trainer.optimizer.param_groups) == 2  # Trainer's decay / no-decay groups
    theirs, _ = train(tmp_path / "torch", torch.optim.AdamW)
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    # resume from the step-2 checkpoint Trainer wrote (torch.save of our state_dict, loaded
    # back with weights_only=True), in a new Trainer with a new optimizer
    resumed, _ = train(tmp_path / "ours", FoAdamW, resume=str(tmp_path / "ours" / "checkpoint-2"))
    for k in ours:
        assert torch.equal(resumed[k], ours[k]), k
    # and a torch.optim.AdamW checkpoint resumes into ours (and the trajectory is the same)
    crossed, _ = train(tmp_path / "torch", FoAdamW, resume=str(tmp_path / "torch" / "checkpoint-2"))
    for k in ours:
        assert torch.equal(crossed[k], ours[k]), k


def test_accelerate_prepare_of_a_new_optimizer_moves_no_state():
    accelerate = pytest.importorskip("accelerate")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-2)
    taken = []
    opt.register_state_dict_post_hook(lambda o, sd: taken.append(len(sd["state"])))
    acc = accelerate.Accelerator(cpu=True)
    model, prepared = acc.prepare(model, opt)
    assert taken == [0]  # prepare's state_dict round trip had no tensor to move
    for _ in range(2):
        acc.backward(model(torch.randn(4, 8)).square().mean())
        prepared.step()
        prepared.zero_grad()
    assert prepared.state is opt.state and float(opt.state[model[0].weight]["step"]) == 2
    # an optimizer that has state already: prepare it without device placement
    again = acc.prepare_optimizer(opt, device_placement=False)
    assert again.state[model[0].weight]["exp_avg"] is opt.fo_states[0].mu["0.weight"]


# ---- CUDA (run on a GPU machine: pytest -m cuda tests/test_torch_optim_integrations.py) -----

def _model_on_gpu(layers=8, width=2048):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()


def _state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() if isinstance(s, dict)
               for v in s.values() if isinstance(v, torch.Tensor))


@pytest.mark.cuda
def test_cuda_accelerate_prepare_keeps_host_state_off_the_gpu():
    accelerate = pytest.importorskip("accelerate")
    model = _model_on_gpu()  # 33.6 M params: 134 MB of fp32; AdamW's state 268 MB on the host
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-3)
    acc = accelerate.Accelerator()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, prepared = acc.prepare(model, opt)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 16 * 2**20
    x = torch.randn(64, 2048, device="cuda")
    for _ in range(2):
        acc.backward(model(x).square().mean())
        prepared.step()
        prepared.zero_grad()
    w = model[0].weight
    assert opt.state[w]["exp_avg"].device.type == "cpu" and opt.state[w]["exp_avg"].is_contiguous()
    state_bytes = _state_bytes(opt)
    assert state_bytes > 250 * 2**20
    # with state: device_placement=False keeps it where it is
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    prepared = acc.prepare_optimizer(opt, device_placement=False)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 16 * 2**20
    assert opt.state[w]["exp_avg"].device.type == "cpu"
    # (the documented pitfall: the default placement copies existing state through the GPU)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    acc.prepare_optimizer(opt)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base >= 0.9 * state_bytes
    assert opt.state[w]["exp_avg"].device.type == "cpu"  # loaded back into the host state


@pytest.mark.cuda
def test_cuda_host_state_round_trips_with_torch_adamw_on_the_gpu():
    model = _model_on_gpu(layers=2, width=256)
    ref_model = _model_on_gpu(layers=2, width=256)
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-3)  # state on the host
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    x = torch.randn(32, 256, device="cuda")
    for m, o in ((model, opt), (ref_model, ref)):
        for _ in range(3):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    sd = opt.state_dict()
    assert "master" not in sd["state"][0]  # an fp32 param's host copy equals the param
    assert sd["state"][0]["exp_avg"].device.type == "cpu"
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b)
    twin = _model_on_gpu(layers=2, width=256)
    twin.load_state_dict(model.state_dict())
    ref2 = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    ref2.load_state_dict(sd)  # torch moves the state to the params' device
    back = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-3)
    back.load_state_dict(ref2.state_dict())  # GPU tensors copied into host state
    assert back.state[model[0].weight]["exp_avg"].device.type == "cpu"
    for m, o in ((model, back), (twin, ref2)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.cuda
def test_cuda_bf16_params_on_the_gpu_keep_an_fp32_master_in_the_view_and_checkpoint():
    model = _model_on_gpu(layers=2, width=256).to(torch.bfloat16)
    opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-3)
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    opt.step()
    view = opt.state[model[0].weight]
    assert view["master"].dtype == torch.float32 and view["master"].device.type == "cpu"
    assert torch.equal(view["master"].to("cuda", torch.bfloat16), model[0].weight.detach())
    twin = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-3)
    twin.load_state_dict(opt.state_dict())
    assert torch.equal(twin.state[model[0].weight]["master"], view["master"])


@pytest.mark.parametrize("delayed, flush_first", [(False, True), (True, True), (True, False)],
                         ids=["plain", "delayed-flushed", "delayed-in-flight"])
def test_a_param_made_fp32_keeps_the_exact_master_it_had_as_bf16(delayed, flush_first):
    """A bf16 param cast to fp32 between steps (its group laid out anew, where an fp32 param
    keeps no master or a hidden one): it takes its master's exact value, so the steps go on as
    ``fo.sgd``'s, which keeps that master; also with a delayed step in flight at the cast."""
    def run(api: str) -> torch.Tensor:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(37).bfloat16()) for _ in range(2)]
        gs = [[torch.randn(37) for _ in range(2)] for _ in range(4)]
        delay = fo.Delay(lookahead=False) if delayed else False
        if api == "torch":
            opt = fo.TorchOptimizer(ps, fo.sgd, lr=0.1, delayed=delay)
        else:
            opt = fo.sgd(0.1, delayed=delay)
            state = opt.init({"0": ps[0], "1": ps[1]})
        for i, g in enumerate(gs):
            if i == 2:
                if flush_first:
                    opt.flush() if api == "torch" else fo.flush(state)
                ps[1].data = ps[1].data.float()
            if api == "torch":
                for p, x in zip(ps, g):
                    p.grad = x.to(p.dtype)
                opt.step()
                opt.zero_grad()
            else:
                _, state = opt.update({str(j): x.to(p.dtype) for j, (p, x) in enumerate(zip(ps, g))},
                                      state)
        opt.flush() if api == "torch" else fo.flush(state)
        return ps[1].detach().clone()

    assert torch.equal(run("torch"), run("fo"))
