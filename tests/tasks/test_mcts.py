"""The tree search: UCT/PUCT and backup by hand, one scripted wave, pair extraction,
and seeded determinism with a real model."""

import math

import pytest

from ratchet.models.sampler import Generation
from ratchet.tasks.label_kinds.mcts import MctsLabel
from ratchet.tasks.label_kinds.tree_search import Node, Tree, backup, complete_nodes, puct, search, select, step_pairs, uct, wave


def hand_tree() -> Tree:
    """root (N=10) with A (N=6, W=3, P=.5), B (N=3, W=2, P=.25), C (N=1, W=0, P=.25)."""
    t = Tree(prompt_id="p", prompt="What is 6 + 5?", answer="11")
    t.root.n, t.root.w = 10, 5.0
    for step, n, w, prior in [("A", 6, 3.0, 0.5), ("B", 3, 2.0, 0.25), ("C", 1, 0.0, 0.25)]:
        x = t.add_child(t.root, step, prior, step_tokens=1, spent=1, ended=False, max_depth=3)
        x.n, x.w, x.value = n, w, 0.0
    return t


def test_uct_and_puct_scores_by_hand():
    t = hand_tree()
    a, b, c = t.nodes[1:]
    # UCT = Q + c sqrt(ln N_parent / N)
    assert uct(a, 10, 1.0) == pytest.approx(0.5 + math.sqrt(math.log(10) / 6))  # 1.1195
    assert uct(b, 10, 1.0) == pytest.approx(2 / 3 + math.sqrt(math.log(10) / 3))  # 1.5427
    assert uct(c, 10, 1.0) == pytest.approx(math.sqrt(math.log(10)))  # 1.5174
    assert uct(Node(id=9, parent=0, depth=1), 10, 1.0) == math.inf  # unvisited first
    # PUCT = Q + c P sqrt(N_parent) / (1 + N)
    assert puct(a, 10, 1.0) == pytest.approx(0.5 + 0.5 * math.sqrt(10) / 7)  # 0.7259
    assert puct(b, 10, 1.0) == pytest.approx(2 / 3 + 0.25 * math.sqrt(10) / 4)  # 0.8643
    assert puct(c, 10, 1.0) == pytest.approx(0.25 * math.sqrt(10) / 2)  # 0.3953


@pytest.mark.parametrize("selection, c, expected", [
    ("uct", 1.0, "B"),  # 1.543 > 1.517 (C) > 1.120 (A)
    ("uct", 2.0, "C"),  # 3.035 > 2.419 (B) > 1.739 (A): more exploration picks the least visited
    ("puct", 1.0, "B"),  # 0.864 > 0.726 (A) > 0.395 (C)
    ("puct", 4.0, "C"),  # 1.581 > 1.457 (B) > 1.404 (A)
    ("puct", 0.0, "B"),  # greedy on Q
])
def test_select_follows_the_tree_policy(selection, c, expected):
    assert select(hand_tree(), selection, c).step == expected


def test_backup_adds_the_value_along_the_path_only():
    t = hand_tree()
    b = t.nodes[2]
    leaf = t.add_child(b, "B1", 1.0, step_tokens=1, spent=1, ended=True, max_depth=3)
    backup(t, leaf, 1.0)
    assert (leaf.n, leaf.w) == (1, 1.0)
    assert (b.n, b.w, b.q) == (4, 3.0, 0.75)
    assert (t.root.n, t.root.w) == (11, 6.0)
    assert (t.nodes[1].n, t.nodes[3].n) == (6, 1)  # siblings untouched
    assert select(t, "puct", 0.0) is leaf  # Q(B) = .75 now leads, and B's only child is final


class Scripted:
    """A sampler whose completions are looked up by (prompt prefix, call kind)."""

    def __init__(self, steps: dict[str, list[Generation]], rollouts: dict[str, str]):
        self.steps, self.rollouts, self.calls = steps, rollouts, []

    def generate(self, prompts, params, seed, prefixes=None):
        self.calls.append((len(prompts), params.n, params.stop, params.max_tokens))
        if params.stop:  # an expansion
            return [self.steps[p] for p in prefixes]
        return [[Generation(self.rollouts[p], 3, "stop")] for p in prefixes]


def verifier(items):
    out = []
    for t, text in items:
        ok = text.rstrip().endswith(t.answer)
        out.append((float(ok), ok))
    return out


def scripted_tree():
    cfg = MctsLabel(k=3, max_depth=2, step_delimiter=". ", selection="puct", c_explore=1.0)
    sampler = Scripted(
        steps={"": [Generation("Add them. ", 4, "stop", ". "), Generation("Add them. ", 4, "stop", ". "),
                    Generation("It is 12", 5, "stop")],
               "Add them.": [Generation(" 6 + 5 = 11", 6, "stop"), Generation(" So 6 + 5 is 10", 7, "stop"),
                             Generation(" So 6 + 5 is 10", 7, "stop")]},
        rollouts={"Add them.": " The sum is 11"},
    )
    t = Tree(prompt_id="p", prompt="What is 6 + 5?", answer="11")
    return t, sampler, cfg


