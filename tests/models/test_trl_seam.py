"""The seam with TRL and transformers (models/train_kinds/seam.py): each internal a trainer class
of ours rests on is still in the installed libraries, one test an entry; and no class of ours
overrides a library method the table does not name."""

import importlib
import importlib.metadata
import inspect

import pytest

from ratchet.models.train_kinds.seam import SEAM, TRL_VERSION, Reach


def _owner(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _ours():
    from ratchet.models.train_kinds.grpo_trainer import RatchetGRPOTrainer
    from ratchet.models.train_kinds.trainers import RatchetDPOTrainer, RatchetSFTTrainer

    return (RatchetSFTTrainer, RatchetDPOTrainer, RatchetGRPOTrainer)


def test_the_seam_was_read_from_the_pinned_trl():
    assert importlib.metadata.version("trl") == TRL_VERSION  # pyproject's pin


@pytest.mark.parametrize("reach", SEAM, ids=lambda r: f"{r.owner}.{r.member}")
def test_each_internal_we_reach_is_still_there(reach: Reach):
    owner = _owner(reach.owner)
    if reach.params is not None:
        theirs = list(inspect.signature(getattr(owner, reach.member)).parameters)
        theirs = theirs[1:] if theirs[:1] == ["self"] else theirs
        assert theirs[:len(reach.params)] == list(reach.params), f"{reach.owner}.{reach.member}{tuple(theirs)}"
    if reach.source is not None:
        assert reach.source in inspect.getsource(owner), f"{reach.owner} no longer has {reach.source!r}"


def test_every_method_our_trainers_override_is_in_the_seam():
    """An override the table does not name is a reach no test guards; __init__ is each class's own."""
    named = {(r.ours, r.member) for r in SEAM}
    for cls in _ours():
        for name, attr in vars(cls).items():
            if callable(attr) and not name.startswith("__"):
                inherited = any(hasattr(base, name) for base in cls.__mro__[1:])
                assert not inherited or (cls.__name__, name) in named, f"{cls.__name__}.{name} overrides the library"
