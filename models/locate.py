"""Where the model a config names is: the embedded default, a local directory, or a hub id.

    find_model("default", "model.path")                  # converted once, then found in the cache
    find_model("org/name@REVISION", "label.model")        # fetched at that commit (or tag or branch)
    find_model("org/name", "model.path", fetch=False)     # only looked for: None where it is not here

A run finds and makes (`fetch`: converts the default on first use, downloads a hub model); `ratchet
plan` only looks, and says a model that is not here yet will be made or fetched.
"""

from __future__ import annotations

from pathlib import Path

from ratchet.data.errors import ConfigError


def find_model(src: str, field: str = "model.path", fetch: bool = True) -> Path | None:
    """The model directory `src` names (given at config field `field`); None only where `fetch` is
    off and it is not here yet."""
    if src == "default":
        from ratchet.models.default_model import default_model_dir

        return default_model_dir(convert=fetch)
    p = Path(src).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    repo, revision = hub_id(src)
    if not fetch:
        try:
            return Path(snapshot_download(repo, revision=revision, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the cache: a run fetches it
            return None
    try:
        return Path(snapshot_download(repo, revision=revision))
    except Exception as e:  # offline, unknown repo, auth: all mean the same thing to the user
        raise ConfigError([f"{field}={src!r} is not a local directory and could not be fetched from a hub "
                           f"({type(e).__name__}); give a local Hugging Face model directory, or 'default' (a gated "
                           "model needs HF_TOKEN in the environment)"]) from e


def hub_id(src: str) -> tuple[str, str | None]:
    """A hub model as a config names it: 'org/name', or 'org/name@REVISION' pinned to a commit (or a
    tag or branch), so a later run reads the same weights."""
    repo, sep, revision = src.partition("@")
    return repo, (revision or None) if sep else None
