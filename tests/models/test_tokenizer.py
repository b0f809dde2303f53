"""The tokenizer a run's fork server loads once for its stage workers (models/tokenizer.py)."""

import shutil

import pytest

pytestmark = pytest.mark.integration


def test_a_preloaded_tokenizer_is_taken_once_for_the_same_files_and_never_for_others(tiny_model, tmp_path,
                                                                                   monkeypatch):
    """A process takes the copy its fork server loaded once, for any directory with the same files (a
    trained model's copy of the base's), and it tokenizes as a load of its own does; the next load
    is a new object (no stage's change to it reaches another), and a directory whose tokenizer files
    differ never gets it."""
    from transformers import AutoTokenizer

    from ratchet.models import tokenizer

    monkeypatch.setattr(tokenizer, "_LOADED", {})
    trained = tmp_path / "trained"
    shutil.copytree(tiny_model, trained)  # what a train stage writes: the base's files, new weights
    (trained / "model.safetensors").write_bytes(b"other weights")
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text().replace(
        "}", ', "model_max_length": 77}', 1))

    tokenizer.preload(str(tiny_model))
    [copy] = tokenizer._LOADED.values()
    assert tokenizer.load(other) is not copy and tokenizer.load(other).model_max_length == 77
    taken = tokenizer.load(trained)
    assert taken is copy and tokenizer._LOADED == {}
    again = tokenizer.load(trained)
    assert again is not taken
    own = AutoTokenizer.from_pretrained(trained)
    text = "What is 12 + 30? Answer: 42 <|im_end|>"
    assert taken(text)["input_ids"] == again(text)["input_ids"] == own(text)["input_ids"]
    assert taken.chat_template == own.chat_template and taken.pad_token == own.pad_token

    tokenizer.preload(str(tmp_path / "missing"))  # one that does not load is the asker's to raise
    assert tokenizer._LOADED == {}
    with pytest.raises(OSError):
        tokenizer.load(tmp_path / "missing")
