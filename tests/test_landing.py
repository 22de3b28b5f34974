"""``fo.land_before_forward`` with ``delayed=fo.Delay(lookahead=False)``: each module's forward
lands its params from the update in flight, so training is exact — the losses and params of the
same optimizer without ``delayed``, bit for bit — while the host step runs beside the forward."""

import gc
import threading

import pytest
import torch
from torch import nn

import functional_offload as fo
from functional_offload.executor import HostExecutor
from functional_offload.optimizers.packing import PACK_MAX
from functional_offload.testing import fail_host_kernel


def model_and_batches(dtype=torch.bfloat16, device="cpu", width=64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.LayerNorm(width), nn.GELU(),
                          nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)).to(device, dtype)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 16, generator=g).to(device, dtype),
                torch.randn(32, 4, generator=g).to(device)) for _ in range(6)]
    return model, batches


def train(delay, hooks: bool, stage: bool = False, dtype=torch.bfloat16, device="cpu",
          width=64, rem: bool = False):
    """Losses and final params of 6 steps of a clipped AdamW (host-resident state;
    ``rem``: ``store_param_remainders``)."""
    model, batches = model_and_batches(dtype, device, width)
    ex = HostExecutor(chunk_bytes=4096, slots=2, threads=2, stage_host_grads=stage)
    opt = fo.chain(fo.clip_by_global_norm(0.05),  # small: it scales every step
                   fo.adamw(1e-2, weight_decay=0.1, placement=fo.placement.on_host(),
                            executor=ex, delayed=delay, store_param_remainders=rem))
    return fit(model, opt, hooks, ((model(x).float() - y).square().mean() for x, y in batches))


def fit(model: nn.Module, opt, hooks: bool, losses) -> tuple[torch.Tensor, dict]:
    """Train ``model`` with ``opt`` on ``losses`` (an iterator computing each step's loss as it
    is reached), its params landed before each module's forward with ``hooks``; the losses and
    the final params."""
    params = dict(model.named_parameters())
    holder = [opt.init(params)]
    handle = fo.land_before_forward(model, lambda: holder[0]) if hooks else None
    out = []
    for loss in losses:
        loss.backward()
        out.append(loss.detach())
        _, holder[0] = opt.update({k: p.grad for k, p in params.items()}, holder[0])
        model.zero_grad(set_to_none=True)
    fo.flush(holder[0])
    if handle is not None:
        handle.remove()
    return torch.stack(out).cpu(), {k: p.detach().cpu() for k, p in params.items()}


