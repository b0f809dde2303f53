"""How a prompt becomes the model's input: its chat template, or a plain layout for a model
without one (a base model).

    model:
      path: ./my-base-model        # no chat template in its tokenizer
      prompt_format: auto          # chat where the tokenizer has a template, else plain
      plain_layout: "Question: {prompt}\\nAnswer:"

Every stage reads prompts through `tokenizer.apply_chat_template` (the sampler, the judge,
TRL's trainers). So the plain format is a chat template too: the base stage writes it into
the run's copy of the model (`chat_template.jinja`, which transformers reads before any
template in tokenizer_config.json), and every stage after it, trained rounds included, reads
the same layout. The user's own directory is never written.

The plain layout puts each user turn in `plain_layout` and ends each model turn with the
end-of-sequence token, so training teaches a base model where its answer stops.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal
from ratchet.data.procs.entry import entry

PromptFormat = Literal["auto", "chat", "plain"]
TEMPLATE_FILE = "chat_template.jinja"


def plain_template(layout: str) -> str:
    """The chat template of a plain layout ("... {prompt} ..."): each user (or system) turn is
    the layout around its text; each model turn is its text and the end-of-sequence token.

    A base model has not learned to stop: it answers, then writes the next question itself. So
    the template also carries, in a comment, where a model turn ends in this layout (a new line
    and the layout's text before the prompt, e.g. "\\nQuestion:"); the samplers stop there and
    cut it off (`turn_end`)."""
    before, after = layout.format(prompt="\0").split("\0", 1)  # literal braces written {{ }}
    lit = lambda s: json.dumps(s)  # noqa: E731  a JSON string is a Jinja string literal
    end = "\n" + before.strip() if before.strip() else ""
    return (f"{{#- {_END}{end.encode().hex()} -#}}"
            "{%- for message in messages -%}"
            "{%- if message['role'] == 'assistant' -%}{{ message['content'] }}{{ eos_token }}"
            f"{{%- else -%}}{{{{ {lit(before)} }}}}{{{{ message['content'] }}}}{{{{ {lit(after)} }}}}"
            "{%- endif -%}{%- endfor -%}")


_END = "ratchet-turn-end:"


def turn_end(tokenizer) -> str | None:
    """Where a model turn ends in the plain layout the tokenizer's template was written from (None:
    a model's own chat template, or a layout with no text before the prompt)."""
    m = re.search(_END + "([0-9a-f]*)", getattr(tokenizer, "chat_template", None) or "")
    return bytes.fromhex(m.group(1)).decode() or None if m else None


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve(tokenizer, fmt: PromptFormat) -> Literal["chat", "plain"]:
    """The format a run uses: `chat` and `plain` as given, `auto` by whether the tokenizer has a
    chat template."""
    if fmt == "auto":
        return "chat" if has_template(tokenizer) else "plain"
    return fmt


def problems(tokenizer, fmt: PromptFormat, field: str, path: Path) -> list[str]:
    """What keeps `fmt` from working with this tokenizer, in the config's words."""
    if fmt == "chat" and not has_template(tokenizer):
        return [f"{field}.prompt_format='chat': the tokenizer at {path} has no chat template (a base model); "
                f"use prompt_format: plain (or auto), or give a model whose tokenizer_config.json or "
                f"{TEMPLATE_FILE} has one"]
    return []


def use(tokenizer, fmt: PromptFormat, layout: str):
    """The tokenizer, reading prompts as the run will (the plain template set where `fmt` resolves
    to plain)."""
    if resolve(tokenizer, fmt) == "plain":
        tokenizer.chat_template = plain_template(layout)
    return tokenizer


def example(tokenizer, prompt: str) -> str:
    """What the model reads for one prompt, up to where its answer begins."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


@entry
def written_template(model_dir: Path, fmt: PromptFormat, layout: str) -> str | None:
    """The template the base stage writes into its copy of the model: the plain one where `fmt`
    resolves to plain, else None (the model's own chat template stands)."""
    if fmt == "chat":
        return None
    if fmt == "auto":
        from ratchet.models import tokenizer

        if has_template(tokenizer.load(model_dir)):
            return None
    return plain_template(layout)


def chats_by_its_files(path: Path) -> bool:
    """Whether the tokenizer in `path` has a chat template, where its files say so for certain:
    transformers reads a non-empty chat_template.jinja, or tokenizer_config.json's chat_template,
    into the loaded tokenizer's. False is "load it to know" (a template may come from elsewhere),
    which takes a process importing transformers: about 6 s on 2 cores."""

    jinja = path / "chat_template.jinja"
    if jinja.is_file() and jinja.stat().st_size:
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
