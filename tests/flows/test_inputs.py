"""User data is checked before anything is loaded or written, and every input is in the key."""

import os
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows.config import config_from_dict
from ratchet.flows.inputs import attention_line, check_inputs, devices_line
from ratchet.models.sampler import vllm_cpu_version

ROOT = Path(__file__).parents[2]
GOOD = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(6)]
HELD = [{"prompt": "What is 50 + 1?", "answer": 51}]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _cfg(tmp_path, rows, eval_rows=HELD, data_check=None, **sections):
    data = {"kind": "file", "path": _write(tmp_path / "train.jsonl", rows),
            "eval_path": _write(tmp_path / "eval.jsonl", eval_rows), **({"check": data_check} if data_check else {})}
    sections["filter"] = few(sections.get("filter"))
    return config_from_dict({"workdir": str(tmp_path / "w"), "data": data, **sections})


def few(section: dict | None = None) -> dict:
    """A filter section whose minimum a handful of prompts can reach (ratchet check refuses one
    no round can: these tests are about other checks)."""
    section = dict(section or {"kind": "rft"})
    section.setdefault("min_pairs" if section["kind"] == "pairs" else "min_rows", 1)
    return section


def test_a_data_path_that_is_no_regular_file_is_named_as_what_it_is(tmp_path):
    """A named pipe or a device as data.path is no missing file: it is named as what it is, with the fix."""
    import os

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    for path, what in ((str(fifo), "is a named pipe (FIFO)"), ("/dev/zero", "is a character device")):
        cfg = config_from_dict({"workdir": str(tmp_path / "w"), "data": {"kind": "file", "path": path,
                                                                          "eval_path": _write(tmp_path / "e.jsonl", HELD)}})
        with pytest.raises(ConfigError) as e:
            check_inputs(cfg)
        text = "\n".join(e.value.problems)
        assert "not a regular file" in text and what in text and "does not exist" not in text, text
        assert "set data.path to a regular file" in text


RESET_NUMBER = """
class Env:
    def reset(self, seed, **row):
        return 42

    def step(self, action):
        return "done", 1.0, True
"""


def test_an_environment_whose_first_episode_fails_fails_the_check(tmp_path):
    """Its reset returns a number: the check plays the first start's opening, as a stage will, and
    refuses the run with the environment's own words, before any model loads."""
    env = tmp_path / "env.py"
    env.write_text(RESET_NUMBER)
    cfg = config_from_dict({"workdir": str(tmp_path / "w"), "data": {"kind": "episodes", "train_size": 2,
                                                                      "eval_size": 1}, "filter": few(),
                            "sample": {"max_tokens": 16, "rollout": {"kind": "environment", "env": f"{env}:Env",
                                                                     "episode_tokens": 64}}})
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    [problem] = e.value.problems
    assert "its first episode could not start (start " in problem
    assert "reset's observation is int 42" in problem and "return the observation as text" in problem
    env.write_text(RESET_NUMBER.replace("return 42", "return 'start'"))
    check_inputs(config_from_dict(cfg.model_dump(mode="json") | {"sample": {
        "max_tokens": 16, "rollout": {"kind": "environment", "env": f"{env}:Env", "episode_tokens": 64}}}))


def test_prompts_too_long_for_a_stage_are_named_with_the_budget(tmp_path, default_model):
    long = {"prompt": "Add these up: " + " + ".join(["1"] * 300) + "?", "answer": 300}
    cfg = _cfg(tmp_path, [*GOOD, long], [*HELD, long | {"prompt": long["prompt"] + " Now."}],
               train={"max_length": 512})
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, default_model)
    train = next(p for p in e.value.problems if "train prompts too long for sampling" in p)
    assert train.startswith(f"{tmp_path / 'train.jsonl'}: train prompts too long for sampling (1): line 7: ")
    assert "> 512. Fix: shorten or drop these rows, or raise sampler.max_model_len or lower sample.max_tokens" in train
    training = next(p for p in e.value.problems if "too long for training" in p)
    assert "(1): line 7:" in training and "raise train.max_length" in training
    ev = next(p for p in e.value.problems if "eval prompts too long for evaluation" in p)
    assert ev.startswith(f"{tmp_path / 'eval.jsonl'}: eval prompts too long for evaluation (1): line 2: ")
    # the same rows fit a context that holds them
    split = check_inputs(cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"max_model_len": 2048}),
                                                "train": cfg.train.model_copy(update={"max_length": 2048})}),
                         default_model)
    assert len(split.train) == 7