@pytest.mark.parametrize("stage", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_landing_before_forward_is_exact(stage, dtype):
    want_losses, want = train(False, hooks=False, stage=stage, dtype=dtype)
    losses, got = train(fo.Delay(lookahead=False), hooks=True, stage=stage, dtype=dtype)
    assert torch.equal(losses, want_losses)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    stale, _ = train(fo.Delay(lookahead=False), hooks=False, stage=stage, dtype=dtype)
    assert not torch.equal(stale, want_losses)  # without the hooks the forward reads old params


@pytest.mark.parametrize("width", [256, 272], ids=["small-leaves", "a-split-leaf"])
def test_landing_is_exact_with_split_masters(width):
    """``store_param_remainders``: small host leaves keep fp32 masters in both modes (with 256,
    ~72k elements of them: ties occur; a split master in the delayed step alone rounded them
    away from zero, the plain step to even); with 272 the middle leaf's master is split."""
    want_losses, want = train(False, hooks=False, width=width, rem=True)
    losses, got = train(fo.Delay(lookahead=False), hooks=True, width=width, rem=True)
    assert torch.equal(losses, want_losses)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_small_leaves_land_packed_exactly(device):
    """Small leaves run packed in the landed step as in the plain one: two packs (weight decay
    on the matrices only), beside a leaf too large to pack; a step where some small leaves have
    no grad (the packs' runs split around them); the bits of the plain update."""
    def run(delay, hooks):
        model, batches = model_and_batches(device=device, width=320)
        assert model[3].weight.numel() > PACK_MAX  # the middle matrix: not packed
        params = dict(model.named_parameters())
        opt = fo.chain(fo.clip_by_global_norm(0.05),
                       fo.adamw(1e-2, weight_decay=0.1, placement=fo.placement.on_host(),
                                weight_decay_mask=lambda ps: {k: p.ndim > 1 for k, p in ps.items()},
                                executor=HostExecutor(chunk_bytes=4096, slots=2, threads=2),
                                delayed=delay))
        holder = [opt.init(params)]
        handle = fo.land_before_forward(model, lambda: holder[0]) if hooks else None
        losses = []
        for n, (x, y) in enumerate(batches):
            loss = (model(x).float() - y).square().mean()
            loss.backward()
            losses.append(loss.detach())
            grads = {k: p.grad for k, p in params.items()}
            if n == 2:  # the LayerNorm and the first bias get none
                grads.update({"1.weight": None, "1.bias": None, "0.bias": None})
            _, holder[0] = opt.update(grads, holder[0])
            model.zero_grad(set_to_none=True)
        fo.flush(holder[0])
        if handle is not None:
            handle.remove()
        return torch.stack(losses).cpu(), {k: p.detach().cpu() for k, p in params.items()}

    want_losses, want = run(False, False)
    losses, got = run(fo.Delay(lookahead=False), True)
    assert torch.equal(losses, want_losses)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_landing_before_forward_is_exact_on_a_gpu(dtype):
    """CUDA params, their state on the host: chunks land on the copy stream while the forward
    runs on the caller's; leaves wider than a 4 KiB chunk land across several."""
    kw = dict(dtype=dtype, device="cuda", width=512)
    want_losses, want = train(False, hooks=False, **kw)
    losses, got = train(fo.Delay(lookahead=False), hooks=True, **kw)
    assert torch.equal(losses, want_losses)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_land_ignores_other_params_and_states_with_nothing_in_flight():
    model, _ = model_and_batches()
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, delayed=fo.Delay(lookahead=False))
    state = opt.init(params)
    assert fo.land(state, [torch.zeros(3)]) is state  # nothing in flight
    _, state = opt.update({k: torch.ones_like(p) for k, p in params.items()}, state)
    fo.land(state, [torch.zeros(3)])  # no leaf of the update: nothing landed, no error
    fo.land(state, list(params.values()))
    fo.flush(state)


def test_a_look_ahead_is_refused_without_failing_the_state():
    model, batches = model_and_batches()
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, delayed=fo.Delay())  # with the look-ahead
    holder = [opt.init(params)]
    hooks = fo.land_before_forward(model, lambda: holder[0])
    x, y = batches[0]
    (model(x).float() - y).square().mean().backward()
    _, holder[0] = opt.update({k: p.grad for k, p in params.items()}, holder[0])
    with pytest.raises(ValueError, match=r"lookahead=False"):
        model(x)
    hooks.remove()
    fo.flush(holder[0])  # usable: the update lands as usual
    opt.update({k: torch.zeros_like(p) for k, p in params.items()}, holder[0])


def test_a_failed_host_step_raises_in_the_forward_and_fails_the_state():
    model, batches = model_and_batches()
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=fo.Delay(lookahead=False),
                   executor=HostExecutor(chunk_bytes=4096, slots=2, threads=1))
    holder = [opt.init(params)]
    hooks = fo.land_before_forward(model, lambda: holder[0])
    x, y = batches[0]
    (model(x).float() - y).square().mean().backward()
    with fail_host_kernel(after=1):
        _, holder[0] = opt.update({k: p.grad for k, p in params.items()}, holder[0])
        with pytest.raises(fo.HostStepError, match="injected failure"):
            model(x)
    with pytest.raises(fo.StateError, match="failed"):
        fo.flush(holder[0])
    hooks.remove()


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        fo.land_before_forward(lambda x: x, lambda: None)
    with pytest.raises(TypeError, match="current state"):
        fo.land_before_forward(nn.Linear(2, 2), None)
    model = nn.Linear(2, 2)
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=fo.Delay(lookahead=False))
    for wrong in (None, opt, 3):  # not a state: nothing would land, the training a step stale
        with pytest.raises(TypeError, match="expected an optimizer state"):
            fo.land(wrong, model)
    hooks = fo.land_before_forward(model, lambda: None)
    with pytest.raises(TypeError, match="got NoneType"):
        model(torch.ones(1, 2))
    hooks.remove()


