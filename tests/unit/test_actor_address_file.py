"""`exgrpo-async actor --learner-file`: an actor started beside its learner waits for the address the
learner writes once it listens (actors/main.py), and refuses a file without one."""

from __future__ import annotations

import json
import threading
import time

import pytest

from actors.main import wait_for_address


def test_waits_for_the_file_then_reads_its_address(tmp_path):
    path = tmp_path / "learner.json"

    def learner_listens():
        time.sleep(0.5)
        tmp = tmp_path / "learner.json.tmp"
        tmp.write_text(json.dumps({"address": "tcp://127.0.0.1:5555", "metrics_port": None}))
        tmp.replace(path)

    writer = threading.Thread(target=learner_listens)
    t0 = time.monotonic()
    writer.start()
    assert wait_for_address(path, patience_s=10) == "tcp://127.0.0.1:5555"
    assert time.monotonic() - t0 >= 0.5
    writer.join()


def test_gives_up_after_its_patience(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no learner address"):
        wait_for_address(tmp_path / "learner.json", patience_s=0.3)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("content", [{"metrics_port": 1}, {"address": 7}, {"address": "127.0.0.1:5555"}])
def test_a_file_without_an_address_is_an_error(tmp_path, content):
    path = tmp_path / "learner.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="holds no learner address"):
        wait_for_address(path, patience_s=1)
