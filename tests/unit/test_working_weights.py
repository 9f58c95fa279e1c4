"""bf16 working weights (learner/maths/working_weights.py): the same step as autocast's casts, bit for bit, with
each weight cast once per optimizer update; fp32 masters that still move at lr 1e-6."""

from __future__ import annotations

import pytest
import torch

from learner.maths.grpo import LogProbs, token_logprobs
from learner.maths.update import StepSettings, update_policy
from learner.maths.working_weights import WorkingWeights
from learner.model import load_policy
from tests.integration.test_learner_ranks import _cfg, _seqs

CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(120)


def _learner(path, working: bool, lr: float):
    torch.manual_seed(0)
    model = load_policy(str(path), "float32", CPU)[0]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ww = WorkingWeights(model) if working else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    return model, LogProbs(model, working=ww), opt, ww


def _steps(path, working: bool, micro: int, lr: float = 1e-3, steps: int = 2):
    cfg = _cfg(path, 1, bf16=True, micro=micro)
    cfg.learner.lr = lr
    model, forward, opt, ww = _learner(path, working, lr)
    results = [update_policy(forward, opt, _seqs(k), 4, cfg, StepSettings(clip=0.2), CPU, 0, 2 * k)
               for k in range(steps)]
    return model, results, ww


@pytest.mark.parametrize("micro", [1, 3])
def test_working_weights_take_autocasts_step_bit_for_bit(tiny_untied, micro):
    """Two steps of two updates each (checkpointed layers, pi_prox recomputed, several micro-batches): the
    same losses, grad norms and updated fp32 masters as autocast's per-use casts; one cast per update."""
    plain, res_plain, _ = _steps(tiny_untied, False, micro)
    model, res, ww = _steps(tiny_untied, True, micro)
    assert [r.losses for r in res] == [r.losses for r in res_plain]
    assert [r.norms for r in res] == [r.norms for r in res_plain]
    for (name, w), w0 in zip(model.named_parameters(), plain.parameters()):
        assert w.dtype == torch.float32 and torch.equal(w, w0), name
    updates = sum(r.updates for r in res)
    # at start, then at the forward after each update (the last one's is made by the next forward)
    assert updates == 4 and ww.casts == len(ww.modules) * updates and ww.refresh() == len(ww.modules)
    assert ww.refresh() == 0
    for m in ww.modules:  # the working copies are the current masters, rounded
        assert torch.equal(m.working_weight, m.weight.detach().to(torch.bfloat16))


def test_the_heads_chunks_take_autocasts_gradient(tiny_untied):
    """The head in several checkpointed chunks: the same log-probs and the same fp32 head gradient."""
    grads = []
    for working in (False, True):
        model, forward, _, _ = _learner(tiny_untied, working, 1e-3)
        ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(1))
        logp = token_logprobs(forward, ids, None, chunk_tokens=16, bf16=True)
        (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        grads.append((logp.detach(), model.lm_head.weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert grads[1][1].dtype == torch.float32


def test_masters_move_at_lr_1e_6_where_bf16_weights_would_not(tiny_untied):
    """At lr 1e-6 most updates are below a bf16 weight's spacing: the fp32 masters keep them (and the
    working copies follow once the masters cross a bf16 step)."""
    model0 = load_policy(str(tiny_untied), "float32", CPU)[0]
    model, res, ww = _steps(tiny_untied, True, 3, lr=1e-6, steps=1)
    assert res[0].updates == 2
    moved = lost_in_bf16 = 0
    for w, w0 in zip(model.parameters(), model0.parameters()):
        changed = w != w0
        moved += int(changed.sum())
        lost_in_bf16 += int((changed & (w.to(torch.bfloat16) == w0.to(torch.bfloat16))).sum())
    total = sum(p.numel() for p in model.parameters())
    assert moved > 0.5 * total and lost_in_bf16 > 0.5 * moved, (moved, lost_in_bf16, total)


def test_removed_working_weights_leave_the_plain_modules(tiny_untied):
    model, forward, _, ww = _learner(tiny_untied, True, 1e-3)
    ww.remove()
    assert all("forward" not in vars(m) and not hasattr(m, "working_weight") for m in ww.modules)
    assert "working_weight" not in dict(model.named_buffers(prefix="", recurse=True)).keys()