def test_the_landing_runs_before_the_modules_other_pre_hooks():
    """A pre-hook registered before the landing's (as ``weight_norm``'s) reads the new params."""
    seen = {}
    for delay in (False, fo.Delay(lookahead=False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        reads = seen[bool(delay)] = []
        model[2].register_forward_pre_hook(lambda m, a: reads.append(m.weight.detach().clone()))
        opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=delay)
        g = torch.Generator().manual_seed(1)
        fit(model, opt, bool(delay), (model(torch.randn(3, 4, generator=g)).square().mean()
                                      for _ in range(4)))
    assert all(map(torch.equal, seen[False], seen[True])) and len(seen[True]) == 4


def test_landing_is_exact_under_torch_compile():
    """Hooks registered before the first compiled forward run (outside the graph), exactly;
    compiled after ``torch.compiler.reset()``, which drops code compiled without them (for the
    plain run here: compiled code does not check hooks)."""
    class Net(nn.Sequential):
        pass

    def losses(model: nn.Module):  # compiled once fit has registered the hooks
        torch.compiler.reset()
        compiled = torch.compile(model, backend="eager")
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            yield compiled(torch.randn(3, 4, generator=g)).square().mean()

    out = []
    for delay in (False, fo.Delay(lookahead=False)):
        torch.manual_seed(0)
        model = Net(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=delay)
        out.append(fit(model, opt, bool(delay), losses(model))[0])
    torch.compiler.reset()  # the compiled code's objects (cycles) go now, not in later tests
    gc.collect()
    assert torch.equal(out[0], out[1])


def test_torch_optimizer_lands_before_forward():
    """A module loop: fo.TorchOptimizer with delayed=fo.Delay(lookahead=False) and the hooks
    trains as the same TorchOptimizer without delayed, bit for bit."""
    out = []
    for delay in (False, fo.Delay(lookahead=False)):
        model, batches = model_and_batches()
        opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-2, weight_decay=0.1,
                                max_grad_norm=0.05,
                                placement=fo.placement.on_host(), delayed=delay,
                                executor=HostExecutor(chunk_bytes=4096, slots=2, threads=2))
        hooks = fo.land_before_forward(model, opt) if delay else None
        losses = []
        for x, y in batches:
            loss = (model(x).float() - y).square().mean()
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.flush()
        if hooks is not None:
            hooks.remove()
        out.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_multihead_attention_lands_its_out_proj():
    """nn.MultiheadAttention reads its out_proj's params without calling it: its hook lands
    them too, so a TransformerEncoderLayer trains exactly."""
    out = []
    for delay in (False, fo.Delay(lookahead=False)):
        torch.manual_seed(0)
        model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=delay,
                       executor=HostExecutor(chunk_bytes=4096, slots=2, threads=2))
        g = torch.Generator().manual_seed(1)
        out.append(fit(model, opt, bool(delay), (model(torch.randn(2, 5, 32, generator=g))
                                                 .square().mean() for _ in range(4)))[0])
    assert torch.equal(out[0], out[1])


