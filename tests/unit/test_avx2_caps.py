"""ops/avx2's caps reach what they claim to: vLLM's kernels in any vLLM process (through the general plugin
this package registers, which vLLM runs in its engine core and workers before it loads kernels), and
Inductor's compile flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNELS = """
from vllm.plugins import load_general_plugins
load_general_plugins()  # what a vLLM engine core or worker process does first
import vllm._custom_ops  # noqa: F401  (loads the kernel build)
print(sorted({l.split('/')[-1].strip() for l in open('/proc/self/maps') if 'vllm/_C' in l}))
"""


def vllm_kernels(env: dict[str, str]) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "VLLM_PLUGINS")}
    out = subprocess.run([sys.executable, "-c", KERNELS], env=base | env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(300)
def test_the_plugin_makes_every_vllm_process_load_the_avx2_kernels_under_the_cap():
    assert vllm_kernels({"ATEN_CPU_CAPABILITY": "avx2"}) == "['_C_AVX2.abi3.so']"
    if "avx512f" in Path("/proc/cpuinfo").read_text():  # the cap is what changed it: without it, the wider build
        assert vllm_kernels({}) != "['_C_AVX2.abi3.so']"


def test_ops_avx2_caps_inductors_compile_flags_too():
    out = subprocess.run(["bash", str(REPO / "ops" / "avx2"), "bash", "-c", "echo $TORCHINDUCTOR_CPP_MARCH $ATEN_CPU_CAPABILITY"],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["x86-64-v3", "avx2"], out.stderr
