"""Decode throughput, step time and GPU-busy fraction on a Qwen3-8B-shaped model with random
weights (``load_format="dummy"``: no files, no network), plus a speculative run with a random
DFlash draft that checks greedy speculation against plain greedy.

    python benchmarks/bench_gpu.py                       # the full matrix on CUDA
    python benchmarks/bench_gpu.py --batch 1 32 --prompt-len 256 --backends flashinfer
    python benchmarks/bench_gpu.py --tiny                # a tiny model on the CPU (smoke test)

For every backend x mode (eager; graphs: CUDA graphs, FlashInfer only) x batch x prompt length: the
requests are prefilled, a few decode steps warm up, then ``--decode-steps`` steps are timed
(``ms_per_step``, decode ``tok_per_s``) and ``--profile-steps`` more run under
``torch.profiler``. ``gpu_busy`` is the GPU time of those steps (union of kernel, memcpy and
memset intervals) per step, divided by the timed ``ms_per_step`` (the profiler slows the host
down, so its own wall time would understate it). On the CPU there is no device timeline:
``gpu_busy`` is null. The speculative run (with graphs when the backend captured them) builds a
random 1-layer DFlash draft (``models.dflash_init``), runs the same prompts with and without
it, verifying K drafts every step, reports the speculative step cost and whether every greedy
output is identical (acceptance of a random draft is
meaningless; cost and exactness are the point). ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402
from engine.args import graph_config  # noqa: E402

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
}
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument("--backends", nargs="+", default=None, help="default: torch flashinfer")
    p.add_argument("--modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"])
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 8 32 128")
    p.add_argument("--prompt-len", type=int, nargs="+", default=None, help="default: 256 1024")
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-memory", default=None, help="default: 40GiB (64MiB with --tiny)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--spec", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the speculative comparison (default: on)")
    p.add_argument("--spec-k", type=int, default=15, help="draft tokens per step")
    p.add_argument("--spec-batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--spec-prompt-len", type=int, default=256)
    p.add_argument("--spec-tokens", type=int, default=64, help="greedy tokens compared")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.shape = TINY if tiny else QWEN3_8B
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.backends = args.backends or (["torch"] if tiny else ["torch", "flashinfer"])
    args.batch = args.batch or ([1, 2] if tiny else [1, 8, 32, 128])
    args.prompt_len = args.prompt_len or ([16] if tiny else [256, 1024])
    args.kv_cache_memory = args.kv_cache_memory or ("64MiB" if tiny else "40GiB")
    if tiny:
        args.spec_prompt_len = min(args.spec_prompt_len, 16)
        args.spec_tokens = min(args.spec_tokens, 12)
        args.spec_k = min(args.spec_k, 3)
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_llm(args, folder: Path, backend: str, mode: str, spec: dict | None = None) -> LLM:
    torch.manual_seed(0)  # dummy weights: every instance gets the same ones
    kwargs = dict(
        model=str(folder), load_format="dummy", dtype=args.dtype, device=args.device,
        attention_backend=backend, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=max(args.prompt_len + [args.spec_prompt_len]) + 256,
        max_num_seqs=max(args.batch + args.spec_batch),
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_config=spec, enforce_eager=mode == "eager",
    )
    return LLM(**kwargs)


def _free(llm: LLM | None) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _device_busy_us(prof) -> float:
    """Length of the union of device-side intervals (kernels, copies, sets) in microseconds."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def measure(llm: LLM, args, batch: int, prompt_len: int, seed: int = 0) -> dict:
    """Prefill ``batch`` prompts, then time and profile decode steps."""
    engine = llm.engine
    device = torch.device(args.device)
    vocab = args.shape["vocab_size"]
    steps = args.warmup_steps + args.decode_steps + args.profile_steps
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    produced: dict[str, int] = {}
    for prompt in _prompts(batch, prompt_len, vocab, seed):
        rid = engine.new_request_id()
        engine.add_request(rid, prompt, params)
        produced[rid] = 0

    def step() -> int:
        new = 0
        for out in engine.step():
            if out.request_id in produced:
                count = len(out.outputs[0].token_ids)
                new += count - produced[out.request_id]
                produced[out.request_id] = count
        return new

    _sync(device)
    start = time.perf_counter()
    prefill_steps = 0
    while min(produced.values()) < 1:
        step()
        prefill_steps += 1
    _sync(device)
    prefill_s = time.perf_counter() - start
    for _ in range(args.warmup_steps):
        step()
    _sync(device)
    start = time.perf_counter()
    tokens = timed = 0
    for _ in range(args.decode_steps):
        if not engine.has_unfinished_requests():
            break
        tokens += step()
        timed += 1
    _sync(device)
    wall = time.perf_counter() - start
    row = {
        "batch": batch, "prompt_len": prompt_len, "prefill_s": round(prefill_s, 4),
        "prefill_steps": prefill_steps, "decode_steps": timed,
        "ms_per_step": round(1000 * wall / max(timed, 1), 3),
        "tok_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "tokens_per_step": round(tokens / max(timed, 1), 3),
        "kernel_ms_per_step": None, "gpu_busy": None,
    }
    if device.type == "cuda" and args.profile_steps and engine.has_unfinished_requests():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiled = 0
            for _ in range(args.profile_steps):
                if not engine.has_unfinished_requests():
                    break
                step()
                profiled += 1
            _sync(device)
        kernel_ms = _device_busy_us(prof) / 1000 / max(profiled, 1)
        row["kernel_ms_per_step"] = round(kernel_ms, 3)
        row["gpu_busy"] = round(kernel_ms / row["ms_per_step"], 3) if timed else None
    for rid in list(produced):  # whatever is left of the budget is not measured
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return row


