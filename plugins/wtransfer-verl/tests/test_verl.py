"""wtransfer engines as verl checkpoint engines, driven with verl 0.9.1's own classes in separate processes.

``scripts/verl_protocol.py`` runs the calls verl's ``CheckpointEngineManager`` makes for each sync, in its
order, with one actor of two ranks and two rollout workers, each a process. What is checked is what the
rollouts hand to verl's rollout engine, bit for bit against what the actor sent (floating tensors cast to
bf16, the cast option), and the labels:

* verl's first sync (step 0) and a step synced twice get labels, all different and going up;
* in the step whose actor is killed after earlier buckets went out, no rollout worker hands on a single
  tensor and each still holds the step before; a new actor's rounds are labelled past every earlier one;
* delta rounds move a small fraction of the bytes and hand on exactly the tensors that changed, unless
  verl took only part of the last round: then the whole copy is handed on;
* with ``rebuild_group`` every sync has a new trainer and is a full round, and labels still go up.

Broken versions this catches, each planted once: a rollout handing on its held tensors when a round
fails; a rollout that builds a new engine for a new actor (the new actor's labels restart).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "verl_protocol.py"


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_verl_checkpoint_engine_sequence_with_a_killed_actor(verl_python: Path, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "report.json"
    run = subprocess.run([str(verl_python), str(SCRIPT), backend, str(out)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(out.read_text())
    assert {"wtransfer:gloo", "wtransfer:shm"} <= set(report["registered"]), report["registered"]
    assert report["engine_class"].startswith("wtransfer_verl.engine."), report["engine_class"]
    expected = report["expected"]

    def landed(step: dict, label: int, changed: set[str] | None = None, want: dict | None = None) -> list[set[str]]:
        """The step landed as ``label`` and every rollout was handed exactly what the actor sent; returns
        the names each rollout was handed."""
        metrics, want = step["sent"][0]["metrics"], want or expected[str(step["step"])]
        assert metrics["wtransfer/version"] == label, (label, step)
        assert step["sent"][1] == {"metrics": {}}, step  # rank 1 only walked verl's generator
        handed = []
        for received in step["received"]:
            assert "error" not in received, received
            assert received["handed"] == {name: want[name] for name in received["handed"]}, \
                f"step {step['step']}: not what the actor sent"
            handed.append(set(received["handed"]))
        if changed is not None:
            assert metrics["wtransfer/wire_bytes"] < metrics["wtransfer/bytes"] / 10, metrics
        return handed

    everything = set(expected["0"])
    dense = report["dense"]
    assert [step["step"] for step in dense] == [0, 1, 1, 2, 3, 3, 4]
    for step, label in zip(dense[:4], (1, 2, 3, 4)):
        assert landed(step, label) == [everything] * 2
    killed = dense[4]
    assert "died" in killed["sent"][0]["error"], killed["sent"]
    for received in killed["received"]:
        assert received["handed"] == {}, "a rollout worker handed on tensors of a round that never committed"
        assert "did not commit" in received["error"] and "keeps version 4" in received["error"], received
    # the actor must die while the round moves (the workers were receiving it), not before it started
    moving = "receiving bucket" if backend == "gloo" else "update failed here"
    assert moving in killed["received"][0]["error"], killed["received"]
    for step, label in zip(dense[5:], (5, 6)):  # the new actor numbers past what the rollouts hold
        assert landed(step, label) == [everything] * 2

    delta = report["delta"]
    changed = {name for name in everything if expected["1"][name] != expected["0"][name]}
    assert 0 < len(changed) < len(everything), changed
    assert landed(delta[0], 1) == [everything] * 2
    first, second = landed(delta[1], 2, changed)
    assert len(first) == 1 and second == changed  # rollout 0's consumer stopped after one tensor
    assert landed(delta[2], 3, changed) == [everything, changed]  # so it is handed the whole copy next
    assert landed(delta[3], 4, changed) == [changed, changed]

    # rebuild_group: a new trainer every sync, so every round is full (no delta base); labels still go up
    rebuilt = report["rebuild"]
    uncast = report["expected_uncast"]
    for step, label in zip(rebuilt, (1, 2, 3)):
        assert landed(step, label, want=uncast[str(step["step"])]) == [everything] * 2
        assert step["sent"][0]["metrics"]["wtransfer/wire_bytes"] == step["sent"][0]["metrics"]["wtransfer/bytes"]