def test_the_judge_budget_counts_its_template_and_the_response(tmp_path, default_model):
    prompt = {"prompt": "Add these up: " + " + ".join(["1"] * 150) + "?", "answer": 150}
    cfg = _cfg(tmp_path, [*GOOD, prompt], label={"kind": "judge", "mode": "rating"},
               filter={"kind": "pairs"}, train={"kind": "dpo"})
    with pytest.raises(ConfigError, match=r"train prompts too long for the judge \(1\): line 7: "):
        check_inputs(cfg, default_model)  # ~300 prompt tokens fit sampling, not the ~350-token rubric around them


def test_a_users_function_must_take_the_columns_its_rows_carry(tmp_path, default_model):
    (tmp_path / "rewards.py").write_text("def score(completion, answer=None, prompt=None):\n    return 1.0\n"
                                         "def fine(completion, answer=None, prompt=None, unit=None):\n    return 1.0\n")
    rows = [{**r, "unit": "cm"} for r in GOOD]
    check = {"kind": "python", "function": f"{tmp_path / 'rewards.py'}:score"}
    with pytest.raises(ConfigError, match=r"cannot take a row's fields by name .*\['unit'\] come by name too"):
        check_inputs(_cfg(tmp_path, rows, [{**HELD[0], "unit": "m"}], data_check=check), default_model)
    split = check_inputs(_cfg(tmp_path, rows, [{**HELD[0], "unit": "m"}],
                              data_check={**check, "function": check["function"][:-5] + "fine"}), default_model)
    assert split.eval[0].fields == {"unit": "m"}


