"""The user's inputs, checked before anything is loaded or written.

    ratchet run my.yaml        # a bad row stops here: exit 2, one report, no workdir touched

Reads the prompt source (every row checked, see data/sources/) and measures each
prompt with the model's tokenizer against the token budget of every stage that will
see it, so a prompt too long for the context is named by its file and line instead of
failing deep inside an engine in round 3. Only the tokenizer is loaded here. `ratchet run` makes
the checks that read the model (check_model) in a child of its fork server (checked_run).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ratchet.data.errors import ConfigError, ProblemReport
from ratchet.data.prompts import Split, check_draw, prompt_key, load_split
from ratchet.flows.config import PipelineConfig
from ratchet.models import prompt_format
from ratchet.models.locate import find_model
from ratchet.models.sampler import backend_kind
from ratchet.tasks.prepare import DEMOS, SETS, sources_of  # noqa: F401 - a run's sources, read by its stages
from ratchet.tasks.label_kinds import Budget
from ratchet.data.procs.entry import entry


def needs_train_answers(cfg: PipelineConfig) -> bool:
    """Whether the label needs a reference answer for every train prompt."""
    return cfg.label.needs_reference() and cfg.label.scores_with(cfg.data.check).needs_answer


def check_inputs(cfg: PipelineConfig, model_dir: Path | None = None) -> Split:
    """The checked split, its digests with every held-out set's; raises one ConfigError listing
    every problem in the data.

    `model_dir` gives the tokenizer for the length checks (default: the configured model).
    """
    return check_task(cfg, model_dir)[0]


def check_task(cfg: PipelineConfig, model_dir: Path | None = None) -> tuple[Split, dict[str, Split]]:
    """check_inputs, and the held-out sets that bring their own data (evaluate.sets), by name."""
    split, sets = check_data(cfg)
    if cfg.sampler.backend_kind.local:
        check_model(cfg, split, sets, model_dir)
    else:
        check_served(cfg, split, sets)
    return with_sets(split, sets), sets


@contextlib.contextmanager
def checked_run(cfg: PipelineConfig, meanwhile=None) -> Iterator[Split]:
    """check_inputs for `ratchet run`, with the run's fork server (data/procs/forkserver.py) started
    for the run's length: the data here, then the model's checks in a child of the server once it
    has imported what they read models with (tasks/stage.READS_MODELS), which the stages import from it
    anyway (a run's own process imported them for the checks alone: 4-5 s of CPU). Nothing is
    written before the checks pass: the server's log has no name until the run's services give it
    one. Where the config has no fork server (`isolate`, `executor.warm_workers`), or this process
    has imported transformers already, the checks are all made here. `meanwhile`: a context
    manager to hold around the model's checks, once the data's have passed (the run's own imports,
    flows/launch.py imports_meanwhile)."""
    import sys

    from ratchet.data.procs import forkserver
    from ratchet.tasks.runner.stage import READS_MODELS

    split, sets = check_data(cfg)  # a bad row is reported before any model library is imported
    local = cfg.sampler.backend_kind.local
    if not local:  # no model here: its server counts the prompts
        check_served(cfg, split, sets)
    key = model_check_key(cfg, split, sets) if local else None
    with forkserver.for_run(cfg.isolate and cfg.executor.warm_workers, None, run_preload(cfg)):
        with meanwhile or contextlib.nullcontext():
            if not local or passed_before(key) is not None:  # passed with these exact inputs: not made again
                pass
            elif "transformers" in sys.modules:  # imported here already (a caller of flows/api.py): nothing to save
                record_pass(key, checked_model(cfg, split, sets))
            else:
                record_pass(key, forkserver.call(checked_model, cfg, split, sets, after=READS_MODELS))
        yield with_sets(split, sets)


def run_preload(cfg: PipelineConfig | None = None) -> tuple[str, ...]:
    """What the run's fork server imports before its children are forked, in order: the libraries
    a stage's worker imports (tasks/runner/stage.py), the tokenizer of `cfg`'s model where it is
    on this machine (models/tokenizer.py: each worker's copy), the modules of the stages it runs,
    and what the run's own calls need (its base model saved for MLflow, the report's figures), and
    MLflow's map of the installed packages, which every save of a version reads (`module:function`:
    called once imported)."""
    from ratchet.data.procs.forkserver import preload_call
    from ratchet.models import mlflow_model, tokenizer, trainer, warm
    from ratchet.models.locate import find_model
    from ratchet.tasks import evaluate, label, sample, train
    from ratchet.tasks.runner import stage

    stages = (stage, sample, evaluate, label, train, trainer, warm, mlflow_model)
    model = None
    if cfg is not None and cfg.sampler.backend_kind.local:
        with contextlib.suppress(Exception):  # a model not here yet, or not a model: the run's checks say so
            model = find_model(cfg.model.path, fetch=False)
    tokenizers = (preload_call(tokenizer.preload, str(model)),) if model is not None else ()
    return (*stage.WORKER_LIBRARIES, *tokenizers, *(m.__name__ for m in stages), "mlflow.transformers",
            f"{mlflow_model.__name__}:{mlflow_model.warm.__name__}", "matplotlib.pyplot")


def check_data(cfg: PipelineConfig) -> tuple[Split, dict[str, Split]]:
    """The checks that need no model library: the rows of the task's data and of every held-out
    set, the label's settings and fixed model (its config.json), the rollouts and the answer
    checks. Raises ConfigError."""
    split = load_split(cfg.data, cfg.seed, train_answers=needs_train_answers(cfg))
    if cfg.data.prompts_per_round:
        check_draw(cfg.data.prompts_per_round, len(split.train))
    check_label_model(cfg)
    check_optimiser_model(cfg)
    if problems := cfg.label.ready():  # a served judge's key and server, before any model loads
        raise ConfigError(problems, source="label")
    if cfg.sampler.endpoint is not None and (problems := cfg.sampler.endpoint.problems("sampler.endpoint")):
        raise ConfigError(problems, source="sampler")  # a served policy's key and server
    if cfg.prompt.search is not None and (problems := cfg.prompt.search.ready()):  # a served optimiser's too
        raise ConfigError(problems, source="prompt.search")
    fields = columns(split.train + split.eval)  # a start's other columns, which an environment's reset may take
    rollouts = _rollouts(cfg)
    first = split.train[0] if split.train else None  # the first start a stage gives an environment
    if problems := sorted({p for ro in rollouts for p in ro.problems(fields, first)}):  # tried as stages use them
        raise ConfigError(problems, source="sample.rollout" + (" and evaluate.sets" if len(rollouts) > 1 else ""))
    if problems := cfg.data.check.problems(columns(split.train + split.eval)):  # loaded once, as a stage will
        raise ConfigError(problems, source="data.check")
    if (own := cfg.label.scores_with(cfg.data.check)) is not cfg.data.check:  # the label's own check (label.check)
        if problems := own.problems(columns(split.train)):
            raise ConfigError(problems, source="label.check")
    if cfg.trains_weights() and not cfg.train.online and cfg.label.consumes == "samples":  # sample.n of each
        per_round = min(len(split.train), cfg.data.prompts_per_round or len(split.train))
        if problems := cfg.filter.ceiling_checks(per_round, cfg.sample.n):
            raise ConfigError(problems, source="filter")
    if cfg.prompt.search is not None:  # a round's draw splits into the search's reward, score and batch prompts
        answered = [p for p in split.train if p.answer is not None or not cfg.data.check.needs_answer]
        per_round = min(len(answered), cfg.data.prompts_per_round or len(answered))
        if problems := cfg.prompt.search.problems(per_round):
            raise ConfigError(problems, source="prompt.search")
    sets = held_out_sets(cfg, split)
    if cfg.cold_start is not None:  # every row, its tool calls run and its episodes replayed
        from ratchet.tasks.cold_start import check

        _, digest = check(cfg.cold_start, cfg.sample.rollout, cfg.data.check,
                          split.eval + [p for s in sets.values() for p in s.eval])
        split = Split(split.train, split.eval, {**split.digests, DEMOS: digest}, split.places)
    return split, sets


@entry
def check_model(cfg: PipelineConfig, split: Split, sets: dict[str, Split], model_dir: Path | None = None) -> None:
    """The checks that read the model: its directory, its LoRA targets, its tokenizer and prompt
    format, and every prompt of `split` and `sets` (check_data's) against the token budget of
    each stage that reads it. `model_dir` gives the tokenizer (default: the configured model).
    Imports transformers, and with it torch: `ratchet run` makes these checks in a child of the
    run's fork server, which imports them for the stages anyway. Raises ConfigError."""
    if problems := device_problems(cfg):
        raise ConfigError(problems, source="executor and train")
    policy = model_dir if model_dir is not None else find_model(cfg.model.path)
    field = f"model.path={cfg.model.path!r}"
    if problems := model_problems(policy, field) or lora_problems(cfg, policy) or engine_problems(cfg, policy, field):
        raise ConfigError(problems, source="model")
    tok = _tokenizer(policy, field)
    if model_dir is None:  # a stored model (a continuation) reads prompts as its base stage wrote it
        if problems := prompt_format.problems(tok, cfg.model.prompt_format, "model", policy):
            raise ConfigError(problems, source="model")
        prompt_format.use(tok, cfg.model.prompt_format, cfg.model.plain_layout)
    if problems := sorted({p for ro in _rollouts(cfg) for p in ro.model_problems(tok)}):  # the template, for episodes
        raise ConfigError(problems, source="model")
    # the model that reads each budget's prompts tokenizes them: a label's fixed model its own way
    fixed = cfg.label.fixed_model()
    readers = {"policy": tok, "label": label_tokenizer(cfg, find_model(fixed)) if fixed else tok}
    report = ProblemReport()
    # a generated prompt (a task's, an episode's seed) is not the user's to edit
    rows = "shorten or drop these rows, or " if cfg.data.users_rows else ""
    reads = [("train", split.train, train_budgets(cfg), split.places),
             ("eval", split.eval, eval_budgets(cfg), split.places)]
    reads += [(f"evaluate set {name!r}", s.eval, eval_budgets(cfg), s.places) for name, s in sets.items()]
    for what, prompts, budgets, places in reads:
        for p in prompts:
            for name, b in budgets.items():
                need = len(_ids(readers[b.reader], b.wrap(p.prompt))) + b.extra
                if need > b.limit:
                    source, place = places.get(p.id, ("data", f"id {p.id!r}"))
                    report.add(source, f"{what} prompts too long for {name}", place,
                               f"{need} tokens with what {name} adds > {b.limit}",
                               rows + b.fix)
    report.raise_if_any()
    if cfg.cold_start is not None and model_dir is None:  # a continuation does not repeat the cold start
        from ratchet.data import demonstrations
        from ratchet.tasks.cold_start import length_problems

        demos, _, _ = demonstrations.read(cfg.cold_start.demonstrations)
        if problems := length_problems(cfg.cold_start, cfg.sample.rollout, tok, demos):
            raise ConfigError(problems, source="cold_start")


def first_message(cfg: PipelineConfig, split: Split) -> str:
    """The first train prompt as the model's first message: version 1 of the run's text
    (prompt.template) in the rollout's template, or an environment's first observation."""
    from ratchet.tasks.text import PromptText, render

    return cfg.sample.rollout.first_message(render([split.train[0]], PromptText(template=cfg.prompt.template))[0])


def model_line(cfg, prompt: str) -> str:
    """The model and its prompt format, with what the model reads for one train prompt (its first
    message: the rollout's template around it, or an environment's first observation)."""
    if (served := cfg.sampler.endpoint) is not None:
        return (f"model: served, {served.where()} (sampler.backend=served: its weights are not here; its server "
                f"applies its chat template)\n  the model reads, as the user's message: {prompt!r}")
    tok, used = policy_tokenizer(cfg)
    fmt = cfg.model.prompt_format
    why = {"auto": " (auto: " + ("the tokenizer's chat template)" if used == "chat" else "the model has no chat "
                                 "template: a base model)"),
           "chat": " (the tokenizer's chat template)", "plain": ""}[fmt]
    layout = ""
    if used == "plain":
        end = prompt_format.turn_end(tok)
        layout = f"; model.plain_layout={cfg.model.plain_layout!r}; an answer ends at the end-of-sequence token" + (
            f" or at {end!r}" if end else "")
    return (f"model: {cfg.model.path}; prompt format: {used}{why}{layout}\n"
            f"  the model reads: {prompt_format.example(tok, prompt)!r}")


@entry
def checked_model(cfg: PipelineConfig, split: Split, sets: dict[str, Split]) -> dict:
    """check_model, and what `ratchet check` says of the model once it passed (kept with the pass)."""
    check_model(cfg, split, sets)
    return {"model_line": model_line(cfg, first_message(cfg, split)) if split.train else None}


# the model's checks that passed, by what they read: the newest few kept, as `ratchet check` and a
# run's start read them back (passed_before)
CHECKS = "checks.json"
KEPT_CHECKS = 64
LIBRARIES = ("transformers", "tokenizers", "jinja2", "torch", "peft", "vllm")  # what reads the model's files
READ_WHOLE = 64 << 20  # a larger file (a model's weights, which no check reads) is keyed by its name and size
# the config fields no model check reads (tests/flows/test_inputs.py poisons them all and checks): a run
# that changes only these (where it writes, its rounds, its filter, its training's schedule) keeps its
# pass; every other field is in the key
UNREAD = ("name", "workdir", "rounds", "improve", "drop_models", "filter", "agreement", "tracking", "curriculum")
UNREAD_TRAIN = ("epochs", "learning_rate", "lr_scheduler", "warmup_ratio", "batch_size", "grad_accum",
                "gradient_checkpointing", "attention", "checkpoint_steps", "logging_steps")


def model_check_key(cfg: PipelineConfig, split: Split, sets: dict[str, Split], model_dir: Path | None = None) -> str | None:
    """The digest of everything check_model reads: the config (less UNREAD), every prompt it measures, the
    model directories' files and the user's files by their content (through the stat cache, which
    reads again a file written since, whatever its mtime; a file over READ_WHOLE, the weights no
    check reads, by its name and size), the package's code, the libraries' versions, the GPUs this
    process sees and what `auto` is here. None where a model is not on this machine yet (a hub
    model), or RATCHET_VERIFY=full asks for every check."""
    import os
    from importlib import metadata

    from ratchet.data.digest import batched, full_hashing, known_sha256, sha256_json
    from ratchet.data.userfiles import helpers, user_files
    from ratchet.tasks.runner.code_reach import code_digest
    from ratchet.models import dtype

    if full_hashing():
        return None
    dirs = {"model.path": model_dir if model_dir is not None else find_model(cfg.model.path, fetch=False)}
    if fixed := cfg.label.fixed_model():
        dirs["label.model"] = find_model(fixed, "label.model", fetch=False)
    if any(d is None for d in dirs.values()):
        return None
    files = {}
    with batched():
        for field, root in {**user_files(cfg), **dirs}.items():
            root = Path(root)
            paths = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
            paths += helpers(root) if root.suffix == ".py" else []
            files[field] = []
            for p in paths:
                size = os.stat(p).st_size
                files[field].append((str(p), size, known_sha256(p) if size <= READ_WHOLE else None))

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    prompts = {"train": split.train, "eval": split.eval, **{f"set {n}": s.eval for n, s in sets.items()}}
    read = cfg.model_dump(mode="json", exclude={*UNREAD, "train"})
    read["train"] = cfg.train.model_dump(mode="json", exclude=set(UNREAD_TRAIN))
    return sha256_json({"config": read, "files": files, "package": code_digest(),
                        "libraries": {n: version(n) for n in LIBRARIES}, "gpus": dtype.visible_gpus(),
                        "auto": dtype.auto().dtype,
                        "prompts": {k: [p.model_dump(mode="json") for p in v] for k, v in prompts.items()}})


def passed_before(key: str | None) -> dict | None:
    """What a pass of the model's checks with this key said (`ratchet check`'s model line), or None."""
    from ratchet.tasks.runner.code_reach import kept_answer

    return None if key is None else kept_answer(key, CHECKS)


def record_pass(key: str | None, said: dict) -> None:
    """Keep a pass of the model's checks (best effort: a cache that cannot be written costs the
    checks next time); the newest KEPT_CHECKS stay."""
    import time

    from ratchet.tasks.runner.code_reach import keep_answer

    if key is not None:
        keep_answer(key, {**said, "at": time.time()}, CHECKS, newest=KEPT_CHECKS)


def check_served(cfg: PipelineConfig, split: Split, sets: dict[str, Split]) -> None:
    """A served policy's prompts against its server's context, as the server counts them (vLLM's
    /tokenize, with the model's own chat template): the longest of each set, in the config's
    prompt.template, with evaluate.max_tokens to answer in (what the search and evaluation ask).
    A server that does not count is not asked; it refuses what it cannot hold, within
    sampler.endpoint.max_refused_frac."""
    from ratchet.models.endpoint import Endpoint
    from ratchet.tasks.text import PromptText

    endpoint = cfg.sampler.endpoint
    report, text = ProblemReport(), PromptText(template=cfg.prompt.template)
    asked = cfg.evaluate.max_tokens
    reads = [("train", split.train, split.places), ("eval", split.eval, split.places),
             *((f"evaluate set {name!r}", s.eval, s.places) for name, s in sets.items())]
    with tempfile.TemporaryDirectory() as t:
        counter = Endpoint(endpoint, Path(t) / "calls.jsonl", at="sampler.endpoint")
        for what, prompts, places in reads:
            if not prompts:
                continue
            p = max(prompts, key=lambda p: len(text.render(p.prompt)))
            counted = counter.count([{"role": "user", "content": text.render(p.prompt)}])
            if counted is None:
                return
            need, context = counted[0] + asked, counted[1]
            if need > context:
                source, place = places.get(p.id, ("data", f"id {p.id!r}"))
                report.add(source, f"{what} prompts too long for the served policy", place,
                           f"{need} tokens with evaluate.max_tokens={asked} > its server's context of {context}",
                           ("shorten or drop these rows, or " if cfg.data.users_rows else "") +
                           "lower evaluate.max_tokens, or serve it with a longer context (vllm serve --max-model-len)")
    report.raise_if_any()


def device_problems(cfg: PipelineConfig) -> list[str]:
    """What this machine's GPUs cannot give the run: each local engine holder its own
    (tasks/units.holder_devices), and each training process one GPU (torchrun gives process k
    device k, and there is no device k past the last). Nothing on a machine without GPUs."""
    from ratchet.models.dtype import visible_gpus

    visible = visible_gpus()
    if not visible:
        return []
    problems = cfg.executor.device_problems(visible)
    if (n := cfg.train.num_processes) > len(visible):
        problems.append(f"train.num_processes={n}: training runs one process per GPU, and this machine shows "
                        f"{len(visible)} ({','.join(visible)}); set train.num_processes={len(visible)} or fewer, or "
                        "make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    elif n > 1 and cfg.train.online:
        problems.append(f"train.num_processes={n} with train.kind={cfg.train.kind}: online training in several "
                        "processes opens an engine in each, and has run on CPU only (gloo); placing each engine on "
                        "its own process's GPU is not built: set train.num_processes: 1 on a machine with GPUs")
    return problems


def dtype_line(cfg: PipelineConfig) -> str:
    """What `auto` dtype and precision resolve to on this machine, and why (models/dtype.py); the
    settings given explicitly, as given."""
    from ratchet.models import dtype
    from ratchet.tasks.evaluate import eval_sampler

    sampling, training = cfg.sampler.dtype, cfg.train.precision
    evaluating = dtype.resolve_dtype(eval_sampler(cfg.evaluate, cfg.sampler, cfg.model.path).dtype)
    own = cfg.evaluate.dtype == "auto" and evaluating != dtype.resolve_dtype(sampling)
    said = (f"sampling {dtype.resolve_dtype(sampling)}, evaluating {evaluating}"
            + (" (as the base model is stored)" if own else "") + f", training {dtype.resolve_precision(training)}")
    if "auto" not in (sampling, training):
        return f"dtype: {said} (as set)"
    choice = dtype.auto()
    return f"dtype: {said} ({choice.dtype} for auto: {choice.why})"


LONG_ROWS = 512  # tokens a training row may reach (max_length) from which check names sdpa on a CPU


def attention_line(cfg: PipelineConfig) -> str | None:
    """What `ratchet check` says where training is left to `attention: auto` on a CPU, which picks
    eager there (the faster for short rows), and its rows may be long: eager keeps every layer's
    attention weights for the backward pass, a square of the row's length, and sdpa trained faster
    from about 256 tokens a row on the CPUs measured (docs/troubleshooting.md). None where nothing
    trains, a GPU is visible (auto picks sdpa there), the setting is given, or rows are short."""
    from ratchet.models.dtype import visible_gpus

    sections = [("train", cfg.train)] if cfg.trains_weights() else []
    if cfg.cold_start is not None:
        sections.append(("cold_start.train", cfg.cold_start.train))
    long = [(name, t.max_length) for name, t in sections if t.attention == "auto" and t.max_length >= LONG_ROWS]
    if not long or visible_gpus():
        return None
    rows = ", ".join(f"{name}.max_length={n}" for name, n in long)
    fix = " and ".join(f"{name}.attention=sdpa" for name, _ in long)
    return (f"attention: eager for training (auto, on a CPU) with rows of up to {rows}: for rows of a few hundred "
            f"tokens or more sdpa trains faster and holds less memory; set {fix}")


def devices_line(cfg: PipelineConfig) -> str:
    """What `ratchet check` says of this machine's GPUs and who takes them: the engine holders
    (local ones each their own), and the training processes, one GPU each, naming the GPUs that
    training would leave idle and the setting that uses them."""
    from ratchet.data.procs.executors import holder_devices
    from ratchet.models.dtype import visible_gpus

    visible = visible_gpus()
    if not visible:
        return "devices: no GPU visible: sampling and training run on the CPU"

    def gpus(ids: list[str]) -> str:
        return f"GPU{'s' if len(ids) > 1 else ''} {','.join(ids)}"

    ex, n = cfg.executor, cfg.train.num_processes
    if ex.kind != "local":
        holders = f"{ex.engines} engine holder{'s' if ex.engines > 1 else ''} placed by Ray"
    elif ex.engines > 1:
        holders = f"{ex.engines} engine holders, on " + " | ".join(holder_devices(ex, visible))
    else:
        tp = cfg.sampler.backend_kind.gpus(cfg.sampler)
        holders = f"sampling on the run's one engine, on {gpus(visible[:tp])}" + (
            f" (executor.engines={len(visible) // tp} samples on all)" if len(visible) >= 2 * tp else "")
    idle = len(visible) - n
    training = f"training in {n} process{'es' if n > 1 else ''} on {gpus(visible[:n])}" + (
        f" ({idle} idle: train.num_processes={len(visible)} trains on all, one process each)" if idle > 0 else "")
    return f"devices: {gpus(visible)} visible; {holders}; {training}"


def with_sets(split: Split, sets: dict[str, Split]) -> Split:
    """The task's split with every held-out set's file digests added to its own (a run's `sources`)."""
    digests = {f"{SETS}{name}.{field}": d for name, s in sets.items() for field, d in s.digests.items()}
    return Split(split.train, split.eval, {**split.digests, **digests}, split.places)


def _rollouts(cfg: PipelineConfig) -> list:
    """The task's rollout and every held-out set's own."""
    return [cfg.sample.rollout] + [s.rollout for s in cfg.evaluate.sets if s.rollout is not None]


def held_out_sets(cfg: PipelineConfig, split: Split) -> dict[str, Split]:
    """Every evaluate.sets entry that brings its own data, checked: its held-out prompts (each with
    an answer), none of them a train prompt of the task unless the set allows it, its check loadable."""
    out, problems = {}, []
    train = {prompt_key(p.prompt): p.id for p in split.train}
    for i, (s, stage) in enumerate(cfg.eval_stages()):
        where = f"evaluate.sets[{i}] ({s.name})" if i < len(cfg.evaluate.sets) else f"data.levels ({stage})"
        if s.data is None:
            if s.check is not None and (bad := s.check.problems(columns(split.eval))):
                problems += [f"{where}: {x}" for x in bad]  # each names the check's place
            continue
        try:
            held = s.source(cfg.data).held_out(cfg.seed)
        except ConfigError as e:
            problems += [f"{where}.data: {x}" for x in e.problems]
            if s.check is not None:
                problems += [f"{where}: {x}" for x in s.check.problems()]
            continue
        if not held.eval:
            problems.append(f"{where}.data: the source holds out no prompts; give it at least one answered prompt")
        if bad := (s.check or s.data.check).problems(columns(held.eval)):
            problems += [f"{where}: {x}" for x in bad]
        trained = [p.id for p in held.eval if prompt_key(p.prompt) in train]
        if trained and not s.allow_overlap:
            problems.append(f"{where}: {len(trained)} of its prompts are train prompts of the task (ids "
                            f"{trained[:3]}); held-out accuracy on trained prompts is not held out. Remove them, "
                            f"or set evaluate.sets[{i}].allow_overlap=true if that is what you want")
        out[s.name] = held
    if problems:
        raise ConfigError(problems, source="evaluate.sets")
    return out


def columns(prompts) -> list[str]:
    """The other columns the prompts carry (Prompt.fields), which a check that reads them gets by name."""
    return sorted({k for p in prompts for k in p.fields})




def check_label_model(cfg: PipelineConfig) -> None:
    """A fixed judge or reward model (label.model) must be a model directory of the right kind;
    only its config.json is read."""
    src = cfg.label.fixed_model()
    if src is None:
        return
    path = find_model(src)
    if not (path / "config.json").is_file():
        raise ConfigError([f"label.model={src!r}: {path} has no config.json; give a Hugging Face model directory"])
    if (wrong := cfg.label.check_model(path)) is not None:
        raise ConfigError([f"label.model={src!r}: {wrong}"])
    if cfg.label.generates and (problems := engine_problems(cfg, path, f"label.model={src!r}")):
        raise ConfigError(problems)  # a fixed judge generates on the run's sampler, as the policy does


def check_optimiser_model(cfg: PipelineConfig) -> None:
    """A search's own optimiser model (prompt.search.optimiser.kind=model) must be a model its
    engine can load; only its files and config.json are read."""
    src = cfg.prompt.optimiser_model()
    if src is None:
        return
    field = f"prompt.search.optimiser.path={src!r}"
    problems = model_problems(find_model(src, "prompt.search.optimiser.path"), field)
    if not problems:
        problems = backend_kind(cfg.prompt.search.optimiser.backend).model_problems(find_model(src), field)
    if problems:
        raise ConfigError(problems, source="prompt.search.optimiser")


def model_problems(path: Path, field: str) -> list[str]:
    """What keeps a directory from being a model a stage can load: its config, weights, tokenizer."""
    fix = "give a Hugging Face model directory (config.json, *.safetensors, the tokenizer's files) or 'default'"
    missing = [what for what, globs in (("config.json", ["config.json"]),
                                        ("weights (*.safetensors or *.bin)", ["*.safetensors", "*.bin"]),
                                        ("a tokenizer (tokenizer.json or tokenizer_config.json)",
                                         ["tokenizer.json", "tokenizer_config.json"]))
               if not any(next(path.glob(g), None) for g in globs)]
    if missing:
        return [f"{field}: {path} lacks {', '.join(missing)}; {fix}"]
    return causal_lm_problems(path, field)


def causal_lm_problems(path: Path, field: str) -> list[str]:
    """A policy generates text: its config.json must name a causal LM transformers knows. Only the
    config is read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # an unknown model_type, a malformed file: transformers' own words, in one line
        why = " ".join(str(e).split())[:300]
        return [f"{field}: {path}/config.json does not load ({type(e).__name__}: {why}); give a model directory "
                "of a model type this transformers knows"]
    archs = getattr(config, "architectures", None) or []
    names = causal_lm_names()
    if (names and config.model_type not in names) or (
            archs and not any(a in names.values() or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)):
        arch = ", ".join(archs) or "no architectures"
        return [f"{field}: {path} holds a {config.model_type!r} model ({arch}), not a causal language model; "
                "the policy generates text: give a causal LM (e.g. a Llama, Qwen or SmolLM directory)"]
    return []


def engine_problems(cfg: PipelineConfig, path: Path, field: str) -> list[str]:
    """A model at `path` the run's sampler backend cannot sample (models/sampler.py: its kind says)."""
    return cfg.sampler.backend_kind.model_problems(path, field)


@functools.lru_cache(maxsize=1)
def causal_lm_names() -> dict[str, str]:
    """transformers' causal-LM model types and classes (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), read from
    its source: importing the module that defines them imports torch and transformers' generation
    code, 8 s of a run's start on 2 cores, for one table. Empty where the table cannot be read (the
    architectures' names are then checked alone)."""
    import ast
    import importlib.util

    try:
        # the file found from the top package's folder: finding the submodule's spec imports its
        # parent packages, transformers.models.auto among them, which imports the module itself
        (root,) = importlib.util.find_spec("transformers").submodule_search_locations
        origin = Path(root) / "models" / "auto" / "modeling_auto.py"
        for node in ast.parse(origin.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                                                    for t in node.targets):
                return dict(ast.literal_eval(node.value.args[0]))
    except (ImportError, AttributeError, OSError, ValueError, SyntaxError, IndexError, TypeError):
        pass
    return {}


def lora_problems(cfg: PipelineConfig, path: Path) -> list[str]:
    """train.lora.target_modules names modules the policy has, matched as PEFT matches them (a
    name: a module of that name or ending in '.name'; a string: a regex the whole name matches).
    Only the model's config is read: the modules are built on the meta device, no weights."""
    import re

    targets = cfg.train.lora.target_modules
    if cfg.train.adapter != "lora" or targets == "all-linear":
        return []
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    names = [n for n, _ in model.named_modules() if n]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    if isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
    else:
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return []
    return [f"train.lora.target_modules: {missing} match no module of the model at {path}; its linear layers are "
            f"{linear}. Name some of them, or use 'all-linear'"]


def _ids(tok, text: str) -> list[int]:
    from ratchet.models.sampler import chat_token_ids

    return chat_token_ids(tok, [text])[0]


def train_budgets(cfg: PipelineConfig) -> dict[str, Budget]:
    """The stages that read a train prompt, each with its budget: sampling (where the label reads the
    sample stage's completions, or an online train kind samples its steps: a prompt plus an episode
    of max_tokens a turn must fit the engine), what the label kind runs itself, and training (an
    online kind trains on what it sampled, which the sampling budget bounds)."""
    same = lambda p: p  # noqa: E731
    out = {}
    ro = cfg.sample.rollout
    if cfg.label.consumes == "samples" or cfg.train.online:
        fix = "lower sample.max_tokens" if ro.budget(cfg.sample.max_tokens) == cfg.sample.max_tokens else \
            "lower sample.rollout.episode_tokens"
        out["sampling"] = Budget(ro.wrap, ro.budget(cfg.sample.max_tokens), cfg.sampler.max_model_len,
                                 f"raise sampler.max_model_len or {fix}")
    out.update(cfg.label.budgets(cfg))
    reads = cfg.label.consumes == "samples" or cfg.label.plays_rollout  # what it trains on began as the rollout's
    if not cfg.train.online:
        out["training"] = Budget(ro.wrap if reads else same, 1, cfg.train.max_length, "raise train.max_length")
    return out


def eval_budgets(cfg: PipelineConfig) -> dict[str, Budget]:
    # a set with a rollout of its own is checked against the widest of the two
    rollouts = [("sample.rollout", cfg.sample.rollout)] + [
        (f"evaluate.sets[{i}].rollout", s.rollout) for i, s in enumerate(cfg.evaluate.sets) if s.rollout is not None]
    field, widest = max(rollouts, key=lambda r: r[1].budget(cfg.evaluate.max_tokens))
    budget = widest.budget(cfg.evaluate.max_tokens)
    # an episode's tokens are its rollout's to bound, not evaluate.max_tokens (one turn's)
    fix = "lower evaluate.max_tokens" if budget == cfg.evaluate.max_tokens else f"lower {field}.episode_tokens"
    return {"evaluation": Budget(widest.wrap, budget, cfg.sampler.max_model_len,
                                 f"raise sampler.max_model_len or {fix}")}


def _tokenizer(model_dir: Path, field: str):
    """The tokenizer of a model directory; one that does not load is the config's problem, said so."""
    from ratchet.models import tokenizer

    try:
        return tokenizer.load(model_dir)
    except Exception as e:  # a broken or foreign tokenizer: transformers' own words, in one line
        why = " ".join(str(e).split())[:300]
        raise ConfigError([f"{field}: the tokenizer at {model_dir} does not load ({type(e).__name__}: {why}); "
                           "give a model directory whose tokenizer transformers' AutoTokenizer reads"],
                          source="model") from e


def label_tokenizer(cfg: PipelineConfig, path: Path):
    """A label's fixed model's tokenizer, reading prompts as its label-model stage will."""
    tok = _tokenizer(path, f"label.model={cfg.label.fixed_model()!r}")
    return prompt_format.use(tok, "auto", cfg.model.plain_layout) if cfg.label.chats else tok


def policy_tokenizer(cfg: PipelineConfig):
    """The configured model's tokenizer, reading prompts in the run's prompt format, and that format
    ('chat' or 'plain')."""
    tok = _tokenizer(find_model(cfg.model.path), f"model.path={cfg.model.path!r}")
    used = prompt_format.resolve(tok, cfg.model.prompt_format)
    return prompt_format.use(tok, cfg.model.prompt_format, cfg.model.plain_layout), used
