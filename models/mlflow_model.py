"""A policy as an MLflow model: what a registered version holds so MLflow's own API loads it.

    mlflow.transformers.load_model("models:/ratchet-default@champion")   a text-generation pipeline
    mlflow.pyfunc.load_model("models:/ratchet-default/3").predict([...])

A LoRA round is saved as MLflow's transformers flavor with a PEFT adapter against a *local*
base model path: the base is the round's starting policy in the artifact store (the base
model's directory, or the previous round's merged model), so a version adds megabytes, not
a copy of the model. The base model and fully fine-tuned rounds have no adapter: their
weights are in the version, as hard links to the store's files where MLflow's artifacts are
local files on the same file system (the default beside a SQLite store), else as a copy.
Either way the folder is written beside the stage's outputs (`mlflow-model/`) and is not one
of them: it records creation times and absolute paths, and the digests of a stage are a
function of its inputs alone.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from ratchet.data.procs.entry import entry

FOLDER = "mlflow-model"
TASK = "text-generation"


def requirements() -> list[str]:
    """The pinned packages a loader needs. Given explicitly: MLflow's own guess for a torch model
    adds torchvision, which this stack does not install."""
    out = []
    for p in ("torch", "transformers", "peft", "accelerate", "safetensors"):
        try:
            out.append(f"{p}=={version(p)}")
        except PackageNotFoundError:
            pass
    return out


def warm() -> None:
    """Build, once in the run's fork server, the map of every installed distribution's modules that
    MLflow reads to check a saved model's pins against the installed packages: built once per
    process, it took about 0.9 s of each save here (a version's registration, in a forked child), for
    pins that `requirements` takes from the installed packages anyway. A forked child inherits it;
    where MLflow has no such map, nothing is done."""
    import contextlib

    with contextlib.suppress(Exception):  # a private helper of MLflow's: its absence costs the time, no more
        from mlflow.utils import requirements_utils

        requirements_utils._init_packages_to_modules_map()


def _quiet():
    logging.getLogger("mlflow.transformers").setLevel(logging.WARNING)


def save_adapter(peft_model, tokenizer, base_dir: Path, out: Path) -> Path:
    """A PEFT model as MLflow's transformers flavor, its base referenced by path, not copied."""
    import mlflow.transformers

    _quiet()
    path = out / FOLDER
    shutil.rmtree(path, ignore_errors=True)
    mlflow.transformers.save_model(transformers_model={"model": peft_model, "tokenizer": tokenizer}, path=str(path),
                                   base_model_path=str(Path(base_dir).resolve()), task=TASK,
                                   pip_requirements=requirements())
    return path


@entry
def save_full(model_dir: Path, path: Path) -> Path:
    """A full model directory as MLflow's transformers flavor. Its files are hard links to the model's
    where `path` is on the model's file system (a local artifact store beside the workdir: the
    version's weights cost no copy and no space), else copies; each is the model's bytes either way."""
    import mlflow.transformers

    _quiet()
    shutil.rmtree(path, ignore_errors=True)
    with _linking_checkpoint_copy():
        mlflow.transformers.save_model(transformers_model=str(Path(model_dir).resolve()), path=str(path), task=TASK,
                                       pip_requirements=requirements())
    return path


@contextlib.contextmanager
def _linking_checkpoint_copy():
    """MLflow's transformers flavor copies a checkpoint directory into the model with
    `shutil.copytree` (mlflow/transformers/model_io.py); within the block that copy links each file
    instead where it can. Where MLflow's module has no such name, it copies as it would."""
    try:
        from mlflow.transformers import model_io
    except ImportError:
        yield
        return
    real = getattr(model_io, "shutil", None)
    if real is not shutil:
        yield
        return
    from ratchet.data.digest import batched, link_or_copy

    model_io.shutil = types.SimpleNamespace(**{**vars(shutil), "copytree": functools.partial(
        shutil.copytree, copy_function=link_or_copy)})
    try:
        with batched():  # the stat cache written once, not once a linked file
            yield
    finally:
        model_io.shutil = real