def test_a_policy_that_is_no_model_or_lacks_the_lora_targets_is_named(tmp_path, default_model):
    """Checked before any weights load: a model directory that holds no model (a stage would fail
    in the tokenizer's or the engine's words), and LoRA target modules the model does not have
    (PEFT would refuse them only when round 1 trains)."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"lacks weights \(\*.safetensors or \*.bin\), a tokenizer"):
        check_inputs(_cfg(tmp_path, GOOD), empty)
    cfg = _cfg(tmp_path, GOOD, train={"lora": {"target_modules": ["q_proj", "qkv_proj"]}})
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, default_model)
    [problem] = e.value.problems
    assert "['qkv_proj'] match no module" in problem and "'v_proj'" in problem and "'all-linear'" in problem
    with pytest.raises(ConfigError, match=r"\['\.\*attn.*qkv'\] match no module"):
        check_inputs(_cfg(tmp_path, GOOD, train={"lora": {"target_modules": r".*attn\.qkv"}}), default_model)
    for fine in (["q_proj", "v_proj"], r".*self_attn\.(q|v)_proj", "all-linear"):
        check_inputs(_cfg(tmp_path, GOOD, train={"lora": {"target_modules": fine}}), default_model)
    # full fine-tuning adapts no modules by name
    check_inputs(_cfg(tmp_path, GOOD, train={"adapter": "full", "lora": {"target_modules": ["nope"]}}), default_model)


def test_a_fixed_judge_is_measured_with_its_own_tokenizer(tmp_path, default_model):
    import shutil

    judge = tmp_path / "judge"  # the default's tokenizer, its chat template led by a long system text
    judge.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model / name, judge / name)
    (judge / "chat_template.jinja").write_text("{{ '" + "Judge with care. " * 120 + "' }}"
                                               + (default_model / "chat_template.jinja").read_text())
    sections = dict(filter={"kind": "pairs"}, train={"kind": "dpo"})
    label = {"kind": "judge", "mode": "rating"}
    assert len(check_inputs(_cfg(tmp_path, GOOD, label=label, **sections), default_model).train) == 6
    with pytest.raises(ConfigError, match=r"train prompts too long for the judge \(6\): line 1: "):
        check_inputs(_cfg(tmp_path, GOOD, label={**label, "model": str(judge)}, **sections), default_model)


def test_a_base_model_is_read_in_the_plain_format_and_every_model_problem_is_named(tmp_path, tiny_base_model,
                                                                                   capsys):
    """A model without a chat template checks clean in the plain format, and `ratchet check` shows what
    the model reads; asking for its chat template, a model that is no causal LM and a tokenizer that does
    not load are each named with the field, the value and the fix, before any weights load."""
    import shutil
    from types import SimpleNamespace

    from ratchet.flows.cli import cmd_check

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"workdir: {tmp_path / 'w'}\nfilter: {{kind: rft, min_rows: 1}}\nmodel:\n  path: {tiny_base_model}\n"
                   "data:\n  kind: file\n  path: "
                   f"{_write(tmp_path / 'train.jsonl', GOOD)}\n  eval_path: {_write(tmp_path / 'eval.jsonl', HELD)}\n")
    hf = ["sampler.backend=hf"]  # the tiny model's heads (16 dimensions) are too small for vLLM's CPU attention
    if vllm_cpu_version() is not None:
        with pytest.raises(ConfigError) as e:  # refused before any weights load, with the fix
            cmd_check(SimpleNamespace(config=str(cfg), overrides=[]))
        [problem] = e.value.problems
        assert problem.startswith(f"model.path='{tiny_base_model}': {tiny_base_model} has attention heads of 16 "
                                  "dimensions, which the attention of vLLM's CPU build")
        assert problem.endswith("set sampler.backend=hf to sample with transformers, or use a model whose head "
                                "size it runs")
    assert cmd_check(SimpleNamespace(config=str(cfg), overrides=hf)) == 0
    out = capsys.readouterr().out
    assert (f"model: {tiny_base_model}; prompt format: plain (auto: the model has no chat template: a base model); "
            "model.plain_layout='Question: {prompt}\\nAnswer:'; an answer ends at the end-of-sequence token or at "
            "'\\nQuestion:'\n  the model reads: 'Question: What is 0 + 1?\\nAnswer:'"
            ) in out
    import torch

    on_cpu = "devices: no GPU visible: sampling and training run on the CPU\ndtype: "
    assert (on_cpu in out) if not torch.cuda.is_available() else ("\ndevices: GPU" in out)
    cmd_check(SimpleNamespace(config=str(cfg), overrides=["model.plain_layout={prompt} =", *hf]))
    assert "the model reads: 'What is 0 + 1? ='" in capsys.readouterr().out

    model = {"path": str(tiny_base_model), "prompt_format": "chat"}
    with pytest.raises(ConfigError) as e:
        check_inputs(_cfg(tmp_path, GOOD, model=model, sampler={"backend": "hf"}))
    [problem] = e.value.problems
    assert problem.startswith(f"model.prompt_format='chat': the tokenizer at {tiny_base_model} has no chat template")
    assert "use prompt_format: plain (or auto)" in problem

    bert = tmp_path / "bert"
    shutil.copytree(tiny_base_model, bert)
    (bert / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    with pytest.raises(ConfigError, match=r"holds a 'bert' model \(BertForMaskedLM\), not a causal language model; "):
        check_inputs(_cfg(tmp_path, GOOD, model={"path": str(bert)}))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_base_model, broken)
    (broken / "tokenizer.json").write_text('{"model": {"type": "nothing-known"}}')
    with pytest.raises(ConfigError, match=rf"model.path='{broken}': the tokenizer at {broken} does not load \("):
        check_inputs(_cfg(tmp_path, GOOD, model={"path": str(broken)}, sampler={"backend": "hf"}))


def test_what_the_machines_gpus_cannot_give_is_refused_before_any_model_is_read(tmp_path, monkeypatch):
    """Each training process takes one GPU and each local engine holder its own: asking for more
    than the visible devices (given here as a scheduler gives them) is named with the fix before
    the model is read (the model path here is no model); without GPUs, processes split the cores."""
    sections = dict(model={"path": str(tmp_path / "no-model")}, train={"num_processes": 2},
                    executor={"engines": 3, "gpus_per_engine": 1})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(ConfigError) as e:
        check_inputs(_cfg(tmp_path, GOOD, **sections))
    assert e.value.problems == [
        "executor.engines=3 with executor.gpus_per_engine=1 needs 3 GPUs, and this machine shows 1 (5); lower "
        "executor.engines or gpus_per_engine",
        "train.num_processes=2: training runs one process per GPU, and this machine shows 1 (5); set "
        "train.num_processes=1 or fewer, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"]
    model_only = r"^1 problem\(s\) in config:\n  - model.path=.*is not a local directory"
    # what `ratchet check` says of them: who takes which GPU, and the setting that uses idle ones
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert devices_line(_cfg(tmp_path, GOOD, executor={"engines": 2})) == (
        "devices: GPUs 4,5,6,7 visible; 2 engine holders, on 4,5 | 6,7; training in 1 process on GPU 4 (3 idle: "
        "train.num_processes=4 trains on all, one process each)")
    assert devices_line(_cfg(tmp_path, GOOD, train={"num_processes": 4})) == (
        "devices: GPUs 4,5,6,7 visible; sampling on the run's one engine, on GPU 4 (executor.engines=4 samples on "
        "all); training in 4 processes on GPUs 4,5,6,7")
    # where training is left to attention: auto and its rows may be long, check names sdpa on a CPU only
    long = _cfg(tmp_path, GOOD, train={"max_length": 964})
    assert attention_line(long) is None  # GPUs visible (auto is sdpa there)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert attention_line(long) == (
        "attention: eager for training (auto, on a CPU) with rows of up to train.max_length=964: for rows of a few "
        "hundred tokens or more sdpa trains faster and holds less memory; set train.attention=sdpa")
    assert attention_line(_cfg(tmp_path, GOOD, train={"max_length": 964, "attention": "sdpa"})) is None
    assert attention_line(_cfg(tmp_path, GOOD)) is None  # the default rows, 256 tokens at most
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    # online training in several processes has run on CPU only: refused where GPUs are visible
    with pytest.raises(ConfigError) as e:
        check_inputs(_cfg(tmp_path, GOOD, train={"kind": "grpo", "num_processes": 2}, sample={"top_k": 0}))
    assert e.value.problems == [
        "train.num_processes=2 with train.kind=grpo: online training in several processes opens an engine in each, "
        "and has run on CPU only (gloo); placing each engine on its own process's GPU is not built: set "
        "train.num_processes: 1 on a machine with GPUs"]
    for enough in ("5,6,7", ""):  # the devices suffice, or there are none: on to the model
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", enough)
        with pytest.raises(ConfigError, match=model_only):
            check_inputs(_cfg(tmp_path, GOOD, **sections))


def test_bad_data_exits_2_with_one_report_and_writes_nothing(tmp_path):
    rows = [*GOOD, '{"prompt": "What is', {"prompt": None, "answer": 1}, {"id": 3, "prompt": "x", "answer": 1},
            {"id": 3, "prompt": "y", "answer": 2}]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"workdir: {tmp_path / 'w'}\nrounds: 1\ndata:\n  kind: file\n  path: "
                   f"{_write(tmp_path / 'train.jsonl', rows)}\n  eval_path: {_write(tmp_path / 'eval.jsonl', [])}\n")
    r = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "run", str(cfg)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr
    assert "ratchet: error: 4 problem(s) in data:" in err
    assert f"{tmp_path / 'train.jsonl'}: malformed JSON lines (1): line 7: Unterminated string" in err
    assert f"{tmp_path / 'train.jsonl'}: null prompts (1): line 8: None" in err
    assert "duplicate ids (1): '3':" in err and f"{tmp_path / 'eval.jsonl'}: no rows (1)" in err
    assert "Traceback" not in err
    assert not (tmp_path / "w").exists()  # no workdir, no MLflow store, no run record


CHECKED_RUN = """
import json, os, sys
from pathlib import Path
from ratchet.data.errors import ConfigError
from ratchet.flows.config import load_config
from ratchet.flows.inputs import checked_run
from ratchet.flows.launch import imports_meanwhile
from ratchet.data.procs import forkserver

