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
    out = subprocess.run(["bash", str(REPO / "ops" / "avx2"), "bash", "-c",
                          "echo $TORCHINDUCTOR_CPP_MARCH $ATEN_CPU_CAPABILITY"],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["x86-64-v3", "avx2"], out.stderr


def test_the_speed_for_a_pace_is_the_ratio_within_slow_cores_bounds():
    sys.path.insert(0, str(REPO / "ops"))
    try:
        from slow_cores import speed_for
    finally:
        sys.path.pop(0)
    assert speed_for(291, 388) == 0.75  # an ordinary hour under the caps: --speed 0.75's
    assert speed_for(291, 300) == 0.97
    assert speed_for(291, 200) == 1.0  # a slower hour than the class's: not slowed
    assert speed_for(291, 10_000) == 0.1  # slow_cores' floor


@pytest.mark.timeout(120)
def test_ops_avx2_pace_measures_under_the_caps_and_says_what_it_did():
    # a target no machine reaches: measured, not slowed (slowing needs root and would take the cores). Without
    # the record of an outer `ops/avx2 --pace` (the suite run under it): that one's speed is the outer's
    env = {k: v for k, v in os.environ.items() if k not in ("EXGRPO_CPU_SPEED", "EXGRPO_CPU_PACE")}
    out = subprocess.run(["bash", str(REPO / "ops" / "avx2"), "--pace", "1000000", "bash", "-c",
                          "echo $EXGRPO_CPU_PACE ${EXGRPO_CPU_SPEED:-none}"],
                         capture_output=True, text=True, timeout=110, cwd=REPO,
                         env=dict(env, EXGRPO_PACE_PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr
    measured, speed = out.stdout.split()
    assert float(measured) > 10 and speed == "none"
    assert f"ops/avx2: pace {measured} under the caps, at or under 1000000 already: not slowed" in out.stderr
    bad = subprocess.run(["bash", str(REPO / "ops" / "avx2"), "--pace", "291", "true"], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env=dict(os.environ, EXGRPO_PACE_PYTHON="/nonexistent/python"))
    assert bad.returncode == 2 and "could not measure the pace" in bad.stderr
