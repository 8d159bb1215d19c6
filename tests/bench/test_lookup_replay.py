"""benchmarks/lookup_replay.py: prompt lookup replayed on greedy outputs steps as the engine does, priced by a table."""

from __future__ import annotations

import gzip
import json

import pytest

from blockspec import PromptLookup
from blockspec.policy.base import LatencyTable

PROMPT = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]  # its last 3 tokens occurred before, followed by 4, 5, 6


@pytest.fixture(scope="module")
def replay_prompt(benchmark_script):
    return benchmark_script("lookup_replay").replay_prompt


def costs(*ms: float) -> PromptLookup:
    """Lookup priced by a table of ``ms[w - 1]`` milliseconds for a forward over w tokens."""
    return PromptLookup(costs=LatencyTable((1,), tuple(range(1, len(ms) + 1)), (tuple(m / 1e3 for m in ms),)))


def test_a_copy_is_proposed_whole_and_accepted_in_one_step(replay_prompt):
    # every width costs one step: the 3 tokens after the match, all the room leaves (4 new tokens, the last the
    # target's own), are proposed and accepted, so 4 tokens take one step where the target alone takes 4
    speed, proposals = replay_prompt(costs(*[10] * 5), PROMPT, [4, 5, 6, 7], max_new_tokens=4)
    assert proposals == [(3, 3, 3)]
    assert speed == pytest.approx(4.0)


def test_a_proposal_is_accepted_up_to_the_first_difference(replay_prompt):
    # step 1 proposes 4 5 6 and keeps 4, then 8; step 2 matches nothing (8 is new); step 3 matches 5 but has no room
    speed, proposals = replay_prompt(costs(*[10] * 5), PROMPT, [4, 8, 5, 6], max_new_tokens=4)
    assert proposals == [(3, 3, 1)]
    assert speed == pytest.approx(4 / 3)


def test_where_a_wider_forward_costs_in_proportion_nothing_is_proposed(replay_prompt):
    # E(k) < k + 1 tokens for a forward costing k + 1 steps: no proposal pays, and the speed is the target alone's
    speed, proposals = replay_prompt(costs(10, 20, 30, 40, 50), PROMPT, [4, 5, 6, 7], max_new_tokens=4)
    assert proposals == []
    assert speed == 1.0


def test_the_replay_reads_gzipped_records_as_it_reads_plain_ones(benchmark_script, tmp_path, capsys):
    replay = benchmark_script("lookup_replay").main
    row = {"dataset": "humaneval", "prompt": "p", "max_new_tokens": 4, "ids": PROMPT, "output": [4, 5, 6, 7]}
    (tmp_path / "records.jsonl").write_text(json.dumps(row) + "\n")
    with gzip.open(tmp_path / "records.jsonl.gz", "wt") as out:
        out.write(json.dumps(row) + "\n")
    flat = tmp_path / "costs.json"
    flat.write_text(json.dumps({"batch_sizes": [1], "tokens": [1, 2, 3, 4], "seconds": [[0.01] * 4]}))
    printed = []
    for name in ("records.jsonl", "records.jsonl.gz"):
        assert replay(["replay", "--records", str(tmp_path / name), "--costs", str(flat)]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1]
    assert "| humaneval | 1 | 4.000x | 4.000x | 1.00 |" in printed[0]  # the copy proposed whole: 4 tokens, 1 step
