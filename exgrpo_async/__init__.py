"""exgrpo-async: asynchronous actor-learner ExGRPO. The shared package, imported by actors/ and learner/,
importing neither: its top-level modules are the library both roles share (config, rollout record, wire,
transport, the seams' protocols, weight sync, data, rewards); launcher/ is the command line and the local
launcher; toy/ the toy task and its shipped policy; report/ a run's report."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("exgrpo-async")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
