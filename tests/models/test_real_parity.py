"""The real SmolLM2-135M-Instruct: greedy output equals transformers' ``generate`` token for token.

EOS is masked for 64 tokens on both sides (``min_tokens`` / ``min_new_tokens``).
"""

from __future__ import annotations

import pytest
import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


@pytest.fixture(scope="module")
def real_model():
    from models.resolve import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


def test_greedy_matches_transformers_generate(real_model):
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    llm = LLM(model="smollm2-135m-instruct", dtype="float32", speculative_config=None,
              max_model_len=1024, kv_cache_memory="128MiB")
    tok = llm.get_tokenizer()
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    ids = [tok.encode(c) for c in chats]
    ours = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(max_tokens=64, min_tokens=64, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    for prompt_ids, out in zip(ids, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=64, min_new_tokens=64,
                              do_sample=False)[0, len(prompt_ids):].tolist()
        assert out.outputs[0].token_ids == ref
        assert len(ref) == 64
    assert "Paris" in ours[0].outputs[0].text
