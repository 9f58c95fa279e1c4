"""A learner rank other than the lead builds the policy without its weights (learner/model.py):
parameters on the meta device, buffers real, tied weights still one parameter; `materialize` gives the
parameters storage and keeps the buffers. That the shards it then receives make world 2 train exactly
as world 1 is tests/integration/test_learner_ranks.py's."""

from __future__ import annotations

import pytest
import torch

from learner.model import load_policy, materialize, policy_skeleton

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("tied", [True, False])
def test_a_skeleton_has_the_models_shape_and_buffers_and_no_weights(tied, tiny_tied, tiny_untied):
    path = str(tiny_tied if tied else tiny_untied)
    skeleton, tokenizer = policy_skeleton(path)
    loaded, _ = load_policy(path, "float32", torch.device("cpu"))
    shapes = {n: (p.shape, p.dtype) for n, p in skeleton.named_parameters()}
    assert shapes == {n: (p.shape, p.dtype) for n, p in loaded.named_parameters()}
    assert all(p.is_meta for p in skeleton.parameters())
    assert (skeleton.lm_head.weight is skeleton.model.embed_tokens.weight) == tied
    buffers = dict(loaded.named_buffers())
    assert buffers and {n for n, _ in skeleton.named_buffers()} == buffers.keys()
    for name, b in skeleton.named_buffers():  # rotary frequencies: computed at construction, in no checkpoint
        assert not b.is_meta and torch.equal(b, buffers[name]), name
    assert tokenizer.pad_token_id == load_policy(path, "float32", torch.device("cpu"))[1].pad_token_id

    materialize(skeleton, torch.device("cpu"))
    assert not any(p.is_meta for p in skeleton.parameters())
    assert (skeleton.lm_head.weight is skeleton.model.embed_tokens.weight) == tied
    for name, b in skeleton.named_buffers():
        assert torch.equal(b, buffers[name]), name
    # with the loaded weights copied in, it computes what the loaded model computes
    skeleton.load_state_dict(loaded.state_dict())
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        assert torch.equal(skeleton(input_ids=ids).logits, loaded(input_ids=ids).logits)
