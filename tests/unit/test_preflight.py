"""exgrpo_async/launcher/preflight.py: a user's first mistakes (data files, model folder, output folder, ports) are
found before `train` starts anything, one line each; and through the command line, exit 2 in a second."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exgrpo_async.config import RunConfig
from exgrpo_async.config_io import with_values
from exgrpo_async.data import DataError, check_file
from exgrpo_async.launcher import preflight

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
GOOD_ROW = {"problem": "What is 1+1?", "answer": "2"}
NO_ANSWER = "no answer (expected `answer`, `final_answer` or a \\boxed{} in `solution`)"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fake_model(folder: Path, *names: str) -> Path:
    """A model folder with these files (the check looks at names only); default: a complete one."""
    folder.mkdir()
    for name in names or ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    return folder


def make_cfg(tmp_path: Path, **values) -> RunConfig:
    """A good config (a tiny JSONL, a fake model folder, output under tmp_path), `values` (dotted keys
    with "__" for ".") replacing its settings."""
    model = tmp_path / "model" if (tmp_path / "model").exists() else fake_model(tmp_path / "model")
    train = tmp_path / "train.jsonl"
    if not train.exists():
        write_jsonl(train, [GOOD_ROW] * 3)
    base = {"model.path": str(model), "data.train_files": [str(train)], "output_dir": str(tmp_path / "runs")}
    return with_values(RunConfig(), base | {k.replace("__", "."): v for k, v in values.items()})


@pytest.mark.timeout(60)
def test_a_good_config_has_no_problems(tmp_path):
    write_jsonl(tmp_path / "held.jsonl", [GOOD_ROW])
    assert preflight.check(make_cfg(tmp_path, data__eval_file=str(tmp_path / "held.jsonl"))) == []
    assert preflight.check_learner(make_cfg(tmp_path), str(tmp_path / "runs" / "run-1")) == []


# ----------------------------------------------------------------------------- data files
@pytest.mark.timeout(60)
def test_a_missing_data_file(tmp_path):
    cfg = make_cfg(tmp_path, data__train_files=[str(tmp_path / "nope.jsonl")])
    assert preflight.check(cfg) == [f"data.train_files: {tmp_path}/nope.jsonl: no such file"]


@pytest.mark.timeout(60)
def test_a_folder_in_place_of_a_data_file(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    cfg = make_cfg(tmp_path, data__train_files=[str(tmp_path / "dir.jsonl")])
    assert preflight.check(cfg) == [f"data.train_files: {tmp_path}/dir.jsonl: a folder, not a file"]


@pytest.mark.timeout(60)
def test_a_data_file_of_unknown_type(tmp_path):
    (tmp_path / "q.csv").write_text("problem,answer\n1+1,2\n")
    cfg = make_cfg(tmp_path, data__train_files=[str(tmp_path / "q.csv")])
    assert preflight.check(cfg) == [f"data.train_files: {tmp_path}/q.csv: unknown file type '.csv'; "
                                    "expected .jsonl, .json or .parquet"]


@pytest.mark.timeout(60)
def test_a_first_row_without_an_answer(tmp_path):
    write_jsonl(tmp_path / "bad.jsonl", [{"problem": "What is 1+1?"}, GOOD_ROW])
    cfg = make_cfg(tmp_path, data__train_files=[str(tmp_path / "bad.jsonl")])
    assert preflight.check(cfg) == [f"data.train_files: {tmp_path}/bad.jsonl: row 1 (line 1): {NO_ANSWER}"]


@pytest.mark.timeout(60)
def test_a_bad_held_out_file_names_data_eval_file(tmp_path):
    (tmp_path / "held.jsonl").write_text('{"problem": "1+1", "answer": \n')
    cfg = make_cfg(tmp_path, data__eval_file=str(tmp_path / "held.jsonl"))
    assert preflight.check(cfg) == [f"data.eval_file: {tmp_path}/held.jsonl: row 1 (line 1): invalid JSON "
                                    "(Expecting value at column 30)"]


@pytest.mark.timeout(60)
def test_skip_bad_rows_allows_a_bad_row_but_not_a_file_without_a_good_one(tmp_path):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"problem": "What is 1+1?"}, GOOD_ROW])
    assert preflight.check(make_cfg(tmp_path, data__train_files=[str(mixed)], data__skip_bad_rows=True)) == []
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "What is 1+1?"}, {"question": "2+2", "answer": None}])
    assert preflight.check(make_cfg(tmp_path, data__train_files=[str(bad)], data__skip_bad_rows=True)) == [
        f"data.train_files: {bad}: none of the first 2 rows is good (data.skip_bad_rows=true skips bad rows, "
        f"not a whole file); row 1 (line 1): {NO_ANSWER}"]


@pytest.mark.timeout(60)
def test_an_empty_data_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    cfg = make_cfg(tmp_path, data__train_files=[str(tmp_path / "empty.jsonl")])
    assert preflight.check(cfg) == [f"data.train_files: {tmp_path}/empty.jsonl: no rows"]


@pytest.mark.timeout(60)
def test_only_the_first_rows_are_read(tmp_path, monkeypatch):
    """A bad row after the first 20 is load_pool's to report; parquet is read a batch, never whole."""
    rows = [GOOD_ROW] * 20 + [{"problem": "no answer"}]
    assert check_file(write_jsonl(tmp_path / "late.jsonl", rows)) == 20
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "late.parquet")
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("read the whole parquet file"))
    assert check_file(tmp_path / "late.parquet") == 20
    assert check_file(tmp_path / "late.parquet", rows=3) == 3
    pq.write_table(pa.Table.from_pylist(rows[::-1]), tmp_path / "early.parquet")
    with pytest.raises(DataError, match=r"early.parquet: row 1: no answer"):
        check_file(tmp_path / "early.parquet")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"fake.parquet: cannot read it"):
        check_file(tmp_path / "fake.parquet")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not SHARED_DATA.exists(), reason="no shared data folder")
