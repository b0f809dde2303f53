"""A number-guessing environment: the model guesses a secret number between 1 and `high`, and is
told "higher" or "lower" after each guess. Reward 1 for finding it; the final reward takes 0.1
per guess beyond the first off, so fewer guesses return more.

    sample:
      rollout: {kind: environment, env: "examples/environments/guess.py:Guess", args: {high: 20}}
"""

import random
import re


class Guess:
    def __init__(self, high: int = 20):
        self.high = high

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(1, self.high)
        self.guesses = 0
        self.found = False
        return (f"I am thinking of a whole number from 1 to {self.high}. Guess it: answer with one number. "
                "After each guess I will say whether the number is higher or lower.")

    def step(self, action: str):
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            return "Answer with one number.", 0.0, False
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            self.found = True
            return "Correct!", 1.0, True
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False

    def final_reward(self) -> float:
        return -0.1 * max(self.guesses - 1, 0) if self.found else 0.0
