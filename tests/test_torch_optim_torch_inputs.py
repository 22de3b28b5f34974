"""fo.TorchOptimizer driven by PyTorch's own optimizer inputs (torch.testing._internal's
OptimizerInfo functions; needs `expecttest`, in the `compat` extra): every error input raises
what torch raises, and every input the adapter supports steps as torch.optim does, bit for bit."""

import copy
import functools

import pytest
import torch
from torch.nn import Parameter

import functional_offload as fo

co = pytest.importorskip("torch.testing._internal.common_optimizers", exc_type=ImportError)

ADAPTERS = {
    "adamw": (fo.adamw, torch.optim.AdamW, co.optim_inputs_func_adamw, co.optim_error_inputs_func_adamw),
    "adam": (fo.adam, torch.optim.Adam, co.optim_inputs_func_adam, co.optim_error_inputs_func_adam),
    "sgd": (fo.sgd, torch.optim.SGD, co.optim_inputs_func_sgd, co.optim_error_inputs_func_sgd),
}
REFUSED = {"amsgrad": True, "capturable": True, "differentiable": True}


def refused(kwargs):
    return any(kwargs.get(k) == v for k, v in REFUSED.items()) or kwargs.get("dampening", 0) != 0


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_torchs_error_inputs_raise_as_in_torch(name):
    make, _, _, errors = ADAPTERS[name]
    adapter = functools.partial(fo.TorchOptimizer, optimizer=make)
    cases = errors("cpu", torch.float32)
    assert cases
    for case in cases:
        params, kwargs = case.optimizer_error_input.params, case.optimizer_error_input.kwargs
        assert case.error_on == co.OptimizerErrorEnum.CONSTRUCTION_ERROR, case.optimizer_error_input.desc
        if issubclass(case.error_type, Warning):
            with pytest.warns(case.error_type, match=case.error_regex):
                adapter(params, **kwargs)
        else:
            with pytest.raises(case.error_type, match=case.error_regex):
                adapter(params, **kwargs)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_torchs_inputs_step_as_torch_optim(name):
    make, torch_cls, inputs, _ = ADAPTERS[name]
    ran = 0
    for case in inputs("cpu", torch.float32):
        kwargs = case.kwargs
        if refused(kwargs):
            with pytest.raises(ValueError, match="is not supported by fo.TorchOptimizer"):
                fo.TorchOptimizer([Parameter(torch.zeros(2))], make, **copy.deepcopy(kwargs))
            continue
        torch.manual_seed(0)
        w, b = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        w2, b2 = Parameter(w.detach().clone()), Parameter(b.detach().clone())
        x = torch.randn(5)
        ours = fo.TorchOptimizer([w, b], make, cpu_kernel="torch", **copy.deepcopy(kwargs))
        ref = torch_cls([w2, b2], **copy.deepcopy(kwargs))
        for _ in range(5):
            for o, (p, q) in ((ours, (w, b)), (ref, (w2, b2))):
                o.zero_grad()
                (p.mv(x) + q).pow(2).sum().backward()
                o.step()
            assert torch.equal(w, w2) and torch.equal(b, b2), case.desc
        ran += 1
    assert ran >= 3
