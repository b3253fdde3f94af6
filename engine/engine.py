"""The engine: builds models, groups, pool, scheduler and runner once, then steps.

``step()`` is schedule -> execute -> update; everything else is setup and bookkeeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from attention.backends import get_backend
from attention.dtypes import dtype_name
from attention.groups import LayerKVSpec, build_groups
from attention.layout import choose_layout
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.graphs import PadSpace, target_passes
from engine.kv_pool import KVPool, plan_pool
from engine.output_processor import EngineCounters, OutputProcessor
from engine.outputs import RequestOutput, StepPlan
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec.factory import build_proposer
from engine.spec.policy import build_controller
from engine.spec.stats import SpecDecodingStats
from models.hf_folder import load_generation_config, load_tokenizer
from models.loader import load_target

log = logging.getLogger("specserve.engine")


class RequestValidationError(ValueError):
    """A request the engine cannot serve as given; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = torch.device(config.device)
        # positions past max_model_len are needed by draft blocks (look-ahead slots)
        max_positions = mc.max_model_len + 128
        self.tp = None  # tensor parallelism: this process is rank 0 of N (engine.distributed)
        if config.tensor_parallel_size > 1:
            from engine.distributed import TensorParallelGroup

            self.tp = TensorParallelGroup(config, max_positions)
            self.model = self.tp.load_target()
        else:
            self.model = load_target(
                mc.path, mc.hf_config, mc.dtype, max_positions, self.device, mc.load_format,
                mc.products,
            )
        cfg = self.model.config
        self.target_layers = [f"target.{name}" for name in self.model.layer_names]
        specs = [
            LayerKVSpec(name, "target", cfg.num_kv_heads, cfg.head_dim, cc.cache_dtype, cc.block_size)
            for name in self.target_layers
        ]
        self.proposer = build_proposer(config, self.model, self.device)
        if self.proposer is not None:
            specs += self.proposer.layer_specs()
        groups = build_groups(specs, mc.dtype)
        names = {"target": config.attention_backend}
        if "draft" in groups:
            names["draft"] = config.speculative.attention_backend or config.attention_backend
        instances = {}  # one instance per backend name: groups on one backend share its workspace
        for name in set(names.values()):
            instances[name] = get_backend(name, self.device)
        backends = {group: instances[name] for group, name in names.items()}
        for name, group in groups.items():
            backends[name].check_support(group.dtype, mc.dtype, group.head_size, name)
        layout, reason = choose_layout(
            cc.layout_request, {b.name: b.supported_layouts for b in backends.values()}
        )
        cc.layout_cell.set(layout)
        lookahead = self.proposer.lookahead_slots if self.proposer is not None else 0
        # static (graphed) steps pad with rows that write to a block no request owns
        reserved = 1 if config.graphs is not None else 0
        plan = plan_pool(
            list(groups.values()), cc.kv_cache_memory_bytes, mc.max_model_len, lookahead,
            cc.num_blocks_override, reserved,
        )
        self.pool = KVPool(list(groups.values()), plan.num_blocks, cc.layout, self.device)
        if self.tp is not None:
            self.tp.setup_workers(layout, self.pool)
        self.blocks = BlockManager(plan.num_blocks - reserved, cc.block_size)
        pad = None
        if config.graphs is not None:
            pad = PadSpace(plan.num_blocks - 1, -(-(mc.max_model_len + lookahead) // cc.block_size))
        if self.proposer is not None:
            self.proposer.bind(self.pool, backends["draft"] if "draft" in backends else None)
            if pad is not None:
                self.proposer.use_graphs(config.graphs, pad)
        runner_args = (self.model, self.pool.layers(self.target_layers), backends["target"],
                       self.device, Sampler(mc.seed), self.proposer)
        if self.tp is None:
            graphs = None
            if pad is not None:
                taps = self.proposer.capture_layers if self.proposer is not None else ()
                graphs = target_passes(self.model, runner_args[1], backends["target"],
                                       self.device, config.graphs, pad, taps)
            self.runner = ModelRunner(*runner_args, graphs=graphs)
        else:
            from engine.distributed import TPModelRunner

            self.runner = TPModelRunner(self.tp, *runner_args)
        controller = None
        if self.proposer is not None:
            group_dtypes = {n: dtype_name(g.dtype) for n, g in groups.items()}
            controller = build_controller(config, self.proposer, self.runner, self.blocks,
                                          group_dtypes)
        self.scheduler = Scheduler(config.scheduler, self.blocks, lookahead, controller)
        k_max = self.proposer.num_speculative_tokens if self.proposer else 0
        self.spec_stats = controller.stats if controller else SpecDecodingStats(k_max)
        self.tokenizer = load_tokenizer(mc.path) if (mc.path / "tokenizer.json").exists() or (
            mc.path / "tokenizer_config.json").exists() else None
        gen = load_generation_config(mc.path)
        eos = list(gen.get("eos_token_id") or [])
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self.eos_token_ids = tuple(eos)
        self.generation_defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
        self.output = OutputProcessor(self.tokenizer)
        self._next_id = 0
        self.startup_info = {
            "model": str(mc.path),
            "dtype": dtype_name(mc.dtype),
            "kv_layout": f"{layout} ({reason})",
            "groups": {n: dtype_name(g.dtype) for n, g in groups.items()},
            "num_blocks": plan.num_blocks - reserved,
            "kv_tokens": (plan.num_blocks - reserved) * cc.block_size,
            "cuda_graphs": None if config.graphs is None else list(config.graphs.sizes),
            "speculative": None if config.speculative is None else {
                **{k: v for k, v in vars(config.speculative).items() if v is not None},
                "num_speculative_tokens": self.proposer.num_speculative_tokens,
                **({"tree_nodes": self.proposer.tree.num_nodes}
                   if self.proposer.tree is not None else {}),
            },
        }
        if self.tp is not None:
            self.startup_info["tensor_parallel_size"] = config.tensor_parallel_size
        log.info("engine ready: %s", self.startup_info)

    # -- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model; returns its effective ``max_tokens``."""
        limit = self.config.model.max_model_len
        vocab = self.config.model.vocab_size
        if not prompt_token_ids:
            raise RequestValidationError("The prompt is empty; provide at least one token", "prompt")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestValidationError(
                f"Token id {bad[0]} is out of vocabulary (valid ids: 0..{vocab - 1})", "prompt"
            )
        n = len(prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n >= limit or n + max_tokens > limit:
            raise RequestValidationError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                "prompt", "context_length_exceeded",
            )
        if params.stop and self.tokenizer is None:
            raise RequestValidationError("stop strings need a tokenizer", "stop")
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> Request:
        return self.add_requests([(request_id, prompt_token_ids, params, prompt)])[0]

    def add_requests(
        self, requests: Sequence[tuple[str, list[int], SamplingParams, str | None]]
    ) -> list[Request]:
        """Add ``(request_id, prompt_token_ids, params, prompt)`` items all or nothing: each is
        validated once and the waiting queue is checked once for the whole batch. A batch
        larger than the queue can ever hold is a ``RequestValidationError`` (code
        ``queue_capacity``); one that only has to wait for room is a ``QueueFullError``."""
        max_tokens = [self.validate(ids, params) for _, ids, params, _ in requests]
        ids_seen = set()
        for rid, *_ in requests:
            if rid in ids_seen or rid in self.scheduler.requests:
                raise ValueError(f"Request id {rid!r} is already in use")
            ids_seen.add(rid)
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and len(requests) > limit:
            raise RequestValidationError(
                f"This request needs {len(requests)} sequences (prompts x n) but the waiting "
                f"queue holds at most {limit} (--max-waiting-requests); send fewer prompts or "
                "a smaller n", None, "queue_capacity")
        if limit is not None and self.num_waiting + len(requests) > limit:
            raise QueueFullError(f"The waiting queue is full ({limit} requests); retry later")
        added = []
        for (rid, ids, params, prompt), max_new in zip(requests, max_tokens):
            if params.max_tokens is None:
                params = SamplingParams(**{**params.__dict__, "max_tokens": max_new})
            req = Request(rid, list(ids), params, self.eos_token_ids, prompt)
            self.scheduler.add(req)
            self.output.add(req)
            added.append(req)
        return added

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self.output.finish(req)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise if the engine can no longer step: a tensor-parallel worker died or the group
        failed (``TensorParallelError``). Cheap; the server calls it while idle."""
        if self.tp is not None:
            self.tp.check_alive()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.runner.execute(plan)
        appended = self.scheduler.update(plan, result)  # speculation stats included
        self._stamp_scheduled(plan)
        return self._outputs(plan, appended)

    @staticmethod
    def _stamp_scheduled(plan: StepPlan) -> None:
        now = time.monotonic()
        for item in plan.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now

    def _outputs(self, plan: StepPlan, appended: dict[str, list[int]]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for item in plan.scheduled:
            req = item.request
            new = appended.get(req.request_id)
            if not new and not req.is_finished:
                continue
            if new:
                hit = self.output.on_tokens(req, new, now)
                if hit is not None and not req.is_finished:
                    self.scheduler.finish(req, "stop", hit.stop)
            if req.is_finished:
                outputs.append(self.output.finished_output(req, len(new or [])))
            else:
                outputs.append(self.output.make_output(req, len(new or [])))
        return outputs

    @property
    def counters(self) -> EngineCounters:
        return self.output.counters

    # -- introspection ----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions


