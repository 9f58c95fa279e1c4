"""The learner process. learner/ is its shell (the loop in train.py, the network side, the dispatcher, the
policy on its ranks, checkpoints, metrics); learner/maths/ is the maths the shell feeds, which imports
nothing of the shell (tests/unit/test_imports.py)."""
