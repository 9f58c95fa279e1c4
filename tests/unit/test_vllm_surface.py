"""vLLM's internals live in one module (actors/vllm_surface.py), for one minor, checked at engine start."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from actors.vllm_surface import TARGET, VLLMVersionError, check_version

ACTORS = Path(__file__).resolve().parents[2] / "actors"
PUBLIC = {"vllm", "vllm.sampling_params", "vllm.v1.engine.async_llm"}  # the engine API the actors build on


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5", "0.32.1+cu130", "0.32.0.dev3"])
def test_the_targeted_minor_passes(version):
    assert check_version(version) == version


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.0.0", "nightly"])
def test_another_minor_fails_clearly(version):
    with pytest.raises(VLLMVersionError, match=rf"vLLM {version} is installed.*vllm==0\.32\.\*"):
        check_version(version)


def test_the_installed_vllm_is_the_targeted_minor():
    import vllm

    assert tuple(int(x) for x in vllm.__version__.split(".")[:2]) == TARGET
    check_version()


def test_no_other_actor_module_reaches_into_vllm():
    """Every `from vllm... import` outside vllm_surface.py names only the public engine API."""
    found = {}
    for path in ACTORS.glob("*.py"):
        if path.name == "vllm_surface.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                if node.module not in PUBLIC or any(a.name.startswith("_") for a in node.names):
                    found[f"{path.name}:{node.lineno}"] = node.module
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
                found[f"{path.name}:{node.lineno}"] = ",".join(a.name for a in node.names)
    assert not found, f"vLLM internals outside actors/vllm_surface.py: {found}"
