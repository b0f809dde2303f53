"""The text a policy puts around each task prompt: the second half of a model version.

A version is a pair, weights and text. The text is a template with one `{prompt}` slot (an
instruction, worked examples, the task's prompt where the slot is); every other character is
literal, so text an optimiser writes cannot break it with a brace. Version 1 is the config's
`prompt.template`; a prompt search (tasks/searches/prompt_agent.py) writes the next.

A policy in a run is a stage manifest: a model stage (role `model`: base, train) alone reads each prompt as
it is; a text stage (role `text`) is a pair, its prompt.json holding the template and the
content digest of its weights, so a stage that keys on the pair keys on both:

    template   the config's template over a model's weights (round 0), or a pair's text carried
               onto the weights a round trained under it
    search     the prompt a search chose, over the weights it searched with

`weights_of` walks a pair to its weights; `text_of` reads its text; every stage that runs the
policy on task prompts (sample, evaluate, an online train stage, a search label, the cold
start) reads them through `render`.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.errors import ArtifactError
from ratchet.data.manifest import StageManifest, read_manifest
from ratchet.data.records import Prompt
from ratchet.data.store import ArtifactStore
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest

SLOT = "{prompt}"
FILE = "prompt.json"


def slot_problem(template: str) -> str | None:
    """What keeps `template` from being a prompt's text (None: nothing), and the fix."""
    n = template.count(SLOT)
    if n == 1:
        return None
    return ("has no {prompt}" if n == 0 else f"has {n} {{prompt}} slots") + (
        "; write {prompt} once, where the task's prompt goes (every other character is literal)")


class PromptText(BaseModel):
    """A version's text: the template each task prompt is put into."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    template: str = Field(default=SLOT, description="the text around each task prompt, with {prompt} once where "
                          "it goes")
    beliefs: dict[str, str] = Field(default_factory=dict, description="a roles rollout's (tasks/rollouts/roles.py) "
                                    "beliefs, by role: what each agent has learned, given with its instructions")

    def render(self, prompt: str) -> str:
        return self.template.replace(SLOT, prompt, 1)

    @property
    def identity(self) -> bool:
        return self.template == SLOT and not self.beliefs

    def dump(self) -> dict:
        """As prompt.json holds it: a text without beliefs keeps the bytes it had before roles had any."""
        return self.model_dump(mode="json", exclude_defaults=True) | {"template": self.template}

    def shown(self) -> str:
        """The text as a person reads it (the registry's copy, an export's card): the template, and
        each role's beliefs after it."""
        return self.template + "".join(f"\n\n[beliefs of {role}]\n{b}" for role, b in sorted(self.beliefs.items()))


def weights_of(store: ArtifactStore, policy: StageManifest) -> StageManifest:
    """The model stage holding a policy's weights: itself, or a pair's weights."""
    seen = 0
    while policy.role == "text":
        ref = (next((p for p in policy.parents if p.role == "model"), None)
               or next((p for p in policy.parents if p.role == "text"), None))
        found = read_manifest(store.root / ref.dir) if ref is not None else None
        if found is None or (seen := seen + 1) > 64:
            raise ArtifactError(f"{store.dir_of(policy)}: the weights of this {policy.stage} stage "
                                f"({ref.dir if ref else 'none recorded'}) are gone; run the stage again")
        policy = found
    return policy


def text_of(store: ArtifactStore, policy: StageManifest) -> PromptText | None:
    """A policy's text; None for a model alone (each prompt as it is)."""
    if policy.role != "text":
        return None
    return PromptText.model_validate(json.loads(store.path(policy, FILE).read_text())["text"])


def render(prompts: list[Prompt], text: PromptText | None) -> list[Prompt]:
    """The prompts as the policy reads them: each put into its text (as they are without one)."""
    if text is None or text.template == SLOT:
        return prompts
    return [p.model_copy(update={"prompt": text.render(p.prompt)}) for p in prompts]


def policy_of(req: StageRequest) -> StageManifest | None:
    """The policy a stage's request runs: its model or pair parent (None: it has none)."""
    return next((p for p in req.parents if p.role in ("model", "text")), None)


def read_text(req: StageRequest, store: ArtifactStore) -> PromptText | None:
    """The text of the policy a stage runs (None: a model alone)."""
    policy = policy_of(req)
    return text_of(store, policy) if policy is not None else None


def write_pair(req: StageRequest, store: ArtifactStore, text: PromptText, weights: StageManifest,
               metrics: dict[str, float] | None = None, info: dict | None = None,
               outputs: dict[str, int | None] | None = None) -> StageManifest:
    """Finish a text stage: its prompt.json (the text, and the digest and stage of its weights,
    so a stage keyed on the pair is keyed on both) and its manifest."""
    d = store.stage_dir(req.stage, req.key)
    (d / FILE).write_text(json.dumps({"text": text.dump(), "weights": weights.content,
                                      "weights_stage": weights.dir}, indent=2) + "\n")
    return req.finish(store, outputs={FILE: None, **(outputs or {})}, metrics=metrics or {},
                      info={"template": text.template, **({"beliefs": text.beliefs} if text.beliefs else {}),
                            **(info or {})})


# the template stage ------------------------------------------------------------------------

class TextJob(BaseModel):
    """A `template` stage: the config's template (version 1) over a model's weights, or, unset,
    the text of its pair parent carried onto the new weights a round trained under it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    template: str | None = None


def template_body(req: StageRequest[TextJob], store: ArtifactStore) -> StageManifest:
    weights = next(p for p in req.parents if p.role == "model")
    if req.config.template is not None:
        text = PromptText(template=req.config.template)
    else:
        text = text_of(store, next(p for p in req.parents if p.role == "text"))
    return write_pair(req, store, text, weights_of(store, weights))


def pair_text(store: ArtifactStore, weights: StageManifest, round: int, *, template: str | None = None,
         carried: StageManifest | None = None, run: str | None = None) -> Made:
    """The pair of `weights` and a text: the config's `template`, or the text of `carried` (a pair
    whose text the round trained under)."""
    if (template is None) == (carried is None):
        raise TypeError("pair_text: give a template or the pair whose text is carried, not both")
    parents = [weights] if carried is None else [weights, carried]
    return STAGE.run(store, round=round, config=TextJob(template=template), parents=parents, run=run)


def pair_text_step(at: At, k: int, weights: StageManifest, carried: StageManifest | None = None) -> Made:
    """The pair of `weights` and a text: the config's prompt.template (version 1, `carried` None),
    or the text of `carried`, the pair whose text round k trained under."""
    template = at.cfg.prompt.template if carried is None else None
    return pair_text(at.store, weights, k, template=template, carried=carried, run=at.run)


STAGE = Stage("template", "text", template_body, pair_text_step, Records())
