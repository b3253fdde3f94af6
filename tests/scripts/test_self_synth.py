"""Self-synthesised prompts: the filters and deduplication (pure functions), the resumable raw
file (the real target, a few short samples), and the wiring of self-generated one- and two-turn
prompts into ``dflash_data.py generate``."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from .script_loader import load_script

synth = load_script("self_synth")
data = load_script("dflash_data")


# --------------------------------------------------------------------------- pure functions

def test_normalise_and_shingles():
    assert synth.normalise("  Hello,   WORLD!! How's it going?") == "hello world how s it going"
    assert synth.shingles("a b c d") == frozenset({"a b c", "b c d"})
    assert synth.shingles("Hi there") == frozenset({"hi there"})  # short text: one shingle
    assert synth.shingles("!!!") == frozenset()
    assert synth.jaccard(frozenset({"x", "y"}), frozenset({"y", "z"})) == pytest.approx(1 / 3)


def test_near_duplicate_index():
    idx = synth.NearDupIndex(n=3, threshold=0.5)
    base = "Can you suggest a three day itinerary for a first visit to Lisbon in spring"
    idx.add(base)
    assert idx.similar("can you suggest a THREE-DAY itinerary, for a first visit to Lisbon in spring?")
    # 15 words, 13 trigrams; the last word changed: 12 shared -> Jaccard 12/14
    assert idx.similar(base.replace("spring", "winter"))
    assert not idx.similar("Write a Python function that reverses a linked list in place")
    # a word in the middle breaks 3 trigrams: 10 shared -> 10 / (13 + 13 - 10) = 0.625
    assert idx.similar(base.replace("first", "second"))
    strict = synth.NearDupIndex(n=3, threshold=0.7)
    strict.add(base)
    assert not strict.similar(base.replace("first", "second"))
    assert len(idx) == 1


def test_filters_name_the_first_failing_reason():
    ok = "I'm planning a solo camping trip to the mountains. Can you help me plan it?"
    assert synth.filter_reason(ok) is None
    assert synth.filter_reason(ok, "length") == "truncated"
    assert synth.filter_reason(ok, "context") == "context_too_long"
    assert synth.filter_reason("Hi <|im_start|>assistant", "stop") == "special_token"
    special = frozenset({0, 1, 2})
    assert synth.filter_reason(ok, "stop", [57, 58, 2], special) is None  # closing <|im_end|>
    assert synth.filter_reason(ok, "stop", [57, 1, 58, 2], special) == "special_token"
    assert synth.filter_reason("Hello there") == "too_short"
    assert synth.filter_reason("Why? ok no") == "too_short"  # 3 words, 10 characters
    assert synth.filter_reason("Tell me about " + "cats and dogs " * 200) == "too_long"
    assert synth.filter_reason("Как приготовить борщ дома быстро и вкусно?") == "non_ascii"
    assert synth.filter_reason("Wie kann ich meinen Garten im Winter gut schützen, "
                               "damit Pflanzen überleben?") in ("non_ascii", "not_english")
    assert synth.filter_reason("Wie kann ich meinen Garten im Winter gut vorbereiten "
                               "damit Pflanzen sicher bleiben") == "not_english"
    assert synth.filter_reason("What is the meaning of this!!!!!!!!!!!!") == "repetitive"
    assert synth.filter_reason("Please help help help help me with my homework") == "repetitive"
    loop = "Can you tell me more about it. " * 6
    assert synth.filter_reason(loop) == "repetitive"


def test_select_keeps_index_order_and_counts_reasons():
    evals = synth.index_of(["What is the capital of France and why is it famous?"])
    seen = synth.index_of(["Natalia sold clips to 48 of her friends in April."])
    rows = [
        {"index": 3, "text": "  How do I grow tomatoes on a small balcony in a cold climate?  ",
         "finish_reason": "stop"},
        {"index": 0, "text": "What is the capital of France and why is it famous", "finish_reason": "stop"},
        {"index": 1, "text": "How do I grow tomatoes on a small balcony in a cold climate?",
         "finish_reason": "stop"},
        {"index": 2, "text": "Natalia sold clips to 48 of her friends in April", "finish_reason": "stop"},
        {"index": 4, "text": "Tell me a story", "finish_reason": "length"},
        {"index": 5, "text": "Write a haiku about the sea at night, please.", "finish_reason": "stop"},
    ]
    kept, counts = synth.select(rows, seen, evals)
    assert [r["index"] for r in kept] == [1, 5]
    assert kept[0]["text"] == "How do I grow tomatoes on a small balcony in a cold climate?"
    assert counts == {"samples": 6, "kept": 2, "eval_overlap": 1, "duplicate": 2, "truncated": 1}
    assert seen.similar("write a haiku about the sea at night please")  # kept ones join `seen`


def test_require_drops_turns_off_the_topic():
    code = r"\b(python|function|sql|code)\b"
    rows = [
        {"index": 0, "text": "Write a Python function that merges two sorted lists.", "finish_reason": "stop"},
        {"index": 1, "text": "How do I grow tomatoes on a small balcony in winter?", "finish_reason": "stop"},
        {"index": 2, "text": "Why does my SQL query return duplicate rows?", "finish_reason": "stop"},
        {"index": 3, "text": "Fix this code", "finish_reason": "length"},  # other filters first
    ]
    kept, counts = synth.select(rows, synth.index_of([]), synth.index_of([]), require=code)
    assert [r["index"] for r in kept] == [0, 2]
    assert counts == {"samples": 4, "kept": 2, "off_topic": 1, "truncated": 1}
    kept, counts = synth.select(rows, synth.index_of([]), synth.index_of([]))
    assert len(kept) == 3 and "off_topic" not in counts


def test_code_topic_recognises_programming_requests():
    system, pattern = synth.TOPICS["code"]
    topic = re.compile(pattern, re.IGNORECASE)
    code = [json.loads(line)["prompt"] for line in
            (synth.ROOT / "benchmarks" / "data" / "code_heldout.jsonl").open()]
    chat = [json.loads(line)["prompt"] for line in
            (synth.ROOT / "benchmarks" / "data" / "chat_heldout.jsonl").open()]
    assert all(topic.search(p) for p in code)  # C++, Dockerfile, mutex, Big O ...
    assert sum(bool(topic.search(p)) for p in chat) < len(chat) / 2
    assert not topic.search("How do I grow tomatoes on a small balcony in winter?")
    assert "programming" in system


def test_user_prefix_steers_with_a_system_turn():
    from models.hf_folder import load_tokenizer
    from models.resolve import resolve_model_path

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    bare = synth.user_prefix(tok, [])
    steer = "The user asks for code."
    first = synth.user_prefix(tok, [], steer)
    second = synth.user_prefix(tok, ["Sort a list in Python?", "Use sorted()."], steer)
    assert bare.endswith(synth.USER_HEADER) and first.endswith(synth.USER_HEADER)
    assert steer not in bare and first.count(steer) == 1 and second.count(steer) == 1
    # the steer replaces the default system turn instead of adding a second one
    assert first.count("<|im_start|>system") == bare.count("<|im_start|>system") == 1
    assert second.index(steer) < second.index("Sort a list") < second.index("Use sorted()")


def test_interleave_and_row_keys():
    rows = [{"source": "a", "prompt": "1"}, {"source": "a", "prompt": "2"},
            {"source": "a", "prompt": "3"}, {"source": "b", "prompt": "x"}]
    assert [r["prompt"] for r in data.interleave(rows)] == ["1", "x", "2", "3"]
    one = {"source": "selfgen_turn2", "prompt": "And then?", "history": ["Q", "A1"]}
    two = {"source": "selfgen_turn2", "prompt": "And then?", "history": ["Q", "A2"]}
    assert data.row_key(one) != data.row_key(two)
    assert data.row_key({"source": "gsm8k_train", "prompt": "q"}) == ("gsm8k_train", "q", ())
    assert [m["role"] for m in data.messages(one)] == ["user", "assistant", "user"]


def test_eval_prompts_hold_every_fixed_set():
    evals = synth.eval_prompts()
    assert set(data.held_out_prompts()) <= set(evals)
    code = [json.loads(line)["prompt"] for line in
            (synth.ROOT / "benchmarks" / "data" / "code_heldout.jsonl").open()]
    assert len(code) >= 50 and set(code) <= set(evals)
    assert not set(evals) & {r["prompt"] for r in data.training_prompts(0)}


# --------------------------------------------------------------------------- the real target

COMMON = ["--dtype", "float32", "--max-user-tokens", "12", "--batch", "2", "--chunk", "2",
          "--num-gsm8k", "1", "--max-model-len", "256"]


def _raw(out: Path, name: str = "selfgen_raw.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).open()]


def test_first_turns_resume_where_they_stopped(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    synth.main(["prompts", "--out", str(a), "--num", "50", "--max-samples", "4", *COMMON])
    first = _raw(a)
    assert [r["index"] for r in first] == [0, 1, 2, 3]
    assert [r["seed"] for r in first] == [0, 1, 2, 3]
    assert len({r["text"] for r in first}) > 1  # one seed per sample, not one for all
    synth.main(["prompts", "--out", str(a), "--num", "50", "--max-samples", "6", *COMMON])
    resumed = _raw(a)
    assert resumed[:4] == first and [r["index"] for r in resumed] == list(range(6))
    # one uninterrupted run gives the same samples
    synth.main(["prompts", "--out", str(b), "--num", "50", "--max-samples", "6", *COMMON])
    assert [r["text"] for r in _raw(b)] == [r["text"] for r in resumed]
    stats = json.loads((a / "selfgen_stats.json").read_text())["selfgen"]
    reasons = {k: v for k, v in stats.items() if k not in ("samples", "written")}
    assert stats["samples"] == 6 and sum(reasons.values()) == 6
    kept = [json.loads(line) for line in (a / "selfgen_prompts.jsonl").open()]
    assert len(kept) == stats["written"] == stats.get("kept", 0)  # fewer kept than --num
    assert [r["source"] for r in kept] == ["selfgen"] * len(kept)


def test_self_generated_turns_are_answered_and_extended(tmp_path):
    (tmp_path / "selfgen_prompts.jsonl").write_text(
        json.dumps({"source": "selfgen", "prompt": "Give me a tip for learning to cook."}) + "\n")
    gen = ["--out", str(tmp_path), "--max-tokens", "6", "--batch", "2", "--dtype", "float32",
           "--num-gsm8k", "1", "--sources", "selfgen", "selfgen_turn2", "--max-model-len", "256"]
    data.main(["generate", *gen])
    seqs = [json.loads(line) for line in (tmp_path / "sequences.jsonl").open()]
    assert [r["source"] for r in seqs] == ["selfgen"]
    # answers that hit --max-tokens are not extended; mark this one complete for the test
    seqs[0]["finish_reason"] = "stop"
    (tmp_path / "sequences.jsonl").write_text(json.dumps(seqs[0]) + "\n")

    synth.main(["turn2", "--out", str(tmp_path), "--turn2", "5", *COMMON])
    raw = _raw(tmp_path, "selfgen_turn2_raw.jsonl")
    tok = synth.make_llm(argparse.Namespace(model="smollm2-135m-instruct", dtype="float32",
                                            device="cpu", max_model_len=256, batch=1)).get_tokenizer()
    answer = tok.decode(seqs[0]["response_ids"], skip_special_tokens=True).strip()
    assert len(raw) == 1 and raw[0]["history"] == [seqs[0]["prompt"], answer]

    # a kept second turn is answered after the whole conversation
    (tmp_path / "selfgen_turn2_prompts.jsonl").write_text(json.dumps(
        {"source": "selfgen_turn2", "prompt": "Another one?", "history": raw[0]["history"]}) + "\n")
    data.main(["generate", *gen])
    data.main(["generate", *gen])  # nothing left: resumes by source, text and history
    seqs = [json.loads(line) for line in (tmp_path / "sequences.jsonl").open()]
    assert [r["source"] for r in seqs] == ["selfgen", "selfgen_turn2"]
    expected = tok.apply_chat_template(
        [{"role": "user", "content": seqs[0]["prompt"]}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "Another one?"}], tokenize=False, add_generation_prompt=True)
    assert seqs[1]["prompt_ids"] == tok.encode(expected)


def test_dedup_against_an_earlier_folder_drops_its_prompts(tmp_path):
    """A new piece of data (``--dedup-against OLD``) keeps none of the self-written prompts an
    earlier folder already kept, first or second turns, and still keeps the new ones."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    seen = "Tell me three ways to keep a small garden watered in summer."
    fresh = "Explain how a bicycle gear changes the effort needed to climb a hill."
    (old / "selfgen_prompts.jsonl").write_text(json.dumps({"source": "selfgen", "prompt": seen}) + "\n")
    rows = [{"index": i, "seed": i, "text": t, "finish_reason": "stop", "token_ids": [7, 8, 9]}
            for i, t in enumerate([seen, fresh])]
    (new / "selfgen_raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["prompts", "--out", str(new), "--num", "5", "--max-samples", "2", *COMMON]

    synth.main(args)  # no earlier folder: both kept (the raw file is complete, nothing sampled)
    assert [json.loads(x)["prompt"] for x in (new / "selfgen_prompts.jsonl").open()] == [seen, fresh]
    synth.main([*args, "--dedup-against", str(old)])
    assert [json.loads(x)["prompt"] for x in (new / "selfgen_prompts.jsonl").open()] == [fresh]
    stats = json.loads((new / "selfgen_stats.json").read_text())["selfgen"]
    assert stats["duplicate"] == 1 and stats["kept"] == 1
    # second turns: compared with the earlier folder's second turns
    (old / "selfgen_turn2_prompts.jsonl").write_text(
        json.dumps({"source": "selfgen_turn2", "prompt": fresh, "history": ["a", "b"]}) + "\n")
    assert synth.earlier_prompts([old], "selfgen_turn2_prompts.jsonl") == [fresh]
    assert synth.earlier_prompts([old, tmp_path / "missing"], "selfgen_prompts.jsonl") == [seen]


def test_pipeline_answers_only_the_sources_asked_for(tmp_path):
    """``--sources`` leaves out what an earlier piece already answered (the self-instruct
    prompts, answered the same way every time)."""
    with pytest.raises(SystemExit):
        synth.main(["pipeline", "--out", str(tmp_path), "--sources", "wikipedia"])
    synth.main(["pipeline", "--out", str(tmp_path), "--num", "0", "--turn2", "1", "--max-tokens",
                "3", "--sources", "gsm8k_train", "--gsm8k-from", "5", *COMMON])
    seqs = [json.loads(line) for line in (tmp_path / "sequences.jsonl").open()]
    assert [r["source"] for r in seqs] == ["gsm8k_train"]
    assert seqs[0]["prompt"] == data.training_prompts(1, gsm8k_from=5)[0]["prompt"]
    assert not (tmp_path / "selfgen_turn2_raw.jsonl").exists()  # not asked for: not sampled
