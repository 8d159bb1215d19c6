"""benchmarks/length_replay.py: length policies replayed on greedy agreement bits step as the engine does, priced
by measured costs (the catch-up after plain steps at its own width)."""

from __future__ import annotations

import gzip
import json

import pytest

from blockspec.policy import FixedLength, LatencyTable
from blockspec.policy.latency import DRAFT_TOKENS, META_FIELDS, LatencyProfile


@pytest.fixture(scope="module")
def script(benchmark_script):
    return benchmark_script("length_replay")


def profile(target_ms, draft_ms=lambda n: n) -> LatencyProfile:
    """Costs of ``target_ms(n)`` for the target's forward over n tokens (1..9) and ``draft_ms(n)`` for the draft's
    over n (1, 2, 4, 8, 16, 64), in milliseconds."""
    draft_tokens = (1, 2, 4, 8, 16, 64)
    return LatencyProfile(
        LatencyTable((1,), tuple(range(1, 10)), (tuple(target_ms(n) / 1e3 for n in range(1, 10)),)),
        LatencyTable((1,), draft_tokens, (tuple(draft_ms(n) / 1e3 for n in draft_tokens),)),
        None,
        {field: None for field in META_FIELDS},
    )


class Scripted:
    """Drafts the lengths it is given, in turn, and records the catch-up it was asked at and what it was taught."""

    def __init__(self, *lengths):
        self.lengths, self.asked, self.taught = list(lengths), [], []

    def reset(self):
        pass

    def draft_budget(self, batch, catch_up):
        self.asked.append(catch_up)
        return self.lengths.pop(0)

    def observe(self, rows, draft_tokens, draft_probs, target_probs, verified, accepted):
        agrees = target_probs[0, : draft_tokens.shape[1]].argmax(-1) == draft_tokens[0]
        self.taught.append((int(verified[0]), int(accepted[0]), agrees.tolist()))


def test_a_drafting_step_after_plain_steps_pays_the_catch_up_of_all_it_did_not_read(script):
    # two plain steps (10 ms each), then K = 2 over agreeing positions 2, 3: the draft first reads the 3 tokens it
    # has not read (3 ms), drafts its second token (1 ms), the target scores 3 tokens (10 ms); 5 tokens in 34 ms
    policy = Scripted(0, 0, 2)
    speed, steps, plain, drafted = script.replay_prompt(policy, "00110", 5, profile(lambda n: 10))
    assert policy.asked == [1, 2, 3]
    assert policy.taught == [(2, 2, [True, True])]
    assert (steps, plain, drafted) == (3, 2, 2)
    assert speed == pytest.approx(50 / 34)


def test_a_chain_is_accepted_up_to_its_first_disagreement_and_teaches_every_position(script):
    # K = 3 over positions 0-2 (agree, disagree, agree): 1 accepted, then the target's own token; the next step
    # reads 1 token; positions 2 and 3 agree and room leaves K = 2 (5 tokens, the last the target's): all accepted,
    # the output ends. The policy learns every verified position, the one after the rejection too
    policy = Scripted(3, 3)
    speed, steps, _, drafted = script.replay_prompt(policy, "10110", 5, profile(lambda n: 10))
    assert policy.asked == [1, 1]
    assert policy.taught == [(3, 1, [True, False, True]), (2, 2, [True, True])]
    assert (steps, drafted) == (2, 5)
    assert speed == pytest.approx(50 / ((3 + 10) + (2 + 10)))


def test_the_adaptive_length_drafts_where_drafting_pays_and_never_where_it_cannot(script):
    agreeing = "1" * 64
    free = script.replay_prompt(FixedLength(0), agreeing, 64, profile(lambda n: 10))
    assert free == (pytest.approx(1.0), 64, 64, 0)
    auto = script.adaptive_or_alone(profile(lambda n: 10))
    assert script.replay_prompt(auto, agreeing, 64, profile(lambda n: 10))[0] > 3.0
    # a wider forward costing in proportion to its tokens: no draft can pay, so the target decodes alone
    proportional = profile(lambda n: 10 * n)
    alone = script.adaptive_or_alone(proportional)
    assert script.replay_prompt(alone, agreeing, 64, proportional) == (pytest.approx(1.0), 64, 64, 0)


def test_the_policy_is_priced_with_the_draft_widths_the_probe_measures(script):
    costs = profile(lambda n: 10, lambda n: n * n)
    seen = script.probed(costs)
    assert seen.draft.tokens == DRAFT_TOKENS
    assert [seen.draft(1, n) for n in DRAFT_TOKENS] == pytest.approx([costs.draft(1, n) for n in DRAFT_TOKENS])
    assert seen.draft(1, 16) > costs.draft(1, 16)  # interpolated from 8 and 32: the probe's view, not the truth


def test_report_prints_a_section_per_costs_file_and_a_row_per_dataset_and_policy(script, tmp_path, capsys):
    rows = [
        {"dataset": "humaneval", "prompt": "a", "max_new_tokens": 8, "match": "11111111", "target_agrees": 8},
        {"dataset": "gsm8k", "prompt": "b", "max_new_tokens": 8, "match": "00000000", "target_agrees": 7},
    ]
    with gzip.open(tmp_path / "records.jsonl.gz", "wt") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    profile(lambda n: 10).save(tmp_path / "costs-flat.json")
    profile(lambda n: 10 * n).save(tmp_path / "costs-proportional.json")
    assert script.main(["report", "--out", str(tmp_path), "--fixed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "agreed with its greedy output at 93.8% of positions" in printed  # 15 of 16
    flat, proportional = printed.split("## predicted speed over the target alone, costs-")[1:]
    assert flat.startswith("flat") and proportional.startswith("proportional")
    # K = 3 on 8 agreeing tokens: 4 + 4 tokens in two steps of 13 and 14 ms (the second reads 2 tokens first)
    assert f"| humaneval | 1 | fixed K=3 | {80 / 27:.3f}x | 3.00 | 0% |" in flat
    assert "| gsm8k | 1 | fixed K=3 |" in flat
    assert "| all | 2 | auto |" in flat
    assert "| all | 2 | auto | 1.000x | 0.00 | 100% |" in proportional  # no draft pays: the target alone
