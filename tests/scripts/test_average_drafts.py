"""Averaging two drafts: weights blend, the vocabulary and shape must agree."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from .script_loader import load_script

avg = load_script("average_drafts")


def _draft(folder, value: float, d2t, config=None):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or {"hidden_size": 4}))
    save_file({"w": torch.full((2, 3), value, dtype=torch.bfloat16), "d2t": d2t},
              folder / "model.safetensors")
    save_file({"mask_embedding": torch.full((4,), value)}, folder / "mask_embedding.safetensors")
    return folder


def test_weights_blend_and_the_vocabulary_is_kept(tmp_path):
    d2t = torch.tensor([0, 3, 5])
    a, b = _draft(tmp_path / "a", 1.0, d2t), _draft(tmp_path / "b", 3.0, d2t)
    avg.main([str(a), str(b), "--weight", "0.25", "--out", str(tmp_path / "o")])
    out = load_file(tmp_path / "o" / "model.safetensors")
    assert out["w"].dtype == torch.bfloat16 and torch.all(out["w"] == 2.5)
    assert torch.equal(out["d2t"], d2t)
    assert torch.all(load_file(tmp_path / "o" / "mask_embedding.safetensors")["mask_embedding"] == 2.5)
    assert json.loads((tmp_path / "o" / "config.json").read_text()) == {"hidden_size": 4}


def test_other_vocabulary_shape_or_weight_is_refused(tmp_path):
    a = _draft(tmp_path / "a", 1.0, torch.tensor([0, 3, 5]))
    b = _draft(tmp_path / "b", 1.0, torch.tensor([0, 3, 6]))
    c = _draft(tmp_path / "c", 1.0, torch.tensor([0, 3, 5]), config={"hidden_size": 8})
    with pytest.raises(ValueError, match="integer tensors differ"):
        avg.average(a, b, 0.5, tmp_path / "o1")
    with pytest.raises(ValueError, match="different config.json"):
        avg.average(a, c, 0.5, tmp_path / "o2")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        avg.average(a, a, 1.5, tmp_path / "o3")