class ReadsItsChild(nn.Module):
    """A parent that reads its child's weight itself (the child's forward never runs): with
    ``width`` 8 every leaf is small (one packed run, landed when the body's forward asks for
    its own params: the head's were read before), with 512 the head's weight is too large to
    pack."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Linear(8, width)
        self.head = nn.Linear(width, 160 if width > 8 else 2)

    def forward(self, x):
        return torch.nn.functional.linear(self.body(x), self.head.weight, self.head.bias)


@pytest.mark.parametrize("width", [8, 512], ids=["packed", "unpacked"])
def test_a_param_read_before_it_landed_is_named_at_the_next_update(width):
    torch.manual_seed(0)
    model = ReadsItsChild(width)
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=fo.Delay(lookahead=False),
                   executor=HostExecutor(chunk_bytes=4096, slots=2, threads=1))
    holder = [opt.init(params)]
    hooks = fo.land_before_forward(model, lambda: holder[0])
    x = torch.randn(4, 8)
    assert (model.head.weight.numel() > PACK_MAX) == (width > 8)
    for step in range(2):
        model(x).square().mean().backward()
        grads = {k: p.grad for k, p in params.items()}
        if step == 0:
            _, holder[0] = opt.update(grads, holder[0])
        else:
            with pytest.raises(RuntimeError, match=r"'head.weight'.*not landed before the forward"):
                opt.update(grads, holder[0])
        model.zero_grad(set_to_none=True)
    assert int(holder[0].count) == 1  # the update did not run; the state is usable, landed
    fo.land(holder[0], model.head)  # (nothing in flight now: a no-op)
    model(x).square().mean().backward()
    _, state = opt.update({k: p.grad for k, p in params.items()}, holder[0])
    fo.flush(state)  # nothing left running into the next test
    hooks.remove()


def test_land_takes_a_tensor_a_module_or_a_tree_and_finds_params_by_memory():
    model, batches = model_and_batches()
    params = {k: p.data for k, p in model.named_parameters()}  # the state built from .data
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=fo.Delay(lookahead=False))
    state = opt.init(params)
    _, state = opt.update({k: torch.ones_like(p) for k, p in params.items()}, state)
    first = next(model.parameters())
    before = first.detach().clone()
    fo.land(state, first)  # the nn.Parameter shares the memory of the .data in the state
    assert not torch.equal(first.detach(), before)
    fo.land(state, model[0])
    fo.land(state, {"any": list(model.parameters())})
    with pytest.raises(TypeError, match="fo.land params.*got a str"):
        fo.land(state, ["w"])
    fo.flush(state)


def test_hooks_with_a_stale_state_function_raise():
    model, batches = model_and_batches()
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, delayed=fo.Delay(lookahead=False))
    state = opt.init(params)
    old = state
    hooks = fo.land_before_forward(model, lambda: old)  # never updated: consumed below
    x, y = batches[0]
    (model(x).float() - y).square().mean().backward()
    _, state = opt.update({k: p.grad for k, p in params.items()}, state)
    with pytest.raises(fo.StateError):
        model(x)
    hooks.remove()
    fo.flush(state)


class Backwards(nn.Module):
    """Its forward reaches its layers in the reverse of their order in named_parameters();
    their weights are too large to be packed (the small leaves run as one)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(272, 272) for _ in range(4))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def test_the_next_host_step_takes_the_leaves_in_the_order_the_forward_landed_them():
    """The first delayed step runs in named_parameters() order; after a forward landed the last
    layer first, the next step's host run starts with it (the first chunk to fail names it)."""
    torch.manual_seed(0)
    model = Backwards().bfloat16()
    params = dict(model.named_parameters())
    opt = fo.adamw(1e-2, placement=fo.placement.on_host(), delayed=fo.Delay(lookahead=False),
                   executor=HostExecutor(chunk_bytes=4096, slots=2, threads=1))
    holder = [opt.init(params)]
    hooks = fo.land_before_forward(model, lambda: holder[0])
    x = torch.randn(4, 272).bfloat16()
    assert model.layers[0].weight.numel() > PACK_MAX
    model(x).float().sum().backward()
    with fail_host_kernel(after=0):
        _, holder[0] = opt.update({k: p.grad for k, p in params.items()}, holder[0])
        with pytest.raises(fo.HostStepError, match=r"leaf 'layers\.0\.weight'"):
            fo.flush(holder[0])
    torch.manual_seed(0)
    model = Backwards().bfloat16()
    params = dict(model.named_parameters())
    holder = [opt.init(params)]
    hooks.remove()
    hooks = fo.land_before_forward(model, lambda: holder[0])
    for step in range(2):
        model(x).float().sum().backward()
        grads = {k: p.grad for k, p in params.items()}
        model.zero_grad(set_to_none=True)
        if step == 0:
            _, holder[0] = opt.update(grads, holder[0])
            continue
        with fail_host_kernel(after=0):  # the step after a forward that landed layers.3 first
            _, holder[0] = opt.update(grads, holder[0])
            with pytest.raises(fo.HostStepError, match=r"leaf 'layers\.3\.weight'"):
                model(x)
    hooks.remove()


