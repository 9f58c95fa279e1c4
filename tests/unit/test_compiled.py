"""Compiled regions (learner/maths/compiled.py): a learner with compiled decoder layers and head takes the eager
learner's steps, and new row widths and segment layouts compile nothing more (the attention kernels are
outside the graph). On CPU, as a GPU learner runs them ("auto" there)."""

import pytest
import torch
from torch._dynamo.utils import counters

from exgrpo_async.config_io import load_config
from learner.maths import compiled

CPU = torch.device("cpu")


def test_the_setting_resolves_per_device_and_checkpointing():
    gpu = torch.device("cuda", 0)
    R = compiled.Regions
    assert compiled.resolve("auto", gpu, False) == R(True, True) and compiled.resolve("auto", CPU, False) == R(False, False)
    # checkpointed layers are compiled whole: with a traceable attention kernel only (not transformers' sdpa)
    assert compiled.resolve("auto", gpu, True, "varlen") == R(compiled.CHECKPOINTED_AUTO, True)
    assert compiled.resolve("auto", gpu, True, "sdpa") == R(False, True)
    assert compiled.resolve("on", CPU, True, "per_sequence") == R(True, True)
    assert compiled.resolve("on", CPU, False) == R(True, True) and compiled.resolve("off", gpu, False) == R(False, False)
    assert compiled.resolve("head", CPU, True) == R(False, True) and str(R(False, True)) == "head"
    with pytest.raises(ValueError, match="'per_sequence' or 'varlen'"):
        compiled.resolve("on", gpu, True, "sdpa")
    with pytest.raises(ValueError, match="learner.compile"):
        compiled.resolve("yes", CPU, False)
    with pytest.raises(ValueError, match="needs learner.attention"):  # at load, before any process starts
        load_config(None, ["learner.compile=on", "learner.gradient_checkpointing=true", "learner.attention=sdpa"])
    load_config(None, ["learner.compile=on", "learner.gradient_checkpointing=true", "learner.attention=per_sequence"])
    with pytest.raises(ValueError, match="no .model.layers"):
        compiled.compile_layers(torch.nn.Linear(2, 2))
    # the attention in the compiled layers' graph: under checkpointing always, without it for varlen only
    both, head = R(True, True), R(False, True)
    assert compiled.attention_in_graph(both, True, "per_sequence") and compiled.attention_in_graph(both, True, "varlen")
    assert compiled.attention_in_graph(both, False, "varlen")
    assert not compiled.attention_in_graph(both, False, "per_sequence") and not compiled.attention_in_graph(both, False, "sdpa")
    assert not compiled.attention_in_graph(head, True, "varlen") and not compiled.attention_in_graph(head, False, "varlen")


@pytest.mark.slow  # inductor compiles the learner's regions: 54-77 s on an AVX2-only CPU
@pytest.mark.timeout(420)
def test_a_compiled_learner_takes_the_eager_learners_steps(tiny_tied):
    """`learner.compile="on"` through the learner's own Policy (its start-up check, two updates of other
    packed widths, the selection pass), without and with gradient checkpointing (the checkpoint inside
    each layer's graph): the same weights and scores as eager, and the second update compiles nothing;
    the checkpointed layers keep far less for the backward; a call that would need a graph past the
    recompile limit raises."""
    import torch._inductor.config as inductor

    from learner.maths.update import StepSettings
    from learner.policy import Policy
    from learner.ranks import Ranks
    from tests.integration.test_learner_ranks import _cfg, _seqs

    torch._dynamo.reset()
    dynamic_threads = inductor.cpp.dynamic_threads
    policies, kept = {}, {}
    for mode in ("off", "on", "on_checkpointed"):
        # the Inductor mode vLLM's CPU platform leaves in a process that built an engine: the regions compile
        # for a fixed thread count instead (its own mode corrupted the heap, 4 runs in 4; compiled.fixed_cpu_threads)
        inductor.cpp.dynamic_threads = True
        cfg = _cfg(tiny_tied, 1)
        cfg.learner.compile, cfg.learner.attention = mode.removesuffix("_checkpointed"), "per_sequence"
        cfg.learner.gradient_checkpointing = mode.endswith("_checkpointed")
        torch.manual_seed(0)
        policies[mode] = p = Policy(cfg, Ranks(), CPU)
        graphs = []
        for step in range(2):
            p.update(_seqs(step), 4, StepSettings(clip=0.2), step)
            graphs.append(counters["stats"]["unique_graphs"])
        if mode != "off":
            assert p.compiled == compiled.Regions(True, True) and graphs[0] > 0 and graphs[1] == graphs[0], graphs
            assert inductor.cpp.dynamic_threads is False and compiled.BACKEND == "inductor"
        kept[mode] = _bytes_kept_for_backward(p, _seqs(3))
    # the checkpoint is real: what the layers keep for the backward (their inputs, the attention's output)
    # is under half of what the layers compiled without it keep
    assert kept["on_checkpointed"] < 0.5 * kept["on"], kept
    eager = dict(policies["off"].model.named_parameters())
    for mode in ("on", "on_checkpointed"):
        fast = dict(policies[mode].model.named_parameters())
        for name, w in eager.items():
            # AdamW at lr 1e-3 moves a weight up to 4e-3 in these 4 updates; fp32 rounding of the fused kernels
            # moves it 1e-5 at most (measured 8e-6): a wrong gradient anywhere moves it by about the lr
            torch.testing.assert_close(fast[name], w, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{mode} {n}: {m}")
    seqs = _seqs(5)
    args = ([s.prompt for s in seqs], [s.completion for s in seqs], "entropy")
    for mode in ("on", "on_checkpointed"):
        torch.testing.assert_close(torch.tensor(policies[mode].score(*args)), torch.tensor(policies["off"].score(*args)),
                                   rtol=1e-5, atol=1e-6)
    # past the recompile limit torch would run the layer eagerly, at eager memory (an out-of-memory error
    # later on a GPU sized for the compiled step): the learner's regions raise at the call instead
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 1  # no more graphs than the layers have
    try:
        ids = torch.tensor([seqs[0].prompt + seqs[0].completion])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
                (torch._dynamo.exc.FailOnRecompileLimitHit, torch._dynamo.exc.Unsupported), match="ecompile.limit"):
            policies["on"].model(input_ids=ids)  # autocast on: a new graph would be needed
    finally:
        torch._dynamo.config.recompile_limit = limit
        inductor.cpp.dynamic_threads = dynamic_threads


def _bytes_kept_for_backward(policy, seqs) -> int:
    """Bytes of the tensors one micro-batch's forward keeps for its backward, parameters aside."""
    from learner.maths.grpo import rows_logprobs
    from learner.maths.update import _rows

    params = {p.data_ptr() for p in policy.model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    policy.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = rows_logprobs(policy.forward, _rows(seqs, 0, policy.cfg.learner), CPU, 1.0)
    logp.sum().backward()
    policy.model.zero_grad(set_to_none=True)
    policy.model.eval()
    return total
