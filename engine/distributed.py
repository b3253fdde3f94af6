"""Tensor parallelism over ``torch.distributed``: rank 0 is the engine process, ranks 1..N-1
are worker processes (``engine.tp_worker``) started with ``torch.multiprocessing`` spawn.

Rank 0 runs the scheduler, the sampler, the speculation controller and the draft; every step it
broadcasts the target pass (token ids, positions and the ``AttentionBatch`` every backend plans
from) to the workers, and all ranks run their shard of the target in lockstep (two all-reduces
per layer, see ``models.parallel``). After the last all-reduce every rank holds the complete
hidden states, so rank 0 computes the logits and the draft's tapped states from its own copy:
nothing is gathered back. When a tree window's accepted nodes move to the slots of their depths
(``ModelRunner.move_slots``), each worker makes the same copies of its own heads when the next
pass arrives, before running it.

Process groups (built from a ``TCPStore`` hosted by rank 0, not registered as the default
group, so several engines can live in one process):
- ``model`` (gloo on CPU, NCCL on CUDA): the all-reduces, with a bounded timeout
  (``SPECSERVE_TP_TIMEOUT`` seconds, default 120): a worker that hangs fails the step;
- ``ctrl`` (gloo): step plans from rank 0; workers wait there between steps, so its timeout
  only bounds how long an idle engine may stay idle (30 days).
A worker that dies closes its sockets, so the peers' collectives fail at once (gloo); rank 0
also checks its workers' exit codes before every step and, through ``LLMEngine.check_health``,
while the server is idle. Either way the step raises
``TensorParallelError`` naming the rank and how it died, and the remaining workers are stopped;
the server answers 503 and exits. On NCCL (untested here: no GPUs) a peer that dies in the
middle of a collective is only noticed by NCCL's watchdog after ``SPECSERVE_TP_TIMEOUT``.
Startup exchanges (readiness, the resolved layout and block count, each rank's report) go
through the store, polled with the workers' liveness, so a worker that dies at startup is
reported within a second instead of after a timeout.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attention.backends.base import AttentionBatch
from attention.dtypes import dtype_name
from engine.runner import ModelRunner

if TYPE_CHECKING:
    from engine.config import CacheConfig, EngineConfig
    from engine.kv_pool import KVPool
    from models.llama import LlamaForCausalLM

log = logging.getLogger("specserve.tp")

TIMEOUT_ENV = "SPECSERVE_TP_TIMEOUT"
DEFAULT_TIMEOUT = 120.0  # seconds a collective may wait for a live peer
STARTUP_TIMEOUT = 600.0  # seconds a worker may take to import, load its shard, set up its pool
IDLE_TIMEOUT = timedelta(days=30)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or disagreed at startup; the engine cannot go on."""


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """One device per rank: CPU for all, or consecutive CUDA devices from ``device``'s index."""
    if device.type != "cuda":
        return [device] * size
    base = device.index or 0
    return [torch.device("cuda", base + r) for r in range(size)]


def cpu_threads_per_rank(size: int) -> int:
    """The cores are divided among the ranks, which share this machine."""
    return max(1, torch.get_num_threads() // size)


class Comm:
    """The two process groups of one rank (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout: float) -> None:
        self.rank, self.size = rank, size
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, size, IDLE_TIMEOUT)
        # rank 0 waits for every worker to take the plan, which a hung worker never does
        self.send_timeout = timedelta(seconds=timeout) if rank == 0 else IDLE_TIMEOUT
        model_store = dist.PrefixStore("model", store)
        if device.type == "cuda":  # not exercised by the CPU tests (scripts/tp_nccl_check.sh)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=timeout)  # the watchdog's bound, as on gloo
            self.model = dist.ProcessGroupNCCL(model_store, rank, size, options)
        else:
            self.model = dist.ProcessGroupGloo(model_store, rank, size, timedelta(seconds=timeout))
        self.reduce_seconds = 0.0  # time spent in all-reduces (waiting for peers included)
        self.reduce_calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.model.allreduce([tensor]).wait()
        self.reduce_seconds += time.perf_counter() - t0
        self.reduce_calls += 1

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (pickled); every other rank returns it."""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self.ctrl.broadcast(size, 0, self.send_timeout).wait()
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size), dtype=torch.uint8)
        self.ctrl.broadcast(buf, 0, self.send_timeout).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())


