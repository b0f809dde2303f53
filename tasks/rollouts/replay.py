"""An environment's demonstrations replayed (a cold start's, data/demonstrations.py): each row's
assistant turns played in the environment from the row's start, as a tree search replays a path,
so a row whose observations are not the environment's, or that goes on past the episode's end, is
refused before any model loads, and the check scores the return the replay earned."""

from __future__ import annotations

from ratchet.data.checks.base import Item
from ratchet.data.errors import show
from ratchet.tasks.environments import EPISODE_KEYS as _KEYS, row_of, seed_of


def replay_demonstrations(rollout, demos: list, report, source: str) -> dict[str, Item]:
    """Each row replayed in the environment, from its start (the row's `seed` and columns, as a
    prompt row's): it must begin with the row's first user turn, answer each assistant turn with
    the row's next user turn, and not end the episode before the row does. The item the check
    scores carries the return the replay earned."""
    kept = []
    for d in demos:
        if extra := d.roles() - {"model", "env"}:
            report.add(source, "turns an environment episode does not have", d.place, f"{', '.join(sorted(extra))} "
                       "turns", "give the environment's observations as user turns, or set sample.rollout.kind="
                       "tool for a program's output")
        elif (n := sum(t.role == "model" for t in d.turns)) > rollout.max_turns:
            report.add(source, "rows of more model turns than an episode has", d.place,
                       f"{n} assistant turns > sample.rollout.max_turns={rollout.max_turns}",
                       "raise sample.rollout.max_turns, or shorten the row")
        else:
            kept.append(d)
    if not kept:
        return {}
    host = rollout.host(fields=tuple(sorted({k for d in kept for k in d.fields})))
    keys = {d.id: next(_KEYS) for d in kept}
    try:
        return _replay(host, kept, keys, report, source)
    finally:
        host.drop(list(keys.values()))



def _replay(host, demos: list, keys: dict[str, int], report, source: str) -> dict[str, Item]:
    def wrong(d, kind: str, at: str, detail: str, fix: str) -> None:
        report.add(source, kind, f"{d.place} {at}", detail, fix)
        live.pop(d.id, None)

    replay = ("an episode replays the row's assistant turns from the row's start (its `seed` and other columns); "
              "give the environment's own observations, or the start they come from")
    for d in demos:
        p = d.as_prompt()
        host.send(keys[d.id], "open", seed=seed_of(p), row=row_of(p))
    live = {d.id: d for d in demos}
    rewards: dict[str, list[float]] = {d.id: [] for d in demos}
    ended: dict[str, str] = {}
    opened = host.collect([keys[d.id] for d in demos])
    for d in demos:
        reply = opened[keys[d.id]]
        if reply.failure is not None:
            wrong(d, "rows the environment failed on", "reset", reply.failure[-300:], "fix the environment or the "
                  "row's start")
        elif (reply.observation or "").strip() != d.prompt.strip():
            wrong(d, "rows that do not begin as the environment does", "messages[0]",
                  f"the environment began {show(reply.observation, 80)}; the row begins {show(d.prompt, 80)}", replay)
    at = {d.id: 0 for d in demos}  # the index of the row's next turn
    while live:
        stepping = list(live.values())
        for d in stepping:
            host.send(keys[d.id], "step", action=d.turns[at[d.id]].text)
        replies = host.collect([keys[d.id] for d in stepping])
        for d in stepping:
            reply, i = replies[keys[d.id]], at[d.id] + 1  # turns[i]: the observation the row gives next
            if reply.failure is not None:
                wrong(d, "rows the environment failed on", f"messages[{i}]", reply.failure[-300:],
                      "fix the environment or the row")
                continue
            rewards[d.id].append(reply.reward)
            if i == len(d.turns):
                ended[d.id] = "done" if reply.done else "max_turns"
                live.pop(d.id)
            elif reply.done:
                wrong(d, "rows that go on after the environment ended the episode", f"messages[{i + 1}]",
                      f"the environment said done after messages[{i}]", "end the row at the turn the "
                      "environment ends on")
            elif (reply.observation or "").strip() != d.turns[i].text.strip():
                wrong(d, "observations that are not the environment's", f"messages[{i + 1}]",
                      f"the environment answered {show(reply.observation, 80)}; the row gives "
                      f"{show(d.turns[i].text, 80)}", replay)
            else:
                at[d.id] = i + 1
    finished = [d for d in demos if d.id in ended]
    for d in finished:
        host.send(keys[d.id], "finish")
    finals = host.collect([keys[d.id] for d in finished])
    out = {}
    for d in finished:
        reply = finals[keys[d.id]]
        if reply.failure is not None:
            report.add(source, "rows the environment failed on", f"{d.place} final_reward", reply.failure[-300:],
                       "fix the environment")
            continue
        out[d.id] = d.item(sum(rewards[d.id]) + (reply.final or 0.0), ended[d.id])
    return out