def test_the_real_question_files_pass(tmp_path):
    files = ["exgrpo_luffy/valid.parquet", "qwen_eval/aime24/test.jsonl", "deepscaler_rllm/test/amc.json"]
    cfg = make_cfg(tmp_path, data__train_files=[str(SHARED_DATA / f) for f in files])
    assert preflight.check_data(cfg) == []


# ----------------------------------------------------------------------------- the model folder
@pytest.mark.timeout(60)
@pytest.mark.parametrize("names,missing", [
    (("config.json", "tokenizer.json"), "no weights in the folder (*.safetensors, *.bin, or their index .json)"),
    (("config.json", "model.safetensors"), "no tokenizer in the folder (tokenizer.json, tokenizer_config.json, "
                                           "tokenizer.model or vocab files)"),
    (("model.safetensors", "tokenizer.json"), "no config.json in the folder"),
])
def test_a_model_folder_missing_a_part(tmp_path, names, missing):
    model = fake_model(tmp_path / "model", *names)
    assert preflight.check(make_cfg(tmp_path)) == [f"model.path={model}: {missing}"]


@pytest.mark.timeout(60)
def test_other_weight_and_tokenizer_files_count(tmp_path):
    fake_model(tmp_path / "model", "config.json", "pytorch_model-00001-of-00002.bin", "tokenizer.model")
    assert preflight.check(make_cfg(tmp_path)) == []


