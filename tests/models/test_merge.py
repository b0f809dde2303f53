"""The merge a LoRA train stage writes its model with, and a dropped model is made again with (models/trainer.py `merged`)."""

import pytest
import torch

pytestmark = pytest.mark.integration


def test_the_merge_into_copied_weights_writes_what_peft_s_own_merge_does(tiny_model, tmp_path):
    """`merged` copies each adapted weight out of the base's mapped file before PEFT adds the adapter into
    it (the copy-on-write of every page made the default model's merge 4-5x slower): the same values
    as PEFT's merge into the mapped weights, bit for bit, the base's file untouched."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ratchet.models.trainer import adapted, merged

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), lora).save_pretrained(
        tmp_path / "adapter")
    before = load_file(str(tiny_model / "model.safetensors"))

    ours = merged(adapted(tiny_model, tmp_path / "adapter")).state_dict()
    peft = adapted(tiny_model, tmp_path / "adapter").merge_and_unload().state_dict()

    assert ours.keys() == peft.keys()
    assert all(torch.equal(ours[k], peft[k]) for k in ours)
    changed = [k for k in before if not torch.equal(before[k], ours[k])]
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed), changed  # the adapter was merged
    after = load_file(str(tiny_model / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base's file as it was
