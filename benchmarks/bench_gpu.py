"""GPU throughput on a Qwen3-8B-shaped model with random weights (no files, no network).

    python benchmarks/bench_gpu.py --batch 1 32 --max-tokens 64 --attention-backend flashinfer
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--attention-backend", default="flashinfer")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="qwen3-8b-shape-"))
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", device="cuda",
              attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_memory="16GiB", max_model_len=4096, max_num_seqs=max(args.batch),
              max_num_batched_tokens=8192, speculative_config=None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for b in args.batch:
        prompts = [torch.randint(0, 151936, (args.prompt_len,), generator=gen).tolist() for _ in range(b)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"qwen3-8b-shape batch={b} backend={args.attention_backend} "
              f"{tokens / seconds:.1f} output tok/s ({tokens} tokens, {seconds:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
