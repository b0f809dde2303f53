"""What an environment rollout plays (`sample.rollout.env`): a family of kinds, like every other.

    env: my_env.py:Maze                                   # a class of your own (short for the next line)
    env: {kind: python, target: "my_env.py:Maze"}         # or 'package.module:Maze', installed
    env: {kind: textarena, game: GuessTheNumber-v0}       # a TextArena single-player game
    env: {kind: gymnasium, game: FrozenLake-v1}           # a gymnasium toy-text game, in words

Each kind says what its host loads (`target`: the user's 'file.py:Class', or Ratchet's adapter
class itself, so a stage that plays it reaches that adapter's code and no other's), what the
class is made with (`args`), what keys it (`source`: the user's file with the modules it imports
from its folder, or the library's version and the game), and what stops it before any model
loads (`problems`). `sample.rollout.args` go to the class (for a library's game, to its `make`).

A new adapter is one class here and one name in `EnvKind`; the rollout (tasks/rollouts/
environment.py) never names a kind.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ratchet.data.userfiles import UserFile, source_digest
from ratchet.tasks import environments


class _EnvKind(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # each kind's last field is `source`: what keys the environment, filled in when the config is read

    def args(self, given: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments its class is made with, from `sample.rollout.args`."""
        return dict(given)

    def problems(self) -> list[str]:
        """What stops it here before its host starts (a library not installed, a game it cannot run)."""
        return []

    # a user's class starts on a stage's own first start (its seed and row); a library's game on seed 0
    starts_on_rows: ClassVar[bool] = False

    def start_hint(self) -> str:
        """Said after why a first episode could not start."""
        return ""


class PythonEnv(_EnvKind):
    """A class of your own."""

    kind: Literal["python"] = "python"
    target: Annotated[str, UserFile(spec=True, digest="source")] = Field(
        description="the environment class: 'path/to/env.py:Env' (a file; relative paths from where ratchet runs) or "
        "'package.module:Env' (an installed module); it defines reset(self, seed, **row) -> str and step(self, "
        "action) -> (observation, reward, done), optionally final_reward(self)")
    source: str | None = Field(default=None, description="sha256 of the class's file and the modules it imports from "
                               "its folder, filled in when the config is read: it keys every stage that plays it, "
                               "not the run's name")
    starts_on_rows: ClassVar[bool] = True

    @model_validator(mode="after")
    def _digest(self) -> PythonEnv:
        from ratchet.data.procs.entry import split_spec

        split_spec(self.target)  # raises ValueError with the expected forms
        if self.source is None:
            self.source = source_digest(self.target)
        return self

    @property
    def name(self) -> str:
        return f"sample.rollout.env={self.target!r}"

    def changed(self) -> str | None:
        """The file's digest now, where it is not the one the run read (None: the same)."""
        now = source_digest(self.target)
        return now if now != self.source else None


def _library_source(package: str) -> Any:
    """A library game's `source` field (declared by each kind, so that it stays the kind's last field)."""
    return Field(default=None, description=f"sha256 of {package}'s version and the game, filled in when the config "
                 "is read")


class _Game(_EnvKind):
    """A library's game, played through Ratchet's adapter for the library."""

    package: ClassVar[str] = ""  # the library (its version keys the game)

    def args(self, given: dict[str, Any]) -> dict[str, Any]:
        return {"game": self.game, **given}

    @model_validator(mode="after")
    def _digest(self) -> _Game:
        if self.source is None:  # the library's version and the game: an upgrade is a new environment
            self.source = hashlib.sha256(
                f"{self.package}=={environments.version(self.package)}:{self.game}".encode()).hexdigest()
        return self

    @property
    def name(self) -> str:
        return f"sample.rollout.env.game={self.game!r} ({self.kind})"

    def changed(self) -> str | None:
        return None  # the library's version is read once, when the config is


class TextArenaGame(_Game):
    """A TextArena single-player game (the textarena package: the envs extra)."""

    kind: Literal["textarena"] = "textarena"
    game: str = Field(description="a TextArena single-player game, e.g. GuessTheNumber-v0")
    source: str | None = _library_source("textarena")
    package: ClassVar[str] = "textarena"

    @property
    def target(self) -> type:
        from ratchet.tasks.environments.textarena_game import TextArenaEnv

        return TextArenaEnv

    def problems(self) -> list[str]:
        from ratchet.tasks.environments import textarena

        problem = textarena.game_problem(self.game)
        return [problem] if problem is not None else []

    def start_hint(self) -> str:
        from ratchet.tasks.environments import textarena

        return textarena.NO_START


class GymnasiumGame(_Game):
    """A gymnasium toy-text game, rendered as text (the gymnasium package: the envs extra)."""

    kind: Literal["gymnasium"] = "gymnasium"
    game: Literal["FrozenLake-v1", "CliffWalking-v1", "Blackjack-v1"] = Field(
        description="a gymnasium toy-text game, rendered as text")
    source: str | None = _library_source("gymnasium")
    package: ClassVar[str] = "gymnasium"

    @property
    def target(self) -> type:
        from ratchet.tasks.environments.gymnasium_game import GymnasiumEnv

        return GymnasiumEnv

    def problems(self) -> list[str]:
        if environments.version("gymnasium") is None:
            return [f"{self.name} needs the gymnasium package: pip install 'gymnasium==1.4.0' (or `pip install -e "
                    ".[envs]`)"]
        return []


EnvKind = Annotated[PythonEnv | TextArenaGame | GymnasiumGame, Field(discriminator="kind")]


def shorthand(data: Any) -> Any:
    """An environment rollout's settings with `env` in its long form: a string is a class of your
    own; `textarena: GAME` and `gymnasium: GAME` beside `env` (how earlier configs named a game)
    are that library's kind. Both forms at once is an error, said as one."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    # a game given as null is nothing
    games = {k: game for k in ("textarena", "gymnasium") if (game := data.pop(k, None)) is not None}
    given = ["env"] * (data.get("env") is not None) + list(games)
    if not given:
        raise ValueError("sample.rollout.kind='environment' needs env: 'path/to/env.py:Env' (a class of your own, or "
                         "'package.module:Env'), {kind: textarena, game: GuessTheNumber-v0} or {kind: gymnasium, "
                         "game: FrozenLake-v1}")
    if len(given) > 1:
        raise ValueError(f"sample.rollout gives {' and '.join(given)}: give one environment, as env: "
                         "{kind: python | textarena | gymnasium, ...} (or env: 'path/to/env.py:Env')")
    if games:
        (package, game), = games.items()
        data["env"] = {"kind": package, "game": game}
    elif isinstance(data.get("env"), str):
        data["env"] = {"kind": "python", "target": data["env"]}
    return data
