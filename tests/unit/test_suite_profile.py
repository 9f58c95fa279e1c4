"""ops/bench/system/suite_profile.py reads py-spy's raw stacks by the innermost process frame (a process's
children nest inside its frames), and counts imports and engine starts within each kind. Synthetic stacks."""

import pytest

from tests.bench import load_bench

ACTOR = 'process 7:"python -m exgrpo_async.launcher.cli actor --learner-file x"'
LEARNER = 'process 6:"python -m exgrpo_async.launcher.cli learner --config c"'
WORKER = 'process 5:"python -u -c import sys;exec(eval(sys.stdin.readline()))"'
SPAWNED = 'process 9:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=3)"'
RAW = "\n".join([
    f'{LEARNER};main (cli.py:1);{ACTOR};main (actors/main.py:3);_find_and_load (<frozen importlib._bootstrap>:1) 30',
    f'{ACTOR};main (actors/main.py:3);VLLMEngine.__init__ (actors/engine.py:9);LLM.__init__ (vllm/llm.py:1) 10',
    f'{ACTOR};main (actors/main.py:3);serve_batch (actors/loop.py:5) 10',
    f'{LEARNER};run (learner/train.py:2) 20',
    f'{WORKER};test_x (tests/unit/test_x.py:1) 20',
    f'{SPAWNED};_worker_main (actors/verifier.py:1) 10',
    'not a stack line',
])


def test_each_sample_goes_to_its_innermost_process_and_imports_are_counted(tmp_path):
    sp = load_bench("system/suite_profile")
    (tmp_path / "x.raw").write_text(RAW)
    res = sp.profile(sp.read_raw(tmp_path / "x.raw"), rate=10.0)
    assert res["seconds"] == 10.0
    kinds = res["kinds"]
    assert kinds["actor"] == {"seconds": 5.0, "share": 0.5, "processes": 1, "imports_share": 0.6,
                              "engine_start_share": 0.2}
    assert kinds["learner"]["seconds"] == 2.0 and kinds["learner"]["imports_share"] == 0.0
    assert kinds["pytest worker"]["seconds"] == 2.0
    assert kinds["spawned helper (verifier worker, vLLM worker, rank, eval shard)"]["seconds"] == 1.0
    assert res["imports_share"] == 0.3 and res["engine_start_share"] == 0.1
    assert sp.table(res)[0] == "10 s sampled: 30% importing, 10% starting vLLM engines"
    assert sp.main([str(tmp_path / "x.raw"), "--out", str(tmp_path / "p.json")]) == 0
    assert (tmp_path / "p.json").read_text().startswith("{")


def test_an_empty_profile_has_no_shares(tmp_path):
    sp = load_bench("system/suite_profile")
    assert sp.profile([], 10.0) == {"seconds": 0.0, "imports_share": 0.0, "engine_start_share": 0.0, "kinds": {}}
    with pytest.raises(FileNotFoundError):
        sp.read_raw(tmp_path / "missing.raw")
