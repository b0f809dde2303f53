"""Lineage: the chain that produced a model, walked over manifests and checked.

    ratchet lineage CONFIG 4               # model version 4 of the workdir's registered model
    ratchet lineage CONFIG prompts:/ratchet-default-prompt/2   # the stage that wrote a prompt version
    ratchet lineage CONFIG RUN_ID --json   # an MLflow round run, as JSON
    ratchet lineage --workdir W            # the newest run's newest version, its config read from its record

Each link is a stage directory: its config hash, code version, output digests
(re-verified against the files on disk), the user's files it read with their digests (a data
file, a scoring function's or an environment's file, as its config keyed them) and, for models,
the registered version and MLflow run. The walk follows manifest parents, so it ends at the
prompts and the base model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.digest import sha256_json
from ratchet.data.errors import ArtifactError, RatchetError, TamperedArtifactError
from ratchet.data.manifest import StageManifest, read_manifest
from ratchet.data.store import ArtifactStore


class Link(BaseModel):
    """One stage of a model's lineage, as `ratchet lineage --json` prints it (a list of these, the
    model's own stage first)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")  # as the manifest writes metrics
    stage: str = Field(description="the stage's name: prompts, base, sample, label, filter, train, evaluate, ...")
    role: str = Field(default="data", description="what its outputs are: model (weights), text (a prompt's text over "
                      "weights), data (rows) or eval (a held-out figure)")
    round: int = Field(description="the round it belongs to (0: the prompts, the base model); -1 for a parent whose "
                       "manifest is missing")
    key: str = Field(description="its cache key (sha256): stage, code version, config and parents' contents")
    dir: str = Field(description="its directory, relative to the workdir")
    code_version: str = Field(description="the digest of every definition it can run, in its own process and its "
                              "children, and of the libraries they import; `ratchet lineage CONFIG --code DIGEST` "
                              "opens it")
    config_hash: str = Field(description="sha256 of its resolved config slice (16 hex digits)")
    outputs: dict[str, str] = Field(description="each output file, relative to `dir`, with its sha256")
    parents: list[str] = Field(description="the keys of the stages it read")
    verified: bool = Field(description="its files match its manifest, and its outputs are the ones its child read")
    problem: str | None = Field(default=None, description="what failed verification, and the fix")
    model_version: str | None = Field(default=None, description="the registered model version it made (base and "
                                      "train stages)")
    mlflow_run_id: str | None = Field(default=None, description="the MLflow run that logged that version")
    metrics: dict[str, float] = Field(default={}, description="the stage's metrics, as its manifest holds them")
    summary: str | None = Field(default=None, description="what the stage holds, where it says (a round's draw of "
                                "prompts)")
    reads: dict[str, str] = Field(default={}, description="the user's files its config names (data, a scoring "
                                  "function's, an environment's), each with the sha256 it was keyed by")
    source: dict[str, Any] = Field(default={}, description="what ran it: `commit` (the git commit of the checkout, "
                                   "null for an installed package), `dirty` (the package's files differed from it) "
                                   "and `version` (the package's); empty for a stage made before it was recorded")
    dropped: list[str] = Field(default=[], description="outputs `ratchet gc --models` removed to save disk (a train "
                               "stage's merged weights), which the stage makes again from its adapter and its parent "
                               "when a run or `ratchet export` needs them; still named with their sha256 in `outputs`")
    ledger: list[dict[str, Any]] = Field(default=[], description=(
        "an online train stage's ledger (ledger.jsonl), a row per optimizer step: `step`, `prompt_ids` (the "
        "prompts of the groups it sampled), `trained_prompt_ids` (those whose groups its loss read), `seeds` (of "
        "each draw), `rollouts` (each stored rollouts file with its sha256) and `sampled_from` (per training "
        "process, the weights the rollouts were sampled from: the trainer's `step` then and the "
        "`trainable_sha256` of its trainable parameters); each rollouts digest is checked against the manifest"))