out = {}
cfg = load_config(sys.argv[1])
with checked_run(cfg, imports_meanwhile(Path(cfg.workdir))) as split:
    out["prompts"], out["server"] = len(split.train), forkserver.current() is not None
try:
    for bad in sys.argv[2:]:
        cfg = load_config(bad)
        with checked_run(cfg, imports_meanwhile(Path(cfg.workdir))):
            pass
except ConfigError as e:
    out["error"] = str(e)
out.update({m: m in sys.modules for m in ("torch", "mlflow.store.tracking.sqlalchemy_store", "prefect")})
os.environ["PREFECT_API_URL"] = "http://127.0.0.1:9/api"  # a server of the user's: no temporary one to start
with imports_meanwhile(Path(cfg.workdir)):
    pass
out["served"] = {m: m in sys.modules for m in ("prefect", "prefect.server.api.server")}
print(json.dumps(out))
"""


def test_a_run_checks_its_model_in_a_child_of_its_fork_server_and_imports_no_torch(tmp_path, tiny_model):
    """`ratchet run` checks its data itself, and its model (the directory, the tokenizer, every
    prompt's length) in a child of its fork server, which imports transformers and torch for the
    stages anyway: the run's own process imports neither. A problem found there is raised here,
    as ever, and nothing is written. Meanwhile the run's own process imports what its start needs
    (flows/launch.py imports_meanwhile): MLflow's store, and Prefect only where its home is settled,
    since Prefect's import creates it (here it is not: no PREFECT_HOME, no server, no workdir);
    with a server of the user's, Prefect but not the temporary server's modules."""
    import yaml

    long = {"prompt": "Add these up: " + " + ".join(["1"] * 300) + "?", "answer": 300}
    configs = []
    for name, rows in (("good", GOOD), ("bad", [*GOOD, long])):
        data = {"kind": "file", "path": _write(tmp_path / f"{name}.jsonl", rows),
                "eval_path": _write(tmp_path / "eval.jsonl", HELD)}
        configs.append(tmp_path / f"{name}.yaml")
        configs[-1].write_text(yaml.safe_dump({"workdir": str(tmp_path / "w"), "model": {"path": str(tiny_model)},
                                               "sampler": {"backend": "hf"}, "data": data, "filter": few()}))
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
    r = subprocess.run([sys.executable, "-c", CHECKED_RUN, *map(str, configs)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["prompts"] == 6 and out["server"]
    assert f"{tmp_path / 'bad.jsonl'}: train prompts too long for training (1): line 7:" in out["error"]
    assert out["torch"] is False and out["mlflow.store.tracking.sqlalchemy_store"] and not out["prefect"], out
    assert out["served"] == {"prefect": True, "prefect.server.api.server": False}, out
    assert not (tmp_path / "w").exists()


CHECK = """
import json, sys
from ratchet.flows.cli import main
code = main(["check", *sys.argv[1:]])
print(json.dumps({"code": code, **{m: m in sys.modules for m in ("transformers", "torch")}}))
"""


def test_a_check_that_passed_is_not_made_again_until_what_it_reads_changes(tmp_path, tiny_model):
    """A run's start and `ratchet check` keep a pass of the model's checks by what they read
    (flows/inputs.py model_check_key): after a run's start has checked (in a child of its fork
    server), `ratchet check` of the same inputs answers from the pass, printing the model line the
    run kept, without importing transformers or torch; a model file changed in place with its mtime
    put back is read again (the stat cache goes by its ctime too) and the change refused; `--full`
    (RATCHET_VERIFY=full) keys none."""
    import shutil

    import yaml

    model = shutil.copytree(tiny_model, tmp_path / "model")
    data = {"kind": "file", "path": _write(tmp_path / "train.jsonl", GOOD), "eval_path": _write(tmp_path / "e.jsonl", HELD)}
    config = tmp_path / "good.yaml"
    config.write_text(yaml.safe_dump({"workdir": str(tmp_path / "w"), "model": {"path": str(model)},
                                      "sampler": {"backend": "hf"}, "data": data, "filter": few()}))
    env = {**os.environ, "RATCHET_CACHE": str(tmp_path / "cache")}

    def check(*flags, code=0):
        r = subprocess.run([sys.executable, "-c", CHECK, str(config), *flags], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=env)
        if code:
            return r
        assert r.returncode == 0, r.stderr[-3000:]
        *lines, last = r.stdout.splitlines()
        said = json.loads(last)
        assert said["code"] == 0 and lines[-1] == f"ok: {config} is ready to run", r.stdout
        model_line = next(x for x in lines if x.startswith("model: "))
        return said, model_line, any(x.startswith("model checks: passed before") for x in lines)

    run = subprocess.run([sys.executable, "-c", CHECKED_RUN, str(config)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in env.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")})
    assert run.returncode == 0 and json.loads(run.stdout.splitlines()[-1])["server"], run.stderr[-3000:]
    again, line, kept = check()
    assert kept and not again["transformers"] and not again["torch"], again
    assert line == f"model: {model}; prompt format: chat (auto: the tokenizer's chat template)"
    # the model's config changed in place, its mtime put back: read again (its ctime moved), refused
    st = (model / "config.json").stat()
    (model / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns))
    refused = check(code=2)
    assert json.loads(refused.stdout.splitlines()[-1])["code"] == 2, refused.stdout[-2000:]
    assert "not a causal language model" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "w").exists()
    from ratchet.data.digest import hashing_everything
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import check_data, model_check_key

    cfg = load_config(config)
    split, sets = check_data(cfg)
    assert model_check_key(cfg, split, sets) is not None
    with hashing_everything():  # what `ratchet check --full` sets: no kept pass is looked up
        assert model_check_key(cfg, split, sets) is None


class Poison:
    """A config value no model check may use: any use of it raises."""

    def __getattr__(self, name):
        raise AssertionError(f"a model check read an UNREAD field ({name})")

    def _used(self, *a):
        raise AssertionError("a model check used an UNREAD field")

    __bool__ = __eq__ = __lt__ = __le__ = __gt__ = __ge__ = __int__ = __float__ = __index__ = __str__ = _used
    __format__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __iter__ = __len__ = __contains__ = _used
    __hash__ = None


@pytest.mark.parametrize("config", ["default.yaml", "self_reward_dpo.yaml", "grpo.yaml"])
def test_the_fields_left_out_of_the_model_checks_key_are_read_by_none_of_them(tmp_path, tiny_model, config):
    """model_check_key leaves out the fields no model check reads (UNREAD: where a run writes, its
    rounds, its filter, its training's schedule), so a run that changes only them starts without
    checking its model again. Each of them poisoned, the checks and `ratchet check`'s model line
    still pass: none of them reads one."""
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import UNREAD, UNREAD_TRAIN, check_data, checked_model

    cfg = load_config(ROOT / "flows" / "configs" / config, [f"workdir={tmp_path}", f"model.path={tiny_model}",
                                                            "sampler.backend=hf"])
    split, sets = check_data(cfg)
    poisoned = cfg.model_copy(update={**{f: Poison() for f in UNREAD},
                                      "train": cfg.train.model_copy(update={f: Poison() for f in UNREAD_TRAIN})})
    assert "the model reads" in checked_model(poisoned, split, sets)["model_line"]


@pytest.mark.integration
def test_every_kind_of_input_is_in_the_key_of_the_split_and_its_evaluation(tmp_path, tiny_model, monkeypatch):
    """Edit a JSONL file, a separate eval file, a save_to_disk directory and a dataset named by id:
    each edit gives a new prompts stage and a new evaluation, never a stale reuse."""
    import datasets

    from ratchet.data.prompts import FileSource, load_split
    from ratchet.data.records import Prompt, read_jsonl
    from ratchet.data.store import ArtifactStore
    from ratchet.models.sampler import SamplerConfig
    from ratchet.tasks import evaluate, prepare
    from ratchet.tasks.evaluate import EvaluateConfig

    store = ArtifactStore(tmp_path / "store")
    base, _ = prepare.base_model(store, "tiny", tiny_model)
    hf = SamplerConfig(backend="hf", dtype="float32")

    def split_and_eval(src: FileSource):
        split = load_split(src, seed=0)
        pm, _ = prepare.prompts(store, src, 0, split.digests)
        ev, reused = evaluate.evaluate(store, base, pm, EvaluateConfig(max_tokens=2), hf, src, 0, 0,
                                       isolate=False)
        held = [p.prompt for p in read_jsonl(store.path(pm, "eval.jsonl"), Prompt)]
        return pm.key, ev.key, reused, held

    rows = [{"q": f"What is {i} + 2?", "answer": i + 2} for i in range(6)]
    d = tmp_path / "ds"
    hub = {"rows": rows}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: datasets.Dataset.from_list(hub["rows"]))

    def edit_jsonl():
        _write(tmp_path / "t.jsonl", [{**r, "q": r["q"].replace("?", " ?")} for r in rows])

    def edit_eval():
        _write(tmp_path / "e.jsonl", [{"q": "What is 90 + 1?", "answer": 91}])

    def edit_dir():
        datasets.Dataset.from_list([{**r, "q": r["q"] + "!"} for r in rows]).save_to_disk(str(d))

    def edit_hub():
        hub["rows"] = [{**r, "q": r["q"] + "!"} for r in rows]

    _write(tmp_path / "t.jsonl", rows)
    _write(tmp_path / "e.jsonl", [{"q": "What is 80 + 1?", "answer": 81}])
    datasets.Dataset.from_list(rows).save_to_disk(str(d))
    cases = [
        (FileSource(path=str(tmp_path / "t.jsonl"), prompt_field="q", eval_size=2), edit_jsonl),
        (FileSource(path=str(tmp_path / "t.jsonl"), eval_path=str(tmp_path / "e.jsonl"), prompt_field="q"), edit_eval),
        (FileSource(path=str(d), prompt_field="q", eval_size=2), edit_dir),
        (FileSource(path="someone/arith", prompt_field="q", eval_size=2), edit_hub),
    ]
    for src, edit in cases:
        first = split_and_eval(src)
        assert split_and_eval(src)[2] is True  # unchanged input: the same stage, reused
        edit()
        second = split_and_eval(src)
        assert second[0] != first[0] and second[1] != first[1], src.path
        assert second[2] is False and second[3] != first[3], src.path  # a fresh evaluation of the new split


def test_episodes_too_long_for_the_context_name_the_rollouts_budget(tmp_path, default_model):
    """Episodes start from seeds, with no text to shorten: the fix is the budget of the rollout
    that overruns, for evaluation too (an episode's tokens are not evaluate.max_tokens)."""
    guess = str(ROOT / "examples" / "environments" / "guess.py") + ":Guess"
    game = {"kind": "environment", "env": guess, "max_turns": 4}
    cfg = config_from_dict({"workdir": str(tmp_path / "w"), "data": {"kind": "episodes", "train_size": 2, "eval_size": 1},
                            "filter": few(), "sample": {"max_tokens": 16, "rollout": {**game, "episode_tokens": 768}},
                            "train": {"max_length": 1024}})
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, default_model)
    assert len(e.value.problems) == 2 and all(p.endswith(
        "> 512. Fix: raise sampler.max_model_len or lower sample.rollout.episode_tokens") for p in e.value.problems)
    # an eval set's own rollout that overruns, where the run's fits, is the one named
    cfg = config_from_dict({"workdir": str(tmp_path / "w"), "data": {"kind": "episodes", "train_size": 2, "eval_size": 1},
                            "filter": few(), "sample": {"max_tokens": 16, "rollout": {**game, "episode_tokens": 128}},
                            "evaluate": {"sets": [{"name": "heldout"},
                                                  {"name": "long", "rollout": {**game, "episode_tokens": 768}}]}})
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, default_model)
    assert e.value.problems and all("evaluation" in p and p.endswith(
        "Fix: raise sampler.max_model_len or lower evaluate.sets[1].rollout.episode_tokens") for p in e.value.problems)


