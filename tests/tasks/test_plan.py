"""The plan (tasks/runner/plan.py, flows/plan.py): each stage keyed by run_stage itself and looked up,
never run; reused, stale (with what differs), to run, or waiting on a stage that will run. With
toy stage bodies, no model."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

from ratchet.data.store import ArtifactStore
from ratchet.data.userfiles import UserFile
from ratchet.tasks.runner.plan import Planner
from ratchet.tasks.runner.stage import StageRequest, run_stage

ROOT = Path(__file__).parents[2]


class Job(BaseModel):
    x: int = 0
    workers: int = Field(default=1, json_schema_extra={"keyed": False})  # cannot change a result
    function: Annotated[str, UserFile(spec=True, digest="source")] = "rewards.py:score"
    source: str | None = None


def body(req: StageRequest[Job], store: ArtifactStore):
    d = store.stage_dir(req.stage, req.key)
    (d / "out.txt").write_text(f"{req.config.x} {[p.key for p in req.parents]}")
    return req.finish(store, outputs={"out.txt": None})


def _chain(store, job1, job2, code2="c", run="r"):
    """Two stages, `two` reading `one`'s output, as a round's stages do."""
    one, _ = run_stage(store, stage="one", round=1, body=body, code="c", config=job1, parents=[], run=run)
    two, _ = run_stage(store, stage="two", round=1, body=body, code=code2, config=job2, parents=[one], run=run)
    return one, two


def _planned(store, job1, job2, code2="c", run="r"):
    planner = Planner(ArtifactStore(store.root, create=False), run)
    _chain(ArtifactStore(store.root, create=False, planner=planner), job1, job2, code2)
    return {s.stage: s for s in planner.steps}


def _tree(root: Path) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_the_plan_keys_as_the_run_and_says_what_differs(tmp_path):
    store = ArtifactStore(tmp_path)
    a = Job(x=1, source="aaa")
    _chain(store, a, a)  # run r finished both
    before = _tree(tmp_path)

    same = _planned(store, a, a)
    assert [(s.state, s.dir) for s in same.values()] == [("reused", same["one"].dir), ("reused", same["two"].dir)]
    assert all(s.dir and (tmp_path / s.dir / "manifest.json").is_file() for s in same.values())
    assert _planned(store, a.model_copy(update={"workers": 8}), a)["one"].state == "reused"  # unkeyed

    changed = _planned(store, Job(x=2, source="aaa"), a)
    assert changed["one"].state == "stale" and changed["one"].why == "config x: 1 -> 2"
    assert changed["two"].state == "waits" and changed["two"].why.startswith("on one (round 1)")

    edited = _planned(store, a, Job(x=1, source="bbb"))  # the user's file changed: its digest
    assert edited["two"].state == "stale" and edited["two"].why == "file rewards.py:score (function) changed"
    assert _planned(store, a, a, code2="c2")["two"].why == "code c -> c2"
    assert {s.state for s in _planned(store, Job(x=2), a, run="another").values()} == {"to run", "waits"}
    assert _tree(tmp_path) == before  # nothing written: no directory, lock, owner or code file

    # a changed field names another run of the same experiment (the config's name): its stages
    # are compared with that run's
    planner = Planner(ArtifactStore(tmp_path, create=False), "exp-2", "exp")
    _chain(ArtifactStore(tmp_path, create=False, planner=planner), Job(x=9, source="aaa"), a)
    assert [s.state for s in planner.steps] == ["to run", "waits"]  # run r is no run of experiment exp
    _chain(store, Job(x=5, source="aaa"), a, run="exp-1")
    planner = Planner(ArtifactStore(tmp_path, create=False), "exp-2", "exp")
    _chain(ArtifactStore(tmp_path, create=False, planner=planner), Job(x=6, source="aaa"), a)
    assert planner.steps[0].why == "since run exp-1: config x: 5 -> 6"
    before = _tree(tmp_path)

    # the parent finished under another key (another run made it): the child names the parent
    b = Job(x=3, source="aaa")
    run_stage(store, stage="one", round=1, body=body, code="c", config=b, parents=[], run="other")
    moved = _planned(store, b, a)
    assert moved["one"].state == "reused" and moved["two"].state == "stale"
    assert moved["two"].why.startswith("parent one differs (was stages/one-")


def test_a_sibling_is_no_earlier_version_and_a_started_stage_says_what_it_kept(tmp_path):
    """Two stages of one name and round (a voter trained beside the policy): where the plan reuses
    the first, the second is to run, not stale against its sibling; one a killed run started says
    where and how far it got, which a run resumes from."""
    from ratchet.data.events import Progress

    store = ArtifactStore(tmp_path)
    policy, voter = Job(x=1), Job(x=2)
    run_stage(store, stage="train", round=1, body=body, code="c", config=policy, parents=[], run="r")
    planner = Planner(ArtifactStore(tmp_path, create=False), "r")
    planned = ArtifactStore(tmp_path, create=False, planner=planner)
    for job in (policy, voter):
        run_stage(planned, stage="train", round=1, body=body, code="c", config=job, parents=[], run="r")
    assert [s.state for s in planner.steps] == ["reused", "to run"]
    assert planner.steps[1].why == "no finished stage with this key"

    started = tmp_path / "stages" / f"train-{planner.steps[1].key[:16]}"  # killed at step 7 of 20
    started.mkdir()
    Progress(started, 20, "step", done=7)
    planner = Planner(ArtifactStore(tmp_path, create=False), "r")
    planned = ArtifactStore(tmp_path, create=False, planner=planner)
    for job in (policy, voter):
        run_stage(planned, stage="train", round=1, body=body, code="c", config=job, parents=[], run="r")
    assert planner.steps[1].why == (f"no finished stage with this key; started in stages/{started.name} (7 of 20 "
                                    "steps done), not finished: a run resumes what it kept there")


def test_a_plan_loads_no_model_imports_no_torch_and_writes_nothing(tmp_path):
    """`ratchet plan` on the default config in a fresh workdir: every stage to run or waiting, in
    a process that never imported torch or vLLM, and no workdir made."""
    code = ("import json, sys\n"
            "from ratchet.flows.cli import main\n"
            f"rc = main(['plan', 'flows/configs/default.yaml', 'workdir={tmp_path / 'w'}', 'rounds=2', '--json'])\n"
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'vllm': 'vllm' in sys.modules,\n"
            "                  'transformers': 'transformers' in sys.modules}), file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    seen = json.loads(r.stderr.strip().splitlines()[-1])
    assert seen == {"rc": 0, "torch": False, "vllm": False, "transformers": False}, r.stderr[-3000:]
    got = json.loads(r.stdout)
    steps = [(s["round"], s["stage"], s["state"]) for s in got["stages"]]
    assert steps[:2] == [(0, "prompts", "to run"), (0, "base", "to run")]
    assert [s for s in steps if s[2] == "waits"] == [s for s in steps[2:]]  # everything after waits on those
    assert {(k, s) for k, s, _ in steps} >= {(2, "sample"), (2, "label"), (2, "filter"), (2, "train"), (2, "evaluate")}
    assert got["counts"] == {"reused": 0, "stale": 0, "to run": 2, "waits": len(steps) - 2}
    assert "reading run default-" in r.stderr and "not run yet" in r.stderr
    assert not (tmp_path / "w").exists()


def test_an_online_round_scores_with_the_source_s_own_check():
    """GRPO scores its steps with whatever check the data source holds, a source's own included
    (reasoning-gym's scorer is not one of the shared check kinds): its train stage's job holds the
    data section, as a label stage's does, and keys it. Before, the job took the shared checks only
    and refused reasoning-gym's, so a GRPO round on a reasoning-gym task could not even be planned."""
    from ratchet.flows.config import load_config
    from ratchet.tasks.runner.stage import keyed
    from ratchet.tasks.train import OnlineJob

    cfg = load_config(ROOT / "flows" / "configs" / "tool_rft.yaml", ["train={kind: grpo}", "sample.top_k=0"])
    job = OnlineJob(train=cfg.train, seed=0, sample=cfg.sample, sampler=cfg.sampler, label=cfg.label, data=cfg.data)
    assert job.data.check.kind == "reasoning_gym" and keyed(job)["data"]["check"]["kind"] == "reasoning_gym"
