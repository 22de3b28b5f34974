"""The wrapper contract: a wrapper written as docs/architecture.md says (a ``combine.Wrapped``
step, two hooks) streams like the optimizer it wraps."""

from typing import Any, NamedTuple

import pytest
import torch

import functional_offload as fo
from conftest import STALE
from functional_offload.combine import Wrapped, run_inner
from functional_offload.state import CONSUMED, terminal_counts
from test_stream import assert_same, make_model, train


class CountedState(NamedTuple):
    count: torch.Tensor  # int64 0-d: the wrapper's own steps; -1 once consumed
    inner_state: Any


def counted(opt: fo.Optimizer) -> fo.Optimizer:
    """``opt``, counting its steps in a state of its own."""

    def advanced(state: CountedState, inner_state: Any) -> CountedState:
        new = CountedState(state.count + 1, inner_state)
        state.count.fill_(CONSUMED)
        return new

    class Counted(Wrapped):
        def __init__(self, state: CountedState, speculative: bool):
            self.state = state
            super().__init__(opt, state.inner_state, speculative)

        def wrap(self, out: Any, inner_state: Any) -> tuple[Any, CountedState]:
            return out, advanced(self.state, inner_state)

        def completed_anyway(self) -> None:
            self.state.count.add_(1)

    def update(grads: Any, state: CountedState) -> tuple[Any, CountedState]:
        out, inner_state = run_inner(lambda: opt.update(grads, state.inner_state),
                                     state.inner_state, terminal_counts(state.inner_state),
                                     lambda: state.count.add_(1))
        return out, advanced(state, inner_state)

    return fo.Optimizer(lambda p: CountedState(torch.zeros((), dtype=torch.int64), opt.init(p)),
                        update, lambda state, speculative=False: Counted(state, speculative))


def test_a_wrapped_step_streams_as_its_inner_optimizer_bit_for_bit():
    mk = lambda: counted(fo.chain(fo.clip_by_global_norm(1e3), fo.adamw(1e-2)))  # noqa: E731
    pa, sa, _ = train(make_model(), mk(), streamed=False)
    pb, sb, counts, kept = train(make_model(), mk(), streamed=True, committed=True)
    assert counts == [6] * 5 and kept == [True] * 5  # run ahead during backward, then kept
    assert int(sa.count) == int(sb.count) == 5
    assert_same(pa, sa.inner_state, pb, sb.inner_state)


def test_a_wrapped_delayed_step_is_not_streamed_unless_run_ahead():
    params = dict(make_model().named_parameters())
    opt = counted(fo.adamw(1e-2, delayed=STALE))
    state = opt.init(params)
    with pytest.raises(ValueError, match="one of them"):
        with fo.stream(opt, state):
            pass
    opt.update({k: torch.zeros_like(v) for k, v in params.items()}, state)  # still usable
    guarded = fo.apply_if_finite(fo.adamw(1e-2, delayed=STALE))  # begun speculatively
    pa, sa, _ = train(make_model(), guarded, streamed=False)
    pb, sb, _ = train(make_model(), guarded, streamed=True)
    fo.flush(sa), fo.flush(sb)
    assert_same(pa, sa, pb, sb)
