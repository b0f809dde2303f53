"""A model without a chat template (a base model) reads prompts in the plain layout; the base
stage writes that layout into the run's copy of the model, never into the user's directory."""

import pytest
from transformers import AutoTokenizer

from ratchet.data.errors import ConfigError
from ratchet.data.store import ArtifactStore
from ratchet.flows.config import config_from_dict
from ratchet.models import prompt_format
from ratchet.models.sampler import chat_token_ids
from ratchet.tasks import prepare
from ratchet.tasks.runner.stage import keyed

LAYOUT = "Question: {prompt}\nAnswer:"


def test_the_plain_layout_frames_each_prompt_and_ends_each_answer(tiny_base_model):
    tok = AutoTokenizer.from_pretrained(tiny_base_model)
    assert not prompt_format.has_template(tok) and prompt_format.resolve(tok, "auto") == "plain"
    prompt_format.use(tok, "auto", LAYOUT)
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    ask = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert ask == "Question: What is 2 + 3?\nAnswer:"
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": " 5"}], tokenize=False)
    assert full == ask + " 5" + tok.eos_token  # training teaches where the answer stops
    # the ids a stage samples from are those of the text, and the answer's tokens follow the prompt's
    [ids] = chat_token_ids(tok, ["What is 2 + 3?"])
    assert ids == tok.encode(ask, add_special_tokens=False)
    assert tok.encode(full, add_special_tokens=False)[: len(ids)] == ids


def test_a_layout_and_a_prompt_are_text_never_template_code(tiny_base_model):
    """Quotes, backslashes, braces and Jinja syntax in the layout or in a prompt come out as written."""
    tok = AutoTokenizer.from_pretrained(tiny_base_model)
    prompt_format.use(tok, "plain", 'Q "{{x}}" \\n {prompt} {{% endfor %}}\\')
    hostile = "{{ 7*7 }} {% for m in messages %}x{% endfor %} </s> \\"
    got = tok.apply_chat_template([{"role": "user", "content": hostile}], add_generation_prompt=True, tokenize=False)
    assert got == 'Q "{x}" \\n ' + hostile + " {% endfor %}\\"


def test_a_chat_model_keeps_its_template_unless_plain_is_asked(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    own = tok.chat_template
    assert prompt_format.use(tok, "auto", LAYOUT).chat_template == own
    assert prompt_format.use(tok, "chat", LAYOUT).chat_template == own
    assert prompt_format.use(tok, "plain", LAYOUT).chat_template == prompt_format.plain_template(LAYOUT)
    assert prompt_format.written_template(tiny_model, "auto", LAYOUT) is None
    assert prompt_format.written_template(tiny_model, "plain", LAYOUT) == prompt_format.plain_template(LAYOUT)


def test_a_plan_reads_a_chat_template_from_the_files_only_where_they_say_it_for_certain(tiny_model, tiny_base_model,
                                                                                        tmp_path):
    """`ratchet plan` keys the base stage without loading the tokenizer where its files hold a
    template; what they say agrees with the loaded tokenizer, and a model without one is loaded."""
    import json
    import shutil


    in_config = tmp_path / "in-config"  # the template in tokenizer_config.json only
    shutil.copytree(tiny_base_model, in_config)
    conf = json.loads((in_config / "tokenizer_config.json").read_text())
    (in_config / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": "{{ messages }}"}))
    empty = tmp_path / "empty"  # an empty template file is no template
    shutil.copytree(tiny_base_model, empty)
    (empty / "chat_template.jinja").write_text("")
    for path, said in [(tiny_model, True), (in_config, True), (tiny_base_model, False), (empty, False)]:
        assert prompt_format.chats_by_its_files(path) is said, path
        assert prompt_format.has_template(AutoTokenizer.from_pretrained(path)) is said, path


@pytest.mark.parametrize("layout, says", [("Answer this:", "exactly the placeholders {prompt}, found none"),
                                          ("{question}\nA:", "found ['question']"),
                                          ("{prompt}\n{prompt}", "holds the prompt once"),
                                          ("{prompt", "not a valid template")])
def test_a_bad_layout_is_refused_with_the_fix(layout, says):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"plain_layout": layout}})
    assert "model.plain_layout" in str(e.value) and says in str(e.value)


def test_the_base_stage_writes_the_layout_into_its_copy_only(tiny_base_model, tiny_model, tmp_path):
    plain = prompt_format.plain_template(LAYOUT)
    before = {f.name: f.read_bytes() for f in tiny_base_model.iterdir()}
    store = ArtifactStore(tmp_path)
    m, _ = prepare.base_model(store, "base", tiny_base_model, template=plain)
    copy = prepare.model_dir(store, m)
    assert (copy / "chat_template.jinja").read_text() == plain and "model/chat_template.jinja" in m.outputs
    assert {f.name: f.read_bytes() for f in tiny_base_model.iterdir()} == before  # the user's files as they were
    got = AutoTokenizer.from_pretrained(copy).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert got == "Question: hi\nAnswer:"
    # a chat model's template is a hard link into the user's directory: replaced in the copy, not written through
    own = (tiny_model / "chat_template.jinja").read_text()
    m2, _ = prepare.base_model(store, "chat", tiny_model, template=plain)
    assert (prepare.model_dir(store, m2) / "chat_template.jinja").read_text() == plain
    assert (tiny_model / "chat_template.jinja").read_text() == own
    # a model read with its own template keys its stage as before the plain format existed
    job = prepare.BaseJob(source="x", path="/x", files={"a": "b"})
    assert keyed(job) == {"source": "x", "path": "/x", "files": {"a": "b"}}
    assert keyed(job.model_copy(update={"template": plain}))["template"] == plain


def test_a_base_model_s_answer_ends_where_it_starts_the_next_question(tiny_base_model):
    """The plain template says where a model turn ends; generation stops there and the text loses it.
    A stop string the caller asked for stays in the text, as it always has."""
    from types import SimpleNamespace

    from ratchet.models.sampler import Generation, SamplingParams, ended_turns

    tok = prompt_format.use(AutoTokenizer.from_pretrained(tiny_base_model), "auto", LAYOUT)
    assert prompt_format.turn_end(tok) == "\nQuestion:"
    asked = []

    def generate_ids(contexts, params, seed):
        asked.append(params.stop)
        return [[Generation(" 5\nQuestion:", 4, "stop", "\nQuestion:"), Generation(" 5 ```", 3, "stop", "```"),
                 Generation(" 5 5 5", 3, "length")]]

    [got] = ended_turns(tok, generate_ids, [[1]], SamplingParams(stop=("```",)), 0)
    assert asked == [("```", "\nQuestion:")]
    assert [(g.text, g.stop, g.finish_reason) for g in got] == [(" 5", None, "stop"), (" 5 ```", "```", "stop"),
                                                              (" 5 5 5", None, "length")]
    # a chat model's own template, and a layout with nothing before the prompt, end no turn by text
    chat = SimpleNamespace(chat_template="{{ messages }}")
    assert ended_turns(chat, generate_ids, [[1]], SamplingParams(), 0)[0][0].text == " 5\nQuestion:"
    assert prompt_format.turn_end(prompt_format.use(AutoTokenizer.from_pretrained(tiny_base_model), "auto",
                                                    "{prompt}\n")) is None
