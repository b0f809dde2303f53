"""GPU benchmark: HF sampling tokens/s, and RFT and DPO training steps/s, tokens/s and MFU in
bf16, through Ratchet's own sampler and trainer code on CUDA.

    python bench/gpu_bench.py [--shapes 135m,1.7b] [--steps 8] [--prompt-words 48 --completion-words 320]
                              [--tokenizer DIR] [--peak-tflops 989] [--json FILE]

A GPU machine without a model hub has no weights to load, so each shape is a Llama built from
its config with seeded random weights (SmolLM2-135M's and SmolLM2-1.7B's shapes) and the
default model's tokenizer. Speed depends on shapes, dtypes and lengths, not on the weights'
values; random weights rarely sample an end-of-sequence token, so completions run to
max_tokens and the token counts say so.

Training goes through the stage's own pieces (load_policy, the trainer arguments, the chat
dataset, the stages' trainer classes RatchetSFTTrainer and RatchetDPOTrainer) for `--steps`
timed steps after 2 warm-up steps, with a CUDA sync at each step's end. MFU counts model FLOPs only, against the GPU's dense bf16
peak (H100/H200 SXM: 989 TFLOP/s): per trained token 6N for full fine-tuning, 4N with LoRA
(frozen weights need no weight gradient), plus the attention term 12*L*d*S; DPO adds the
reference's forward (2N per token: LoRA's reference is the adapter switched off). N counts the
weights of every matmul, the LM head included. Recomputation (gradient checkpointing) is not
counted, as MFU's definition has it.

On a lent GPU machine that has torch, transformers, peft and accelerate but no pydantic, TRL,
datasets or MLflow, those travel as wheels (31 of them, 17 MB, measured with this stack):
pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
(and the manylinux_2_17/2_28/2_34 tags) -d .whl mlflow-skinny==3.17.2 pydantic==2.14.3 trl==1.16.0
datasets==5.2.0 and what `pip install --dry-run --report` lists beyond the machine's packages; a
tokenizer directory (the default model's tokenizer files, 3.4 MB) goes with them, and
RATCHET_TEST_TOKENIZER points the GPU tests' tiny model at it. Ratchet itself need not travel
as a wheel: a folder `ratchet/` of links to the checkout's data, models, tasks and flows, put
on PYTHONPATH, runs the working tree as installed.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

SHAPES = {  # SmolLM2's published configs (Llama architecture, tied embeddings)
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}
WORDS = ("the of and to in is was for on that with as by at from his her an which are this be or had not "
         "but what all were when we there can more if no out so said time up one about into than them "
         "number sum answer step first then add value result next each total").split()


def build_model(shape: str, tokenizer_dir: Path, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, rms_norm_eps=1e-5,
                      rope_theta=10000.0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def matmul_params(model_dir: Path) -> tuple[int, int, int, int]:
    """(N: weights of every matmul, LM head included; layers; hidden size; vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    n = sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear))
    return n, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def bench_sampling(model_dir: Path, prompts: int, n: int, max_tokens: int) -> dict:
    import torch

    from ratchet.models.sampler import HFSampler, SamplerConfig, SamplingParams

    rng = random.Random(0)
    batch = [f"What is {rng.randrange(100)} + {rng.randrange(100)}?" for _ in range(prompts)]
    t = time.time()
    s = HFSampler(model_dir, SamplerConfig(backend="hf", dtype="bfloat16", hf_batch_size=prompts), seed=0)
    load = time.time() - t
    params = SamplingParams(n=n, temperature=0.8, top_p=0.95, max_tokens=max_tokens)
    s.generate(batch[:4], SamplingParams(n=1, max_tokens=8), seed=0)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t = time.time()
    out = s.generate(batch, params, seed=0)
    torch.cuda.synchronize()
    gen = time.time() - t
    tokens = sum(g.n_tokens for row in out for g in row)
    s.close()
    return {"load_s": load, "gen_s": gen, "sequences": prompts * n, "tokens": tokens, "tok_per_s": tokens / gen}


def _timer(steps_to_skip: int):
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            if state.global_step > steps_to_skip:
                self.times.append(time.perf_counter() - self._t)

    return StepTimer()


