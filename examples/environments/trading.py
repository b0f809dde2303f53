"""Single-stock trading: each day the model reads the last closes and its position, and answers
buy, sell or hold. Long one unit or flat; a day's reward is that day's return on the position,
less `cost` on a day the position changes, so the episode's return is the sum of its daily
returns. The prices are generated offline from `series_seed`: a random walk whose drift and
volatility switch between regimes (rising, falling, quiet) at random. The series is made by this
file's code alone, so the file's digest, which keys every stage that plays it, covers the prices
too (a file of prices read from elsewhere would not be in the key).

An episode is a window of `days` trading days. Seed N starts N windows into the series, so the
held-out seeds (data.kind=episodes puts them after the train seeds) are later periods than every
train episode.

    data: {kind: episodes, train_size: 64, eval_size: 32, check: {kind: return, success: 0.001}}
    sample:
      rollout: {kind: environment, env: "examples/environments/trading.py:Trading", args: {days: 8}}
"""

import math
import random
import re

REGIMES = {"rising": (0.004, 0.010), "falling": (-0.004, 0.012), "quiet": (0.0, 0.006)}  # daily drift, volatility


def generated(seed: int, length: int, switch: float = 0.06) -> list[float]:
    """A price series from `seed`: each day a log-return drawn from the current regime's drift and
    volatility; the regime changes with probability `switch` a day."""
    rng = random.Random(seed)
    regime, price, out = rng.choice(sorted(REGIMES)), 100.0, []
    for _ in range(length):
        if rng.random() < switch:
            regime = rng.choice(sorted(set(REGIMES) - {regime}))
        drift, vol = REGIMES[regime]
        price *= math.exp(rng.gauss(drift, vol))
        out.append(round(price, 4))
    return out


class Trading:
    def __init__(self, days: int = 8, history: int = 5, cost: float = 0.001, series_seed: int = 0,
                 series_length: int = 3000):
        self.days, self.history, self.cost = days, history, cost
        self.series = generated(series_seed, series_length)

    def reset(self, seed: int) -> str:
        self.start = self.history + seed * self.days
        if self.start + self.days >= len(self.series):
            raise ValueError(f"seed {seed} starts on day {self.start}, and an episode of {self.days} days needs "
                             f"{self.start + self.days + 1} prices; the series has {len(self.series)}: use fewer "
                             "seeds, fewer days, or a longer series (series_length)")
        self.t, self.position, self.value = self.start, 0, 1.0
        return self.observation("You trade one stock. Each day, answer buy, sell or hold.")

    def observation(self, note: str) -> str:
        closes = self.series[self.t - self.history + 1:self.t + 1]
        shown = ", ".join(f"{c:.2f}" for c in closes)
        day = self.t - self.start + 1
        return (f"{note}\nDay {day} of {self.days}. Last {len(closes)} closes: {shown}. You are "
                f"{'holding the stock' if self.position else 'in cash'}. Answer buy, sell or hold.")

    def step(self, action: str):
        words = re.findall(r"\b(buy|sell|hold)\b", action.lower())
        wanted = {"buy": 1, "sell": 0, "hold": self.position}[words[-1]] if words else self.position
        changed = wanted != self.position
        self.position = wanted
        move = self.series[self.t + 1] / self.series[self.t] - 1.0
        reward = self.position * move - (self.cost if changed else 0.0)
        self.value *= 1.0 + reward
        self.t += 1
        done = self.t - self.start >= self.days
        note = (f"The close moved {move:+.2%}; your day's return {reward:+.2%}." if words else
                f"No buy, sell or hold found: you held. The close moved {move:+.2%}; your day's return {reward:+.2%}.")
        return (note if done else self.observation(note)), reward, done