def make_draft(args, folder: Path, target_folder: Path) -> Path:
    from models.dflash_init import draft_hf_config, random_draft, save_draft
    from models.hf_folder import load_hf_config
    from models.loader import decoder_config

    target = decoder_config(load_hf_config(target_folder))
    block = args.spec_k + 1
    dcfg = draft_hf_config(target, num_layers=1, block_size=block,
                           mask_token_id=target.vocab_size - 1)
    save_draft(random_draft(dcfg, seed=0, std=0.02), dcfg, folder)
    return folder


def speculative(args, folder: Path, backend: str, work: Path, mode: str) -> dict:
    """Greedy outputs with and without a random DFlash draft, and the speculative step cost
    (every step verifies K drafts: the adaptive controller would rightly skip a random draft)."""
    draft = make_draft(args, work / "draft", folder)
    spec_cfg = {"method": "dflash", "model": str(draft), "num_speculative_tokens": args.spec_k,
                "adaptive": False}
    params = SamplingParams(max_tokens=args.spec_tokens, temperature=0, ignore_eos=True)
    vocab = args.shape["vocab_size"]
    prompts = _prompts(max(args.spec_batch), args.spec_prompt_len, vocab, seed=7)
    result: dict = {"backend": backend, "mode": mode, "k": args.spec_k, "runs": []}
    llm = build_llm(args, folder, backend, mode)
    plain = {b: [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:b], params)]
             for b in args.spec_batch}
    base = {b: measure(llm, args, b, args.spec_prompt_len, seed=11) for b in args.spec_batch}
    _free(llm)
    llm = build_llm(args, folder, backend, mode, spec_cfg)
    for b in args.spec_batch:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:b], params)]
        first_diff = None
        for i, (a, s) in enumerate(zip(plain[b], got)):
            for j, (x, y) in enumerate(zip(a, s)):
                if x != y:
                    first_diff = {"request": i, "token": j}
                    break
            if first_diff:
                break
        cost = measure(llm, args, b, args.spec_prompt_len, seed=11)
        result["runs"].append({
            "batch": b, "greedy_equal": first_diff is None, "first_difference": first_diff,
            "plain_ms_per_step": base[b]["ms_per_step"], "spec_ms_per_step": cost["ms_per_step"],
            "step_cost_ratio": round(cost["ms_per_step"] / base[b]["ms_per_step"], 3),
            "spec_tokens_per_step": cost["tokens_per_step"], "spec_tok_per_s": cost["tok_per_s"],
            "plain_tok_per_s": base[b]["tok_per_s"],
        })
    stats = getattr(llm, "get_spec_decoding_stats", None)
    if stats is not None:
        s = stats()
        result["drafts"] = {k: getattr(s, k) for k in ("num_drafts", "num_draft_tokens",
                                                        "num_accepted_tokens") if hasattr(s, k)}
    _free(llm)
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device here; use --tiny (CPU) or --device cpu")
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    folder = work / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(args.shape))
    device = torch.device(args.device)
    report: dict = {
        "shape": "tiny" if args.tiny else "qwen3-8b", "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "results": [], "speculative": [], "errors": [], "notes": [],
    }
    modes = args.modes
    for backend in args.backends:
        captured = False
        for mode in modes:
            if mode == "graphs" and graph_config(device, backend, 1, False, 512) is None:
                note = f"{backend}/graphs: not captured here (graphs need CUDA and flashinfer)"
                report["notes"].append(note)
                print(f"SKIP {note}", flush=True)
                continue
            try:
                llm = build_llm(args, folder, backend, mode)
            except Exception as exc:  # noqa: BLE001 - report and go on with the others
                report["errors"].append(f"{backend}/{mode}: {type(exc).__name__}: {exc}")
                print(f"SKIP {backend}/{mode}: {exc}", flush=True)
                continue
            captured = captured or mode == "graphs"
            for prompt_len in args.prompt_len:
                for batch in args.batch:
                    row = {"backend": backend, "mode": mode,
                           **measure(llm, args, batch, prompt_len)}
                    report["results"].append(row)
                    print(json.dumps(row), flush=True)
            _free(llm)
        if args.spec:
            try:
                spec = speculative(args, folder, backend, work,
                                   "graphs" if captured else "eager")
            except Exception as exc:  # noqa: BLE001
                report["errors"].append(f"{backend}/speculative: {type(exc).__name__}: {exc}")
                print(f"SKIP {backend}/speculative: {exc}", flush=True)
                continue
            report["speculative"].append(spec)
            print(json.dumps(spec), flush=True)
    print(table(report), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict) -> str:
    lines = [f"## {report['shape']} on {report['device_name']} ({report['dtype']}, "
             f"kv {report['kv_cache_dtype']}, torch {report['torch']})", "",
             "| backend | mode | prompt | batch | tok/s | ms/step | kernel ms/step | GPU busy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        busy = "n/a" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.0f}%"
        kernel = "n/a" if r["kernel_ms_per_step"] is None else f"{r['kernel_ms_per_step']:.2f}"
        lines.append(f"| {r['backend']} | {r['mode']} | {r['prompt_len']} | {r['batch']} | "
                     f"{r['tok_per_s']} | {r['ms_per_step']:.2f} | {kernel} | {busy} |")
    for s in report["speculative"]:
        for r in s["runs"]:
            lines.append(f"\nspeculative {s['backend']} ({s['mode']}) K={s['k']} batch "
                         f"{r['batch']}: greedy "
                         f"equal {r['greedy_equal']} (first difference {r['first_difference']}), step "
                         f"{r['spec_ms_per_step']:.2f} ms vs {r['plain_ms_per_step']:.2f} ms plain "
                         f"({r['step_cost_ratio']}x), {r['spec_tokens_per_step']} tokens/step")
    for e in report["errors"]:
        lines.append(f"\nerror: {e}")
    for note in report["notes"]:
        lines.append(f"\nnote: {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
