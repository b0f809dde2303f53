"""DPO step time on CPU, side by side in one run: TRL's fused LM head vs the plain fp32 head
that models.trainer.train_dpo installs off GPU. Same model, adapter, pairs and seed.

    python bench/dpo_bench.py [--pairs FILE.jsonl] [--steps 4] [--repeats 2]

FILE is a filter stage's train_set.jsonl (prompt/chosen/rejected); without it, pairs of
the default task are built (a correct answer against a wrong, longer one).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path



def _pairs(path: str | None, n: int) -> list[dict]:
    if path:
        return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()][:n]
    return [{"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}.",
             "rejected": f"To add {a} and {b}, count up {b} from {a}. The answer is {a + b + 1}."}
            for a in range(20) for b in range(10)][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    import torch
    from trl import DPOConfig, DPOTrainer

    from ratchet.models.default_model import default_model_dir
    from ratchet.models.train_kinds.dpo import DPOTrainConfig
    from ratchet.models.train_kinds.trainers import plain_lm_head
    from ratchet.models.trainer import chat_dataset, load_policy, resolve_precision, trainer_args

    cfg = DPOTrainConfig()
    prec = resolve_precision(cfg.precision)
    rows = _pairs(a.pairs, cfg.batch_size * a.steps)
    ds = chat_dataset([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    results: dict[str, list[float]] = {"trl": [], "plain": []}
    for _ in range(a.repeats):
        for variant in ("trl", "plain"):
            torch.manual_seed(0)
            model, tok, peft = load_policy(default_model_dir(), cfg, prec)
            with tempfile.TemporaryDirectory() as out:
                args, _ = trainer_args(DPOConfig, cfg, Path(out), 0, beta=cfg.beta, loss_type=cfg.loss_type)
                args.max_steps, args.save_strategy, args.disable_tqdm = a.steps, "no", True
                tr = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft)
                if variant == "plain":
                    assert plain_lm_head(tr.model.get_base_model())
                t = time.time()
                tr.train()
                results[variant].append((time.time() - t) / a.steps)
            print(f"{variant:>5}: {results[variant][-1]:.2f} s/step", flush=True)
    trl, plain = min(results["trl"]), min(results["plain"])
    print(f"\nprecision {prec}, batch {cfg.batch_size} pairs, {a.steps} steps, best of {a.repeats}")
    print(f"| head | s/step |\n|---|---:|\n| TRL fused (tiled) | {trl:.2f} |\n| plain fp32 | {plain:.2f} |")
    print(f"speed-up x{trl / plain:.2f}")


if __name__ == "__main__":
    main()
