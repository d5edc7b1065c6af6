"""Tracing from two threads at once: make_fx's global state is guarded by the tracer's lock."""

from __future__ import annotations

import copy
import threading

import torch

from gm_trace import JointGraph, run_traced_graph, trace_model_graph
from gm_trace.testing import MLP, TinyGPT, lm_loss, make_lm_batch, make_regression_batch, mse_loss

# Without the lock this interleaving fails in make_fx ("CURRENT_PATCHER is None"): thread A
# starts tracing, B starts tracing, A finishes, B finishes. With the lock B cannot start before
# A ends, so A's wait for B simply runs out.
OVERLAP_WAIT_S = 1.0


def _eager(model, train_fn, batch):
    model = copy.deepcopy(model)
    loss = train_fn(model, *batch)
    loss.backward()
    return loss, {fqn: p.grad for fqn, p in model.named_parameters()}


def test_two_threads_trace_two_models_at_once_and_each_equals_eager():
    torch.manual_seed(0)
    gpt = TinyGPT(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    a_tracing, b_tracing, a_done = threading.Event(), threading.Event(), threading.Event()

    def first_fn(model, x, y):
        a_tracing.set()
        b_tracing.wait(OVERLAP_WAIT_S)  # let B enter make_fx while A is inside
        return mse_loss(model, x, y)

    def second_fn(model, x, y):
        b_tracing.set()
        a_done.wait(OVERLAP_WAIT_S)  # and leave only after A has left
        return lm_loss(model, x, y)

    cases = [
        (MLP(), first_fn, make_regression_batch(8), a_done),
        (gpt, second_fn, make_lm_batch(2, 16, 64), None),
    ]
    graphs: dict[int, JointGraph] = {}
    errors: list[BaseException] = []

    def trace(i: int) -> None:
        model, train_fn, batch, done = cases[i]
        if i == 1:
            a_tracing.wait(OVERLAP_WAIT_S)
        try:
            graphs[i] = trace_model_graph(model, train_fn, *batch)
        except BaseException as exc:
            errors.append(exc)
        if done is not None:
            done.set()

    threads = [threading.Thread(target=trace, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i, (model, train_fn, batch, _) in enumerate(cases):
        ref_loss, ref_grads = _eager(model, train_fn, batch)
        out = run_traced_graph(graphs[i], model, *batch)
        assert torch.equal(out.loss, ref_loss.detach())
        assert set(out.grads) == set(ref_grads)
        for fqn, grad in out.grads.items():
            assert torch.equal(grad, ref_grads[fqn]), fqn
