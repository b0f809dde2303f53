"""The sampler backends are a kind family (models/sampler.py, models/served.py): each answers for
itself what it is and may do, and no module elsewhere compares a backend's name."""

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from ratchet.models.sampler import HFBackend, SamplerConfig, VLLMBackend, backend_kind
from ratchet.models.served import ServedBackend

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"vllm", "hf", "served"}
HOMES = {ROOT / "models" / "backends.py", ROOT / "models" / "sampler.py", ROOT / "models" / "served.py"}
ENDPOINT = {"base_url": "http://127.0.0.1:9/v1", "model": "policy"}


def _compared_names(path: Path) -> list[str]:
    """Where a backend's name is compared (==, !=, in, match case) in a module, as file:line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        consts = []
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                consts += [e.value for e in elts if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant):
            consts.append(node.value.value)
        if NAMES & {c for c in consts if isinstance(c, str)}:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_no_backend_name_is_compared_outside_its_module():
    """A new backend is one kind class: no `backend == "vllm"` elsewhere to find and extend."""
    found = [hit for folder in ("flows", "tasks", "models", "data") for path in sorted((ROOT / folder).rglob("*.py"))
             if path not in HOMES for hit in _compared_names(path)]
    assert found == []


def test_the_rule_finds_a_comparison(tmp_path):
    """The scan above would see one, written as the code before the kinds wrote it."""
    (tmp_path / "m.py").write_text('if cfg.sampler.backend != "served":\n    pass\nok = x in ("hf", "y")\n')
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert _compared_names(tmp_path / "m.py") == ["m.py:1", "m.py:3"]
    finally:
        ROOT = root


def test_each_kind_answers_for_itself():
    assert [type(backend_kind(n)) for n in ("vllm", "hf", "served")] == [VLLMBackend, HFBackend, ServedBackend]
    vllm, hf, served = (backend_kind(n) for n in ("vllm", "hf", "served"))
    assert (vllm.local, hf.local, served.local) == (True, True, False)
    assert (vllm.top_logprobs, hf.top_logprobs) == (20, None)
    assert vllm.bounded_context and not hf.bounded_context
    assert vllm.gpus(SamplerConfig(tensor_parallel_size=2)) == 2 and hf.gpus(SamplerConfig(backend="hf")) == 1
    assert SamplerConfig(backend="served", endpoint=ENDPOINT).backend_kind.name == "served"


@pytest.mark.parametrize("fields, says", [
    ({"backend": "served"}, "backend='served' needs endpoint"),
    ({"backend": "hf", "endpoint": ENDPOINT}, "backend='hf' runs the model here"),
])
def test_a_kinds_own_checks_refuse_its_fields(fields, says):
    with pytest.raises(ValidationError, match=says):
        SamplerConfig(**fields)


def test_a_policy_in_the_wrong_place_is_named_by_its_kind():
    assert "has weights of its own here" in backend_kind("served").policy_mismatch("runs/x")
    assert "is served elsewhere" in backend_kind("hf").policy_mismatch("runs/x")


def test_the_config_dump_is_the_same_for_every_kind():
    """Stage keys read the dump: the kind family adds nothing to it."""
    assert SamplerConfig().model_dump() == SamplerConfig.model_validate(SamplerConfig().model_dump()).model_dump()
    assert "backend_kind" not in SamplerConfig().model_dump()
