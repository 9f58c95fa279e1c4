"""Attention within each sequence of a packed row (learner/maths/attention.py): every backend gives the log-probs,
entropies and gradients of each sequence run alone, and the start-up check catches one that leaks."""

import pytest
import torch

from exgrpo_async.toy.task import build_model
from learner.maths import attention
from learner.maths.grpo import check_no_cross_attention, rows_logprobs
from learner.maths.packing import pack_rows, pad_rows
from tests.unit.test_update import _seqs

CPU = torch.device("cpu")


def _logps_and_grads(model, rows, backend: str):
    attention.use(model, backend)
    model.zero_grad(set_to_none=True)
    lp, ent = rows_logprobs(model, rows, CPU, 1.0, with_entropy=True)
    (rows.per_token(torch.linspace(0.5, 1.5, len(rows.lengths))) * lp + 0.1 * ent * rows.target_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return rows.split(lp.detach()), rows.split(ent.detach()), grads


def test_segments_follow_the_packed_position_ids():
    r = pack_rows([[1, 2], [1], [1, 2, 3]], [[5, 6], [7], [8]], pad_id=0, max_tokens=6)
    seg = attention.segments_from_positions(r.position_ids, CPU)
    # row 0: sequences of 4 and 2 tokens; row 1: one of 4, then its padding (2) as a segment of its own
    assert seg.bounds == (0, 4, 6, 10, 12)
    assert seg.cu_seqlens.tolist() == [0, 4, 6, 10, 12] and seg.cu_seqlens.dtype == torch.int32
    assert seg.max_len == 4


@pytest.mark.parametrize("backend", ["sdpa", "per_sequence"])
def test_packed_rows_give_what_each_sequence_gives_alone(backend):
    torch.manual_seed(0)
    seqs = _seqs()
    prompts, comps = [s.prompt for s in seqs], [s.completion for s in seqs]
    alone = pad_rows(prompts, comps, 0)  # one right-padded row per sequence: the reference
    packed = pack_rows(prompts, comps, 0, max_tokens=64)
    assert packed.input_ids.shape[0] < len(seqs)  # really packed
    ref = _logps_and_grads(build_model(0), alone, "sdpa")
    got = _logps_and_grads(build_model(0), packed, backend)
    for a, b in zip(ref[0] + ref[1], got[0] + got[1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert ref[2].keys() == got[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-4, atol=3e-5, msg=name)


def test_right_padded_rows_need_no_segments():
    """Without segments a kernel treats each row as one causal sequence: right padding comes after
    every real token, so padded rows score as the SDPA path with its padding mask does."""
    seqs = _seqs()
    rows = pad_rows([s.prompt for s in seqs], [s.completion for s in seqs], 0)
    ref = _logps_and_grads(build_model(0), rows, "sdpa")
    got = _logps_and_grads(build_model(0), rows, "per_sequence")
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "per_sequence"])
def test_start_up_check_passes_a_backend_that_keeps_sequences_apart(backend):
    model = build_model(0).eval()
    attention.use(model, backend)
    check_no_cross_attention(model, model.config.vocab_size, CPU, bf16=False)


def test_start_up_check_catches_attention_across_sequences():
    """A kernel that ignores the segments (causal over the whole row) lets a sequence see the one before it."""
    from transformers import AttentionInterface

    def leaky(module, q, k, v, mask, scaling=None, dropout=0.0, sliding_window=None, packed_segments=None, **kw):
        return attention.per_sequence_attention(module, q, k, v, mask, scaling, dropout, sliding_window, None)

    AttentionInterface.register("exgrpo_per_sequence", leaky)
    model = build_model(0).eval()
    model.config._attn_implementation = "exgrpo_per_sequence"
    try:
        with pytest.raises(RuntimeError, match="attend across sequences"):
            check_no_cross_attention(model, model.config.vocab_size, CPU, bf16=False)
    finally:
        AttentionInterface.register("exgrpo_per_sequence", attention.per_sequence_attention)


def test_backend_choice():
    assert attention.resolve("auto", CPU, bf16=True) == "sdpa"
    assert attention.resolve("per_sequence", CPU, bf16=False) == "per_sequence"
    with pytest.raises(ValueError, match="needs a CUDA learner"):
        attention.resolve("varlen", CPU, bf16=True)
    with pytest.raises(ValueError, match="expected one of"):
        attention.resolve("flash", CPU, bf16=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_on_packed_rows_matches_each_sequence_alone_on_gpu():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    seqs = _seqs()
    prompts, comps = [s.prompt for s in seqs], [s.completion for s in seqs]
    alone, packed = pad_rows(prompts, comps, 0), pack_rows(prompts, comps, 0, max_tokens=64)
    outs = []
    for rows, backend in ((alone, "per_sequence"), (packed, "varlen")):
        model = build_model(0).to(dev).eval()
        attention.use(model, backend)
        with torch.no_grad():
            outs.append(rows.split(rows_logprobs(model, rows, dev, 1.0, bf16=True).float().cpu()))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=0, atol=0.05)  # bf16 compute, two kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_start_up_check_passes_varlen_on_gpu():
    dev = torch.device("cuda")
    model = build_model(0).to(dev).eval()
    attention.use(model, "varlen")
    check_no_cross_attention(model, model.config.vocab_size, dev, bf16=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_inside_compiled_layers_takes_the_eager_kernels_steps_on_gpu():
    """Compiled layers without checkpointing run varlen inside their graph (learner/maths/compiled.py
    `attention_in_graph`): the packed rows' log-probs and gradients are the eager kernel's, and a second
    layout (other widths and segments) compiles nothing new."""
    from torch._dynamo.utils import counters

    from learner.maths import compiled

    dev = torch.device("cuda")
    seqs = _seqs()
    prompts, comps = [s.prompt for s in seqs], [s.completion for s in seqs]
    # widths and row counts apart from the toy's sizes (head_dim 64...): the compiler would take an equal
    # width for the same size ("duck sizing") and compile again for the next one
    rows = [pack_rows(prompts, comps, 0, max_tokens=48), pack_rows(prompts[1:], comps[1:], 0, max_tokens=40)]
    got = []
    for in_graph in (False, True):
        torch._dynamo.reset()
        model = build_model(0).to(dev).train()
        attention.use(model, "varlen", traceable=in_graph)
        if in_graph:
            compiled.compile_layers(model)
        out = []
        for r in rows:
            model.zero_grad(set_to_none=True)
            lp = rows_logprobs(model, r, dev, 1.0, bf16=True)
            lp.float().sum().backward()
            out.append((lp.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()
                                                     if p.grad is not None}))
            if in_graph and r is rows[0]:
                graphs = counters["stats"]["unique_graphs"]
        if in_graph:
            assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs  # the second layout reused them
        got.append(out)
    for (lp_e, g_e), (lp_c, g_c) in zip(*got):
        torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=0.05)  # bf16 compute, fused kernels
        for n, g in g_e.items():
            torch.testing.assert_close(g_c[n], g, rtol=0.05, atol=0.05 * float(g.abs().max()) + 1e-6, msg=n)
