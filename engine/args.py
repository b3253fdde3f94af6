"""Turn user-facing arguments (CLI flags or ``LLM(...)`` keywords) into one ``EngineConfig``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_dtype,
    parse_memory,
)
from engine.dtype_choice import auto_dtype, auto_products
from models.hf_folder import load_hf_config
from models.loader import decoder_config
from models.resolve import DEFAULT_MODEL, builtin_model_name, resolve_model_path

log = logging.getLogger("specserve.engine")

DEFAULT_SPEC = "default"  # the built-in model's shipped draft, when it has one


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None  # None: default_block_size(device)
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | str = "1GiB"
    kv_cache_layout: str | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int | None = None
    speculative_config: Any = DEFAULT_SPEC
    attention_backend: str = "torch"
    device: str = "cpu"
    seed: int = 0
    served_model_name: str | None = None
    load_format: str = "auto"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # CUDA: never capture graphs (vLLM's switch)
    max_cudagraph_capture_size: int = 512  # CUDA: the largest step (in tokens) run as a graph

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"Unknown engine arguments {unknown}; valid: {sorted(known)}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        path = resolve_model_path(self.model)
        hf = load_hf_config(path)
        dec = decoder_config(hf)
        dtype = parse_dtype(self.dtype)
        if dtype is None:
            dtype = auto_dtype(hf, torch.device(self.device), self.max_num_seqs)
        products = auto_products(hf, torch.device(self.device), dtype, self.max_num_seqs)
        max_len = self.max_model_len or dec.max_position_embeddings
        if max_len > dec.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"({dec.max_position_embeddings}); choose --max-model-len <= "
                f"{dec.max_position_embeddings}",
                "max_model_len",
            )
        model = ModelConfig(
            model=self.model,
            path=path,
            hf_config=hf,
            dtype=dtype,
            max_model_len=max_len,
            vocab_size=dec.vocab_size,
            served_model_name=self.served_model_name or self.model,
            seed=self.seed,
            load_format=self.load_format,
            products=products,
        )
        block_size = self.block_size
        if block_size is None:
            block_size = default_block_size(torch.device(self.device))
        cache = CacheConfig(
            block_size=block_size,
            cache_dtype=self.kv_cache_dtype,
            kv_cache_memory_bytes=parse_memory(self.kv_cache_memory),
            num_blocks_override=self.num_kv_blocks,
            layout_request=self.kv_cache_layout,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_len,
            max_waiting_requests=self.max_waiting_requests,
        )
        self._check_tensor_parallel(dec)
        graphs = graph_config(torch.device(self.device), self.attention_backend,
                              self.tensor_parallel_size, self.enforce_eager,
                              self.max_cudagraph_capture_size)
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            speculative=self._speculative(),
            attention_backend=self.attention_backend,
            device=self.device,
            tensor_parallel_size=self.tensor_parallel_size,
            graphs=graphs,
        )

    def _check_tensor_parallel(self, dec) -> None:
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {n!r}",
                              "tensor_parallel_size")
        if n == 1:
            return
        from models.parallel import tensor_parallel_error

        problem = tensor_parallel_error(dec, n)
        if problem is not None:
            raise ConfigError(f"{problem} (model {self.model})", "tensor_parallel_size")
        device = torch.device(self.device)
        if device.type == "cuda":
            first = device.index or 0
            count = torch.cuda.device_count()
            if first + n > count:
                raise ConfigError(
                    f"tensor_parallel_size {n} needs CUDA devices {first}..{first + n - 1}, but "
                    f"{count} {'is' if count == 1 else 'are'} visible", "tensor_parallel_size")
        elif device.type != "cpu":
            raise ConfigError(f"tensor parallelism runs on cpu or cuda, not {device.type}",
                              "tensor_parallel_size")

    def _speculative(self) -> SpeculativeConfig | None:
        if isinstance(self.speculative_config, str) and self.speculative_config == DEFAULT_SPEC:
            draft = default_draft_for(self.model)
            if draft is None:
                return None
            # the adaptive controller decides per step, from measured costs, whether drafts pay
            return SpeculativeConfig(method="dflash", model=str(draft))
        return SpeculativeConfig.parse(self.speculative_config)


def capture_sizes(max_tokens: int) -> tuple[int, ...]:
    """The token counts captured as graphs: 1, 2, 4, 8, then steps of 8 to 32, 16 to 128, 32
    to 256 and 64 beyond (above 32 tokens a padded step wastes under a third of its rows, from
    48 under a quarter),
    up to and including ``max_tokens``."""
    sizes, n = [], 1
    while n <= max_tokens:
        sizes.append(n)
        n = n * 2 if n < 8 else n + (8 if n < 32 else 16 if n < 128 else 32 if n < 256 else 64)
    if sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return tuple(sizes)


def graph_config(device: torch.device, backend: str, tensor_parallel_size: int,
                 enforce_eager: bool, max_tokens: int) -> GraphConfig | None:
    """CUDA graphs for decode and verify steps where they can run: a CUDA device, the
    FlashInfer backend (whose plans take fixed-size buffers; the torch backend's shapes follow
    the contexts), one rank, and no ``enforce_eager``. Elsewhere every step runs eagerly."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_cudagraph_capture_size must be an integer >= 1, got "
                          f"{max_tokens!r}", "max_cudagraph_capture_size")
    if enforce_eager or device.type != "cuda":
        return None
    if backend.strip().lower() != "flashinfer":
        log.info("CUDA graphs need --attention-backend flashinfer; running %s eagerly", backend)
        return None
    if tensor_parallel_size > 1:
        log.info("CUDA graphs are not captured with tensor parallelism; running eagerly")
        return None
    return GraphConfig(capture_sizes(max_tokens))


def default_block_size(device: torch.device) -> int:
    """Tokens per KV block when none is asked for: 128 on the CPU, 16 elsewhere (as vLLM).

    On the CPU the paged attention reads longer runs of contiguous K/V per block: SmolLM2-135M
    bf16, 32 requests of 256 tokens, block size 128 against 16 in one process (4 alternating
    rounds, the same tokens): 1.10x tok/s (1.07-1.19); at 1 request and at 16 requests of 64
    tokens 0.99x and 1.00x (2-vCPU AVX-512-BF16 EPYC)."""
    return 128 if device.type == "cpu" else 16


def default_draft_for(model: str) -> Path | None:
    """The DFlash draft shipped for a built-in model, if one is present."""
    name = builtin_model_name(model)
    if name is None:
        return None
    folder = Path(__file__).resolve().parent.parent / "models" / "drafts" / f"{name}-dflash"
    return folder if (folder / "config.json").exists() else None
