"""Train kinds: how a round's accepted rows become its policy. Each is one module, a config model
(a member of TrainConfig's union) that declares the rows it consumes and trains on them
(models/trainer.py: OptimSettings); this union is their registration.

    rft  supervised fine-tuning on accepted samples (RFT / ReST-EM / STaR)
    dpo  DPO on preference pairs
"""

from __future__ import annotations

import typing
from typing import Annotated

from pydantic import Field

from ratchet.models.train_kinds.dpo import DPOTrainConfig
from ratchet.models.train_kinds.rft import RFTTrainConfig

TrainConfig = Annotated[RFTTrainConfig | DPOTrainConfig, Field(discriminator="kind")]


def config_class(kind: str) -> type:
    """The config model of the train kind named `kind`."""
    members = typing.get_args(typing.get_args(TrainConfig)[0])
    for cls in members:
        if cls.model_fields["kind"].default == kind:
            return cls
    raise ValueError(f"train.kind={kind!r} is not a known kind; use one of "
                     f"{[c.model_fields['kind'].default for c in members]}")
