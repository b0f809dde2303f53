"""The TextArena adapter class (tasks/environments/textarena.py says how it plays). It names
textarena in `imports`: the environment's host process imports it once and every episode's
process forks with it loaded (an import per episode took seconds), while the stage that names the
class (and so is keyed by its code) does not import it."""

from __future__ import annotations

from ratchet.tasks.environments.textarena import game_problem


class TextArenaEnv:
    """One TextArena game for one player, played through the environment interface."""

    imports = ("textarena",)

    def __init__(self, game: str, **kwargs):
        import textarena as ta

        if (problem := game_problem(game)) is not None:
            raise ValueError(problem)
        self.env = ta.make(game, **kwargs)
        self.seen = ""

    def reset(self, seed: int) -> str:
        self.env.reset(num_players=1, seed=seed)
        return self._new(None)

    def step(self, action: str):
        done, _ = self.env.step(action)
        if done:
            rewards, info = self.env.close()
            why = ((info or {}).get(0) or {}).get("reason", "")
            reward = (rewards or {}).get(0, 0.0)
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise ValueError(f"TextArena's game ended with a reward that is not a number ({reward!r:.120}); "
                                 "this game's rewards cannot be read")
            return str(why), float(reward), True
        return self._new(action), 0.0, False

    def _new(self, action: str | None) -> str:
        """What the player's observation added since it was last read, the echo of its move left out."""
        _, obs = self.env.get_observation()
        new = obs[len(self.seen):] if obs.startswith(self.seen) else obs
        self.seen = obs
        new = new.lstrip("\n")
        for echo in _echoes(action):
            if new.startswith(echo):
                new = new[len(echo):].lstrip("\n")
                break
        return new


def _echoes(action: str | None) -> list[str]:
    """How the game's log can echo `action`, longest first: TextArena's action wrapper puts a move
    with no bracket in brackets (Mastermind's, GuessTheNumber's; a game without that wrapper
    echoes it as it came), and its log drops the player's role tag from every move."""
    if action is None:
        return []
    said = [f"[{action}]", action] if "[" not in action and "]" not in action else [action]
    return [f"[Player] {a.replace('[Player]', '')}" for a in said]
