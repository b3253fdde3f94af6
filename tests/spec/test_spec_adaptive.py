"""The adaptive speculation default at engine level: exact output whatever the controller
chooses, measured costs cached per machine, and ``dtype auto`` by measurement."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from engine import SamplingParams
from engine.spec.controller import Decision, SpecController
from engine.spec.cost import StepCostModel

from .helpers import greedy, make_llm, random_prompts, token_ids


class ScriptedChoices(SpecController):
    """Cycles through verify lengths 0..K and drafts on two steps of three: every mix of k
    values and draft pauses in one batch, independent of timing."""

    def __init__(self, base: SpecController) -> None:
        super().__init__(base.k_max, base.acceptance, None, base.stats, adaptive=False)
        self.step = 0

    def plan(self, cands, other_tokens=0):
        self.step += 1
        out = []
        for i, c in enumerate(cands):
            k = (self.step + i) % (self.k_max + 1)
            out.append(Decision(min(k, c.available, c.cap),
                                self.k_max if (self.step + i) % 3 else 0))
        return out

    def fresh_request_drafts(self, batch_rows):
        return self.k_max if self.step % 2 == 0 else 0


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("measure-cache")))


def _scripted(llm):
    llm.engine.scheduler.controller = ScriptedChoices(llm.engine.scheduler.controller)
    return llm


@pytest.mark.parametrize("method", ["dflash", "ngram"])
def test_greedy_exact_for_any_choice_of_k(qwen3_target, draft_b8_dir, method):
    prompts = random_prompts([5, 17, 9, 30, 3, 12])
    plain = token_ids(make_llm(qwen3_target).generate(prompts, greedy(40)))
    spec = ({"method": "dflash", "model": str(draft_b8_dir)} if method == "dflash"
            else {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1})
    llm = _scripted(make_llm(qwen3_target, spec))
    assert token_ids(llm.generate(prompts, greedy(40))) == plain
    hist = llm.get_spec_decoding_stats().num_steps_by_k
    assert hist[0] > 0 and sum(hist[1:]) > 0  # plain decodes and verifications both happened
    # the adaptive default with the costs it measures here: the same tokens
    adaptive = make_llm(qwen3_target, {**spec, "adaptive": True})
    assert adaptive.engine.scheduler.controller.adaptive
    assert token_ids(adaptive.generate(prompts, greedy(40))) == plain


def test_seeded_sampling_does_not_depend_on_the_choices(qwen3_target, draft_dir):
    prompts = random_prompts([6, 11, 4])
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=100 + i,
                             ignore_eos=True) for i in range(3)]
    spec = {"method": "dflash", "model": str(draft_dir)}
    fixed = token_ids(make_llm(qwen3_target, spec).generate(prompts, params))
    scripted = token_ids(_scripted(make_llm(qwen3_target, spec)).generate(prompts, params))
    plain = token_ids(make_llm(qwen3_target).generate(prompts, params))
    assert fixed == scripted == plain


def test_the_realized_gain_check_sees_decode_steps_only(qwen3_target, draft_b8_dir):
    llm = _scripted(make_llm(qwen3_target, {"method": "dflash", "model": str(draft_b8_dir)}))
    ctl = llm.engine.scheduler.controller
    seen = []
    ctl.observe_step = lambda rows, tokens, drafted, seconds, **kw: seen.append((rows, tokens, kw))
    llm.generate(random_prompts([5, 17, 9]), greedy(12))
    prefill = [s for s in seen if s[1] > s[0] + s[2]["verified"]]
    decode = [s for s in seen if s[1] == s[0] + s[2]["verified"]]
    assert prefill and all(s[2]["expected"] is None for s in prefill)
    assert decode and all(s[2]["expected"] is not None for s in decode)
    # every decode row produces its token plus the accepted drafts, never more than verified
    assert all(rows <= kw["produced"] <= tokens for rows, tokens, kw in decode)
    assert any(kw["verified"] for _, _, kw in decode)


def test_drafting_is_priced_without_the_draft_context_it_catches_up(qwen3_target, draft_b8_dir):
    """A request that drafts after plain steps first writes the draft context those steps
    deferred: that is part of the step's time, never of the draft pass's price (charged to
    the draft, it priced one pass at 11.8 ms where it takes 3 and speculation stopped)."""
    llm = _scripted(make_llm(qwen3_target, {"method": "dflash", "model": str(draft_b8_dir)}))
    proposer = llm.engine.proposer
    write = proposer._write_context
    slow = 0.05

    def slow_write(taken):
        time.sleep(slow)
        write(taken)

    proposer._write_context = slow_write
    seen = []
    ctl = llm.engine.scheduler.controller
    ctl.observe_step = lambda rows, tokens, drafted, seconds, **kw: seen.append(
        (drafted, seconds, kw["draft_seconds"]))
    llm.generate(random_prompts([5, 17, 9]), greedy(12))
    drafting = [s for s in seen if s[0]]
    assert drafting and all(seconds >= slow > draft for _, seconds, draft in drafting)
    assert all(draft > 0 for _, _, draft in drafting)
    assert all(draft == 0 for drafted, _, draft in seen if not drafted)


def test_step_costs_are_cached_and_a_corrupt_cache_is_ignored(qwen3_target, draft_dir,
                                                              monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    spec = {"method": "dflash", "model": str(draft_dir), "adaptive": True}
    make_llm(qwen3_target, spec)
    files = list((tmp_path / "measurements").glob("step-costs-*.json"))
    assert len(files) == 1
    first = json.loads(files[0].read_text())

    import engine.spec.policy as policy

    def must_not_measure(*args, **kwargs):
        raise AssertionError("the cached step costs were measured again")

    with monkeypatch.context() as m:
        m.setattr(policy, "measure_step_costs", must_not_measure)
        llm = make_llm(qwen3_target, spec)
    assert llm.engine.scheduler.controller.cost.table == first["table"]
    files[0].write_text('{"rows": [1], "table": ')
    with caplog.at_level(logging.WARNING, logger="specserve"):
        make_llm(qwen3_target, spec)
    assert "ignoring unreadable measurement cache" in caplog.text
    assert json.loads(files[0].read_text())["rows"]  # measured again and rewritten


def test_dtype_auto_picks_the_measured_faster_and_caches_it(monkeypatch, tmp_path, caplog):
    import engine.dtype_choice as dc

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    hf = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 2}
    calls = []

    def fake(shapes, dtype, device, rows):
        calls.append(dtype)
        return lambda: [{torch.float32: 2.0, torch.bfloat16: 1.0}[dtype]] * len(rows)

    monkeypatch.setattr(dc, "decode_step_timer", fake)
    with caplog.at_level(logging.INFO, logger="specserve"):
        assert dc.auto_dtype(hf, torch.device("cpu")) == torch.bfloat16
    assert ("decode at 1/4/16/32 rows / a 128-token prefill step: "
            "float32 2000.00/2000.00/2000.00/2000.00/2000.00, "
            "bfloat16 1000.00/1000.00/1000.00/1000.00/1000.00") in caplog.text
    assert dc.auto_dtype(hf, torch.device("cpu")) == torch.bfloat16
    assert len(calls) == 2  # the second answer came from the cache
    for f in (tmp_path / "measurements").glob("dtype-*.json"):
        f.write_text("not json")
    monkeypatch.setattr(dc, "decode_step_timer", lambda s, d, dev, rows: lambda: [
        {torch.float32: 1.0, torch.bfloat16: 3.0}[d]] * len(rows))
    assert dc.auto_dtype(hf, torch.device("cpu")) == torch.float32


def test_dtype_auto_weighs_every_batch_size(monkeypatch, tmp_path):
    """As measured with AVX2 kernels (ms per token): bf16 twice as fast at one row, slower from
    16 rows on and 3x slower in prefill. The one-row figure alone would pick bf16 and halve
    throughput under load; the choice weighs every batch size up to max_num_seqs alike."""
    import engine.dtype_choice as dc

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    hf = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
          "vocab_size": 256, "num_hidden_layers": 2}
    per_token = {torch.float32: {1: 62.1, 4: 22.4, 16: 8.2, 32: 5.4, 128: 3.1},
                 torch.bfloat16: {1: 33.9, 4: 14.3, 16: 12.3, 32: 11.6, 128: 10.8}}
    seen = []

    def fake(shapes, dtype, device, rows):
        seen.append(rows)
        return lambda: [per_token[dtype][r] for r in rows]

    monkeypatch.setattr(dc, "decode_step_timer", fake)
    assert dc.auto_dtype(hf, torch.device("cpu"), max_num_seqs=64) == torch.float32
    assert seen[-1] == (1, 4, 16, 32, 128)
    # an engine that never batches more than one request only has the one-row case
    assert dc.auto_dtype(hf, torch.device("cpu"), max_num_seqs=1) == torch.bfloat16
    assert seen[-1] == (1, 128)
    # where bf16 is faster everywhere (this EPYC's AVX-512-BF16 kernels) it is bf16
    per_token[torch.bfloat16] = {1: 36.6, 4: 9.7, 16: 4.5, 32: 2.8, 128: 1.7}
    assert dc.auto_dtype(hf, torch.device("cpu"), max_num_seqs=16) == torch.bfloat16


def test_dtype_measurement_runs_on_a_thread_that_ends(monkeypatch, tmp_path):
    """The server measures while building its config on the main thread and steps the engine
    on another; GNU OpenMP keeps a team of workers per thread that ran a parallel region, and
    a main-thread team left behind made every engine step slower. So the measurement runs on a
    thread of its own, which is gone (with its team) when the answer comes back, and its
    failures still reach the caller."""
    import threading

    import engine.dtype_choice as dc

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    hf = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
          "vocab_size": 256, "num_hidden_layers": 2}
    ran_on = []

    def fake(shapes, dtype, device, rows):
        ran_on.append(threading.current_thread())
        return lambda: [{torch.float32: 2.0, torch.bfloat16: 1.0}[dtype]] * len(rows)

    monkeypatch.setattr(dc, "decode_step_timer", fake)
    assert dc.auto_dtype(hf, torch.device("cpu")) == torch.bfloat16
    assert ran_on and all(t is not threading.current_thread() for t in ran_on)
    assert not any(t.is_alive() for t in ran_on)

    def broken(shapes, dtype, device, rows):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(dc, "decode_step_timer", broken)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "fresh"))
    with pytest.raises(RuntimeError, match="no kernel for this dtype"):
        dc.auto_dtype(hf, torch.device("cpu"))


def test_dtype_auto_real_measurement_runs_on_this_machine(monkeypatch, tmp_path):
    import engine.dtype_choice as dc

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 6,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 512}
    shapes = dc.model_gemm_shapes(hf)
    assert shapes["layer"][0] == [64, 3 * 64] and shapes["head"] == [64, 256]
    assert dc.auto_dtype(hf, torch.device("cpu")) in (torch.float32, torch.bfloat16)
    times = dc.measure_dtypes(hf, torch.device("cpu"), rounds=1, rows=(1, 4, 128))
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())


def test_cost_measurement_on_a_time_budget(qwen3_target, draft_dir):
    from engine.spec.cost import measure_step_costs

    llm = make_llm(qwen3_target, {"method": "dflash", "model": str(draft_dir)})
    eng = llm.engine
    free = eng.blocks.num_free_blocks
    timed: set[tuple[int, int, bool]] = set()  # (rows, tokens, drafting) of each step run
    execute = eng.runner.execute

    def run(plan):
        timed.add((len(plan.scheduled), plan.num_tokens, any(s.draft for s in plan.scheduled)))
        return execute(plan)

    eng.runner.execute = run
    model = measure_step_costs(eng.runner, eng.blocks, max_rows=64, max_per_row=4,
                               max_tokens=2048, with_draft=True, vocab_size=256,
                               lookahead=4, max_model_len=192, time_budget=0.0)
    assert eng.blocks.num_free_blocks == free  # the scratch pages went back to the pool
    assert model.rows == [1, 4, 16, 64]
    assert model.tokens == [1, 2, 4, 8, 16, 17, 32, 33, 48, 49, 64, 65, 128, 256]
    # out of time from the start, every line past the first was still timed (its plain step,
    # one draft a row, the draft pass), never priced from another line
    for rows in (4, 16, 64):
        assert {(rows, rows, False), (rows, 2 * rows, False), (rows, rows, True)} <= timed
    assert all(t > 0 for line in model.table for t in line)
    assert all(d > 0 for d in model.draft)
    # the engine still serves normally afterwards
    assert token_ids(llm.generate(random_prompts([5]), greedy(8)))[0]


def test_dtype_measurement_alternates_the_dtypes(monkeypatch):
    """A stretch of load must hit both dtypes: their timings interleave, best of the rounds."""
    import engine.dtype_choice as dc

    order = []
    slow_once = {"bfloat16": [5.0, 1.0, 1.2], "float32": [2.0, 2.1, 2.2]}

    def fake(shapes, dtype, device, rows):
        name = str(dtype).removeprefix("torch.")
        times = iter(slow_once[name])
        return lambda: order.append(name) or [next(times)] * len(rows)

    monkeypatch.setattr(dc, "decode_step_timer", fake)
    best = dc.measure_dtypes({}, torch.device("cpu"), rounds=3, rows=(1, 4))
    assert order == ["float32", "bfloat16"] * 3
    assert best == {"float32": [2.0, 2.0], "bfloat16": [1.0, 1.0]}


def test_cost_table_never_prices_more_rows_cheaper(monkeypatch):
    """Timing noise only adds time: a cell measured slower than the same block with more rows
    (or more tokens) is taken at the larger shape's time."""
    import types

    import engine.spec.cost as cost_mod
    from engine.block_manager import BlockManager

    clock = [0.0]
    noisy_rows = 4  # this row count measures 3x slower than it is

    class Runner:
        device = torch.device("cpu")

        def execute(self, plan):
            rows = len(plan.scheduled)
            tokens = plan.num_tokens
            drafting = 0.005 * rows if any(s.draft for s in plan.scheduled) else 0.0
            context = 0.002 * rows  # the draft's context update, drafting or not
            t = 0.01 + 0.001 * tokens + context + drafting
            slow = 3 if rows == noisy_rows else 1
            clock[0] += slow * t
            return types.SimpleNamespace(draft_elapsed=slow * drafting)

    monkeypatch.setattr(cost_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = cost_mod.measure_step_costs(
        Runner(), BlockManager(64, 16), max_rows=16, max_per_row=4, max_tokens=2048,
        with_draft=True, vocab_size=100, lookahead=4, max_model_len=512, time_budget=1e9)
    assert model.rows == [1, 4, 16]
    for q in (1, 2, 4):  # at as many tokens per row, more rows never cost less
        column = [model.step_time(r, r * q) for r in model.rows]
        assert column == sorted(column), column
    assert model.step_time(4, 4) == pytest.approx(model.step_time(16, 16))  # priced as 16
    assert model.draft == sorted(model.draft)
    assert model.table[0][0] == pytest.approx(0.013)  # the clean cells are untouched
    # the draft pass is priced from the runner's drafting time alone
    assert model.draft[0] == pytest.approx(0.005) and model.draft[2] == pytest.approx(0.08)


def test_cost_calibration_prices_each_drafted_slot(monkeypatch):
    """The draft pass is timed with one draft a request and with all of them: a request's
    further slots (here 1 ms each, its 3 drafts in 3 slots) are priced apart from the pass."""
    import types

    import engine.spec.cost as cost_mod
    from engine.block_manager import BlockManager

    clock = [0.0]

    class Runner:
        device = torch.device("cpu")

        def execute(self, plan):
            drafting = [s.draft for s in plan.scheduled if s.draft]
            spent = 0.002 * len(drafting) + 0.001 * sum(n - 1 for n in drafting)
            clock[0] += 0.01 + 0.001 * plan.num_tokens + spent
            return types.SimpleNamespace(draft_elapsed=spent)

    monkeypatch.setattr(cost_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = cost_mod.measure_step_costs(
        Runner(), BlockManager(64, 16), max_rows=16, max_per_row=4, max_tokens=2048,
        with_draft=True, vocab_size=100, lookahead=4, max_model_len=512, draft_slots=3,
        time_budget=1e9)
    assert model.draft == pytest.approx([0.002, 0.008, 0.032])
    assert model.draft_slot == pytest.approx([0.001] * 3)
    assert model.draft_time(4, 12) == pytest.approx(0.008 + 8 * 0.001)
    assert StepCostModel.from_json(model.to_json()).draft_slot == model.draft_slot


def test_cost_table_prices_a_tile_staircase_in_total_tokens(monkeypatch):
    """Products run in tiles of 16 rows (AMX): a step of 17 query tokens costs a tile more
    than one of 16, whatever the rows. The table measures both sides of each edge, so a
    batch of 4 to 8 rows verifying a draft or two each is priced on the right side of it."""
    import types

    import engine.spec.cost as cost_mod
    from engine.block_manager import BlockManager

    clock = [0.0]

    def truth(rows: int, tokens: int) -> float:
        return 0.010 + 0.0002 * tokens + 0.0035 * ((tokens - 1) // 16) + 0.0005 * rows

    class Runner:
        device = torch.device("cpu")

        def execute(self, plan):
            drafting = 0.003 if any(s.draft for s in plan.scheduled) else 0.0
            clock[0] += truth(len(plan.scheduled), plan.num_tokens) + drafting
            return types.SimpleNamespace(draft_elapsed=drafting)

    monkeypatch.setattr(cost_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = cost_mod.measure_step_costs(
        Runner(), BlockManager(64, 16), max_rows=8, max_per_row=8, max_tokens=2048,
        with_draft=True, vocab_size=100, lookahead=8, max_model_len=512, time_budget=1e9)
    assert model.rows == [1, 4, 8]
    assert {16, 17, 32, 33, 48, 49, 64} <= set(model.tokens)
    for rows, tokens in [(1, 8), (4, 16), (4, 17), (4, 20), (6, 16), (6, 17), (8, 8), (8, 16),
                         (8, 17), (8, 24), (8, 33), (8, 64)]:
        assert model.step_time(rows, tokens) == pytest.approx(truth(rows, tokens)), (rows, tokens)
    assert model.draft_time(8) == pytest.approx(0.003)


def test_cost_calibration_measures_every_line_before_the_large_blocks(monkeypatch):
    """Decode-sized steps of every line come first: large blocks that use up the time budget
    must not leave the 64-row line's plain step to an extrapolation."""
    import types

    import engine.spec.cost as cost_mod
    from engine.block_manager import BlockManager

    clock = [0.0]

    def truth(rows: int, tokens: int) -> float:
        return 0.010 + 0.0002 * tokens + 0.0001 * rows

    class Runner:
        device = torch.device("cpu")

        def execute(self, plan):
            tokens = plan.num_tokens
            clock[0] += 10.0 if tokens > 65 else truth(len(plan.scheduled), tokens)
            return types.SimpleNamespace(draft_elapsed=0.0)

    monkeypatch.setattr(cost_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = cost_mod.measure_step_costs(
        Runner(), BlockManager(512, 16), max_rows=64, max_per_row=33, max_tokens=2048,
        with_draft=False, vocab_size=100, lookahead=33, max_model_len=512, time_budget=5.0)
    assert model.rows == [1, 4, 16, 64]
    for rows, tokens in [(1, 17), (4, 33), (16, 17), (16, 64), (64, 64), (64, 65)]:
        assert model.step_time(rows, tokens) == pytest.approx(truth(rows, tokens)), (rows, tokens)
    # the 4-row line's large blocks were measured and took the budget; the 16-row line's were
    # not: they follow its measured slope
    assert clock[0] > 80
    assert model.step_time(16, 512) == pytest.approx(truth(16, 512))


def test_cost_calibration_out_of_time_still_measures_each_lines_shape(monkeypatch):
    """Past the time budget a line is measured sparsely (its plain step, one draft a row and
    the draft pass), not scaled from the line below: on a CPU where a step's cost follows its
    tokens in all, 16 rows priced as 4 times the 4-row line put the plain step at twice its
    cost and a draft a row at a fraction of its share, and drafting looked cheap."""
    import types

    import engine.spec.cost as cost_mod
    from engine.block_manager import BlockManager

    clock = [0.0]
    seen: dict[int, set[int]] = {}

    def truth(rows: int, tokens: int) -> float:
        return 0.03 + 0.004 * tokens + 0.0005 * rows  # compute-bound: tokens in all

    class Runner:
        device = torch.device("cpu")

        def execute(self, plan):
            rows, tokens = len(plan.scheduled), plan.num_tokens
            seen.setdefault(rows, set()).add(tokens)
            drafting = 0.001 * rows if any(s.draft for s in plan.scheduled) else 0.0
            clock[0] += truth(rows, tokens) + drafting
            return types.SimpleNamespace(draft_elapsed=drafting)

    monkeypatch.setattr(cost_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = cost_mod.measure_step_costs(
        Runner(), BlockManager(512, 16), max_rows=64, max_per_row=8, max_tokens=2048,
        with_draft=True, vocab_size=100, lookahead=8, max_model_len=512, time_budget=3.0)
    assert model.rows == [1, 4, 16, 64]
    assert seen[16] == {16, 32} and seen[64] == {64, 128}  # sparse: plain and a draft a row
    assert len(seen[4]) > 2  # the 4-row line was measured whole
    for rows, tokens in [(16, 16), (16, 24), (16, 32), (16, 64), (64, 64), (64, 96), (64, 128),
                         (64, 256)]:
        assert model.step_time(rows, tokens) == pytest.approx(truth(rows, tokens)), (rows, tokens)
    assert model.draft_time(16) == pytest.approx(0.016)
    assert model.draft_time(64) == pytest.approx(0.064)
    # however far past the budget (a machine busy with something else while it calibrates):
    # each line is still timed sparsely, none scaled from another
    seen.clear()
    model = cost_mod.measure_step_costs(
        Runner(), BlockManager(512, 16), max_rows=64, max_per_row=8, max_tokens=2048,
        with_draft=True, vocab_size=100, lookahead=8, max_model_len=512, time_budget=0.0)
    assert seen[4] == {4, 8} and seen[16] == {16, 32} and seen[64] == {64, 128}
    for rows, tokens in [(16, 16), (16, 32), (64, 64), (64, 128)]:
        assert model.step_time(rows, tokens) == pytest.approx(truth(rows, tokens)), (rows, tokens)
