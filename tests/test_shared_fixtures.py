"""tests/conftest.py's `built_once`, by which the session's corpus and shared runs are built once however many
pytest-xdist workers ask for them (`make test` runs two): the first builds while the others wait, and a build that
failed half-way is started again from an empty directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, built_once

WORKER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
import common.files, filelock  # imported by built_once: loaded now, so that asking takes no time after "started"
from tests.conftest import built_once

class Factory:
    def getbasetemp(self):
        return Path({basetemp!r})

def build(directory):
    with open({count!r}, "a") as count:
        count.write("built\\n")
    deadline = time.time() + 30  # the build lasts until both workers have asked: without the lock, both build
    while len(list(Path({started!r}).glob("*"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the other worker has asked by now (or waits on the lock)
    (directory / "made").write_text("yes")
    return {{"dir": str(directory)}}

(Path({started!r}) / {name!r}).touch()
print(json.dumps(built_once(Factory(), "shared", build)))
"""


class Factory:
    def __init__(self, basetemp: Path):
        self.basetemp = basetemp

    def getbasetemp(self) -> Path:
        return self.basetemp


def test_two_workers_asking_at_once_get_one_build(tmp_path):
    count, started = tmp_path / "builds.txt", tmp_path / "started"
    started.mkdir()
    workers = []
    for name in ("gw0", "gw1"):
        basetemp = tmp_path / f"popen-{name}"
        basetemp.mkdir()
        script = WORKER.format(repo=str(REPO), basetemp=str(basetemp), count=str(count), started=str(started),
                               name=name)  # fmt: skip
        env = {"PYTEST_XDIST_WORKER": name, "PATH": "/usr/bin:/bin"}
        workers.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True))
    results = [json.loads(worker.communicate(timeout=60)[0]) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    assert count.read_text() == "built\n", "one build for both workers"
    assert results[0] == results[1] == {"dir": str(tmp_path / "shared")}
    assert (tmp_path / "shared" / "made").read_text() == "yes"


def test_a_failed_build_is_started_again_from_an_empty_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    factory = Factory(tmp_path / "popen-gw0")

    def fails(directory: Path) -> dict:
        (directory / "half").write_text("written before the failure")
        raise RuntimeError("the launch failed")

    with pytest.raises(RuntimeError, match="the launch failed"):
        built_once(factory, "run", fails)
    assert not (tmp_path / "run.json").exists(), "no record of a failed build"

    built = built_once(factory, "run", lambda directory: sorted(p.name for p in directory.iterdir()))
    assert built == [], "the half-written directory was emptied first"
    assert built_once(factory, "run", lambda directory: "built again") == [], "a finished build is read, not redone"
