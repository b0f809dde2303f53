"""Where a continuation draws its prompts: after everything this experiment's runs drew from
the same pool, and nothing that other experiments, pools or seeds drew."""

from ratchet.flows.config import config_from_dict
from ratchet.flows.runs import RunContext, RunRecord, pool_drawn, write_record


def _record(workdir, name, cfg, pool_start=0, sources=None):
    ctx = RunContext(run_name=name, workdir=str(workdir), parent_run_id="x", code_version="c", config_hash="h",
                     sources=sources or {}, pool_start=pool_start)
    write_record(workdir, RunRecord(ctx=ctx, config=cfg.model_dump(mode="json"), state="finished"))


def test_a_continuation_draws_after_every_earlier_run_of_the_same_pool(tmp_path):
    (tmp_path / "runs").mkdir()
    cfg = config_from_dict({"data": {"kind": "chain", "prompts_per_round": 64}, "rounds": 3})
    assert pool_drawn(tmp_path, cfg, {}) == 0  # nothing drawn yet
    _record(tmp_path, "fresh", cfg)  # rounds 1-3: stream positions 0-191
    assert pool_drawn(tmp_path, cfg, {}) == 192
    _record(tmp_path, "cont", config_from_dict({"data": {"kind": "chain", "prompts_per_round": 32}, "rounds": 2}),
            pool_start=192)  # another draw size continues the same stream
    assert pool_drawn(tmp_path, cfg, {}) == 256

    # other experiments, seeds, pools and data files, and whole-pool runs, drew nothing from this stream
    _record(tmp_path, "other-name", config_from_dict({"name": "x", "data": {"kind": "chain", "prompts_per_round": 999}}))
    _record(tmp_path, "other-seed", config_from_dict({"seed": 5, "data": {"kind": "chain", "prompts_per_round": 999}}))
    _record(tmp_path, "other-pool", config_from_dict({"data": {"kind": "chain", "prompts_per_round": 999,
                                                               "train_size": 1000}}))
    _record(tmp_path, "other-file", cfg, pool_start=5000, sources={"path": "abc"})
    _record(tmp_path, "whole-pool", config_from_dict({"data": {"kind": "chain"}, "rounds": 9}))
    assert pool_drawn(tmp_path, cfg, {}) == 256
