"""TextArena's single-player games as environments: `env: {kind: textarena, game: GuessTheNumber-v0}`.

TextArena (`pip install textarena`, pinned in the `envs` extra) keeps one observation per player
that grows by the whole history; the model is shown only what is new since its last turn (its
own move, which the game echoes as a `[Player] ...` line, left out). The reward is the game's
own at its end (TextArena's: 1 a win, -1 or 0 a loss or a draw, some games a fraction). A move
the game refuses as invalid is answered by the game itself, as the game's rules say.

Games that fetch a word list at run time (nltk's corpora: Wordle, Hangman, SpellingBee, ...)
cannot run offline and are refused by name before anything starts; games for two or more
players are refused by the start of their first episode (they need an opponent).
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path

from ratchet.tasks import environments

OFFLINE = ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Mastermind-v0", "Minesweeper-v0", "FrozenLake-v0", "2048-v0",
           "LightsOut-v0")  # single-player games that start without a download (docs/guides/environments.md)
NO_START = (f"; a game for two or more players needs an opponent, which no rollout gives: choose a single-player "
            f"game ({', '.join(OFFLINE)})")  # said of a game whose first episode cannot start
DOWNLOADS = re.compile(r"^\s*(import nltk|from nltk|from textarena\.envs\.utils\.word_lists|from textarena\.utils\.word_lists|import requests)", re.M)


@lru_cache(maxsize=None)
def game_problem(game: str) -> str | None:
    """Why `game` cannot be played here (not installed, not a game, needs a download), or None.
    Reads the registry, and the game's module source without importing it."""
    if environments.version("textarena") is None:
        return ("sample.rollout.env (textarena) needs the textarena package: pip install 'textarena==0.7.4' (or "
                "`pip install -e .[envs]`)")
    from textarena.envs.registration import ENV_REGISTRY

    games = {g: e.entry_point for g, e in ENV_REGISTRY.items() if isinstance(getattr(e, "entry_point", None), str)}
    if game not in games:
        return f"sample.rollout.env.game={game!r} is not a TextArena game; {_near(game, games)}"
    module = games[game].split(":")[0]
    found = importlib.util.find_spec(module.rsplit(".", 1)[0])
    path = Path(found.origin).parent / (module.rsplit(".", 1)[1] + ".py") if found and found.origin else None
    if path is not None and path.is_file() and DOWNLOADS.search(path.read_text()):
        return (f"sample.rollout.env.game={game!r} fetches a word list (nltk's corpora) when it starts, and this "
                f"machine cannot download it at run time; choose a game that needs no download ({', '.join(OFFLINE)})")
    return None


def _near(game: str, games) -> str:
    """What to write instead of `game`: the registered names of the same game (another case or
    variant), else the names closest in spelling, else the games that run offline."""
    import difflib

    base = game.split("-")[0].lower()
    same = sorted(g for g in games if g.split("-")[0].lower() == base)
    if not same:
        by_lower = {g.lower(): g for g in games}
        same = [by_lower[g] for g in difflib.get_close_matches(game.lower(), list(by_lower), n=4, cutoff=0.7)]
    if same:
        return f"did you mean {', '.join(same[:4])}?"
    return f"single-player games that run offline: {', '.join(OFFLINE)}"
