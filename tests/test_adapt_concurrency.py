"""The machine setup under concurrent processes: two ``adaptree adapt`` runs on one empty cache measure once (one
measures, the other waits at the lock and takes its result) and agree; cache writes use temporary names of their
own; a setup whose files do not match its ``setup.json`` is not used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

TINY_FLAGS = ["--prompts", "2", "--max-new-tokens", "8", "--max-depth", "4", "--width", "4", "--widths", "2,4",
              "--sizes", "0,1,2,4", "--lengths", "8,24", "--repeats", "1", "--validate-tokens", "4",
              "--confirm-rounds", "1", "--confirm-tokens", "4", "--methods", "ar,static,static-gs"]
"""An ``adaptree adapt`` of a few seconds on a tiny model (two execution modes probed, no compile measurement)."""


def test_two_processes_on_one_empty_cache_measure_once_and_agree(tiny_folders, tmp_path):
    model, head = tiny_folders
    env = {**os.environ, "ADAPTREE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "adaptree.cli", "adapt", "--model", str(model), "--draft", str(head),
               "--compile", "off", "--threads", "1", "--quiet", "--json", *TINY_FLAGS]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outs = [run.communicate(timeout=600) for run in runs]
    for run, (out, err) in zip(runs, outs):
        assert run.returncode == 0, err
    err = "".join(e for _, e in outs)
    # one process chose the execution mode, probing every candidate mode and measuring a setup for each mode the
    # choice set up (the best-probed one, and a runner-up only where its probe still beat it); the other measured
    # nothing
    folder = tmp_path / "cache" / "machines"
    (choice,) = (json.loads(f.read_text()) for f in folder.glob("execution-*.json"))
    assert err.count("choosing the execution mode by measurement among bfloat16, float32") == 1, err
    assert err.count("probe bfloat16:") == err.count("probe float32:") == 1, err
    assert err.count("measuring this machine once") == len(choice["set_up"]) >= 1, err
    assert len(list(folder.glob("*/setup.json"))) == len(choice["set_up"])
    assert sum("measuring" in e for _, e in outs) == 1, err
    first, second = (json.loads(out) for out, _ in outs)
    assert first == second  # the same setup (its folder, files, timings and creation time)
    assert not list(folder.rglob(".tmp-*")) and not list(folder.rglob("*.tmp"))  # no temporary file left behind


def test_a_setup_is_whole_or_absent(models, tmp_path, monkeypatch):
    """A setup whose static tree is not the one its ``setup.json`` lists (written by another measurement) is not
    used; one that lacks a file is not either."""
    from test_adapt import TINY, Tok

    from adaptree.adapt import AdaptConfig, adapt, find_setup
    from adaptree.adapt.setup import SETUP_FILES
    from adaptree.api import Pipeline
    from conftest import PROMPTS

    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path / "cache"))
    p = Pipeline(models[0], Tok(), models[1])
    setup = adapt(p, AdaptConfig(**TINY), prompt_ids=[(f"p{i}", ids) for i, ids in enumerate(PROMPTS)],
                  progress=False, message=lambda _: None)
    assert sorted(setup.files) == sorted(SETUP_FILES) and find_setup(p) is not None
    tree = json.loads(setup.static_gs_path.read_text())
    setup.static_gs_path.write_text(json.dumps({**tree, "size": tree["size"] + 1}))  # another run's tree
    assert find_setup(p) is None
    setup.static_gs_path.write_text(json.dumps(tree, indent=2) + "\n")  # the same bytes again: whole
    assert find_setup(p) is not None
    setup.latency_path.unlink()
    assert find_setup(p) is None


def test_a_lock_is_held_by_one_process_at_a_time_and_reentrant(tmp_path):
    """``file_lock``: a second process waits while the first holds it; the holder may take it again (nested)."""
    from adaptree.core.files import file_lock

    lock = tmp_path / ".x.lock"
    child = ("import time; from adaptree.core.files import file_lock\n"
             f"print('ready', flush=True); t0 = time.time()\nwith file_lock({str(lock)!r}): print(time.time() - t0)\n")
    with file_lock(lock):
        with file_lock(lock):  # re-entrant: no deadlock with itself
            run = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
            assert run.stdout.readline().strip() == "ready"
            time.sleep(1.0)
            assert run.poll() is None  # still waiting for the lock
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 0 and float(out) >= 0.9
    # threads of one process wait like processes do
    order = []

    def hold(name: str) -> None:
        with file_lock(lock):
            order.append(f"{name} in")
            time.sleep(0.2)
            order.append(f"{name} out")

    threads = [threading.Thread(target=hold, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order[0][0] == order[1][0] and order[2][0] == order[3][0]  # one in and out before the other


def test_cache_writes_use_temporary_names_of_their_own(tmp_path):
    """Two writes of one file never share a temporary file: each goes through a name of its own (host, pid, a
    random part) and leaves nothing behind, also when the write fails."""
    from adaptree.core.files import atomic_path
    from adaptree.offline.runs import write_json

    target = tmp_path / "entry.json"
    with atomic_path(target) as a, atomic_path(target) as b:
        assert a != b and a.parent == b.parent == tmp_path and a.name.startswith(".tmp-entry.json-")
        a.write_text("1")
        b.write_text("2")
    assert target.read_text() == "1"  # the write that ended last (the outer one) is the file, whole
    with pytest.raises(RuntimeError), atomic_path(target) as c:
        c.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]
    write_json({"x": 1}, target)
    assert json.loads(target.read_text()) == {"x": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]
