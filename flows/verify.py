"""`ratchet verify`: run finished stages again from their recorded inputs and compare the bytes.

A stage's manifest says what it read (its parents' outputs, by digest; its config slice; its
code version) and what it wrote (each output's sha256). Verifying a stage runs its body again, in
a worker process, in a scratch store under WORKDIR/verify/ whose `stages/` links to the recorded
parents (read, never written), and compares every output digest with the record:

- identical: every output's bytes are the recorded ones;
- differs: which files, and each metric that moved, by how much (timings are not compared);
- not re-runnable, with the reason: the manifest names no body (recorded before Ratchet kept it),
  the code here is another version than the one that ran, its answers come from a server (a
  served judge, policy or optimiser: a re-run would ask it again), or its key here differs from
  the recorded one (its config reads differently here).

The run's own store is read, never written. The verdicts are kept in
WORKDIR/verify/RUN/STAMP.json and logged to the run's MLflow parent run under verify/."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from ratchet.data.errors import RatchetError
from ratchet.data.manifest import StageManifest, read_manifest
from ratchet.data.store import ArtifactStore, stage_key
from ratchet.flows.lineage import LEDGER

Verdict = Literal["identical", "differs", "not re-runnable"]
# metrics that time the work, not its result (seconds, and rates: `*_s`, `*_per_s`): a re-run's
# differ and say nothing of its bytes


class StageVerdict(BaseModel):
    stage: str
    round: int
    dir: str
    verdict: Verdict
    why: str = ""  # not re-runnable: the reason; differs: what differs
    files: dict[str, list[str | None]] = {}  # an output that differs: [recorded sha256, re-run sha256]
    metrics: dict[str, list[float | None]] = {}  # a metric that moved: [recorded, re-run]
    wall_s: float = 0.0


def _served(config: Any) -> str | None:
    """The field of a config slice that names a server the stage asks (its answers are its)."""
    if isinstance(config, dict):
        for k, v in config.items():
            if k == "endpoint" and isinstance(v, dict) and v.get("base_url"):
                return f"{k} {v.get('base_url')} ({v.get('model')})"
            if (found := _served(v)) is not None:
                return found
    elif isinstance(config, list):
        for v in config:
            if (found := _served(v)) is not None:
                return found
    return None


def _body_of(m: StageManifest):
    from ratchet.data.procs.entry import load_target

    name = (m.ran_by or {}).get("body")
    if not name:
        return None, "its manifest names no body (recorded before Ratchet kept each stage's body)"
    try:
        return load_target(name), None
    except (ImportError, AttributeError) as e:
        return None, f"its body {name} is not in this Ratchet ({type(e).__name__}: {e})"


def _timing(name: str) -> bool:
    return name.endswith("_s") or "per_s" in name or "wall" in name


def compare(recorded: StageManifest, again: StageManifest) -> tuple[dict, dict]:
    """The outputs whose digests differ, and the metrics (not timings) that moved."""
    def digest(m: StageManifest, name: str) -> str | None:
        return m.outputs[name].sha256 if name in m.outputs else None

    files = {n: [digest(recorded, n), digest(again, n)] for n in sorted(set(recorded.outputs) | set(again.outputs))}
    files = {n: pair for n, pair in files.items() if pair[0] != pair[1]}
    metrics = {n: [recorded.metrics.get(n), again.metrics.get(n)]
               for n in sorted(set(recorded.metrics) | set(again.metrics)) if not _timing(n)}
    metrics = {n: pair for n, pair in metrics.items() if pair[0] != pair[1]
               and not (isinstance(pair[0], float) and isinstance(pair[1], float) and pair[0] != pair[0]
                        and pair[1] != pair[1])}  # NaN on both sides is the same fact
    return files, metrics


def verify_stage(store: ArtifactStore, m: StageManifest, scratch: Path, upstream: list[str] | None = None
                 ) -> StageVerdict:
    """Run `m`'s body again from its recorded parents, config and code, in `scratch`; its verdict.
    `upstream`: the stage directories above it (default: its chain, walked and verified here),
    linked into the scratch store: a body may read past its parents (a search's weights are its
    template's)."""
    from ratchet.tasks.runner import code_reach
    from ratchet.tasks.runner.stage import keyed, request_type, resolved, run_stage

    head = {"stage": m.stage, "round": m.round, "dir": m.dir}
    if (server := _served(m.config)) is not None:
        return StageVerdict(**head, verdict="not re-runnable",
                            why=f"its answers come from a server ({server}): a re-run would ask it again, and its "
                                "journal in the stage directory is the record of what it answered")
    body, why = _body_of(m)
    if body is None:
        return StageVerdict(**head, verdict="not re-runnable", why=why)
    from pydantic import TypeAdapter

    job = request_type(body).model_fields["config"].annotation  # a job class, or a union of them
    config = resolved(TypeAdapter(job).validate_python(m.config))
    code = code_reach.opened(code_reach.roots_of(body, config))["digest"]
    if code != m.code_version:
        return StageVerdict(**head, verdict="not re-runnable",
                            why=f"the code here is version {code}, and version {m.code_version} ran it "
                                f"(`ratchet lineage --code {m.code_version}` opens what that covered); check out "
                                f"the commit it names ({(m.ran_by or {}).get('commit') or 'not recorded'}) to verify")
    parents = []
    for p in m.parents:
        parent = read_manifest(store.root / p.dir)
        if parent is None:
            return StageVerdict(**head, verdict="not re-runnable", why=f"its parent {p.dir} has no manifest")
        parents.append(parent)
    if (key := stage_key(m.stage, code, keyed(config), parents)) != m.key:
        return StageVerdict(**head, verdict="not re-runnable",
                            why=f"its key here is {key[:16]}, and {m.key[:16]} was recorded: its config slice "
                                "resolves differently on this machine (a dtype `auto` chose, say)")
    here = ArtifactStore(scratch)
    (scratch / "stages").mkdir(parents=True, exist_ok=True)
    if upstream is None:
        from ratchet.flows.lineage import walk

        upstream = [link.dir for link in walk(store, m)[1:]]
    for d in {*upstream, *(p.dir for p in parents)} - {m.dir}:  # linked: read where the body reads them, never copied
        link = scratch / d
        if not link.exists():
            link.symlink_to(store.root / d, target_is_directory=True)
    started = time.time()
    try:
        again, _ = run_stage(here, stage=m.stage, role=m.role, round=m.round, body=body, config=config, parents=parents,
                             isolate=True)
    except Exception as e:  # noqa: BLE001 - the verdict carries it
        return StageVerdict(**head, verdict="not re-runnable", why=f"it failed when run again: {type(e).__name__}: "
                            f"{str(e)[:500]}", wall_s=round(time.time() - started, 1))
    files, metrics = compare(m, again)
    wall = round(time.time() - started, 1)
    if not files:
        return StageVerdict(**head, verdict="identical", metrics=metrics, wall_s=wall)
    said = f"{len(files)} of {len(m.outputs)} output(s) differ: {', '.join(list(files)[:5])}"
    if LEDGER in files:  # online training: the first optimizer step whose record is not the recorded one
        def rows(s: ArtifactStore, x: StageManifest) -> list[str]:
            p = s.path(x, LEDGER)
            return p.read_text().splitlines() if p.is_file() else []

        was, now = rows(store, m), rows(here, again)
        step = next((i for i, (a, b) in enumerate(zip(was, now)) if a != b), min(len(was), len(now)))
        said += f"; the ledger first differs at optimizer step {step + 1} of {len(was)}"
    return StageVerdict(**head, verdict="differs", why=said, files=files, metrics=metrics, wall_s=wall)


def chosen_stages(store: ArtifactStore, start: StageManifest, names: list[str]
                  ) -> tuple[list[StageManifest], list[str]]:
    """The chain behind `start` (flows/lineage.py walk, every digest verified), in the order it ran, with
    `names` only those stages (NAME, or NAME:ROUND); and every directory of the chain."""
    from ratchet.flows.lineage import walk

    links = walk(store, start)
    if broken := [x for x in links if not x.verified]:
        raise RatchetError(f"{broken[0].dir}: {broken[0].problem}; a chain whose records do not hold cannot be "
                           "verified (`ratchet lineage` shows every link)")
    found = {m.key: m for link in links if (m := read_manifest(store.root / link.dir)) is not None}
    chain: list[StageManifest] = []

    def ran(m: StageManifest) -> None:  # after every stage it read: the order they ran in
        if m in chain:
            return
        for p in m.parents:
            if p.key in found:
                ran(found[p.key])
        chain.append(m)

    for m in sorted(found.values(), key=lambda m: (m.round, m.created_at)):
        ran(m)
    dirs = [m.dir for m in chain]
    if not names:
        return chain, dirs
    wanted = [n.partition(":") for n in names]
    out = [m for m in chain if any(m.stage == s and (not r or str(m.round) == r) for s, _, r in wanted)]
    if not out:
        have = ", ".join(f"{m.stage}:{m.round}" for m in chain)
        raise RatchetError(f"--stage {' '.join(names)} names no stage of this chain; it holds {have}")
    return out, dirs


def verify(store: ArtifactStore, stages: list[StageManifest], out_dir: Path, say=print,
           upstream: list[str] | None = None) -> tuple[Path, list]:
    """Verify each stage in a scratch store of its own; write the verdicts to out_dir/STAMP.json.
    `upstream`: every stage directory the stages may read (the chain they are from)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    verdicts = []
    for m in stages:
        scratch = out_dir / f"{stamp}-scratch" / f"{m.stage}-{m.round}"
        say(f"verifying {m.stage} (round {m.round}) {m.dir} ...")
        v = verify_stage(store, m, scratch, upstream)
        verdicts.append(v)
        say(f"  {v.verdict}" + (f": {v.why}" if v.why else "") + (f" ({v.wall_s:.0f} s)" if v.wall_s else ""))
        for name, (was, now) in list(v.metrics.items())[:8]:
            say(f"    metric {name}: {was} recorded, {now} again" + (
                f" ({now - was:+.3g})" if isinstance(was, float) and isinstance(now, float) else ""))
        if v.verdict != "differs":
            shutil.rmtree(scratch, ignore_errors=True)  # kept where it differs: the bytes to compare
    if not any(v.verdict == "differs" for v in verdicts):
        shutil.rmtree(out_dir / f"{stamp}-scratch", ignore_errors=True)
    path = out_dir / f"{stamp}.json"
    path.write_text(json.dumps({"stamp": stamp, "store": str(store.root),
                                "stages": [v.model_dump() for v in verdicts]}, indent=1))
    return path, verdicts