def describe_rank(rank: int, cache: CacheConfig, pool: KVPool) -> dict[str, Any]:
    """What one rank resolved: the layout (config cell and pool), blocks and per-group KV."""
    return {
        "rank": rank,
        "layout": cache.layout,
        "pool_layout": pool.layout,
        "num_blocks": pool.num_blocks,
        "groups": {
            name: {"dtype": dtype_name(g.dtype), "kv_heads": g.num_kv_heads,
                   "head_size": g.head_size, "block_size": g.block_size, "layers": len(g.layers),
                   "pages": tuple(pool.layer(g.layers[0]).physical.shape)}
            for name, g in pool.groups.items()
        },
    }


@dataclass
class WorkerArgs:
    rank: int
    size: int
    port: int
    config: EngineConfig
    max_positions: int
    threads: int
    timeout: float
    device: str


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop_workers(procs: list, comm_holder: list, threads_before: int | None) -> None:
    """Ask the workers to leave while they serve steps; kill them when the groups failed or
    the engine never finished starting (they are not listening then)."""
    comm = comm_holder[0] if comm_holder else None
    if comm is not None and all(p.exitcode is None for p in procs):
        try:
            comm.broadcast_object(None)
            deadline = time.monotonic() + 5.0
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a broken group: the workers are killed below
            pass
    for p in procs:
        if p.exitcode is None:
            p.kill()  # a failed group's workers can do nothing useful (and may be stopped)
            p.join(5.0)
    comm_holder.clear()
    if threads_before is not None:
        torch.set_num_threads(threads_before)


class TensorParallelGroup:
    """Rank 0's side: starts the workers, sets them up, sends them every step, watches them."""

    def __init__(self, config: EngineConfig, max_positions: int) -> None:
        from engine.tp_worker import worker_main

        self.config = config
        self.size = config.tensor_parallel_size
        self.max_positions = max_positions
        self.timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
        self.devices = rank_devices(torch.device(config.device), self.size)
        self.device = self.devices[0]
        self.failed: str | None = None
        self.reports: list[dict[str, Any]] = []
        threads_before = None
        threads = 1
        if self.device.type == "cpu":
            threads_before = torch.get_num_threads()
            threads = cpu_threads_per_rank(self.size)
            torch.set_num_threads(threads)
            if self.size > threads_before:
                log.warning("tensor_parallel_size %d exceeds the %d torch threads (cores) of "
                            "this process: ranks share cores, every all-reduce waits for "
                            "descheduled peers", self.size, threads_before)
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True,
                                   timedelta(seconds=STARTUP_TIMEOUT), wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs = []
        self._comm: list[Comm] = []
        self._serving: list[Comm] = []  # set once the workers run their step loop
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self._serving,
                                           threads_before)
        for rank in range(1, self.size):
            args = WorkerArgs(rank, self.size, self.store.port, config, max_positions, threads,
                              self.timeout, str(self.devices[rank]))
            proc = ctx.Process(target=worker_main, args=(args,), daemon=True,
                               name=f"specserve-tp-rank{rank}")
            proc.start()
            self.procs.append(proc)
        log.info("tensor parallel: %d ranks on %s, %d torch threads each, worker pids %s",
                 self.size, [str(d) for d in self.devices], threads,
                 [p.pid for p in self.procs])
        self._wait_keys([f"ready/{r}" for r in range(1, self.size)], "start")
        self._comm.append(Comm(self.store, 0, self.size, self.device, self.timeout))

    @property
    def comm(self) -> Comm:
        if not self._comm:
            raise TensorParallelError(self.failed or "tensor parallelism was shut down")
        return self._comm[0]

    # -- startup ----------------------------------------------------------------------------
    def load_target(self) -> LlamaForCausalLM:
        """Rank 0's shard of the target (the workers load theirs meanwhile)."""
        from models.parallel import load_target_shard

        mc = self.config.model
        return load_target_shard(mc.path, mc.hf_config, mc.dtype, self.max_positions,
                                 self.device, mc.load_format, 0, self.size, self.comm.all_reduce,
                                 products=mc.products)

    def setup_workers(self, layout: str, pool: KVPool) -> None:
        """Hand the workers rank 0's resolved layout and block count; each allocates its KV
        pool (the target group, its heads) and reports what it resolved, which must agree."""
        self.store.set("setup", pickle.dumps({"layout": layout, "num_blocks": pool.num_blocks}))
        self._wait_keys([f"report/{r}" for r in range(1, self.size)], "set up its KV pool")
        mine = describe_rank(0, self.config.cache, pool)
        reports = [mine] + [pickle.loads(self.store.get(f"report/{r}"))
                            for r in range(1, self.size)]
        for rep in reports[1:]:
            if "error" in rep:
                raise self._fail(f"tensor-parallel rank {rep['rank']} failed at startup:\n"
                                 f"{rep['error']}")
            for key in ("layout", "pool_layout", "num_blocks"):
                if rep[key] != mine[key]:
                    raise self._fail(f"tensor-parallel rank {rep['rank']} resolved {key}="
                                     f"{rep[key]!r} but rank 0 resolved {mine[key]!r}")
            for name, spec in rep["groups"].items():
                if spec != mine["groups"].get(name):
                    raise self._fail(f"tensor-parallel rank {rep['rank']} resolved KV group "
                                     f"{name!r} as {spec} but rank 0 as "
                                     f"{mine['groups'].get(name)}")
        self.reports = reports
        self._serving.append(self.comm)
        log.info("tensor parallel: all %d ranks resolved layout %s, %d blocks, target KV %s",
                 self.size, layout, pool.num_blocks, mine["groups"]["target"])

    def _wait_keys(self, keys: list[str], what: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise self._fail(f"tensor-parallel workers did not {what} within "
                                 f"{STARTUP_TIMEOUT:.0f} s")
            time.sleep(0.02)

    # -- steps ------------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        if any(p.exitcode is not None for p in self.procs):
            raise self.failure(None)

    def send_step(self, ids: list[int], positions: torch.Tensor, batch: AttentionBatch,
                  moves: list[tuple[list[int], list[int]]]) -> None:
        """Send one target pass; ``moves``: K/V slot copies ``(src, dst)`` rank 0 made since
        the last pass, which each worker applies to its own heads, in order, before it."""
        self.check_alive()
        try:
            self.comm.broadcast_object(("step", ids, positions, batch, moves))
        except RuntimeError as exc:
            raise self.failure(exc) from exc

    def failure(self, exc: BaseException | None) -> TensorParallelError:
        """Describe a failed step (who died, how, what it said), stop every worker, and return
        the error to raise. Later steps raise it again at once."""
        if self.failed is not None:
            return TensorParallelError(self.failed)
        deadline = time.monotonic() + 2.0  # a dead peer's exit status may lag its sockets
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            time.sleep(0.02)
        parts = []
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is None:
                continue
            line = f"worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)}"
            try:
                if self.store.check([f"error/{rank}"]):
                    line += ":\n" + self.store.get(f"error/{rank}").decode(errors="replace")
            except Exception:  # noqa: BLE001 - the store is best effort here
                pass
            parts.append(line)
        if not parts:
            parts.append(f"a collective failed with every worker alive ({exc}); a worker may "
                         f"be hung (collectives time out after {self.timeout:.0f} s, "
                         f"{TIMEOUT_ENV})")
        return self._fail("tensor parallelism failed, the engine cannot continue: "
                          + "; ".join(parts))

    def _fail(self, message: str) -> TensorParallelError:
        self.failed = message
        log.error("%s", message)
        self._comm.clear()  # the groups are unusable now: no goodbye broadcast
        self._serving.clear()
        self.shutdown()
        return TensorParallelError(message)

    def shutdown(self) -> None:
        """Stop the workers (idempotent; also runs when the group is garbage collected)."""
        self._finalizer()


class TPModelRunner(ModelRunner):
    """The runner of rank 0: every target pass is first sent to the workers, with the K/V
    moves of accepted tree nodes made since the one before."""

    def __init__(self, tp: TensorParallelGroup, *args: Any) -> None:
        super().__init__(*args)
        self.tp = tp
        self._moves: list[tuple[list[int], list[int]]] = []

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        # The workers move their heads when the next pass arrives, before it runs: nothing
        # reads or writes their K/V in between, so no message of its own is needed
        super().move_slots(src, dst)
        self._moves.append((src, dst))

    def run_target(self, ids: list[int], positions: torch.Tensor, batch: AttentionBatch,
                   capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        moves, self._moves = self._moves, []
        self.tp.send_step(ids, positions, batch, moves)
        try:
            return super().run_target(ids, positions, batch, capture)
        except RuntimeError as exc:
            raise self.tp.failure(exc) from exc
