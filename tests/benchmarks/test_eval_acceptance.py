"""benchmarks/eval_acceptance.py: each draft keeps its own row."""

from __future__ import annotations

from pathlib import Path

from benchmarks.eval_acceptance import draft_label


def test_drafts_with_the_same_folder_name_get_distinct_labels():
    drafts = [Path("models/drafts/shipped"), Path("runs/a/draft"), Path("runs/b/draft")]
    labels = [draft_label("dflash", d, drafts) for d in drafts]
    assert labels == ["dflash:shipped", "dflash:a/draft", "dflash:b/draft"]
