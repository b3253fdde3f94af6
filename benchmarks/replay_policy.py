"""Speculation policies replayed on recorded draft acceptance: a comparison without timing noise.

On a shared 2-vCPU machine two runs of the same engine differ by 10-20% (the same adaptive
controller measured 1.06x and 1.62x no speculation on the same four GSM8K prompts), so a
policy change worth 5% is invisible end to end without hours of runs. This replays instead.

``record``: for every stored sequence of a draft-data folder (``scripts/dflash_data.py``: the
target's greedy answers with tapped features), how many drafted tokens the target accepts
from a block anchored at each response position (the draft's dense pass, as
``train_dflash.py --eval-only`` walks it; K = the draft's block size - 1). Written as JSON.

``replay``: one stream at a time over those sequences, under each policy: no speculation,
fixed K, and the engine's own adaptive controller (``engine.spec.controller``, unchanged),
which decides from a step cost table it believes and refines it from the replayed steps'
times. A step verifying k drafts takes ``--step-ms[k]`` ms, plus ``--draft-ms`` when it
drafts, each times lognormal noise. Greedy outputs are fixed, so a block anchored at position p
always gains the same tokens: the replay is exact about tokens, and its times are as right as
the cost figures (the defaults: one row of SmolLM2-135M in bfloat16 on a 2-vCPU AVX-512-BF16
EPYC, 30 interleaved rounds, minimum). ``--believe noisy`` starts the controller from a startup
calibration that over-priced the full block and the draft pass as one measured run did.

    python benchmarks/replay_policy.py record DATA_DIR traces.json
    python benchmarks/replay_policy.py replay traces.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from engine.spec.acceptance import AcceptanceModel, load_seed_curve  # noqa: E402
from engine.spec.controller import Candidate, SpecController  # noqa: E402
from engine.spec.cost import StepCostModel  # noqa: E402
from engine.spec.stats import SpecDecodingStats  # noqa: E402

STEP_MS = [15.0, 15.2, 15.3, 15.5, 15.7, 16.0, 17.2, 18.3]  # verifying k = 0..7 drafts, 1 row
DRAFT_MS = 2.5


def load_draft(draft_dir: Path, model: str):
    """A saved draft in eval mode and the target's frozen embedding and LM head restricted to
    the draft's vocabulary (``train_dflash.Frozen``), as the dense evaluations take them."""
    import train_dflash as td
    from models.dflash import iter_draft_weights
    from models.dflash2 import build_draft, draft_config
    from models.hf_folder import load_hf_config

    frozen, _ = td.load_frozen(model)
    draft = build_draft(draft_config(load_hf_config(draft_dir)), frozen.embed.shape[0])
    draft.load_weights(iter_draft_weights(draft_dir))
    draft.eval()
    ids = draft.draft_token_ids
    return draft, (frozen if ids is None else frozen.restrict(ids))


def record(data: Path, out: Path, draft_dir: Path, model: str, taps: list[int]) -> None:
    import torch
    import train_dflash as td

    draft, frozen = load_draft(draft_dir, model)
    traces = []
    with torch.no_grad():
        for seq in td.load_sequences(data, taps):
            traces.append({"accepted": td.accepted_prefixes(draft, frozen, seq)})
    out.write_text(json.dumps({"k": draft.config.block_size - 1, "draft": str(draft_dir),
                               "traces": traces}))
    print(f"{len(traces)} sequences, {sum(len(t['accepted']) for t in traces)} positions -> {out}")


def believed_costs(step_ms: list[float], draft_ms: float, believe: str) -> StepCostModel:
    """A one-row cost table on the ladder 1, 2, 4, ... tokens (as the engine measures it)."""
    tokens, q = [], 1
    while q < len(step_ms):
        tokens.append(q)
        q *= 2
    tokens.append(len(step_ms))
    line = [step_ms[q - 1] / 1e3 for q in tokens]
    draft = draft_ms / 1e3
    if believe == "noisy":  # measured once: a 1.54x price on the full block, 4.9 ms of draft
        line = [line[0]] * (len(line) - 1) + [1.54 * line[0]]
        draft = max(draft, 0.33 * line[0])
    return StepCostModel([1], tokens, [line], [draft], max_per_row=len(step_ms))