@pytest.mark.timeout(60)
def test_a_chat_template_is_required_when_prompts_use_the_tokenizers(tmp_path):
    model = fake_model(tmp_path / "model", "config.json", "model.safetensors", "tokenizer_config.json")
    want = [f"model.path={model}: data.use_chat_template=true but the tokenizer has no chat template (no "
            "chat_template in tokenizer_config.json, no chat_template.jinja or .json); set data.chat_template "
            "(\"think\" or a Jinja template)"]
    assert preflight.check(make_cfg(tmp_path, data__use_chat_template=True)) == want
    assert preflight.check(make_cfg(tmp_path, data__use_chat_template=True, data__chat_template="think")) == []
    assert preflight.check(make_cfg(tmp_path)) == []  # no chat template used
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert preflight.check(make_cfg(tmp_path, data__use_chat_template=True)) == []
    (model / "tokenizer_config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    assert preflight.check(make_cfg(tmp_path, data__use_chat_template=True)) == []


@pytest.mark.timeout(60)
def test_a_model_path_that_is_neither_a_folder_nor_a_hub_id(tmp_path):
    fake_model(tmp_path / "model")
    cfg = make_cfg(tmp_path, model__path="/nonexistent")
    assert preflight.check(cfg) == ["model.path=/nonexistent: no such folder (and not a hub id like org/name)"]
    (tmp_path / "weights.bin").write_text("x")
    cfg = make_cfg(tmp_path, model__path=str(tmp_path / "weights.bin"))
    assert preflight.check(cfg) == [f"model.path={tmp_path}/weights.bin: not a folder (a Hugging Face model "
                                    "folder, or a hub id like org/name)"]


@pytest.mark.timeout(60)
def test_a_hub_id_passes_when_no_such_folder_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_model(tmp_path / "model")
    assert preflight.check(make_cfg(tmp_path, model__path="Qwen/Qwen2.5-Math-1.5B")) == []


@pytest.mark.parametrize("text,hub", [
    ("Qwen/Qwen2.5-Math-7B", True), ("org/name_1-x.y", True), ("/nonexistent", False), ("./org/name", False),
    ("~/models/x", False), ("org/name/sub", False), ("name", False), ("org/na me", False), ("org/..", False),
    ("org/", False),
])
def test_what_looks_like_a_hub_id(text, hub):
    assert preflight.is_hub_id(text) is hub


# ----------------------------------------------------------------------------- the output folder
@pytest.mark.timeout(60)
def test_an_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "runs").write_text("not a folder")
    assert preflight.check(make_cfg(tmp_path)) == [f"output_dir={tmp_path}/runs: exists and is not a folder"]
    cfg = make_cfg(tmp_path, output_dir=str(tmp_path / "runs" / "demo"))
    assert preflight.check(cfg) == [f"output_dir={tmp_path}/runs/demo: cannot be created: {tmp_path}/runs is a "
                                    "file, not a folder"]
    assert preflight.check(make_cfg(tmp_path, output_dir=str(tmp_path / "new" / "deeper"))) == []
    assert not (tmp_path / "new").exists()  # the write probe's folders are removed again
    assert preflight.check(make_cfg(tmp_path), resume_dir=str(tmp_path / "runs")) == [
        f"--resume {tmp_path}/runs: exists and is not a folder"]
    assert preflight.check_learner(make_cfg(tmp_path), str(tmp_path / "runs")) == [
        f"--run-dir {tmp_path}/runs: exists and is not a folder"]


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_output_dir_that_cannot_be_written(tmp_path):
    (tmp_path / "locked").mkdir(mode=0o500)
    cfg = make_cfg(tmp_path, output_dir=str(tmp_path / "locked" / "runs"))
    assert preflight.check(cfg) == [f"output_dir={tmp_path}/locked/runs: cannot be created: {tmp_path}/locked "
                                    "is not writable"]


@pytest.mark.timeout(60)
def test_an_output_dir_where_nothing_can_be_written_even_as_root(tmp_path):
    """os.access says yes to root anywhere (CI runs as root), and /proc's permissions say nothing of what it
    takes: the check makes a folder and a file to know, for root and for anyone."""
    for path in ("/proc/exgrpo-async-test/runs", "/proc"):
        (problem,) = preflight.check(make_cfg(tmp_path, output_dir=path))
        assert problem.startswith(f"output_dir={path}: cannot write there ("), problem
    assert not Path("/proc/exgrpo-async-test").exists()


