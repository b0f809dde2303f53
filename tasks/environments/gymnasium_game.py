"""Gymnasium's toy-text environments, rendered as text: `env: {kind: gymnasium, game: FrozenLake-v1}`.

Gymnasium's observations are integers and tuples; a language model needs words. Each game here
gets rules (the first message), a rendering of its state as text after every move, and a
reading of the model's turn as an action: the last of the game's action words it wrote (`left`,
`down`, ... or `hit` / `stick`). A turn that names no action is answered with the words to use
and costs a turn, not the episode (in CliffWalking also a step's -1, so standing still never
returns more than walking). Rewards are otherwise gymnasium's own.

    FrozenLake-v1    walk a 4x4 frozen lake from S to G without falling into a hole (H); the ice
                     is slippery (`args: {is_slippery: false}` for a deterministic lake);
                     reward 1 at the goal
    CliffWalking-v1  walk a 4x12 grid from the start to T along a cliff: -1 per step, -100 and
                     back to the start for a step onto the cliff
    Blackjack-v1     hit or stick against the dealer; 1 a win, -1 a loss, 0 a draw

A module of its own because it imports gymnasium at the top: the environment's host process
imports it once and every episode's process forks with it loaded.
"""

from __future__ import annotations

import re


GAMES = ("FrozenLake-v1", "CliffWalking-v1", "Blackjack-v1")


class _FrozenLake:
    actions = ("left", "down", "right", "up")  # gymnasium's order: 0 left, 1 down, 2 right, 3 up
    idle = 0.0  # the reward of a turn that names no move

    def rules(self, env) -> str:
        rows, cols = env.unwrapped.desc.shape
        slippery = " The ice is slippery: you may slide to a side instead of where you meant to go." if \
            getattr(env.unwrapped, "is_slippery", False) else ""
        return (f"You are on a frozen lake, a grid of {rows} rows and {cols} columns. S is the start, F is frozen "
                "ice you can walk on, H is a hole you must not fall into, and G is the goal. You are at A. Each "
                f"turn, move one square: answer with one word, left, down, right or up.{slippery}")

    def render(self, env, obs) -> str:
        desc = [[c.decode() for c in row] for row in env.unwrapped.desc]
        r, c = divmod(int(obs), len(desc[0]))
        desc[r][c] = "A"
        return "\n".join("".join(row) for row in desc)


class _CliffWalking:
    actions = ("up", "right", "down", "left")  # 0 up, 1 right, 2 down, 3 left
    idle = -1.0  # a turn spent is a step's cost: standing still never beats walking

    def rules(self, env) -> str:
        return ("You walk on a grid of 4 rows and 12 columns. You are at x, the goal is T, and C is a cliff: a "
                "step onto it costs 100 points and sends you back to the start. Every step costs 1 point. Each "
                "turn, move one square: answer with one word, up, right, down or left.")

    def render(self, env, obs) -> str:
        rows, cols = 4, 12
        r, c = divmod(int(obs), cols)
        grid = [["o"] * cols for _ in range(rows)]
        for j in range(1, cols - 1):
            grid[3][j] = "C"
        grid[3][cols - 1] = "T"
        grid[r][c] = "x"
        return "\n".join(" ".join(row) for row in grid)


class _Blackjack:
    actions = ("stick", "hit")  # 0 stick, 1 hit
    idle = 0.0

    def rules(self, env) -> str:
        return ("We are playing blackjack against a dealer. Cards count their value, face cards 10, an ace 1 or "
                "11. Get closer to 21 than the dealer without going over. Each turn, answer with one word: hit (take "
                "a card) or stick (stop).")

    def render(self, env, obs) -> str:
        total, dealer, ace = (int(x) for x in obs)
        return (f"Your cards sum to {total}{' (an ace counts 11)' if ace else ''}. The dealer shows "
                f"{'an ace' if dealer == 1 else dealer}. Hit or stick?")


TEXT = {"FrozenLake-v1": _FrozenLake(), "CliffWalking-v1": _CliffWalking(), "Blackjack-v1": _Blackjack()}


class GymnasiumEnv:
    """One gymnasium toy-text game, played in words through the environment interface."""

    imports = ("gymnasium",)  # by its host, once (tasks/environments/__init__.py)

    def __init__(self, game: str, **kwargs):
        import gymnasium as gym

        if game not in TEXT:
            raise ValueError(f"sample.rollout.env.game={game!r} has no text rendering here; choose one of {GAMES}")
        self.text = TEXT[game]
        self.env = gym.make(game, **kwargs)
        words = "|".join(self.text.actions)
        self.pattern = re.compile(rf"\b({words})\b", re.IGNORECASE)

    def reset(self, seed: int) -> str:
        obs, _ = self.env.reset(seed=seed)
        return f"{self.text.rules(self.env)}\n\n{self.text.render(self.env, obs)}"

    def step(self, action: str):
        said = self.pattern.findall(action)
        if not said:
            return f"Answer with one word: {', '.join(self.text.actions)}.", self.text.idle, False
        move = self.text.actions.index(said[-1].lower())
        obs, reward, terminated, truncated, _ = self.env.step(move)
        return self.text.render(self.env, obs), float(reward), bool(terminated or truncated)

    def close(self) -> None:
        self.env.close()
