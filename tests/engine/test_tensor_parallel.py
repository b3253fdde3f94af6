"""Tensor parallelism on the CPU (gloo, 2 ranks): greedy output equal to one rank, the layout
contract on every rank, and bounded failure when a worker dies or hangs.

``SPECSERVE_TP_DEVICE=cuda`` runs the equality tests and the startup tests on CUDA devices
0 and 1 instead (NCCL all-reduces; ``scripts/tp_nccl_check.sh``); they skip without 2 GPUs.
The failure tests stay on the CPU (gloo): a dead NCCL peer is only noticed after a timeout."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from engine.distributed import TensorParallelError
from engine.sampling_params import SamplingParams
from models.parallel import local_config, shard_slice, tensor_parallel_error
from models.loader import decoder_config
from tests.spec.helpers import make_llm, random_prompts, save_draft, save_target, token_ids

PROMPTS = random_prompts([5, 23, 9, 40, 14, 31])
TP_DEVICE_ENV = "SPECSERVE_TP_DEVICE"


@pytest.fixture
def tp_device() -> dict:
    """Engine args placing the ranks: ``{}`` (CPU, gloo) unless ``SPECSERVE_TP_DEVICE=cuda``,
    which needs two visible CUDA devices (else the test skips)."""
    device = os.environ.get(TP_DEVICE_ENV, "cpu")
    if device == "cpu":
        return {}
    if device != "cuda":
        pytest.fail(f"{TP_DEVICE_ENV} must be cpu or cuda, got {device!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.skip(f"{TP_DEVICE_ENV}=cuda needs 2 CUDA devices for TP=2, {count} visible")
    return {"device": "cuda"}


def _qwen3_one_kv_head(folder: Path) -> Path:
    """Qwen3 with 4 query heads and a single KV head: 2 ranks replicate it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                      initializer_range=0.3, rope_theta=1e6, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    out = {
        "llama-kv2": save_target(root / "llama", "llama", seed=3),
        "qwen3-kv1": _qwen3_one_kv_head(root / "qwen3"),
    }
    save_draft(root / "draft", seed=11)
    out["draft"] = root / "draft"
    return out


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _params(n: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3)


def _close(llm) -> None:
    if llm.engine.tp is not None:
        llm.engine.tp.shutdown()


CASES = [  # (model, draft, extra engine args)
    ("llama-kv2", False, {"num_kv_blocks": 12, "block_size": 16}),  # 6 requests need 16: preemption
    ("qwen3-kv1", False, {}),
    ("llama-kv2", True, {}),
    ("qwen3-kv1", True, {"kv_cache_layout": "HND"}),
]


@pytest.mark.parametrize("name,with_draft,extra", CASES,
                         ids=["llama-kv2-preempt", "qwen3-kv1", "llama-kv2-dflash",
                              "qwen3-kv1-dflash-hnd"])
