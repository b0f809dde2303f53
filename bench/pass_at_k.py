"""How often a trained model gets a sum right when it samples: pass@k and the share of samples
right, at one level of addition, on fresh prompts (none of a run's; seeded by the level).

    python bench/pass_at_k.py MODEL_DIR --level 9 --k 16 --temperature 1.0 --prompts 20

MODEL_DIR is a model directory (a train stage's `model/`). The answer read is the last number of
the completion, as `data.check: {kind: number}` reads it. What it says: whether a round at this
level has right answers to find, and how often they are the common one (what a vote needs).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--level", type=int, default=9, help="digits in each operand")
    ap.add_argument("--k", type=int, default=16, help="samples a prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=400)
    a = ap.parse_args()

    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler

    rng = random.Random(a.level * 7919)
    lo, hi = 10 ** (a.level - 1), 10 ** a.level
    pairs = [(rng.randrange(lo, hi), rng.randrange(lo, hi)) for _ in range(a.prompts)]
    engine = open_sampler(a.model, SamplerConfig(max_model_len=a.max_tokens + 128), seed=0)
    t = time.time()
    out = engine.generate([f"What is {x} + {y}?" for x, y in pairs],
                          SamplingParams(n=a.k, temperature=a.temperature, max_tokens=a.max_tokens), seed=1)
    right = [[(nums[-1] if (nums := re.findall(r"-?\d+", g.text)) else None) == str(x + y) for g in row]
             for (x, y), row in zip(pairs, out)]
    print(json.dumps({"level": a.level, "k": a.k, "temperature": a.temperature, "prompts": a.prompts,
                      "samples_right": sum(map(sum, right)), "sample_accuracy": sum(map(sum, right)) / (a.k * a.prompts),
                      "pass_at_k": sum(map(any, right)) / a.prompts, "s": round(time.time() - t, 1)}))


if __name__ == "__main__":
    main()