def replay(traces: list[list[int]], policy: str, *, k_max: int, step_ms: list[float],
           draft_ms: float, noise: float, seed: int, seed_curve: list[float] | None,
           believe: str = "true") -> dict:
    """Tokens per second and steps by k of ``policy`` ("none", "K=n" or "adaptive") over the
    traces, one request after the other through one controller (as a server keeps one)."""
    rng = random.Random(seed)

    def jitter() -> float:
        return math.exp(rng.gauss(0.0, noise))

    ctl = None
    if policy == "adaptive":
        ctl = SpecController(k_max, AcceptanceModel(k_max, seed_curve),
                             believed_costs(step_ms, draft_ms, believe), SpecDecodingStats(k_max))
    fixed = int(policy[2:]) if policy.startswith("K=") else 0
    tokens = 0
    seconds = 0.0
    by_k = [0] * (k_max + 1)
    for accepted in traces:
        # the prefill's step sampled the first response token (position 0) and drafted from
        # it or not; each later step verifies what the one before drafted
        end, pos = len(accepted), 0
        held = k_max if fixed else ctl.fresh_request_drafts(1) if ctl is not None else 0
        state = ctl.acceptance.new_request() if ctl is not None else None
        while pos < end:
            cap = min(k_max, end - 1 - pos)  # tokens past this anchor, less the target's own
            if ctl is not None:
                decision = ctl.plan([Candidate(state, held, cap, 1)])[0]
                k, made = decision.k, decision.draft
            else:
                k, made = min(fixed, held, cap), k_max if fixed else 0
            drafts = made > 0
            gained = min(k, accepted[pos])
            draft_s = draft_ms / 1e3 * jitter() if drafts else 0.0
            step_s = step_ms[k] / 1e3 * jitter() + draft_s
            if ctl is not None:
                expected = ctl.expected_tokens(state, k)
                ctl.observe(state, k, gained)
                ctl.observe_step(1, 1 + k, int(drafts), step_s, verified=k, expected=expected,
                                 produced=1 + gained, draft_seconds=draft_s)
            by_k[k] += 1
            held = made  # the drafts made for the next step
            tokens += 1 + gained
            seconds += step_s
            pos += 1 + gained
    return {"tok_s": tokens / seconds, "steps_by_k": by_k}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="acceptance at every position of stored sequences")
    r.add_argument("data", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--draft", type=Path,
                   default=ROOT / "models" / "drafts" / "smollm2-135m-instruct-dflash")
    r.add_argument("--model", default="smollm2-135m-instruct")
    r.add_argument("--taps", type=int, nargs="+", default=[1, 14, 27])
    q = sub.add_parser("replay", help="policies over recorded traces")
    q.add_argument("traces", type=Path, nargs="+")
    q.add_argument("--policies", nargs="+", default=["none", "K=3", "K=7", "adaptive"])
    q.add_argument("--believe", nargs="+", default=["true", "noisy"], choices=["true", "noisy"],
                   help="the adaptive controller's starting cost table")
    q.add_argument("--step-ms", type=float, nargs="+", default=STEP_MS,
                   help="ms of a one-row step verifying 0, 1, ..., K drafts")
    q.add_argument("--draft-ms", type=float, default=DRAFT_MS)
    q.add_argument("--noise", type=float, default=0.1, help="lognormal sigma of step times")
    q.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    if args.cmd == "record":
        record(args.data, args.out, args.draft, args.model, args.taps)
        return
    print("| traces | policy | tok/s | x none | steps with k = 0..K |")
    print("|---|---|---|---|---|")
    for path in args.traces:
        data = json.loads(path.read_text())
        k_max = data["k"]
        if len(args.step_ms) != k_max + 1:
            raise SystemExit(f"--step-ms needs {k_max + 1} values for K = {k_max}")
        traces = [t["accepted"] for t in data["traces"]]
        seed_curve = load_seed_curve(data.get("draft"))

        def rate(pol: str, believe: str = "true") -> tuple[float, list[int]]:
            out = [replay(traces, pol, k_max=k_max, step_ms=args.step_ms,
                          draft_ms=args.draft_ms, noise=args.noise, seed=s,
                          seed_curve=seed_curve, believe=believe) for s in range(args.seeds)]
            return sum(o["tok_s"] for o in out) / len(out), out[0]["steps_by_k"]

        base, _ = rate("none")
        for pol in args.policies:
            for believe in args.believe if pol == "adaptive" else ["true"]:
                tok_s, by_k = rate(pol, believe)
                label = f"{pol} ({believe} costs)" if pol == "adaptive" else pol
                print(f"| {path.stem} | {label} | {tok_s:.1f} | {tok_s / base:.2f}x | "
                      + "/".join(map(str, by_k)) + " |")


if __name__ == "__main__":
    main()
