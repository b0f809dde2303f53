"""Sampling throughput, side by side in one run, on the same prompts:

  1. vLLM called directly (engine in this process)
  2. the sample stage on vLLM, as the pipeline runs it: a worker process, sharding,
     JSONL writes, digests and the manifest -- the orchestration overhead
  3. HF transformers generate called directly

    python bench/sample_bench.py [--prompts 64] [--n 8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()

    from ratchet.data.prompts import AdditionSource
    from ratchet.data.store import ArtifactStore
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.sampler import SamplerConfig, open_sampler
    from ratchet.tasks.prepare import base_model, prompts as prompts_stage
    from ratchet.tasks.sample import SampleConfig, sample

    model = default_model_dir()
    cfg = SampleConfig(n=a.n, max_tokens=a.max_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = ArtifactStore(Path(tmp))
        src = AdditionSource(eval_size=50, train_size=a.prompts)
        pm, _ = prompts_stage(store, src, seed=0, sources={})
        base, _ = base_model(store, "default", model)
        from ratchet.data.records import Prompt, read_jsonl

        texts = [p.prompt for p in read_jsonl(store.path(pm, "train.jsonl"), Prompt)]

        def direct(backend: str) -> dict:
            t0 = time.time()
            s = open_sampler(model, SamplerConfig(backend=backend, kv_cache_gb=4), seed=0)
            load = time.time() - t0
            t1 = time.time()
            out = s.generate(texts, cfg.params(), seed=0)
            gen = time.time() - t1
            s.close()
            del s
            gc.collect()
            toks = sum(g.n_tokens for o in out for g in o)
            return {"path": f"{backend} direct", "load_s": load, "gen_s": gen, "tokens": toks,
                    "wall_s": time.time() - t0}

        rows.append(direct("vllm"))
        t0 = time.time()
        m, _ = sample(store, base, pm, cfg, SamplerConfig(backend="vllm", kv_cache_gb=4), seed=0, round=1,
                      isolate=True)
        rows.append({"path": "vllm sample stage", "load_s": m.metrics["load_s"], "gen_s": m.metrics["gen_s"],
                     "tokens": int(m.metrics["gen_tokens"]), "wall_s": time.time() - t0})
        if not a.skip_hf:
            rows.append(direct("hf"))

    print(f"\n{a.prompts} prompts x n={a.n}, max_tokens={a.max_tokens}, T={cfg.temperature}, top_k={cfg.top_k}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'path':<20} {'load s':>7} {'gen s':>7} {'tokens':>7} {'gen tok/s':>10} {'wall s':>7} {'wall tok/s':>10}")
    for r in rows:
        print(f"{r['path']:<20} {r['load_s']:>7.1f} {r['gen_s']:>7.1f} {r['tokens']:>7d} "
              f"{r['tokens'] / r['gen_s']:>10.1f} {r['wall_s']:>7.1f} {r['tokens'] / r['wall_s']:>10.1f}")
    d, st = rows[0], rows[1]
    print(f"\nstage / direct (vLLM): generation tok/s x{(st['tokens'] / st['gen_s']) / (d['tokens'] / d['gen_s']):.2f}, "
          f"end-to-end tok/s x{(st['tokens'] / st['wall_s']) / (d['tokens'] / d['wall_s']):.2f}")
    if len(rows) > 2:
        h = rows[2]
        print(f"vLLM / HF generate: generation tok/s x{(d['tokens'] / d['gen_s']) / (h['tokens'] / h['gen_s']):.2f}")


if __name__ == "__main__":
    main()