def schema_markdown() -> str:
    """docs/reference/lineage-json.md: the fields of `ratchet lineage --json`'s links."""
    rows = ["# `ratchet lineage --json`", "",
            "A JSON list of links, the model's own stage first, then its parents depth-first, round by round. "
            "Generated from the `Link` model (flows/lineage.py); its JSON Schema is "
            "`Link.model_json_schema()`.", "", "| field | type | what it holds |", "|---|---|---|"]
    for name, f in Link.model_fields.items():
        kind = str(f.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
        rows.append(f"| `{name}` | `{kind}` | {f.description} |")
    rows += ["", "`ratchet lineage CONFIG --code DIGEST --json` prints one object: `digest`, `definitions` "
             "(`[module, name, digest of its syntax tree]` for each definition the code version covers) and "
             "`libraries` (import name: `distribution==version`)."]
    return "\n".join(rows) + "\n"


SPEC = re.compile(r"[^\s:]+:[A-Za-z_]\w*")  # 'path/to/file.py:name' or 'package.module:name'
SHA256 = re.compile(r"[0-9a-f]{64}")


def reads(config: Any) -> dict[str, str]:
    """The user's files a stage's config names, with the digests it was keyed by: a function's or an
    environment's spec beside its `source` digest (at any depth: a check, a rollout, a held-out
    set's), and a prompt stage's data files beside their `sources` digests."""
    out: dict[str, str] = {}
    if isinstance(config, dict):
        src = config.get("source")
        if isinstance(src, str) and SHA256.fullmatch(src):
            out.update({v: src for k, v in config.items() if k != "source" and isinstance(v, str) and SPEC.fullmatch(v)})
        files, data = config.get("sources"), config.get("data")
        if isinstance(files, dict) and isinstance(data, dict):
            out.update({data[k]: d for k, d in files.items() if isinstance(data.get(k), str) and isinstance(d, str)})
        for v in config.values():
            out.update(reads(v))
    elif isinstance(config, list):
        for v in config:
            out.update(reads(v))
    return out


LEDGER = "ledger.jsonl"  # an online train stage's (models/train_kinds/grpo.py)


def ledger_of(store: ArtifactStore, m: StageManifest) -> tuple[list[dict[str, Any]], str | None]:
    """A stage's ledger, and what is wrong with it: a step whose rollouts the manifest does not hold
    with the digest the ledger names."""
    if LEDGER not in m.outputs or not store.path(m, LEDGER).is_file():
        return [], None
    rows = [json.loads(x) for x in store.path(m, LEDGER).read_text().splitlines() if x.strip()]
    for row in rows:
        for name, digest in row.get("rollouts", {}).items():
            held = m.outputs.get(name)
            if held is None or held.sha256 != digest:
                return rows, (f"its ledger's step {row.get('step')} names {name} with sha256 {digest[:16]}, and the "
                              f"manifest holds {held.sha256[:16] if held else 'no such file'}: the ledger and the "
                              "rollouts it trained on disagree; run the stage again")
    return rows, None


def _link(m: StageManifest, problem: str | None, dropped: list[str] = (), ledger: list[dict] = ()) -> Link:
    return Link(stage=m.stage, role=m.role, round=m.round, key=m.key, dir=m.dir, code_version=m.code_version,
                config_hash=sha256_json(m.config)[:16], outputs={k: v.sha256 for k, v in m.outputs.items()},
                parents=[p.key for p in m.parents], verified=problem is None, problem=problem, metrics=m.metrics,
                summary=(m.info or {}).get("summary") or _text_summary(m), reads=reads(m.config),
                source=m.ran_by or {}, dropped=sorted(dropped), ledger=list(ledger))


def walk(store: ArtifactStore, start: StageManifest) -> list[Link]:
    """Every stage upstream of `start` (itself first), each verified, no repeats.

    Depth-first, data parents before the model parent, so the chain reads round by
    round: train 3, filter 3, label 3, sample 3, prompts, train 2, ...

    A link has a problem when its files no longer match its manifest, or when its
    outputs are not the ones its child consumed (the parent was recomputed or edited).
    """
    links: list[Link] = []
    seen: set[str] = set()
    stack: list[tuple[StageManifest, str | None, str]] = [(start, None, "")]
    while stack:
        m, expected, consumer = stack.pop()
        if m.key in seen:
            continue
        seen.add(m.key)
        problem = None
        try:
            store.verify(m)
        except TamperedArtifactError as e:
            problem = str(e)
        if problem is None and expected is not None and m.content != expected:
            problem = f"its outputs are not the ones {consumer} consumed"
        ledger, wrong = ledger_of(store, m) if problem is None else ([], None)
        links.append(_link(m, problem or wrong, [x for x in store.dropped(m).get("outputs", [])
                                                 if not (store.dir_of(m) / x).is_file()], ledger))
        model_last = sorted(m.parents, key=lambda p: p.role == "model")
        for p in reversed(model_last):  # the stack pops the last pushed first
            parent = read_manifest(store.root / p.dir)
            if parent is None:
                links.append(Link(stage=p.stage, role=p.role, round=-1, key=p.key, dir=p.dir, code_version="?",
                                  config_hash="?", outputs={}, parents=[], verified=False,
                                  problem=f"{store.root / p.dir}: manifest missing"))
                seen.add(p.key)
            else:
                stack.append((parent, p.content, f"{m.stage} (round {m.round})"))
    return links


def annotate(links: list[Link], tracker) -> None:
    """Add registered versions and MLflow run ids to model links (base and train stages), and
    check what the registry recorded for each version against the store: a version whose
    recorded stage key or file digest differs from the stage on disk is a problem."""
    for link in links:
        if link.role != "model":
            continue
        v = tracker.version_of(link.key)
        if v is None:
            continue
        mv = tracker.version(v)
        link.model_version, link.mlflow_run_id = v, mv.run_id
        recorded, actual = mv.tags.get("ratchet.content"), sha256_json(link.outputs)
        if recorded is not None and recorded != actual:
            link.verified = False
            link.problem = (f"registry version {v} records content {recorded[:16]} but the store holds {actual[:16]} "
                            f"at {link.dir}: the files were replaced after registration")


def own_model(target: str, tracker) -> None:
    """Refuse `models:/NAME/N` where NAME is not this run's registered model."""
    if target.startswith("models:/") and target.removeprefix("models:/").rpartition("/")[0] != tracker.model_name:
        raise RatchetError(f"{target} names another registered model than this run's; give "
                           f"models:/{tracker.model_name}/N")


def resolve(target: str, store: ArtifactStore, tracker) -> StageManifest:
    """A model version number, 'models:/name/N', 'prompts:/name/N' (a prompt version: the stage that
    wrote its text), 'champion', an MLflow run id, or a stage directory (a path, or as a link names
    it: relative to the workdir)."""
    for p in (Path(target), store.root / target):  # as given, or as a link names it (under the workdir)
        if p.is_dir() and (p / "manifest.json").exists():
            return read_manifest(p)
    if target.startswith("prompts:/"):
        return prompt_manifest(store, tracker, target)
    if target == "champion":
        champion = tracker.champion()
        if champion is None:
            raise RatchetError(f"{tracker.model_name} has no champion yet; name a version (see `ratchet runs`)")
        return version_manifest(store, tracker, champion)
    version = target.rsplit("/", 1)[-1] if target.startswith("models:/") else target
    own_model(target, tracker)
    if not version.isdigit():
        try:
            run = tracker.client.get_run(target)
        except Exception as e:
            raise RatchetError(f"{target!r} is neither a model version, an MLflow run id, nor a stage directory; "
                               "pass e.g. `ratchet lineage 3`") from e
        version = run.data.tags.get("ratchet.model_version")
        if version is None:
            raise RatchetError(f"MLflow run {target} has no registered model (is it a round run that finished?)")
    return version_manifest(store, tracker, version)


def prompt_manifest(store: ArtifactStore, tracker, uri: str) -> StageManifest:
    """The stage that wrote a prompt version's text (the first to register it: a search, or the
    template stage of version 1), from the prompt version's ratchet.stage_dir tag."""
    name, _, number = uri.removeprefix("prompts:/").rpartition("/")
    try:
        pv = tracker.client.get_prompt_version(name, number) if number.isdigit() else None
    except Exception as e:  # noqa: BLE001 - the registry's own words, with the fix
        raise RatchetError(f"{uri}: {e}; give a prompt version as prompts:/NAME/N (a model version's "
                           "ratchet.prompt tag names its own)") from e
    if pv is None or not pv.tags.get("ratchet.stage_dir"):
        raise RatchetError(f"{uri} is not a prompt version this run's registry holds with its stage; give "
                           f"prompts:/{tracker.prompt_name}/N (a model version's ratchet.prompt tag names its own)")
    m = read_manifest(store.recorded_dir(pv.tags["ratchet.stage_dir"], f"{uri}'s ratchet.stage_dir tag"))
    if m is None:
        raise ArtifactError(f"{uri} points at {store.root / pv.tags['ratchet.stage_dir']}, which has no manifest: "
                            "the store behind this prompt version is gone (or is another workdir's)")
    return m


def version_manifest(store: ArtifactStore, tracker, version: str) -> StageManifest:
    """The stage manifest behind a registered model version (not re-verified here)."""
    mv = tracker.version(version)
    stage_dir = mv.tags.get("ratchet.stage_dir")
    if not stage_dir:
        raise RatchetError(f"{tracker.model_name} version {version} carries no ratchet.stage_dir tag, so its "
                           "files cannot be found in the store")
    m = read_manifest(store.recorded_dir(stage_dir, f"{tracker.model_name} version {version}'s ratchet.stage_dir tag"))
    if m is None:
        raise ArtifactError(f"{tracker.model_name} version {version} points at {store.root / stage_dir}, which "
                            "has no manifest: the store behind this version is gone (or is another workdir's)")
    if (key := mv.tags.get("ratchet.stage_key")) is not None and key != m.key:
        raise ArtifactError(f"{tracker.model_name} version {version} records stage key {key[:16]}, but "
                            f"{store.root / stage_dir} holds {m.key[:16]}: the registry and the store disagree")
    return m


def render_text(links: list[Link]) -> str:
    out = []
    for link in links:
        head = f"{link.stage:<9} round {link.round:<2} {link.dir}"
        if link.model_version:
            head += f"  model version {link.model_version} (run {link.mlflow_run_id})"
        out.append(head)
        out.append(f"    config {link.config_hash}  code {link.code_version}{source_text(link.source)}  "
                   + ("verified" if link.verified else f"PROBLEM: {link.problem}"))
        if link.dropped:
            out.append(f"    merged weights dropped, re-makeable ({len(link.dropped)} file(s): made again from "
                       "adapter/ and its parent model when needed, checked against these digests)")
        if link.summary:
            out.append(f"    {link.summary}")
        if link.ledger:
            out.append(f"    ledger: {len(link.ledger)} optimizer step(s), each with its prompts, seeds, rollouts "
                       "(digests checked) and the weights they were sampled from")
        for name, digest in sorted(link.reads.items()):
            out.append(f"    reads {name}  sha256 {digest[:16]}")
        for name, digest in sorted(link.outputs.items()):
            if not name.startswith(("model/", "adapter/")) or name.endswith(".safetensors"):
                out.append(f"    {name}  sha256 {digest[:16]}")
    bad = [x for x in links if not x.verified]
    out.append(f"{len(links)} links, {'all verified' if not bad else f'{len(bad)} with problems'}")
    return "\n".join(out)


def source_text(source: dict[str, Any]) -> str:
    """' (commit 1a2b3c4 dirty, ratchet 0.1.0)': what ran a stage, as its manifest recorded it."""
    if not source:
        return " (no source recorded)"
    commit = source.get("commit")
    where = f"commit {commit[:12]}{' dirty' if source.get('dirty') else ''}" if commit else "no git checkout"
    return f" ({where}, ratchet {source.get('version') or '?'})"


def render_code(opened: dict[str, Any]) -> str:
    """What a code version covers (`ratchet lineage --code DIGEST`): every definition, by module,
    with its digest, then the libraries and their versions."""
    out = [f"code {opened['digest']}: {len(opened['definitions'])} definitions, {len(opened['libraries'])} libraries"]
    module = None
    for mod, name, digest in opened["definitions"]:
        if mod != module:
            out.append(mod)
            module = mod
        out.append(f"    {name:<40} {digest}")
    out += ["libraries"] + [f"    {n:<40} {v or 'not installed'}" for n, v in sorted(opened["libraries"].items())]
    return "\n".join(out)


def render_mermaid(links: list[Link]) -> str:
    lines = ["graph BT"]
    for link in links:
        label = f"{link.stage} r{link.round}"
        if link.model_version:
            label += f" v{link.model_version}"
        if not link.verified:
            label += " TAMPERED"
        lines.append(f'  {link.key[:12]}["{label}"]')
    for link in links:
        for p in link.parents:
            lines.append(f"  {p[:12]} --> {link.key[:12]}")
    return "\n".join(lines)


def as_json(links: list[Link]) -> list[dict[str, Any]]:
    return [json.loads(link.model_dump_json()) for link in links]  # strict JSON: a NaN metric is "NaN"


def _text_summary(m: StageManifest) -> str | None:
    """A pair's text (tasks/text.py), where it is one: what its stage chose or carried, and from what."""
    if m.role != "text" or "template" not in (m.info or {}):
        return None
    t = m.info["template"]
    shown = json.dumps(t if len(t) <= 120 else t[:117] + "...")
    if beliefs := m.info.get("beliefs"):
        shown = "beliefs of " + ", ".join(f"{role} ({len(b.splitlines())})" for role, b in sorted(beliefs.items()))
    if "optimiser" in m.info:  # a search chose it
        return (f"prompt {shown}, chosen by {m.info.get('optimiser', '?')}'s revisions: node "
                f"{m.info.get('chosen', '?')} of {int(m.metrics.get('nodes', 0))}, reward prompts "
                f"{m.metrics.get('chosen_reward', 0):.1%} against the base's {m.metrics.get('base_reward', 0):.1%}")
    return ("" if beliefs else "prompt ") + shown + (" (the config's prompt.template)" if m.config.get("template") is not None
                                 else " (carried from the pair the weights were trained under)")


def _served(store: ArtifactStore, w: StageManifest) -> str:
    from ratchet.tasks.prepare import SERVED_FILE as SERVED

    at = json.loads(store.path(w, SERVED).read_text())
    return f"{at['model']!r} at {at['base_url']}"


def export(store: ArtifactStore, tracker, version: str, out: Path) -> Path:
    """Copy a registered version's merged model (weights, config, tokenizer) into `out`, each
    file checked against its manifest digest, with a model card naming its lineage."""
    import shutil

    if out.exists() and any(out.iterdir()):
        raise RatchetError(f"{out} exists and is not empty; give a new directory to export into")
    m = version_manifest(store, tracker, version)
    from ratchet.tasks.prepare import model_dir

    from ratchet.tasks.text import FILE, text_of, weights_of

    model_dir(store, m, remake_here=False)  # dropped weights made again (in a child: this process has no torch)
    store.verify(m)
    w = weights_of(store, m)  # a pair's weights (its text is written beside them)
    store.verify(w)
    links = walk(store, m)
    annotate(links, tracker)
    from ratchet.tasks.prepare import SERVED_FILE as SERVED

    served = SERVED in w.outputs  # a served policy: its text and where it is served, not weights
    files = sorted(k for k in w.outputs if k.startswith("model/") or k == SERVED)
    if not files:
        raise RatchetError(f"{tracker.model_name} version {version} ({w.dir}) has no model/ files to export")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k in files:
        dst = tmp / k.removeprefix("model/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(store.path(w, k), dst)
    text = text_of(store, m)
    if text is not None:
        shutil.copyfile(store.path(m, FILE), tmp / FILE)
    tags = tracker.version(version).tags
    acc = {k.removeprefix("ratchet.accuracy."): v for k, v in tags.items() if k.startswith("ratchet.accuracy.")}
    card = [f"# {tracker.model_name} version {version}", "",
            f"Exported from a Ratchet run: round {m.round}, stage `{m.dir}` (content {m.content[:16]}), "
            f"MLflow `models:/{tracker.model_name}/{version}`.", "",
            "Held-out accuracy: " + (", ".join(f"{float(v):.1%} on eval set {k}" for k, v in sorted(acc.items()))
                                     or "not recorded") + ".", "",
            *(["Load it with `transformers.AutoModelForCausalLM.from_pretrained(\"<this dir>\")` or "
               "`vllm.LLM(model=\"<this dir>\")`.", ""] if not served else
              [f"Its weights are not here: the policy is the model served as {_served(store, w)} ({SERVED}). What "
               "this version holds is its text, which a prompt search improved over the served model.", ""]),
            *([f"It was evaluated with each task prompt put into its text ({FILE}, `text.template`; `{{prompt}}` is "
               "where the prompt goes): give it its prompts the same way.", "", "```", text.template, "```", ""]
              if text is not None and not text.beliefs else []),
            *([f"It was evaluated with each role of its roles rollout given its beliefs ({FILE}, `text.beliefs`) "
               "before its instructions: give them the same way.", "", "```", text.shown(), "```", ""]
              if text is not None and text.beliefs else []),
            "## Lineage (each link re-verified against its digests when exported)", "", "```",
            render_text(links), "```", ""]
    (tmp / "README.md").write_text("\n".join(card))
    if out.exists():
        out.rmdir()
    tmp.replace(out)
    return out
