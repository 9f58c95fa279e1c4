"""Compiled regions (learner/compiled.py): a learner with compiled decoder layers and head takes the eager
learner's steps, and new row widths and segment layouts compile nothing more (the attention kernels are
outside the graph). On CPU, as a GPU learner runs them ("auto" there)."""

import pytest
import torch
from torch._dynamo.utils import counters

from exgrpo_async.config import load_config
from learner import compiled

CPU = torch.device("cpu")


def test_the_setting_resolves_per_device_and_checkpointing():
    gpu = torch.device("cuda", 0)
    R = compiled.Regions
    assert compiled.resolve("auto", gpu, False) == R(True, True) and compiled.resolve("auto", CPU, False) == R(False, False)
    assert compiled.resolve("auto", gpu, True) == R(False, True)  # a layer's recompute may run another graph
    assert compiled.resolve("on", CPU, False) == R(True, True) and compiled.resolve("off", gpu, False) == R(False, False)
    assert compiled.resolve("head", CPU, True) == R(False, True) and str(R(False, True)) == "head"
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        compiled.resolve("on", gpu, True)
    with pytest.raises(ValueError, match="learner.compile"):
        compiled.resolve("yes", CPU, False)
    with pytest.raises(ValueError, match="gradient_checkpointing=false"):  # at load, before any process starts
        load_config(None, ["learner.compile=on", "learner.gradient_checkpointing=true"])
    with pytest.raises(ValueError, match="no .model.layers"):
        compiled.compile_layers(torch.nn.Linear(2, 2))


@pytest.mark.slow  # inductor compiles the learner's regions: 54-77 s on an AVX2-only CPU
@pytest.mark.timeout(300)
def test_a_compiled_learner_takes_the_eager_learners_steps(tiny_tied):
    """`learner.compile="on"` through the learner's own Policy (its start-up check, two updates of other
    packed widths, the selection pass): the same weights and scores as eager, and the second update
    compiles nothing; a call that would need a graph past the recompile limit raises."""
    from tests.integration.test_learner_ranks import _cfg, _seqs
    from learner.policy import Policy
    from learner.ranks import Ranks
    from learner.update import StepSettings

    torch._dynamo.reset()
    policies = {}
    for mode in ("off", "on"):
        cfg = _cfg(tiny_tied, 1)
        cfg.learner.compile, cfg.learner.attention = mode, "per_sequence"  # no checkpointing: compiled.resolve
        torch.manual_seed(0)
        policies[mode] = p = Policy(cfg, Ranks(), CPU)
        graphs = []
        for step in range(2):
            p.update(_seqs(step), 4, StepSettings(clip=0.2), step)
            graphs.append(counters["stats"]["unique_graphs"])
        if mode == "on":
            assert p.compiled == compiled.Regions(True, True) and graphs[0] > 0 and graphs[1] == graphs[0], graphs
    eager, fast = (dict(policies[m].model.named_parameters()) for m in ("off", "on"))
    for name, w in eager.items():
        # AdamW at lr 1e-3 moves a weight up to 4e-3 in these 4 updates; fp32 rounding of the fused kernels
        # moves it 1e-5 at most (measured 8e-6): a wrong gradient anywhere moves it by about the lr
        torch.testing.assert_close(fast[name], w, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    seqs = _seqs(5)
    args = ([s.prompt for s in seqs], [s.completion for s in seqs], "entropy")
    torch.testing.assert_close(torch.tensor(policies["on"].score(*args)), torch.tensor(policies["off"].score(*args)),
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