def test_one_wave_expands_merges_duplicates_rolls_out_and_backs_up():
    t, sampler, cfg = scripted_tree()
    wave([t], sampler, cfg, seed=0, score=verifier)
    root, add, twelve = t.nodes
    # the two identical "Add them. " samples merge: prior 2/3; "It is 12" ended the response. The step keeps
    # the delimiter's period, not its space: the next step brings its own (" 6 + 5"), as the model writes it
    assert (add.step, add.prior, add.step_tokens, add.spent, add.ended) == ("Add them.", 2 / 3, 4, 8 + 3, False)
    assert (twelve.step, twelve.prior, twelve.ended, twelve.final, twelve.rollout) == ("It is 12", 1 / 3, True,
                                                                                       True, "")
    # one batched expansion (n=k, stopping at the delimiter), one rollout for the open child only
    assert sampler.calls == [(1, 3, (". ",), cfg.step_max_tokens), (1, 1, (), cfg.rollout_tokens)]
    assert (add.value, add.correct, twelve.value, twelve.correct) == (1.0, True, 0.0, False)
    assert (root.n, root.w, add.n, add.q, twelve.n, twelve.q) == (2, 1.0, 1, 1.0, 1, 0.0)
    assert t.gen_tokens() == 4 + 4 + 5 + 3

    # wave 2: PUCT picks "Add them." (1 + 2/3 sqrt2/2 > 0 + 1/3 sqrt2/2) and expands it at max depth
    wave([t], sampler, cfg, seed=1, score=verifier)
    kids = [t.nodes[i] for i in add.children]
    assert [(x.step, x.prior, x.final, x.value) for x in kids] == [(" 6 + 5 = 11", 1 / 3, True, 1.0),
                                                                 (" So 6 + 5 is 10", 2 / 3, True, 0.0)]
    assert (add.n, add.w, root.n, root.w) == (3, 2.0, 4, 2.0)
    # trajectories: prefix + step (+ rollout), best first
    assert [t.trajectory(x) for x in complete_nodes(t)][:2] == ["Add them. 6 + 5 = 11", "Add them. The sum is 11"]


def test_step_pairs_from_a_small_tree():
    t, sampler, cfg = scripted_tree()
    for s in range(2):
        wave([t], sampler, cfg, seed=s, score=verifier)
    pairs = step_pairs(t, margin=0.3, min_visits=1, max_pairs=5)
    # root: Q("Add them.") = 2/3 vs Q("It is 12") = 0 -> gap 2/3; at "Add them.": 1 vs 0 -> gap 1
    assert [(p["node"], p["depth"], round(p["gap"], 4)) for p in pairs] == [(1, 1, 1.0), (0, 0, 0.6667)]
    deep, root = pairs
    # both sides share the prefix up to the node and part at the step
    assert (deep["chosen"], deep["rejected"]) == ("Add them. 6 + 5 = 11", "Add them. So 6 + 5 is 10")
    # the better child is completed by its best trajectory, the worse by its worst
    assert (root["chosen"], root["rejected"]) == ("Add them. 6 + 5 = 11", "It is 12")
    assert (root["chosen_correct"], root["rejected_correct"]) == (True, False)
    assert step_pairs(t, margin=0.7, min_visits=1, max_pairs=5) == [deep]  # the root gap is below the margin
    assert step_pairs(t, margin=0.3, min_visits=2, max_pairs=5) == []  # the depth-2 siblings have 1 visit each
    assert step_pairs(t, margin=0.3, min_visits=1, max_pairs=1) == [deep]
    assert Tree.from_json(t.to_json()).to_json() == t.to_json()  # trees round-trip through trees.jsonl


def test_text_judge_cannot_value_rollouts():
    with pytest.raises(ValueError, match="mode 'rating' or 'p_yes'"):
        MctsLabel(value="judge", judge={"mode": "text"})


@pytest.mark.integration
def test_same_seed_same_trees_on_a_real_model(tiny_model):
    from pathlib import Path

    from ratchet.models.sampler import SamplerConfig, open_sampler

    sampler = open_sampler(Path(tiny_model), SamplerConfig(backend="hf", dtype="float32"), seed=0)
    cfg = MctsLabel(simulations=3, k=3, max_depth=3, step_max_tokens=3, rollout_tokens=4)

    def trees(seed):
        ts = [Tree(prompt_id=str(i), prompt=f"What is {i} + 2?", answer=str(i + 2)) for i in range(3)]
        search(ts, sampler, cfg, seed, lambda items: [(float(len(text) % 2), None) for _, text in items])
        return [t.to_json() for t in ts]

    first = trees(7)
    assert trees(7) == first
    assert trees(8) != first
    assert all(len(t["nodes"]) > 1 + cfg.k for t in first)  # more than the root's expansion happened