def test_params_given_other_memory_before_a_forward_land_there():
    """``param.data = param.data.clone()`` on every param between two steps: the next forward's
    hooks land the step in flight in the new memory (the losses and params of the plain update,
    bit for bit), also where a module's params were landed with an earlier module's (a pack)."""
    def run(delay, hooks):
        model, batches = model_and_batches()
        opt = fo.adamw(1e-2, weight_decay=0.1, placement=fo.placement.on_host(), delayed=delay)

        def losses():
            for n, (x, y) in enumerate(batches):
                if n == 2:
                    for p in model.parameters():
                        p.data = p.data.clone()
                yield (model(x).float() - y).square().mean()
        return fit(model, opt, hooks, losses())

    want_losses, want = run(False, False)
    losses, got = run(fo.Delay(lookahead=False), True)
    assert torch.equal(losses, want_losses)
    for k in want:
        assert torch.equal(got[k], want[k]), k


class ParentReadsChild(nn.Module):
    """A model whose forward reads its child ``b``'s params itself (``F.linear`` on them), so
    ``b``'s forward never runs and nothing lands them before they are read."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.a(x)), self.b.weight, self.b.bias)


def test_a_missed_landing_in_a_later_group_is_refused_before_any_group_steps():
    """fo.TorchOptimizer, two param groups in the landed form, the second group's params read
    by the parent (F.linear on a child's weight), so never landed before the forward: the step
    is refused naming them before any group steps (every group's last step landed, the
    optimizer usable); landing them, redoing forward and backward, the step goes on as the
    plain update's, bit for bit."""
    def run(landed: bool) -> dict:
        torch.manual_seed(0)
        m = ParentReadsChild()
        groups = [{"params": list(m.a.parameters())}, {"params": list(m.b.parameters())}]
        opt = fo.TorchOptimizer(groups, fo.adamw, lr=1e-2,
                                delayed=fo.Delay(lookahead=False) if landed else False)
        if landed:
            fo.land_before_forward(m, opt)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        for t in range(3):
            m(x).square().mean().backward()
            if landed and t > 0:
                with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\].*"
                                                       "were not landed before the forward"):
                    opt.step()
                opt.land(list(m.b.parameters()))
                opt.zero_grad()
                m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        return {k: v.detach().clone() for k, v in m.named_parameters()}

    plain, landed = run(False), run(True)
    assert all(torch.equal(plain[k], landed[k]) for k in plain)


