"""A sequence-classification reward model: one scalar per (prompt, response).

The model is a local Hugging Face directory whose config names a
`*ForSequenceClassification` architecture with one label (the reward is its logit, as
reward models trained with TRL's RewardTrainer give) or two (the reward is the
probability of label 1). The pair is written as a chat, the user's prompt then the
assistant's response, with the reward model's own chat template; a tokenizer without
one reads "prompt\\n\\nresponse". Batched, longest sequences first, truncated from the
left so the end of the response is always seen.
"""

from __future__ import annotations

import json
from pathlib import Path


def describe(model_dir: Path) -> tuple[str, int] | str:
    """(architecture, num_labels) from a reward model's config.json, or what is wrong with it."""
    cfg_file = Path(model_dir) / "config.json"
    if not cfg_file.is_file():
        return f"{model_dir} has no config.json; give a Hugging Face model directory"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{cfg_file} cannot be read ({e})"
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a.endswith("ForSequenceClassification")), None)
    if arch is None:
        return (f"{model_dir} is a {archs or 'model without architectures'}, not a sequence-classification reward "
                "model (*ForSequenceClassification)")
    labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
    if labels not in (1, 2):
        return f"{model_dir} has num_labels={labels}; a reward model gives one score (1 label) or a yes/no (2)"
    return arch, labels


class RewardScorer:
    def __init__(self, model_dir: Path, dtype: str = "float32", batch_size: int = 16, max_length: int = 1024):
        import torch
        from transformers import AutoModelForSequenceClassification

        from ratchet.models import tokenizer

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
        self.tokenizer = tokenizer.load(model_dir)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch_dtype)
        self.model = self.model.to(self.device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length = batch_size, max_length

    def text(self, prompt: str, response: str) -> str:
        tok = self.tokenizer
        if tok.chat_template:
            return tok.apply_chat_template([{"role": "user", "content": prompt},
                                            {"role": "assistant", "content": response}], tokenize=False)
        return f"{prompt}\n\n{response}"

    def score(self, items: list[tuple[str, str]]) -> list[float]:
        import torch

        texts = [self.text(p, r) for p, r in items]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = [0.0] * len(texts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            enc = self.tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_length, add_special_tokens=False)
            with torch.inference_mode():
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits.float()
            vals = logits[:, 0] if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)[:, 1]
            for i, v in zip(idx, vals.tolist()):
                out[i] = v
        return out

    def close(self) -> None:
        del self.model
