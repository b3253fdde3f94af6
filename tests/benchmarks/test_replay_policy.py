"""The policy replay: exact token accounting, and the adaptive controller against its options
on acceptance traces where the right answer is known."""

from __future__ import annotations

import json

import pytest

from benchmarks import replay_policy as rp

K = 7


def run(traces, policy, believe="true", **kw):
    return rp.replay(traces, policy, k_max=K, step_ms=rp.STEP_MS, draft_ms=rp.DRAFT_MS,
                     noise=0.0, seed=0, seed_curve=[0.5] * K, believe=believe, **kw)


def test_token_accounting_of_fixed_policies():
    every = [[K] * 81]  # every draft accepted: K + 1 tokens per verifying step
    none, fixed = run(every, "none"), run(every, "K=7")
    assert none["steps_by_k"][0] == 81 and sum(none["steps_by_k"]) == 81
    # drafted at prefill: 10 full blocks of 8 tokens, then the last token alone (nothing past
    # it to verify); every step drafts
    assert fixed["steps_by_k"][0] == 1 and fixed["steps_by_k"][K] == 10
    assert fixed["tok_s"] / none["tok_s"] == pytest.approx(
        81 * rp.STEP_MS[0] / (rp.STEP_MS[0] + 10 * rp.STEP_MS[K] + 11 * rp.DRAFT_MS))


@pytest.mark.parametrize("believe", ["true", "noisy"])
def test_adaptive_drafts_where_it_pays_and_not_where_it_does_not(believe):
    good = [[K if i % 3 else 2 for i in range(300)] for _ in range(4)]
    bad = [[0] * 300 for _ in range(4)]
    none_good, none_bad = run(good, "none")["tok_s"], run(bad, "none")["tok_s"]
    assert run(good, "adaptive", believe)["tok_s"] > 2.0 * none_good
    # drafts never accepted: probes aside, it decodes plainly
    out = run(bad, "adaptive", believe)
    assert out["tok_s"] > 0.97 * none_bad
    assert out["steps_by_k"][0] > 0.95 * sum(out["steps_by_k"])


def test_replay_cli_reads_recorded_traces(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"k": K, "draft": None,
                                "traces": [{"accepted": [1, 0, 3, 7, 2] * 30}]}))
    rp.main(["replay", str(path), "--policies", "none", "K=3", "--seeds", "1"])
    out = capsys.readouterr().out
    assert "| t | none |" in out and "| t | K=3 |" in out and "1.00x" in out
    with pytest.raises(SystemExit, match="needs 8 values"):
        rp.main(["replay", str(path), "--step-ms", "1", "2"])
