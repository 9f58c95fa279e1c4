"""The toy task (task.py: questions, tokenizer, a tiny Qwen2 policy and its warm start) and the warm-started
policy this package ships (shipped.py, policy/; rebuilt bit for bit by rebuild.py).

The names below are the toy task's surface that the peer harness (../shared/tools/peer/trl_toy.py, TRL on
this task) reads as `exgrpo_async.toy.NAME`; task.py imports only the standard library at module level, as
the harness expects (tests/integration/test_bench_runs.py runs its evaluator)."""

from exgrpo_async.toy.task import (
    BOS,
    EOS,
    PROMPT_TEMPLATE,
    TEST_KINDS,
    make_question,
    make_test_set,
    make_train_set,
    recipe_key,
)

__all__ = ["BOS", "EOS", "PROMPT_TEMPLATE", "TEST_KINDS", "make_question", "make_test_set", "make_train_set",
           "recipe_key"]
