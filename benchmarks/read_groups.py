"""One read of a prompt for many (policy, ratio) jobs: the benchmarks' grouping of their jobs
so that the policies whose prefills read alike are compressed from one prefill state
(`jaxkv.prefill_each`); `jaxkv bench ruler` and `jaxkv bench ruler_shared` run their jobs
in these groups."""

from __future__ import annotations

from jaxkv import policies
from jaxkv.generation.budgets import budget_read_in_prefill, one_prefill_refusal


def reads_once(name: str, options: dict) -> bool:
    """Whether policy `name` with `options` can share a read of a prompt with other ratios and
    policies (`jaxkv.prefill_each`): its prefill reads no budget (WG-KV's ratios are
    thresholds); the full cache runs once anyway."""
    if name in ("full", "wgkv"):
        return False
    return budget_read_in_prefill(policies.get(name, **options)) is None


def prefill_classes(chosen: dict) -> dict:
    """{entry: class}: entries of `chosen` ({entry: (policy, params)}) in classes whose
    members' prefills read alike (`one_prefill_refusal`), each joining the first class that
    takes it."""
    classes: list[list] = []
    for entry in chosen:
        for members in classes:
            trial = [chosen[e] for e in (*members, entry)]
            if one_prefill_refusal([p for p, _ in trial], [q for _, q in trial]) is None:
                members.append(entry)
                break
        else:
            classes.append([entry])
    return {entry: index for index, members in enumerate(classes) for entry in members}


def job_groups(jobs, classes: dict) -> list[list[tuple]]:
    """`jobs` ((entry, ratio, setting, task, index), in run order) in groups that one prefill
    serves: a sample's pending jobs in one setting of the entries of one class of `classes`
    ({entry: class}, `prefill_classes`) together, in the first one's place, an entry's jobs
    side by side; every other job alone."""
    groups: dict[tuple, list[tuple]] = {}
    for job in jobs:
        entry, _, setting, task, index = job
        key = (classes[entry], setting, task, index) if entry in classes else job
        groups.setdefault(key, []).append(job)
    first_place = {entry: place for place, entry in reversed(list(enumerate(j[0] for j in jobs)))}
    # An entry's ratios side by side: `prefill_each` compresses them in one program.
    return [sorted(group, key=lambda job: first_place[job[0]]) for group in groups.values()]