def test_zeroed_grads_of_a_skipped_module_are_no_grads_to_the_landing_check():
    """``zero_grad(set_to_none=False)`` leaves a skipped module's grads as zero tensors: the
    landed form treats the ones no backward wrote as it treats ``None`` (their params were not
    read), so it steps as the plain update does, bit for bit, where it refused falsely."""
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
            self.t = 0

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if self.t % 2 == 0:  # b skipped on odd steps
                h = torch.tanh(self.b(h))
            return self.out(h)

    def run(delayed: bool) -> dict:
        torch.manual_seed(0)
        m = Skip()
        opt = fo.TorchOptimizer(m.named_parameters(), fo.adamw, lr=1e-2,
                                delayed=fo.Delay(lookahead=False) if delayed else False)
        if delayed:
            fo.land_before_forward(m, opt)
        g = torch.Generator().manual_seed(1)
        for t in range(5):
            m.t = t
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            (m(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        opt.flush()
        return {k: v.detach().clone() for k, v in m.named_parameters()}

    plain, landed = run(False), run(True)
    assert all(torch.equal(plain[k], landed[k]) for k in plain)


def test_a_missed_landing_in_a_partition_part_is_refused_before_any_part_steps():
    """fo.partition of two delayed parts in the landed form, the second part's params read by
    the parent (never landed before the forward): the update is refused naming them before
    any part steps (every part's last step landed, the state usable); landing them, redoing
    forward and backward, the updates go on as the plain partition's, bit for bit."""
    def run(landed: bool) -> dict:
        torch.manual_seed(0)
        m = ParentReadsChild()
        params = dict(m.named_parameters())
        delay = fo.Delay(lookahead=False) if landed else False
        opt = fo.partition({"a": fo.adamw(1e-2, delayed=delay), "b": fo.sgd(1e-2, delayed=delay)},
                           lambda p: {k: "a" if k.startswith("a") else "b" for k in p})
        holder = [opt.init(params)]
        if landed:
            fo.land_before_forward(m, lambda: holder[0])
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        for t in range(3):
            m(x).square().mean().backward()
            if landed and t > 0:
                with pytest.raises(RuntimeError, match="'b.bias', 'b.weight' got grads but were "
                                                       "not landed"):
                    opt.update({k: p.grad for k, p in params.items()}, holder[0])
                fo.land(holder[0], list(m.b.parameters()))
                for p in params.values():
                    p.grad = None
                m(x).square().mean().backward()
            _, holder[0] = opt.update({k: p.grad for k, p in params.items()}, holder[0])
            for p in params.values():
                p.grad = None
        fo.flush(holder[0])
        return {k: v.detach().clone() for k, v in m.named_parameters()}

    plain, landed = run(False), run(True)
    assert all(torch.equal(plain[k], landed[k]) for k in plain)


class _Mark:
    """A CUDA event's calls, played on the CPU: complete or not, as ``done`` says."""

    def __init__(self, done=True):
        self.done = done

    def query(self):
        return self.done


class _Stream:
    """A CUDA stream's calls, played on the CPU (the landing orders nothing here): the events
    it records are ``marks`` in turn (complete ones without), and ``waited`` keeps those its
    waits were given."""

    def __init__(self, marks=None):
        self.marks, self.waited = marks, []

    def record_event(self):
        return _Mark() if self.marks is None else next(self.marks)

    def wait_event(self, event):
        self.waited.append(event)


@pytest.fixture
def engine_on_cpu(monkeypatch):
    """The GPU engine's stream calls as no-ops, so that a :class:`Landing` with an engine job
    runs on the CPU."""
    monkeypatch.setattr(HostExecutor, "engine_stream", lambda self, device: None)
    monkeypatch.setattr(HostExecutor, "engine_math_streams", lambda self, device: [])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())


class _Job:
    """A GPU engine's job played on the CPU: ``prepare`` keeps the grads and the outputs of its
    ``leaves``; a test's ``run`` steps them."""

    leaves: list[int] = []

    def prepare(self, gs, outs):
        self.gs, self.outs = gs, outs


def _negate(work):
    """A kernel whose new params are the grads negated."""
    for piece, a, b in work.claims():
        piece.out[a:b] = -piece.grad[a:b]


def _landing(grads, params, engine, kernel=_negate):
    """A delayed step's landing of one leaf per grad into ``params``: ``engine``'s leaves
    stepped by it, the others by the CPU run's ``kernel``."""
    from functional_offload.executor import HostLeaf
    from functional_offload.executor.delayed import Landing
    leaves = [HostLeaf(f"l{j}", g, None, (torch.zeros(g.numel()),), None)
              for j, g in enumerate(grads)]
    return Landing(HostExecutor(chunk_bytes=4096, slots=2, threads=1), leaves, kernel,
                   [[(0, p)] for p in params], engine=engine)


def test_a_leaf_stepped_by_the_engine_lands_early_only_once_all_of_it_is_stepped(engine_on_cpu):
    """A delayed step's leaves divided between the GPU engine (here played on the CPU by a job
    that holds back its last piece of the first leaf) and the CPU run: the run numbers its
    leaves among its own, and the landing must count them as the leaves they are. A leaf landed
    early waits for the whole of it — not for as many elements of other leaves."""
    sizes = [4096, 256, 1024, 2048]  # the engine's: 0 and 2; the run's: 1 and 3
    held = 256  # the engine's last piece of leaf 0: no larger than leaf 1, which the run steps
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for n in sizes]
    params = [torch.zeros(n) for n in sizes]
    gate = threading.Event()

    class Engine(_Job):  # new params: -grad, leaf 0's last piece only once the gate opens
        leaves = [0, 2]

        def run(self, done):
            g, o, n = self.gs, self.outs, sizes[0]
            o[0][:n - held] = -g[0][:n - held]
            done([(0, 0, n - held)])
            assert gate.wait(10)
            o[0][n - held:] = -g[0][n - held:]
            done([(0, n - held, n)])
            o[2][:] = -g[2]
            done([(2, 0, sizes[2])])

    landing = _landing(grads, params, Engine())  # the run's leaves: -grad as well
    landing.run.wait()  # the run's leaves are stepped; the engine holds leaf 0's last piece
    returned = threading.Event()
    early = threading.Thread(target=lambda: (landing.land_leaves([0]), returned.set()))
    early.start()
    assert not returned.wait(0.5), "leaf 0 landed before the engine had stepped all of it"
    gate.set()
    early.join(10)
    assert returned.is_set()
    landing.land(None)
    for p, g in zip(params, grads):
        assert torch.equal(p, -g)


