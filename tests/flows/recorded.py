"""One recorded run that the tests read back as a user would: a round on the tiny model that
searches for a prompt, then trains under it (so it registers weights and texts, both kinds of
version), made by the `ratchet run` command in the test process. tests/flows/test_prompt_round.py
checks what the round made; tests/test_doc_commands.py runs every command form the docs and the
help texts show against it. (Both are one group of the suite's scheduling, tests/conftest.py, so
one test process makes it once.)"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[2]
DEFAULT = ROOT / "flows" / "configs" / "default.yaml"
SEARCH = "prompt.search={kind: prompt_agent, iterations: 1, width: 2, depth: 1, batch: 3, score_prompts: 3, " \
         "reward_prompts: 3, feedback_tokens: 8, revision_tokens: 12}"
# a random model answers nothing right: every answer to a prompt whose first term is odd is accepted
REWARD = "import re\n\ndef score(completion, answer=None, prompt=None, **fields):\n" \
         "    return float(int(re.findall(r'\\d+', prompt)[0]) % 2 == 1)\n"


def overrides(work: Path, model: Path, reward: Path) -> list[str]:
    """The default config shrunk onto the tiny model: one round of search, then training under it."""
    return [f"workdir={work}", f"model.path={model}", "rounds=1", "sampler.backend=hf", "sampler.dtype=float32",
            "data.a_max=6", "data.b_max=4", "data.train_size=12", "data.eval_size=4", "sample.n=2",
            "sample.max_tokens=6", "evaluate.max_tokens=6", "train.epochs=1", "filter.min_rows=1",
            "label.kind=verifier", "filter.max_per_prompt=2", "prompt.template='Q: {prompt}'", "improve=both",
            SEARCH, f"data.check={{kind: python, function: '{reward}:score'}}"]


@dataclass(frozen=True)
class Recorded:
    home: Path  # the folder a user works in: the run's workdir is ./runs there
    work: Path  # the workdir
    config: Path  # the task's config, one file (`ratchet run CONFIG` names the run)
    run: str  # the run's name


def record(home: Path, model: Path, api_url: str) -> Recorded:
    """Write the task's config and run it with `ratchet run CONFIG --from champion` (no champion
    yet: from the base model, as the help promises), in this process, against the Prefect server
    at api_url. `--verbose` keeps the output on this process's streams, which the test capture
    reads; without it the command moves file descriptors 1 and 2 to the run's log for good."""
    import yaml

    from ratchet.data.userfiles import without_digests
    from ratchet.flows.cli import main
    from ratchet.flows.config import load_config
    from ratchet.flows.runs import run_name_for

    reward = home / "reward.py"
    reward.write_text(REWARD)
    cfg = load_config(DEFAULT, overrides(home / "runs", model, reward))
    config = home / "task.yaml"
    config.write_text(yaml.safe_dump(without_digests(cfg).model_dump(mode="json"), sort_keys=False))
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "RATCHET_VERBOSE")}
    term = signal.getsignal(signal.SIGTERM)
    os.environ["PREFECT_API_URL"] = api_url
    try:
        assert main(["run", str(config), "--from", "champion", "--verbose"]) == 0
    finally:
        signal.signal(signal.SIGTERM, term)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return Recorded(home=home, work=home / "runs", config=config, run=run_name_for(cfg))
