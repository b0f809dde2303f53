"""What runs a stage: its key and claim, its worker process, its units and where they run, the
code its key covers, and `ratchet plan`'s planner, which keys a stage instead of running it.

    stage.py       run_stage: key a stage, reuse it if finished, else compute it (maybe in a worker)
    units.py       a stage's units of work and the executor settings that run them
    code_reach.py  a stage's code version: the definitions its body can run
    plan.py        the planner `ratchet plan` hands each stage to
"""