def test_a_hub_model_is_fetched_at_the_revision_it_is_pinned_to(monkeypatch, tmp_path):
    import huggingface_hub

    from ratchet.models.locate import find_model

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, revision=None: asked.append((repo, revision)) or str(tmp_path))
    assert find_model("org/model@0a1b2c") == tmp_path and find_model("org/model") == tmp_path
    assert asked == [("org/model", "0a1b2c"), ("org/model", None)]


def test_a_filter_minimum_no_round_can_reach_is_refused_with_the_ceiling():
    """6 prompts x min(max_per_prompt=2, n=4) = 12 accepted rows at most: min_rows=16 would stop
    every round at its filter. Pairs: each completion in one pair, so n=4 gives 2 per prompt."""
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import check_data

    with pytest.raises(ConfigError, match=r"filter.min_rows=16 can never be reached: a round accepts at most 12 rows "
                                          r"\(6 prompts x at most min\(filter.max_per_prompt=2, sample.n=4\) each\)"):
        check_data(load_config(ROOT / "flows/configs/default.yaml", ["data.prompts_per_round=6", "sample.n=4"]))
    check_data(load_config(ROOT / "flows/configs/default.yaml", ["data.prompts_per_round=6", "sample.n=4",
                                                                  "filter.min_rows=12"]))
    with pytest.raises(ConfigError, match=r"filter.min_pairs=16 can never be reached: a round builds at most 12 pairs"):
        check_data(load_config(ROOT / "flows/configs/self_reward_dpo.yaml", ["data.prompts_per_round=6", "sample.n=4",
                                                                             "filter.max_pairs_per_prompt=3"]))
    check_data(load_config(ROOT / "flows/configs/grpo.yaml", ["data.prompts_per_round=6"]))  # no filter stage


def test_the_causal_lm_table_is_read_without_importing_transformers():
    """causal_lm_names reads transformers' table from its source: finding the module's spec would
    import its parent packages, which import the module (and torch) itself."""
    code = ("import sys; from ratchet.flows.inputs import causal_lm_names; n = causal_lm_names(); "
            "print(len(n), 'llama' in n, 'transformers' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    count, llama, transformers, torch = r.stdout.split()
    assert int(count) > 50 and llama == "True" and transformers == torch == "False", r.stdout
