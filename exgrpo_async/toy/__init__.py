"""The toy task (task.py: questions, tokenizer, a tiny Qwen2 policy and its warm start) and the warm-started
policy this package ships (shipped.py, policy/; rebuilt bit for bit by rebuild.py)."""
