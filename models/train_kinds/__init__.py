"""Train kinds: how a round's accepted rows become its policy. Each is one module, a config model
(a member of TrainConfig's union) that declares the rows it consumes and trains on them
(models/trainer.py: OptimSettings); this union is their registration.

    rft  supervised fine-tuning on accepted samples (RFT / ReST-EM / STaR)
    dpo  DPO on preference pairs
    grpo online RL from the round's prompts: groups sampled on the run's engine, scored by the
         run's reward, group-relative advantages (GRPO, RLOO), TRL's GRPOTrainer
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ratchet.data.kinds import member
from ratchet.models.train_kinds.dpo import DPOTrainConfig
from ratchet.models.train_kinds.grpo import GRPOTrainConfig
from ratchet.models.train_kinds.rft import RFTTrainConfig

TrainConfig = Annotated[RFTTrainConfig | DPOTrainConfig | GRPOTrainConfig, Field(discriminator="kind")]


def config_class(kind: str) -> type:
    """The config model of the train kind named `kind`."""
    return member(TrainConfig, kind, "train.kind")