def test_an_early_landing_waits_only_for_the_engine_math_of_the_leaves_it_copies(
        engine_on_cpu, monkeypatch):
    """The GPU engine queues its chunks ahead: a leaf landed early waits (on the caller's
    stream) for the math of its own last chunk, and another engine leaf whose math is still
    queued is not copied with it (it lands on its own call, or with the rest)."""
    sizes = [1024, 512, 2048]  # the engine's: 0 and 2; the run's: 1
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(n, generator=gen) for n in sizes]
    params = [torch.zeros(n) for n in sizes]
    stream = _Stream(iter([_Mark(True), _Mark(False)]))  # leaf 0's chunk has run; 2's queued
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    stepped = threading.Event()

    class Engine(_Job):  # new params: -grad
        leaves = [0, 2]

        def run(self, done):
            for j in self.leaves:
                self.outs[j][:] = -self.gs[j]
                done([(j, 0, sizes[j])])
            stepped.set()

    landing = _landing(grads, params, Engine())
    landing.run.wait()
    assert stepped.wait(10)
    landing.land_leaves([0])
    assert torch.equal(params[0], -grads[0]) and torch.equal(params[1], -grads[1])
    assert torch.equal(params[2], torch.zeros(sizes[2])), "a leaf whose math is queued landed"
    assert [m.done for m in stream.waited] == [True]  # leaf 0's chunk's, not the later one's
    landing.land(None)
    for p, g in zip(params, grads):
        assert torch.equal(p, -g)


def test_a_failed_step_lands_the_run_s_finished_leaves_into_their_own_params(engine_on_cpu):
    """A failed step lands the finished chunks only: with the engine stepping an earlier leaf,
    the run's finished leaf lands into its own param, not into the engine leaf's."""
    from functional_offload.executor import HostStepError
    sizes = [2048, 1024, 1024]  # the engine's: 0; the run's: 1 (its chunk 0), 2 (chunk 1: fails)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen) for n in sizes]
    params = [torch.zeros(n) for n in sizes]

    class Engine(_Job):
        leaves = [0]

        def run(self, done):
            self.outs[0][:] = -self.gs[0]
            done([(0, 0, sizes[0])])

    calls = [0]

    def kernel(work):  # one worker: a call per chunk; the second chunk (leaf 2) fails
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom")
        _negate(work)

    landing = _landing(grads, params, Engine(), kernel)
    with pytest.raises(HostStepError):
        landing.land(None)
    assert torch.equal(params[0], -grads[0])  # the engine's, all of it
    assert torch.equal(params[1], -grads[1])  # the run's finished chunk, into its own param
    assert torch.equal(params[2], torch.zeros(sizes[2]))  # the failed chunk: not landed
