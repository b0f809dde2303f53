"""Environment rollouts: the default model's success on games, and how fast episodes run.

For each game (TextArena's offline single-player games, gymnasium's toy-text games in words, and
the guessing game in examples/environments/), the default model plays the held-out seeds of `data.kind: episodes`
(seeds 64.. as a run with train_size 64 holds them out) greedily, as evaluation does, on vLLM.
It prints the success rate (the environment ended the episode with a return >= the game's
success threshold), the mean return, turns per
episode, episodes/s, the model's tokens/s over the whole rollout's wall time, and the share of
that wall time the engine sat waiting on the environment. `--compare` plays one game sampled
(n=4), overlapped and in lockstep, side by side.

    python bench/env_bench.py [--episodes 32] [--max-tokens 48] [--games guess10,GuessTheNumber-v0]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUESS = str(ROOT / "examples/environments/guess.py") + ":Guess"
TRADING = str(ROOT / "examples/environments/trading.py") + ":Trading"
# name -> (rollout settings, success threshold)
GAMES = {
    "guess10": ({"env": GUESS, "args": {"high": 10}, "max_turns": 6}, 0.5),
    "guess20": ({"env": GUESS, "args": {"high": 20}, "max_turns": 8}, 0.5),
    "guess10-told": ({"env": GUESS, "args": {"high": 10}, "max_turns": 6,
                      "template": "{observation}\nReply with the number only, for example: 4"}, 0.5),
    "trading8": ({"env": TRADING, "args": {"days": 8}, "max_turns": 8,
                  "template": "{observation}\nReply with one word: buy, sell or hold."}, 0.001),  # made money
    "GuessTheNumber-v0": ({"env": {"kind": "textarena", "game": "GuessTheNumber-v0"}, "max_turns": 10}, 1.0),
    "TowerOfHanoi-v0": ({"env": {"kind": "textarena", "game": "TowerOfHanoi-v0"}, "max_turns": 12}, 1.0),
    "Mastermind-v0": ({"env": {"kind": "textarena", "game": "Mastermind-v0"}, "max_turns": 10}, 1.0),
    "Minesweeper-v0-small": ({"env": {"kind": "textarena", "game": "Minesweeper-v0-small"}, "max_turns": 10}, 1.0),
    "FrozenLake-v0": ({"env": {"kind": "textarena", "game": "FrozenLake-v0"}, "max_turns": 10}, 1.0),
    "LightsOut-v0": ({"env": {"kind": "textarena", "game": "LightsOut-v0"}, "max_turns": 10}, 1.0),
    "FrozenLake-v1": ({"env": {"kind": "gymnasium", "game": "FrozenLake-v1"}, "args": {"is_slippery": False},
                       "max_turns": 12}, 1.0),
    "FrozenLake-v1-slippery": ({"env": {"kind": "gymnasium", "game": "FrozenLake-v1"}, "max_turns": 12}, 1.0),
    "CliffWalking-v1": ({"env": {"kind": "gymnasium", "game": "CliffWalking-v1"}, "max_turns": 20},
                        -17.0),  # the goal, in <= 17 steps
    "Blackjack-v1": ({"env": {"kind": "gymnasium", "game": "Blackjack-v1"}, "max_turns": 6}, 1.0),
    "Blackjack-v1-told": ({"env": {"kind": "gymnasium", "game": "Blackjack-v1"}, "max_turns": 6,
                           "template": "{observation}\nReply with one word only: hit or stick."}, 1.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32, help="held-out seeds per game")
    ap.add_argument("--max-tokens", type=int, default=48, help="one model turn")
    ap.add_argument("--episode-tokens", type=int, default=1024)
    ap.add_argument("--games", default=",".join(GAMES))
    ap.add_argument("--show", action="store_true", help="print each game's first episode")
    ap.add_argument("--compare", default="guess20", help="the game played overlapped and in lockstep ('' for none)")
    a = ap.parse_args()

    from ratchet.data.checkers import ReturnCheck
    from ratchet.data.sources.episodes import EpisodesSource
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler
    from ratchet.tasks.label_kinds import item_of
    from ratchet.tasks.rollouts.environment import EnvironmentRollout

    starts = EpisodesSource(train_size=64, eval_size=a.episodes).load(0, False).eval
    engine = open_sampler(default_model_dir(), SamplerConfig(backend="vllm", kv_cache_gb=4, max_model_len=2048),
                          seed=0)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=a.max_tokens)
    engine.generate(["Hello"] * 4, greedy, seed=1)  # warm-up, not measured
    print(f"default model on vLLM, {len(starts)} held-out seeds per game, greedy, max_tokens={a.max_tokens} a turn, "
          f"episode_tokens={a.episode_tokens}")
    print(f"{'game':<22} {'success':>7} {'return':>7} {'turns':>6} {'failed':>6} {'ep/s':>6} {'tok/s':>7} "
          f"{'env wait':>8} {'wall s':>7}")

    def play(settings: dict, params: SamplingParams, overlap: bool | None = None):
        ro = EnvironmentRollout(**settings, episode_tokens=a.episode_tokens, overlap=overlap)
        t = time.time()
        rows, cost = ro.roll(engine, starts, params, seed=0)
        return rows, cost, time.time() - t, ro

    for name in [g for g in a.games.split(",") if g]:
        settings, success = GAMES[name]
        rows, cost, wall, ro = play(settings, greedy)
        m = ro.metrics(cost)
        verdicts = ReturnCheck(success=success, needs_done=True).check_many([item_of(r) for r in rows])
        scored = [v for v in verdicts if v.correct is not None]
        print(f"{name:<22} {sum(v.correct for v in scored) / max(len(scored), 1):>7.0%} {m['return_mean']:>7.2f} "
              f"{m['turns_per_episode']:>6.1f} {m['env_failed']:>6.0f} {len(rows) / wall:>6.2f} "
              f"{cost['gen_tokens'] / wall:>7.0f} {cost['env_wait_s'] / wall:>8.1%} {wall:>7.1f}", flush=True)
        if a.show:
            r = rows[0]
            print(f"  {r.prompt_id}: {r.outcome.start[-300:]!r}")
            for seg in r.segments:
                print(f"  {seg.role:>5}: {seg.text[:200]!r}")
            print(f"  ended {r.outcome.ended}, return {r.outcome.ret}, failure {(r.outcome.failure or '')[-200:]!r}")
    if a.compare:
        settings, _ = GAMES[a.compare]
        sampled = SamplingParams(n=4, temperature=0.8, top_k=50, max_tokens=a.max_tokens)
        print(f"\n{a.compare}, sampled (n=4, temperature 0.8): the environment's steps beside generation")
        for label, overlap in (("overlapped", True), ("lockstep", False)):
            rows, cost, wall, ro = play(settings, sampled, overlap)
            print(f"{label:<22} {len(rows) / wall:>6.2f} episodes/s {cost['gen_tokens'] / wall:>7.0f} tok/s "
                  f"{cost['env_wait_s'] / wall:>6.1%} of wall time waiting on the environment ({wall:.1f} s)",
                  flush=True)
    engine.close()


if __name__ == "__main__":
    main()
