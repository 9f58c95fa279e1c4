"""The command line (cli.py) and the local launcher of `exgrpo-async train` (train.py and its helpers). Only
the command line reaches it: no library, learner or actor module imports it."""