def test_tp2_greedy_equals_tp1(models, name, with_draft, extra, restore_threads, tp_device):
    spec = {"method": "dflash", "model": str(models["draft"]), "num_speculative_tokens": 3} \
        if with_draft else None
    extra = {**extra, **tp_device}
    one = make_llm(models[name], spec, **extra)
    want = one.generate(PROMPTS, _params())
    two = make_llm(models[name], spec, tensor_parallel_size=2, **extra)
    try:
        got = two.generate(PROMPTS, _params())
        assert token_ids(got) == token_ids(want)
        # the all-reduce sums in another order than one GEMM: logprobs agree to rounding
        for g, w in zip(got, want):
            for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert lg.token_id == lw.token_id
                assert set(lg.top) == set(lw.top)
                for tok, value in lw.top.items():
                    assert abs(lg.top[tok] - value) < 1e-4
        reports = two.engine.tp.reports
        assert [r["rank"] for r in reports] == [0, 1]
        for key in ("layout", "pool_layout", "num_blocks"):
            assert reports[1][key] == reports[0][key]
        assert reports[1]["groups"]["target"] == reports[0]["groups"]["target"]
        want_layout = extra.get("kv_cache_layout", "NHD")
        assert reports[0]["layout"] == want_layout
        assert reports[0]["groups"]["target"]["dtype"] == "float32"
        if tp_device:  # one rank per device: rank 1 on the next CUDA device
            assert [str(d) for d in two.engine.tp.devices] == ["cuda:0", "cuda:1"]
        kv_heads = decoder_config(one.engine_config.model.hf_config).num_kv_heads
        assert reports[0]["groups"]["target"]["kv_heads"] == max(1, kv_heads // 2)
        if with_draft:  # the draft lives on rank 0 only, and its drafts were verified
            assert set(reports[0]["groups"]) == {"target", "draft"}
            assert set(reports[1]["groups"]) == {"target"}
            stats = two.get_spec_decoding_stats()
            assert stats.num_drafts > 0 and stats.num_accepted_tokens >= 0
        if "num_kv_blocks" in extra:
            assert two.engine.num_preemptions > 0
    finally:
        _close(two)


def test_tp_size_that_does_not_fit_fails_at_startup(models):
    with pytest.raises(ConfigError) as err:
        make_llm(models["llama-kv2"], tensor_parallel_size=3)
    msg = str(err.value)
    assert "num_attention_heads (4) is not divisible by 3" in msg
    assert "Valid sizes for it: 1, 2, 4" in msg
    with pytest.raises(ConfigError, match="integer >= 1"):
        make_llm(models["llama-kv2"], tensor_parallel_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA devices 0..1, but 0 are visible"):
            make_llm(models["llama-kv2"], tensor_parallel_size=2, device="cuda")


def test_shard_slices_cover_the_checkpoint():
    cfg = decoder_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 32,
                          "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                          "num_attention_heads": 8, "num_key_value_heads": 2})
    # 4 ranks, 2 KV heads: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    kv = [shard_slice("model.layers.0.self_attn.k_proj.weight", cfg, r, 4) for r in range(4)]
    assert kv == [(0, 0, 8), (0, 0, 8), (0, 8, 8), (0, 8, 8)]
    q = [shard_slice("model.layers.0.self_attn.q_proj.weight", cfg, r, 4) for r in range(4)]
    assert [s[1] for s in q] == [0, 16, 32, 48]
    assert shard_slice("model.layers.0.mlp.down_proj.weight", cfg, 3, 4) == (1, 72, 24)
    assert shard_slice("model.embed_tokens.weight", cfg, 1, 4) is None
    local = local_config(cfg, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 24)
    assert tensor_parallel_error(cfg, 8) is None  # 8 ranks, 2 KV heads: each replicated 4x
    assert "num_key_value_heads (4) neither divides by 3" in tensor_parallel_error(
        decoder_config({**_hf(cfg), "num_key_value_heads": 4, "num_attention_heads": 12}), 3)


def test_engine_startup_failure_stops_the_workers(models, restore_threads, tp_device):
    import gc
    import multiprocessing

    from engine.kv_pool import KVBudgetError

    with pytest.raises(KVBudgetError):  # rank 0 fails after the workers started
        make_llm(models["llama-kv2"], tensor_parallel_size=2, kv_cache_memory="4KiB",
                 **tp_device)
    gc.collect()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()


def _hf(cfg) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers}


def _wait_dead(proc, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.02)


def test_killed_worker_fails_the_engine_in_bounded_time(models, restore_threads):
    llm = make_llm(models["llama-kv2"], tensor_parallel_size=2)
    try:
        engine = llm.engine
        llm.generate(PROMPTS[:2], _params(4))
        worker = engine.tp.procs[0]
        for i, ids in enumerate(PROMPTS[:3]):
            engine.add_request(f"k{i}", ids, _params(64))
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)  # mid-run: the next step meets a dead peer
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError) as err:
            for _ in range(200):
                engine.step()
        assert time.monotonic() - t0 < 15
        assert "worker rank 1" in str(err.value) and "SIGKILL" in str(err.value)
        with pytest.raises(TensorParallelError):  # the engine stays failed, at once
            engine.step()
        _wait_dead(worker)
        assert worker.exitcode is not None
    finally:
        _close(llm)


def test_hung_worker_times_out(models, restore_threads, monkeypatch):
    monkeypatch.setenv("SPECSERVE_TP_TIMEOUT", "3")
    llm = make_llm(models["qwen3-kv1"], tensor_parallel_size=2)
    try:
        engine = llm.engine
        worker = engine.tp.procs[0]
        engine.add_request("h", PROMPTS[0], _params(8))
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="may be hung"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 20
        _wait_dead(worker)
        assert worker.exitcode is not None  # stopped workers are killed, not left behind
    finally:
        _close(llm)


@pytest.mark.slow
def test_real_smollm2_tp3_with_dflash_equals_tp1(restore_threads):
    """SmolLM2-135M (9 query, 3 KV heads: TP=3), float32, its shipped DFlash draft verifying
    every node of its tree on rank 0: greedy tokens equal one rank without speculation."""
    from engine.args import default_draft_for
    from models.resolve import DEFAULT_MODEL, resolve_model_path

    try:
        resolve_model_path(DEFAULT_MODEL)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"real model unavailable: {exc}")
    draft = default_draft_for(DEFAULT_MODEL)
    if draft is None:
        pytest.skip("the shipped draft is not present")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    args = {"max_model_len": 128, "kv_cache_memory": "32MiB"}
    want = token_ids(make_llm(DEFAULT_MODEL, None, **args).generate(prompts, _params(16)))
    llm = make_llm(DEFAULT_MODEL, {"method": "dflash", "model": str(draft)},
                   tensor_parallel_size=3, **args)
    try:
        assert llm.engine.proposer.tree is not None  # the draft's tree.json
        assert token_ids(llm.generate(prompts, _params(16))) == want
        assert llm.get_spec_decoding_stats().num_drafts > 0
    finally:
        _close(llm)


def test_killed_worker_fails_llm_generate_in_bounded_time(models, restore_threads):
    """The offline API: ``LLM.generate`` blocked in a step whose peer is killed raises
    ``TensorParallelError`` naming the rank and the signal, and keeps raising it."""
    import threading

    llm = make_llm(models["llama-kv2"], tensor_parallel_size=2)
    try:
        worker = llm.engine.tp.procs[0]
        os.kill(worker.pid, signal.SIGSTOP)  # the first step blocks in its all-reduce
        killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError,
                           match=r"worker rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\)"):
            llm.generate(PROMPTS[:2], _params(8))
        assert time.monotonic() - t0 < 30
        killer.join()
        with pytest.raises(TensorParallelError, match="SIGKILL"):
            llm.generate(PROMPTS[:1], _params(2))
        _wait_dead(worker)
        assert worker.exitcode is not None
    finally:
        _close(llm)
