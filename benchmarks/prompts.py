"""Prompt sets shared by the benchmarks (GSM8K test, self-instruct, built-in chat prompts)."""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "data"

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about cats.",
    "Explain photosynthesis in simple terms.",
    "List three fruits and their colours.",
    "How do I boil an egg?",
    "What is 17 times 23?",
    "Tell me a joke about computers.",
    "Describe the moon to a child.",
]


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_questions(split: str = "test", limit: int | None = None, data_dir: Path = DATA_DIR) -> list[str]:
    rows = read_jsonl(data_dir / f"gsm8k_{split}.jsonl")
    questions = [r["question"] for r in rows]
    return questions[:limit] if limit else questions


def self_instruct_prompts(data_dir: Path = DATA_DIR) -> list[str]:
    """Instructions (with their input, if any) from both self-instruct files, in file order."""
    prompts = []
    for name in ("self_instruct_seed_tasks.jsonl", "self_instruct_user_oriented.jsonl"):
        path = data_dir / name
        if not path.exists():
            continue
        for row in read_jsonl(path):
            prompts.extend(_self_instruct_rows(row))
    return prompts


def _self_instruct_rows(row: dict) -> list[str]:
    instruction = row.get("instruction", "").strip()
    instances = row.get("instances") or [{}]
    text = instruction
    first = instances[0] if instances else {}
    extra = (first.get("input") or "").strip()
    if extra:
        text = f"{instruction}\n\n{extra}"
    return [text] if text else []


def chat(tokenizer, questions: list[str]) -> list[str]:
    """Apply the tokenizer's chat template (one user turn, generation prompt added)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]


def load(name: str, limit: int, data_dir: Path = DATA_DIR) -> list[str]:
    if name == "gsm8k":
        return gsm8k_questions("test", limit, data_dir)
    if name == "self-instruct":
        return self_instruct_prompts(data_dir)[:limit]
    if name == "chat":
        return (CHAT_PROMPTS * (limit // len(CHAT_PROMPTS) + 1))[:limit]
    path = Path(name)
    if path.suffix == ".jsonl" and path.exists():
        return [r.get("prompt") or r.get("question") for r in read_jsonl(path)][:limit]
    raise ValueError(f"Unknown prompt set {name!r}; use gsm8k, self-instruct, chat or a .jsonl file")
