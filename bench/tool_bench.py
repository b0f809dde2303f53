"""Tool rollouts against single answers, side by side in one run, on the same prompts and engine:

  1. single: one generation per sample (sample.rollout.kind=single)
  2. tool, overlapped: the unit's two halves take turns, one half's programs run while the
     other half generates (overlap: true; the default where the engine is on a GPU)
  3. tool, in lockstep: every episode generates, then every program runs (overlap: false; the
     default on a CPU)

Each prints its generated tokens per second (the model's tokens over the whole rollout's wall
time, programs included), its calls, and the share of wall time the engine sat waiting on
programs. The prompts are reasoning-gym products (the tool_rft.yaml task), so the model calls
the tool.

    python bench/tool_bench.py [--prompts 32] [--n 4] [--max-tokens 96] [--block-size 64]

`--block-size` is the engine's KV-cache block size (sampler.block_size; unset: vLLM's, 128 on
CPU). A prefix is reused in whole blocks, so it decides whether a continued episode re-reads
its earlier turns.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--block-size", type=int, default=None)
    a = ap.parse_args()

    from ratchet.data.sources.reasoning_gym import ReasoningGymSource
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler
    from ratchet.tasks.rollouts.single import SingleRollout
    from ratchet.tasks.rollouts.tool import ToolRollout

    src = ReasoningGymSource(dataset="products", config={"min_terms": 2, "max_terms": 2, "min_digits": 2,
                                                          "max_digits": 3}, eval_size=a.prompts, train_size=8)
    prompts = src.load(seed=0, train_answers=True).eval
    engine = open_sampler(default_model_dir(), SamplerConfig(backend="vllm", kv_cache_gb=4, block_size=a.block_size),
                          seed=0)
    params = SamplingParams(n=a.n, temperature=a.temperature, top_k=50, max_tokens=a.max_tokens)
    engine.generate([p.prompt for p in prompts[:4]], params, seed=1)  # warm-up, not measured
    runs = [("single", SingleRollout()), ("tool, overlapped", ToolRollout(overlap=True)),
            ("tool, lockstep", ToolRollout(overlap=False))]
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    print(f"{len(prompts)} prompts x {a.n} samples, max_tokens={a.max_tokens}, default model on vLLM, KV blocks of "
          f"{block} tokens")
    print(f"{'rollout':<18} {'wall s':>7} {'gen tok':>8} {'tok/s':>7} {'vs single':>9} {'calls':>6} "
          f"{'used tool':>9} {'waiting on tools':>16}")
    base = None
    for name, ro in runs:
        t = time.time()
        _, cost = ro.roll(engine, prompts, params, seed=0)
        wall = time.time() - t
        rate = cost["gen_tokens"] / wall
        base = base or rate
        episodes = cost.get("episodes", 0)
        print(f"{name:<18} {wall:>7.1f} {cost['gen_tokens']:>8.0f} {rate:>7.1f} {rate / base:>9.0%} "
              f"{cost.get('tool_calls', 0):>6.0f} {cost.get('tool_used', 0) / max(episodes, 1):>9.0%} "
              f"{cost.get('tool_wait_s', 0) / wall:>16.1%}")
    engine.close()


if __name__ == "__main__":
    main()