# ----------------------------------------------------------------------------- eval
@pytest.mark.timeout(60)
def test_eval_checks_its_model_data_and_report_file_before_it_starts(tmp_path):
    """`eval` (before: the hub's traceback for a missing model folder, and a report lost after the whole
    evaluation for an --out it could not write)."""
    model, data = fake_model(tmp_path / "model"), write_jsonl(tmp_path / "q.jsonl", [GOOD_ROW])
    cfg = make_cfg(tmp_path, model__path=str(model))
    assert preflight.check_eval(cfg, [str(data)], None) == []
    assert preflight.check_eval(cfg, [str(data)], str(tmp_path / "new" / "report.json")) == []
    assert not (tmp_path / "new").exists()
    assert preflight.check_eval(cfg, [str(data), str(tmp_path / "nope.jsonl")], str(tmp_path)) == [
        f"--data: {tmp_path}/nope.jsonl: no such file", f"--out {tmp_path}: a folder; give the report's file name"]
    assert preflight.check_eval(make_cfg(tmp_path, model__path="/nonexistent"), [str(data)], "/proc/x/report.json") == [
        "--model /nonexistent: no such folder (and not a hub id like org/name)",
        "--out /proc/x/report.json: cannot write there (No such file or directory)"]


@pytest.mark.timeout(60)
def test_eval_with_a_model_path_that_does_not_exist_fails_in_one_line(tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [GOOD_ROW])
    proc = subprocess.run([sys.executable, "-m", "exgrpo_async.launcher.cli", "eval", "--model", "/nonexistent",
                           "--data", str(data)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "exgrpo-async: --model /nonexistent: no such folder (and not a hub id like org/name)"]


# ----------------------------------------------------------------------------- ports
@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", ["transport.port", "weight_sync.port", "metrics.port", "metrics.actor_port"])
def test_a_taken_port(tmp_path, taken_port, setting):
    cfg = make_cfg(tmp_path, **{setting.replace(".", "__"): taken_port})
    assert preflight.check(cfg) == [f"{setting}={taken_port}: already in use on 127.0.0.1 (pick another port, "
                                    "or 0 for a free one)"]


@pytest.mark.timeout(60)
def test_free_fixed_ports_pass_and_two_settings_may_not_share_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert preflight.check(make_cfg(tmp_path, transport__port=port, metrics__port=None)) == []
    cfg = make_cfg(tmp_path, transport__port=port, weight_sync__port=port)
    assert preflight.check(cfg) == [f"weight_sync.port={port}: transport.port uses the same port on 127.0.0.1"]
    cfg = make_cfg(tmp_path, metrics__actor_port=port, actor__num_actors=2)
    assert preflight.check(cfg) == [f"metrics.actor_port={port}: fixed, but train starts 2 actors on this host, "
                                    "each binding it (use 0 for free ports)"]


@pytest.mark.timeout(60)
def test_every_problem_is_listed_and_a_follower_rank_checks_only_the_model(tmp_path):
    (tmp_path / "runs").write_text("")
    cfg = make_cfg(tmp_path, model__path="/nonexistent", data__train_files=[str(tmp_path / "nope.jsonl")])
    assert [line.split(":")[0] for line in preflight.check(cfg)] == [
        "data.train_files", "model.path=/nonexistent", f"output_dir={tmp_path}/runs"]
    assert [line.split(":")[0] for line in preflight.check_learner(cfg, lead=False)] == ["model.path=/nonexistent"]


# ----------------------------------------------------------------------------- through the command line
def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "exgrpo_async.launcher.cli", "train", *args, f"output_dir={tmp_path / 'runs'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def assert_one_line_exit_2(proc: subprocess.CompletedProcess, tmp_path: Path, want: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines == [want], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(90)
def test_train_with_a_missing_data_file_fails_in_one_line(tmp_path):
    model = fake_model(tmp_path / "model")
    proc = run_cli(tmp_path, 'data.train_files=["nope.jsonl"]', f"model.path={model}")
    assert_one_line_exit_2(proc, tmp_path, "exgrpo-async: data.train_files: nope.jsonl: no such file")


@pytest.mark.timeout(90)
def test_train_with_a_model_path_that_does_not_exist_fails_in_one_line(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [GOOD_ROW])
    proc = run_cli(tmp_path, "model.path=/nonexistent", f"data.train_files={json.dumps([str(train)])}")
    assert_one_line_exit_2(proc, tmp_path, "exgrpo-async: model.path=/nonexistent: no such folder (and not a hub "
                                           "id like org/name)")


@pytest.mark.timeout(90)
def test_train_with_an_output_dir_nothing_can_be_written_in_fails_in_one_line(tmp_path):
    """Before the check made a file there, root got a traceback from the run folder's mkdir (its rc 1)."""
    proc = subprocess.run([sys.executable, "-m", "exgrpo_async.launcher.cli", "train", "output_dir=/proc/x"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=60)
    assert_one_line_exit_2(proc, tmp_path, "exgrpo-async: output_dir=/proc/x: cannot write there (No such file or "
                                           "directory)")


@pytest.mark.timeout(120)
def test_a_policy_folder_as_transformers_saves_it_passes(tiny_tied, tmp_path):
    """The folder layout of the toy policy (and of the tests' tiny policies): save_pretrained's files."""
    cfg = make_cfg(tmp_path, model__path=str(tiny_tied))
    assert preflight.check(cfg) == []
    assert preflight.check_model(make_cfg(tmp_path, model__path=str(tiny_tied), data__use_chat_template=True)) == [
        f"model.path={tiny_tied}: data.use_chat_template=true but the tokenizer has no chat template (no "
        "chat_template in tokenizer_config.json, no chat_template.jinja or .json); set data.chat_template "
        "(\"think\" or a Jinja template)"]


@pytest.mark.timeout(90)
def test_the_learner_command_fails_in_one_line_before_it_loads_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RANK"} | {"PYTHONPATH": str(REPO)}
    (tmp_path / "run").write_text("")
    proc = subprocess.run([sys.executable, "-m", "exgrpo_async.launcher.cli", "learner", "--run-dir", str(tmp_path / "run"),
                           "model.path=/nonexistent", f"data.train_files={json.dumps([str(tmp_path / 'nope.jsonl')])}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"exgrpo-async: data.train_files: {tmp_path}/nope.jsonl: no such file",
        "exgrpo-async: model.path=/nonexistent: no such folder (and not a hub id like org/name)",
        f"exgrpo-async: --run-dir {tmp_path}/run: exists and is not a folder"]


@pytest.mark.timeout(120)
def test_a_training_file_whose_every_prompt_is_too_long_ends_train_in_a_line_each_from_learner_and_launcher(
        tiny_tied, tmp_path):
    """Past the checks (they read no tokenizer), the learner finds no training question whose prompt fits
    beside a whole completion (256 tokens of context less 64; the tiny policy's tokens are characters): a data
    error, so its line and the launcher's, no traceback (before: a ValueError's)."""
    train = write_jsonl(tmp_path / "train.jsonl", [dict(GOOD_ROW, problem="1+" * 100 + "1=")])
    proc = run_cli(tmp_path, f"model.path={tiny_tied}", f"data.train_files={json.dumps([str(train)])}",
                   "actor.num_actors=0", "learner.device=cpu", "data.eval_file=none")
    assert proc.returncode == 1, proc.stderr
    assert ("learner: no training question's prompt fits in 192 tokens (model.max_model_len=256 less "
            "rollout.max_new_tokens=64)") in proc.stderr
    assert "the learner exited (code 2) before it was ready; its log above says why" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_a_learner_that_fails_after_the_checks_ends_train_with_one_line_of_its_own(tmp_path):
    """A model folder with the right file names passes the checks, and the learner fails loading it: the
    launcher says so in one line (no second traceback of its own) and exits 1, having started no actor."""
    train = write_jsonl(tmp_path / "train.jsonl", [GOOD_ROW])
    proc = run_cli(tmp_path, f"model.path={fake_model(tmp_path / 'model')}", f"data.train_files={json.dumps([str(train)])}",
                   "actor.num_actors=0", "learner.device=cpu", "data.eval_file=none")
    assert proc.returncode == 1, proc.stderr
    assert "the learner exited (code 1) before it was ready; its log above says why" in proc.stderr
    assert proc.stderr.count("Traceback") <= 1, proc.stderr  # the learner's own, never the launcher's
    assert "exgrpo_async/launcher/train.py" not in proc.stderr
