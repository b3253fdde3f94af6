"""A tensor-parallel worker process (ranks 1..N-1; rank 0 is the engine, ``engine.distributed``).

It loads its shard of the target, allocates its KV pool (the target group with its heads, the
layout and block count rank 0 resolved), reports what it resolved, then runs every target pass
rank 0 broadcasts until told to stop. It samples nothing and holds no draft. Any exception is
written to the store under ``error/<rank>`` (rank 0 quotes it) before the process exits.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed import IDLE_TIMEOUT, Comm, WorkerArgs, describe_rank


def _watch_parent(parent: int) -> None:
    """Leave when the engine process is gone (e.g. killed with SIGKILL)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def worker_main(args: WorkerArgs) -> None:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", args.port, args.size, False,
                          timedelta(seconds=args.timeout))
    try:
        _serve(args, store)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then the process exits
        text = traceback.format_exc()
        try:
            store.set(f"error/{args.rank}", text)
        except Exception:  # noqa: BLE001 - rank 0 may be gone already
            pass
        print(f"specserve tensor-parallel rank {args.rank} failed:\n{text}", file=sys.stderr)
        sys.exit(1)


def _serve(args: WorkerArgs, store: dist.Store) -> None:
    from attention.backends import get_backend
    from attention.groups import LayerKVSpec, build_groups
    from attention.layout import choose_layout
    from engine.kv_pool import KVPool
    from engine.runner import copy_slots
    from models.parallel import load_target_shard

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store.set(f"ready/{args.rank}", "1")
    comm = Comm(store, args.rank, args.size, device, args.timeout)
    config = args.config
    mc, cc = config.model, config.cache
    error = None
    try:
        model = load_target_shard(mc.path, mc.hf_config, mc.dtype, args.max_positions, device,
                                  mc.load_format, args.rank, args.size, comm.all_reduce,
                                  with_lm_head=False, products=mc.products)
        cfg = model.config
        names = [f"target.{name}" for name in model.layer_names]
        specs = [LayerKVSpec(n, "target", cfg.num_kv_heads, cfg.head_dim, cc.cache_dtype,
                             cc.block_size) for n in names]
        groups = build_groups(specs, mc.dtype)
        backend = get_backend(config.attention_backend, device)
        for name, group in groups.items():
            backend.check_support(group.dtype, mc.dtype, group.head_size, name)
    except Exception:  # noqa: BLE001 - reported in this rank's startup report
        error = traceback.format_exc()
    store.wait(["setup"], IDLE_TIMEOUT)
    setup = pickle.loads(store.get("setup"))
    report = {"rank": args.rank, "error": error}
    if error is None:
        try:
            # rank 0's layout is the request: it checks this rank's backend supports it
            layout, _ = choose_layout(setup["layout"], {backend.name: backend.supported_layouts})
            cc.layout_cell.set(layout)
            pool = KVPool(list(groups.values()), setup["num_blocks"], cc.layout, device)
            report = describe_rank(args.rank, cc, pool)
        except Exception:  # noqa: BLE001
            report["error"] = error = traceback.format_exc()
    store.set(f"report/{args.rank}", pickle.dumps(report))
    if error is not None:
        return
    kv_layers = pool.layers(names)
    with torch.inference_mode():
        while True:
            msg = comm.broadcast_object()
            if msg is None:
                return
            _, ids, positions, batch, moves = msg
            for src, dst in moves:  # accepted tree nodes rank 0 moved after the last pass
                copy_slots(kv_layers, src, dst, device)
            meta = backend.build_metadata(batch, device)
            model(torch.tensor(ids, dtype=torch.long, device=device), positions.to(device),
                  meta, kv_layers, ())
