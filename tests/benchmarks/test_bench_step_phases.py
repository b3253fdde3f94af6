"""``benchmarks/bench_step_phases.py``: every part of a step is timed where the engine calls
it, the parts fit inside the whole step, and the table prints a column per configuration."""

from __future__ import annotations

import json

from benchmarks import bench_step_phases
from tests.spec.helpers import save_draft, save_target


def test_parts_add_up_inside_the_step_and_the_table_prints(tmp_path, capsys):
    target = save_target(tmp_path / "target")
    save_draft(tmp_path / "draft")
    results = bench_step_phases.main([
        "--model", str(target), "--draft", str(tmp_path / "draft"), "--ks", "0", "2",
        "--prompt-ids", "5", "6", "7", "--prompt-ids", "9", "10", "--max-tokens", "6",
        "--dtype", "float32", "--in-process"])
    plain, spec = results
    for r in results:
        ph = r["phases"]
        assert r["steps"] > 0 and r["tokens"] == 2 * 6  # both prompts ran to max_tokens
        assert ph["target"] > 0 and ph["head"] > 0 and ph["sample"] > 0 and ph["schedule"] > 0
        parts = sum(v for k, v in ph.items() if k != "step")
        assert parts <= ph["step"] * 1.001  # every part runs inside a step
    assert plain["phases"]["draft_block"] == 0 and plain["phases"]["draft_choose"] == 0
    assert spec["phases"]["draft_block"] > 0 and spec["phases"]["draft_choose"] > 0
    assert spec["phases"]["draft_context"] > 0
    out = capsys.readouterr().out
    assert "2 prompts, 1 at a time" in out and "| ms per step | no speculation | K = 2 |" in out
    assert "| draft: block pass | 0.00 |" in out and "| tokens per step | 1.00 |" in out


def test_layer_parts_fit_inside_the_target_pass(tmp_path, capsys):
    """``--layers``: the parts of each target pass are timed by its query rows (1 for a plain
    decode, K + 1 for a verification of K drafts, even with a draft that ships a tree) and fit
    inside the pass."""
    from attention.backends import torch_backend

    attend_before = (torch_backend.PagedMetadata.attend, torch_backend.TorchMetadata.attend)
    target = save_target(tmp_path / "target")
    save_draft(tmp_path / "draft")
    # a tree of 7 nodes (depth 3): a fixed K = 2 must still verify a chain of 2, not the 6
    # nodes within depth 2 (7 query rows)
    (tmp_path / "draft" / "tree.json").write_text(json.dumps(
        {"paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]], "conditional": [0.5] * 7}))
    results = bench_step_phases.main([
        "--model", str(target), "--draft", str(tmp_path / "draft"), "--ks", "0", "2",
        "--prompt-ids", "5", "6", "7", "8", "--max-tokens", "8", "--dtype", "float32",
        "--in-process", "--layers"])
    plain, spec = (r["layers"] for r in results)
    # a 4-token prefill, then decodes of 1 row, or verifications of K + 1 = 3 rows
    assert plain[4]["passes"] == 1 and plain[1]["passes"] == 7 and 3 not in plain
    # no pass beyond the 4-token prefill: verifications have 3 rows (fewer near max_tokens)
    assert spec[3]["passes"] >= 1 and max(spec) <= 4
    for by_rows in (plain, spec):
        for parts in by_rows.values():
            inside = sum(v for k, v in parts.items() if k not in ("pass", "passes"))
            assert 0 < inside <= parts["pass"] and parts["attention"] > 0 and parts["down"] > 0
    out = capsys.readouterr().out
    assert "ms per target pass, by its query rows:" in out and "| query rows | passes |" in out
    # the attention timers were on the metadata classes: taken off again after each run
    from attention.backends import torch_backend

    assert attend_before == (torch_backend.PagedMetadata.attend, torch_backend.TorchMetadata.attend)


def test_the_adaptive_default_with_arrivals(tmp_path, capsys, monkeypatch):
    """``--ks -1`` is the served default; ``--arrivals`` gives the engine all prompts at once
    with room for ``--concurrency``, so the third prompt starts when one of the others ends."""
    from engine import LLM

    target = save_target(tmp_path / "target")
    save_draft(tmp_path / "draft")
    submitted, room = [], []
    generate, init = LLM.generate, LLM.__init__

    def recording_generate(self, prompts, *args, **kwargs):
        submitted.append(len(prompts))
        return generate(self, prompts, *args, **kwargs)

    def recording_init(self, *args, **kwargs):
        room.append(kwargs.get("max_num_seqs"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", recording_generate)
    monkeypatch.setattr(LLM, "__init__", recording_init)
    results = bench_step_phases.main([
        "--model", str(target), "--draft", str(tmp_path / "draft"), "--ks", "0", "-1",
        "--prompt-ids", "5", "6", "7", "--prompt-ids", "9", "10", "--prompt-ids", "4", "8",
        "--max-tokens", "6", "--concurrency", "2", "--arrivals", "--dtype", "float32",
        "--in-process"])
    plain, adaptive = results
    assert plain["tokens"] == adaptive["tokens"] == 3 * 6
    assert room == [2, 2] and submitted == [1, 3, 1, 3]  # warm-up, then all three at once
    assert "| ms per step | no speculation | adaptive |" in capsys.readouterr().out