def test_a_graded_value_steers_a_tree_before_its_first_correct_rollout():
    """With 0/1 values every node of an unsolved tree has Q = 0, so the tree policy can
    follow only the priors; a graded value ranks the near miss above the far one."""
    from ratchet.data.checkers import NumberCheck, graded

    def grade(items):
        return [(graded(NumberCheck(), text, t.answer, 0.5), False) for t, text in items]

    cfg = MctsLabel(k=3, max_depth=3, step_delimiter=". ", selection="puct", c_explore=0.1)
    for score, picked in [(verifier, "It is 20"), (grade, "Add them.")]:
        sampler = Scripted(steps={"": [Generation("It is 20", 4, "stop"), Generation("It is 20", 4, "stop"),
                                       Generation("Add them. ", 4, "stop", ". ")]},
                           rollouts={"Add them.": " The sum is 10"})
        t = Tree(prompt_id="p", prompt="What is 6 + 5?", answer="11")
        wave([t], sampler, cfg, seed=0, score=score)
        far, near = (t.nodes[i] for i in t.root.children)
        assert (far.step, near.step) == ("It is 20", "Add them.")
        if score is verifier:
            assert far.q == near.q == 0.0
        else:
            assert (far.q, near.q) == (pytest.approx(0.5 / 10), 0.25)
        assert select(t, "puct", cfg.c_explore).step == picked  # the prior (2/3) or the value decides


def test_a_wave_selects_past_final_leaves_to_a_node_that_can_grow():
    """Unsolved, Q = 0 everywhere: the prior (2/3) leads to "It is 20", a step that ended the
    response. The textbook rule backs its value up again and spends the wave on nothing; by
    default the wave passes it by and expands the open child."""
    steps = {"": [Generation("It is 20", 4, "stop"), Generation("It is 20", 4, "stop"),
                  Generation("Add them. ", 4, "stop", ". ")],
             "Add them.": [Generation(" So 6 + 5 is 10", 7, "stop")] * 3}
    for revisit in (True, False):
        cfg = MctsLabel(k=3, max_depth=3, step_delimiter=". ", revisit_final=revisit)
        sampler = Scripted(steps=steps, rollouts={"Add them.": " The sum is 10"})
        t = Tree(prompt_id="p", prompt="What is 6 + 5?", answer="11")
        wave([t], sampler, cfg, seed=0, score=verifier)
        far, near = (t.nodes[i] for i in t.root.children)
        assert far.final and not near.final and select(t, "puct", cfg.c_explore) is far
        wave([t], sampler, cfg, seed=1, score=verifier)
        if revisit:
            assert len(sampler.calls) == 2 and (far.n, near.n, len(t.nodes)) == (2, 1, 3)  # no call, no new node
        else:
            assert len(sampler.calls) == 3 and (far.n, near.n, len(t.nodes)) == (1, 2, 4)  # one expansion
            assert [t.nodes[i].step for i in near.children] == [" So 6 + 5 is 10"]
            assert select(t, "puct", cfg.c_explore, past_final=True) is None  # every path ends final: spent
            before = t.to_json()
            wave([t], sampler, cfg, seed=2, score=verifier)
            assert len(sampler.calls) == 3 and t.to_json() == before  # a spent tree sits the wave out


def test_growable_marks_what_a_wave_could_still_expand():
    from ratchet.tasks.label_kinds.tree_search import growable

    t, sampler, cfg = scripted_tree()
    assert growable(t) == [True]  # a bare root
    wave([t], sampler, cfg, seed=0, score=verifier)
    assert growable(t) == [True, True, False]  # "Add them." is open, "It is 12" ended
    wave([t], sampler, cfg, seed=1, score=verifier)
    assert growable(t) == [False] * 5  # "Add them."'s children sit at max_depth


def test_a_step_leaves_its_delimiters_trailing_space_to_the_next_step():
    from ratchet.tasks.label_kinds.tree_search import step_text

    assert step_text("So 7 - 1 = 6. ", ". ") == "So 7 - 1 = 6."  # " Then" is one token; " " + "Then" is not
    assert step_text("7 - 1 = 6\n", "\n") == "7 - 1 = 6\n"  # a newline is how the model ends a line: kept
    assert step_text("It is 12", None) == "It is 12"  # the response ended, or the step hit its token limit
    assert step_text(". ", ". ") == "."
    assert step_text(" ", " ") == " "  # a step is never emptied
    assert step_text("6. x", ". ") == "6. x"  # only a delimiter at the end is trimmed
