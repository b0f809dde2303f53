"""What a stage would do if the run started now, worked out without running it: `ratchet plan`.

A store made with a `Planner` (`ArtifactStore(root, create=False, planner=...)`) has `run_stage`
hand each stage to it instead of running it. The planner keys the stage exactly as `run_stage` would (the same code version, the same
resolved config, the same parents) and looks the key up in the store, reading only:

- reused: a finished stage with this key is in the store;
- stale: this run finished the stage under another key; the step names what differs (the config
  fields, the user's files, the definitions and libraries of its code, the parents);
- to run: neither;
- waits: a parent will run, so its output, and with it this stage's key, is not known yet.

A stage that will run (or wait) hands its children a placeholder manifest, which makes them wait
in turn. Nothing is written: no stage directory, lock, code file or owner. The flow around it
(flows/plan.py) walks the rounds as the pipeline would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from ratchet.data.manifest import MANIFEST, Role, StageManifest, read_manifest
from ratchet.data.store import ArtifactStore, stage_key

State = Literal["reused", "stale", "to run", "waits"]
PLACEHOLDER = "planned-"  # the key of a stage the plan expects to run: its output is not known yet


@dataclass
class Step:
    """One stage of one round, as the plan sees it."""

    stage: str
    round: int
    state: State
    why: str
    key: str | None = None  # the stage's key (None while it waits)
    dir: str | None = None  # where it is (reused) or was (stale)

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "round": self.round, "state": self.state, "why": self.why, "key": self.key,
                "dir": self.dir}


def pending(m: StageManifest) -> bool:
    return m.key.startswith(PLACEHOLDER)


def _flat(value: Any, at: str = "") -> dict[str, Any]:
    """A config slice as dotted paths (list items as [i], as data/userfiles.config_fields names them)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{at}.{k}" if at else str(k)))
        return out or {at: {}}
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flat(v, f"{at}[{i}]"))
        return out
    return {at: value}


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Planner:
    """Decides each stage of a planned run (`run_stage` calls `stage`). `run`: the pipeline run
    whose earlier stages count as its own (stale, rather than to run); `experiment`: the config's
    name, whose other runs' stages are compared where this run has none."""

    store: ArtifactStore  # the store the plan reads (made with create=False)
    run: str | None
    experiment: str = ""  # the config's name: its other runs' stages count as earlier ones too
    steps: list[Step] = field(default_factory=list)
    _opened: dict[tuple, dict] = field(default_factory=dict)
    _count: int = 0

    def placeholder(self, stage: str, round: int, role: Role | None = None) -> StageManifest:
        self._count += 1
        return StageManifest(stage=stage, **({"role": role} if role else {}), round=round, key=f"{PLACEHOLDER}{self._count}",
                             dir=f"stages/{stage}-planned{self._count:09d}", code_version="", config={})

    def note(self, stage: str, round: int, state: State, why: str) -> None:
        """A step the flow decides itself (a gate's decision, a round the agreement gate stops)."""
        self.steps.append(Step(stage, round, state, why))

    def code(self, body, config: BaseModel) -> dict:
        from ratchet.tasks.runner import code_reach

        roots = tuple(code_reach.roots_of(body, config))
        if roots not in self._opened:
            self._opened[roots] = code_reach.opened(list(roots))
        return self._opened[roots]

    def stage(self, stage: str, round: int, body, config: BaseModel, keyed: dict, code: str | None,
              parents: list[StageManifest], role: Role | None = None) -> tuple[StageManifest, bool]:
        """What `run_stage` would do with this stage: its key from the same pieces (`keyed`: the
        config as it keys the stage), then reused, stale, to run or waits."""
        waiting = [p for p in parents if pending(p)]
        if waiting:
            on = ", ".join(f"{p.stage} (round {p.round})" for p in waiting)
            self.steps.append(Step(stage, round, "waits", f"on {on}: its key needs that output"))
            return self.placeholder(stage, round, role), False
        opened = self.code(body, config) if code is None else {"digest": code, "definitions": [], "libraries": {}}
        key = stage_key(stage, opened["digest"], keyed, parents)
        found = self.store.find(stage, key, verify=False)
        if found is not None:
            note = "; its merged weights are dropped, made again when a stage reads them" if \
                self.store.dropped(found) else ""
            self.steps.append(Step(stage, round, "reused", f"finished in {found.dir}{note}", key, found.dir))
            return found, True
        mine, theirs = self._earlier(stage, round)
        planned = {s.dir for s in self.steps if s.state == "reused"}  # a sibling this plan reuses (a voter
        # beside the policy, an evaluation of another set) is not an earlier version of this stage
        mine, theirs = [m for m in mine if m.dir not in planned], [m for m in theirs if m.dir not in planned]
        if not mine and not theirs:
            self.steps.append(Step(stage, round, "to run", "no finished stage with this key" + self._started(stage, key),
                                   key))
        else:  # the earlier stage closest to this one: the fewest differences, then the newest
            newest = sorted(mine or theirs, key=lambda m: m.created_at, reverse=True)
            why, old = min(((self.differences(m, opened, config, keyed, parents), m) for m in newest),
                           key=lambda t: len(t[0]))
            since = "" if mine else f"since run {self._owner(old)}: "
            self.steps.append(Step(stage, round, "stale", since + ("; ".join(why) or "its key differs")
                                   + self._started(stage, key), key, old.dir))
        return self.placeholder(stage, round, role), False

    def _started(self, stage: str, key: str) -> str:
        """Where a stage with this key was started and not finished (killed, or running now): what it
        has done, which a run resumes from."""
        from ratchet.data.events import read_progress

        d = self.store.stage_dir(stage, key)
        if not d.is_dir():
            return ""
        p = read_progress(d) or {}
        done = f" ({p['done']} of {p['total']} {p.get('unit', 'unit')}s done)" if p.get("total") else ""
        return f"; started in {d.relative_to(self.store.root)}{done}, not finished: a run resumes what it kept there"

    def _earlier(self, stage: str, round: int) -> tuple[list[StageManifest], list[StageManifest]]:
        """The finished stages of this name and round that this run computed, and those that other
        runs of the same experiment (`experiment`, the config's name) computed: a run is its config,
        so a changed field names another run, whose stages are the ones it changed."""
        stages = self.store.root / "stages"
        mine, theirs = [], []
        for d in stages.glob(f"{stage}-*") if stages.is_dir() else []:
            if not (d / MANIFEST).is_file():
                continue  # unfinished (another stage whose name starts the same is told apart by its manifest)
            owners = self.store.owners(d)
            ours = self.run in owners
            if not ours and not any(o.startswith(f"{self.experiment}-") for o in owners):
                continue
            try:
                m = read_manifest(d)
            except Exception:  # noqa: BLE001 - an unreadable manifest is no earlier stage to compare with
                continue
            if m is not None and m.round == round and m.stage == stage:
                (mine if ours else theirs).append(m)
        return mine, theirs

    def _owner(self, m: StageManifest) -> str:
        owners = [o for o in self.store.owners(self.store.dir_of(m)) if o.startswith(f"{self.experiment}-")]
        return owners[-1] if owners else "?"

    def differences(self, old: StageManifest, opened: dict, config: BaseModel, keyed: dict,
                    parents: list[StageManifest]) -> list[str]:
        """What differs between an earlier finished stage and this one, as a user reads it."""
        from ratchet.data.userfiles import config_fields, marker

        out = []
        new_all, new_keyed, was = _flat(config.model_dump(mode="json")), _flat(keyed), _flat(old.config)
        unkeyed = set(new_all) - set(new_keyed)
        files = {}  # a user file's digest field -> the field that names the file, and its value
        for at, owner, name, value in config_fields(config):
            m = marker(type(owner), name)
            if m is not None and m.digest is not None:
                files[f"{at.rpartition('.')[0]}.{m.digest}".lstrip(".")] = (at, value)
        changed = [p for p in sorted(set(new_keyed) | set(was)) if p not in unkeyed
                   and new_keyed.get(p, "<unset>") != was.get(p, "<unset>")]
        named = []
        for p in changed:
            if p in files:
                at, value = files[p]
                out.append(f"file {value} ({at}) changed")
            elif p.startswith("sources."):
                out.append(f"data {p.removeprefix('sources.')} changed")
            else:
                named.append(f"{p}: {_short(was.get(p, '<unset>'))} -> {_short(new_keyed.get(p, '<unset>'))}")
        if named:
            more = f" (and {len(named) - 4} more)" if len(named) > 4 else ""
            out.append("config " + ", ".join(named[:4]) + more)
        if old.code_version != opened["digest"]:
            out.append(self._code_change(old.code_version, opened))
        before = {p.stage: p for p in old.parents}
        for p in parents:
            b = before.get(p.stage)
            if b is None:
                out.append(f"new parent {p.stage}")
            elif b.content != p.content:
                out.append(f"parent {p.stage} differs (was {b.dir}, now {p.dir})")
        return out

    def _code_change(self, was: str, opened: dict) -> str:
        try:
            before = self.store.code(was)
        except Exception:  # noqa: BLE001 - a store from before code versions were kept
            return f"code {was} -> {opened['digest']}"
        old_defs = {(m, n): d for m, n, d in before.get("definitions", [])}
        new_defs = {(m, n): d for m, n, d in opened.get("definitions", [])}
        edits = sorted(f"{m}.{n}" for (m, n) in set(old_defs) | set(new_defs) if old_defs.get((m, n)) != new_defs.get((m, n)))
        libs_old, libs_new = before.get("libraries", {}), opened.get("libraries", {})
        libs = sorted(f"{libs_old.get(k, k + ' (none)')} -> {libs_new.get(k, 'none')}"
                      for k in set(libs_old) | set(libs_new) if libs_old.get(k) != libs_new.get(k))
        parts = []
        if edits:
            parts.append("definitions " + ", ".join(edits[:4]) + (f" (and {len(edits) - 4} more)" if len(edits) > 4 else ""))
        if libs:
            parts.append("libraries " + ", ".join(libs[:3]))
        return f"code {was} -> {opened['digest']}: " + ("; ".join(parts) or "its definitions differ")
