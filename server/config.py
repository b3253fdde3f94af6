"""Server-level settings (everything that is not an engine argument)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers
DEFAULT_BODY_TIMEOUT = 30.0  # seconds a request may take to send its body
DEFAULT_KEEP_ALIVE = 5.0  # seconds an idle keep-alive connection is kept
DEFAULT_LIMIT_CONCURRENCY = 512  # in-flight requests before a 503 (/health, /metrics exempt)


class ServerConfigError(ValueError):
    """An invalid server option; the message names the flag."""


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()
    max_logprobs: int = 20
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions batch
    request_timeout: float | None = None  # seconds; the request is aborted past it
    shutdown_timeout: float = 0.0  # seconds in-flight requests may run after SIGTERM
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_stats_interval: float = 10.0  # seconds between stats log lines; 0 disables
    metrics_without_auth: bool = False  # /metrics answers without the API key
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    timeout_keep_alive: float = DEFAULT_KEEP_ALIVE
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ServerConfigError("--served-model-name needs at least one non-empty name")
        if any(not k for k in self.api_keys):
            raise ServerConfigError("--api-key must not be empty")
        if self.max_logprobs < 0:
            raise ServerConfigError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_n < 1 or self.max_prompts < 1:
            raise ServerConfigError("max_n and max_prompts must be >= 1")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ServerConfigError(
                f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ServerConfigError(
                f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.max_body_bytes < 1024:
            raise ServerConfigError(
                f"--max-request-body-bytes must be >= 1024, got {self.max_body_bytes}")
        for flag, value in (("--http-header-timeout", self.header_timeout),
                            ("--http-body-timeout", self.body_timeout),
                            ("--timeout-keep-alive", self.timeout_keep_alive)):
            if not value > 0:
                raise ServerConfigError(f"{flag} must be > 0 seconds, got {value}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ServerConfigError(
                f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")

    @property
    def model_name(self) -> str:
        """The name used in responses and in the ``model_name`` metrics label."""
        return self.served_model_names[0]
