"""exgrpo-async: asynchronous actor-learner ExGRPO. The shared package: config, rollout record, transport,
weight sync, launch; imported by actors/ and learner/, importing neither."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("exgrpo-async")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