def bench_training(kind: str, adapter: str, model_dir: Path, a, peak: float) -> dict:
    import torch
    from trl import DPOConfig, SFTConfig

    from ratchet.models.train_kinds import DPOTrainConfig, RFTTrainConfig
    from ratchet.models.train_kinds.trainers import RatchetDPOTrainer, RatchetSFTTrainer
    from ratchet.models.trainer import chat_dataset, load_policy, resolve_precision, trainer_args

    warm = 2
    rng = random.Random(1)
    lr = 1e-4 if adapter == "lora" else 1e-5
    common = dict(adapter=adapter, lora={"r": 64, "alpha": 128}, precision="bf16", attention="sdpa",
                  learning_rate=lr, max_length=a.max_length, checkpoint_steps=10_000, logging_steps=10_000)
    if kind == "rft":
        cfg = RFTTrainConfig(batch_size=a.rft_batch, **common)
        rows = [{"prompt": text(rng, a.prompt_words), "completion": text(rng, a.completion_words)}
                for _ in range(cfg.batch_size * (a.steps + warm))]
    else:
        cfg = DPOTrainConfig(batch_size=a.dpo_batch, **common)
        rows = [{"prompt": text(rng, a.prompt_words), "chosen": text(rng, a.completion_words),
                 "rejected": text(rng, a.completion_words)} for _ in range(cfg.batch_size * (a.steps + warm))]
    prec = resolve_precision(cfg.precision)
    torch.manual_seed(0)
    model, tok, peft = load_policy(model_dir, cfg, prec)
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        if kind == "rft":
            args, _ = trainer_args(SFTConfig, cfg, Path(out), 0, completion_only_loss=True)
            args.num_train_epochs, args.save_strategy = 1, "no"
            tr = RatchetSFTTrainer(model=model, args=args, train_dataset=chat_dataset(rows),
                                   processing_class=tok, peft_config=peft)
            lengths = [len(x) for x in tr.train_dataset["input_ids"]]
        else:
            args, _ = trainer_args(DPOConfig, cfg, Path(out), 0, beta=cfg.beta, loss_type=list(cfg.loss_type))
            args.num_train_epochs, args.save_strategy = 1, "no"
            tr = RatchetDPOTrainer(model=model, args=args, train_dataset=chat_dataset(rows), processing_class=tok,
                                   peft_config=peft)
            d = tr.train_dataset
            lengths = [len(p) + len(c) + len(r) for p, c, r in zip(d["prompt_ids"], d["chosen_ids"], d["rejected_ids"])]
            # the sequences the model runs: prompt + chosen, prompt + rejected
            seqs = [len(p) + len(c) for p, c in zip(d["prompt_ids"], d["chosen_ids"])]
        timer = _timer(warm)
        tr.add_callback(timer)
        tr.train()
    step_s = sorted(timer.times)[len(timer.times) // 2]
    n, layers, hidden, _ = matmul_params(model_dir)
    mean_len = sum(lengths) / len(lengths)
    if kind == "rft":
        tokens_per_step = cfg.batch_size * mean_len
        seq = mean_len
        per_token = (6 if adapter == "full" else 4) * n + 12 * layers * hidden * seq
        flops = tokens_per_step * per_token
    else:
        # the forward/backward runs prompt + chosen and prompt + rejected: 2 sequences per pair
        seq = sum(seqs) / len(seqs)
        tokens_per_step = cfg.batch_size * 2 * seq
        train_per_token = (6 if adapter == "full" else 4) * n + 12 * layers * hidden * seq
        ref_per_token = 2 * n + 4 * layers * hidden * seq
        flops = tokens_per_step * (train_per_token + ref_per_token)
    achieved = flops / step_s / 1e12
    return {"kind": kind, "adapter": adapter, "batch": cfg.batch_size, "mean_tokens_per_row": mean_len,
            "steps_timed": len(timer.times), "s_per_step": step_s, "steps_per_s": 1 / step_s,
            "tokens_per_s": tokens_per_step / step_s, "model_tflops": achieved, "mfu": achieved / peak,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "params_matmul": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="135m,1.7b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--completion-words", type=int, default=320)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--rft-batch", type=int, default=16)
    ap.add_argument("--dpo-batch", type=int, default=8)
    ap.add_argument("--sample-prompts", type=int, default=64)
    ap.add_argument("--sample-n", type=int, default=8)
    ap.add_argument("--sample-tokens", type=int, default=256)
    ap.add_argument("--tokenizer", help="a tokenizer directory (default: the default model's)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: from its name)")
    ap.add_argument("--json", help="write every figure here too")
    a = ap.parse_args()

    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_bench.py needs a CUDA GPU")
    name = torch.cuda.get_device_name(0)
    peak = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        raise SystemExit(f"no bf16 peak known for {name!r}: pass --peak-tflops")
    if a.tokenizer:
        tokenizer = Path(a.tokenizer)
    else:
        from ratchet.models.default_model import default_model_dir

        tokenizer = default_model_dir()
    print(f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"bf16 peak {peak:.0f} TFLOP/s", flush=True)
    results = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
               "peak_tflops": peak, "shapes": {}}
    for shape in a.shapes.split(","):
        with tempfile.TemporaryDirectory() as d:
            model_dir = build_model(shape, tokenizer, Path(d) / shape)
            r = results["shapes"][shape] = {"sampling": bench_sampling(model_dir, a.sample_prompts, a.sample_n,
                                                                       a.sample_tokens), "training": []}
            s = r["sampling"]
            print(f"{shape}: HF generate {s['sequences']} sequences, {s['tokens']:,} tokens in {s['gen_s']:.1f} s: "
                  f"{s['tok_per_s']:,.0f} tok/s (load {s['load_s']:.1f} s)", flush=True)
            for kind, adapter in (("rft", "lora"), ("dpo", "lora"), ("rft", "full"), ("dpo", "full")):
                t = bench_training(kind, adapter, model_dir, a, peak)
                r["training"].append(t)
                print(f"{shape}: {kind} {adapter:>4} batch {t['batch']} x {t['mean_tokens_per_row']:.0f} tok: "
                      f"{t['steps_per_s']:.2f} steps/s, {t['tokens_per_s']:,.0f} tok/s, "
                      f"{t['model_tflops']:.0f} TFLOP/s, MFU {100 * t['mfu']:.1f}%, peak {t['peak_mem_gib']:.1f} GiB",
                      flush=True)
                torch.cuda.empty_cache()
    print("\n| shape | stage | adapter | batch | steps/s | tokens/s | MFU | peak GiB |\n|---|---|---|---:|---:|---:|---:|---:|")
    for shape, r in results["shapes"].items():
        s = r["sampling"]
        print(f"| {shape} | HF sampling ({s['sequences']} seq x {a.sample_tokens} max) | - | - | - | "
              f"{s['tok_per_s']:,.0f} | - | - |")
        for t in r["training"]:
            print(f"| {shape} | {t['kind']} | {t['adapter']} | {t['batch']} | {t['steps_per_s']:.2f} | "
                  f"{t['tokens_per_s']:,.0f} | {100 * t['mfu']:.1f}% | {t['peak_mem_gib']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
