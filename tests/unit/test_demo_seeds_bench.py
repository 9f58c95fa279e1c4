"""ops/bench/learning/demo_seeds.py's figures: each seed's gain in points with its paired error, and the gains' mean
and spread over seeds; `--report` prints the same table from the saved JSON."""

from __future__ import annotations

import json

from tests.bench import load_bench

demo_seeds = load_bench("learning/demo_seeds")


def _run(seed: int, gain: float, se: float) -> dict:
    return {"seed": seed, "before": 0.40, "after": 0.40 + gain, "wall_s": 300.0 + seed, "rl_s": 200.0,
            "gain": {"sampled": gain, "sampled_se": se, "greedy": gain / 2, "greedy_se": se}}


def test_the_table_quotes_each_gain_with_its_error_and_the_spread_over_seeds(tmp_path, capsys):
    runs = [_run(0, 0.06, 0.015), _run(1, 0.08, 0.016), _run(2, 0.10, 0.02)]
    lines = demo_seeds.table(runs)
    assert lines[2] == "| 0 | 0.400 -> 0.460 | +6.0 ± 1.5 | 4.0 | +3.0 ± 1.5 | 300 | 200 |"
    assert lines[-1].startswith("\ngain over 3 seeds: +8.0 ± 2.0 points (mean ± std; +6.0 .. +10.0); median wall 301 s")
    saved = tmp_path / "demo-seeds.json"
    saved.write_text(json.dumps({"runs": runs}))
    assert demo_seeds.main(["--report", str(saved)]) == 0
    assert capsys.readouterr().out.splitlines() == "\n".join(lines).splitlines()


def test_one_seed_has_no_spread_line_and_the_cpu_is_named(monkeypatch):
    assert len(demo_seeds.table([_run(0, 0.05, 0.01)])) == 3
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "EXGRPO_CPU_SPEED", "EXGRPO_CPU_PACE"):  # ops/avx2's
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    c = demo_seeds.cpu()
    assert c["caps"] == {"ATEN_CPU_CAPABILITY": "avx2"} and c["model"] != "?"
    assert all(f.startswith(("avx", "amx")) for f in c["flags"])
