"""The word problems' reward: the right number, said briefly.

score(completion, answer=None, prompt=None, **fields) is called once per completion with the
row's fields by name; it returns the score and, beside it, metrics Ratchet logs per round.
"""

import re


def score(completion, answer=None, prompt=None, **fields):
    numbers = re.findall(r"-?\d+", completion)
    right = bool(numbers) and numbers[-1] == str(answer).strip()
    words = len(completion.split())
    # 1.0 for the right last number within 30 words; each word past 30 costs 0.02
    return {"score": float(right) - 0.02 * max(words - 30, 0), "words": float(words)}
