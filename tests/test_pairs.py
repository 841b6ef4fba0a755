"""Every pair of single-process plan tokens on a tiny model (offload simulated): it trains two steps to a
finite loss, or it is refused when the plan is built (``Plan.parse``/``Plan.check``) with a reason that is
true for that pair. "True" is checked against the explicit tables below, each row reviewed against the
code: the reason names one of the two tokens and says what the table's row says. An unexpected refusal,
an unexpected success, a late refusal (after ``Plan.check``), a crash or a NaN fails.

Where the second token must not change the numbers (``checkpoint``, ``accum:2``, ``attention:math``,
``chunked-ce``, simulated offload of activations, params or the optimizer), the pair's losses (two steps,
then the loss after them) equal the first token's alone within 1e-5 relative. The learning rate is 1e-2
so that this can fail: at 1e-2 a change as small as ``adamw8bit`` for ``adamw`` moves them by 1.4e-5 and
``compress:int8`` by 4e-4 (measured, CPU, 2026-11-27; at the default 3e-4 both hide below 1e-5).
"""
import functools
import itertools
import math
import re
import sys

import pytest
import torch

from colabkit import PlanError, TextData, Trainer, build_model
from colabkit.plan import Context, Plan

TOKENS = ["fp16", "bf16", "checkpoint", "accum:2", "compress:int8", "attention:math", "attention:efficient",
          "chunked-ce", "adamw8bit", "paged-adamw8bit", "adamw4bit", "lion", "lion8bit", "adafactor", "adam-mini",
          "galore:4", "sgd", "fused-step", "offload:optimizer", "offload:activations", "offload:params",
          "offload:disk", "lora:4", "qlora:4"]
PAIRS = list(itertools.combinations(TOKENS, 2))
LR = 1e-2
EXACT = 1e-5
# the second token must not change the numbers
NEUTRAL = {"checkpoint", "accum:2", "attention:math", "chunked-ce", "offload:activations", "offload:params",
           "offload:optimizer"}
# ... except within 16-bit rounding where the first computes in 16 bits and the second runs another kernel
# or other GEMM shapes (the CPU lora base is bf16): measured up to 3.4e-4 (fp16+attention:math), the
# order of a 16-bit token's own distance from fp32 (fp16 2.2e-4, bf16 3.7e-4); and where the first is
# compress:int8, lossy on what is saved for backward, and the second changes what is saved (compress
# alone is 4e-4 from fp32; measured up to 4.3e-4 from it).
ROUNDING = 1e-3
SIXTEEN_BIT = {(a, b) for a in ("fp16", "bf16", "lora:4") for b in ("accum:2", "attention:math")}
LOSSY = {("compress:int8", b) for b in ("checkpoint", "offload:params", "attention:math", "chunked-ce")}

# ----- expected refusals, reviewed against the code ------------------------------------------------
# two tokens that choose the same thing (Plan.parse): precision, optimizer, attention backend, adapters
GROUPS = {"precision": {"fp16", "bf16"}, "attention": {"attention:math", "attention:efficient"},
          "adapters": {"lora:4", "qlora:4"},
          "optimizer": {"adamw8bit", "paged-adamw8bit", "adamw4bit", "lion", "lion8bit", "adafactor", "adam-mini",
                        "galore:4", "sgd"}}
# tokens this machine cannot run at all, refused alone too (and so in any pair)
CPU_ONLY_REFUSED = {"attention:efficient": r"on the CPU only attention:math can be forced",
                    "paged-adamw8bit": r"no GPU memory to page out of"}
# pairs that conflict, each reason read against the code it describes
CONFLICTS = {
    # GradScaler must see every gradient before any parameter steps (techniques/fused_step.py)
    ("fp16", "fused-step"): r"GradScaler must check every gradient",
    # streamed blocks are recomputed in backward already (offload.py, _StreamedBlockFn)
    ("checkpoint", "offload:params"): r"'offload:params' already recomputes each block",
    ("accum:2", "fused-step"): r"gradients cannot accumulate over micro-batches",
    # both install saved_tensors_hooks; the inner one would win
    ("compress:int8", "offload:activations"): r"both rewrite the tensors saved for backward",
    ("adam-mini", "lora:4"): r"'adam-mini' partitions whole weight matrices",
    ("adam-mini", "qlora:4"): r"'adam-mini' partitions whole weight matrices",
    ("galore:4", "fused-step"): r"'galore' with 'fused-step'",
    ("galore:4", "lora:4"): r"'galore' projects full-rank gradients",
    ("galore:4", "qlora:4"): r"'galore' projects full-rank gradients",
    ("fused-step", "offload:optimizer"): r"both take the gradient inside backward",
    ("fused-step", "offload:params"): r"parameters would be stepped twice",
    ("fused-step", "offload:disk"): r"once per parameter inside backward",
    ("offload:optimizer", "offload:disk"): r"both own the optimizer state",
    ("offload:params", "lora:4"): r"'offload:params' with 'lora:4' is not supported: offload:params is made for full training",
    ("offload:params", "qlora:4"): r"packed weights are not streamed by offload:params",
    ("offload:disk", "lora:4"): r"adapter state is already tiny",
    ("offload:disk", "qlora:4"): r"adapter state is already tiny",
    # offload:disk is DiskAdamW: AdamW's two moments in files; other optimizers keep other state
    **{(o, "offload:disk"): r"'offload:disk' keeps AdamW's two moments on disk"
       for o in ("adamw8bit", "adamw4bit", "lion", "lion8bit", "adafactor", "adam-mini", "galore:4", "sgd")},
}


def expected_refusal(a: str, b: str) -> str | None:
    """The regex the refusal of ``a+b`` must match, None when the pair must train."""
    if any({a, b} <= g for g in GROUPS.values()):
        return r"both choose the|appears twice"
    cpu = [CPU_ONLY_REFUSED[t] for t in (a, b) if t in CPU_ONLY_REFUSED]
    if cpu:  # either one's, where both cannot run here
        return "|".join(cpu)
    return CONFLICTS.get((a, b))


def _family(token: str) -> str:
    # a token with a user's argument may be named by its family ("'attention' appears twice", "'galore' with ...")
    family = token.partition(":")[0]
    return family if family in ("attention", "galore", "lora", "qlora") else token


@functools.cache
def run(plan: str) -> tuple[str, object]:
    """("refused", reason) when Plan.parse/Plan.check refuses; ("late", reason) for a PlanError after
    check; else ("ok", [loss step 1, loss step 2, loss after both])."""
    ctx = Context(device=torch.device("cpu"), offload_sim=True, lr=LR)
    try:
        Plan.parse(plan).check(ctx)
    except PlanError as e:
        return "refused", str(e)
    torch.manual_seed(0)
    try:
        t = Trainer(build_model("gpt-tiny"), plan, device="cpu", offload_sim=True, lr=LR)
    except PlanError as e:
        return "late", str(e)
    losses = [t.step(*TextData().batch(4, 16, step=s)) for s in range(2)]
    return "ok", losses + [t.evaluate(*TextData().batch(4, 16, step=2))]


def check_pair(a: str, b: str) -> None:
    why = expected_refusal(a, b)
    kind, got = run(f"{a}+{b}")
    if why is not None:
        assert kind == "refused", f"{a}+{b}: expected a refusal matching {why!r}, got {kind}: {got}"
        assert re.search(why, got), f"{a}+{b}: reason {got!r} is not the expected {why!r}"
        assert _family(a) in got or _family(b) in got, f"{a}+{b}: the reason names neither token: {got}"
        return
    assert kind == "ok", f"{a}+{b}: expected to train, got {kind}: {got}"
    assert all(math.isfinite(v) for v in got), (a, b, got)
    for first, second in ((a, b), (b, a)):
        if second not in NEUTRAL:
            continue
        k, ref = run(first)
        assert k == "ok", (first, ref)
        tol = ROUNDING if (first, second) in SIXTEEN_BIT | LOSSY else EXACT
        dev = max(abs(x - r) / abs(r) for x, r in zip(got, ref))
        assert dev < tol, f"{a}+{b}: {second} changed {first}'s losses by {dev:.2e} (> {tol}): {got} vs {ref}"


# ----- a deterministic sample in the fast set, the rest of the matrix marked slow --------------------
MUST = [("fp16", "lora:4"), ("checkpoint", "attention:math"), ("adafactor", "offload:optimizer"),
        ("adam-mini", "offload:optimizer"), ("galore:4", "offload:optimizer"), ("checkpoint", "compress:int8"),
        ("fp16", "attention:math"), ("lion8bit", "fused-step"), ("adamw8bit", "offload:params")]
SAMPLE = sorted(set(PAIRS[::17]) | set(MUST), key=PAIRS.index)
REST = [p for p in PAIRS if p not in SAMPLE]


@pytest.mark.parametrize("token", TOKENS)
def test_each_token_alone(token):
    kind, got = run(token)
    if token in CPU_ONLY_REFUSED:
        assert kind == "refused" and re.search(CPU_ONLY_REFUSED[token], got), got
    else:
        assert kind == "ok" and all(math.isfinite(v) for v in got), got


@pytest.mark.parametrize("a, b", SAMPLE, ids=[f"{a}+{b}" for a, b in SAMPLE])
def test_pair_sample(a, b):
    check_pair(a, b)


@pytest.mark.slow  # fast twin: test_pair_sample
@pytest.mark.parametrize("a, b", REST, ids=[f"{a}+{b}" for a, b in REST])
def test_pair_rest_of_matrix(a, b):
    check_pair(a, b)


def test_tables_are_pairs_of_the_matrix_and_detect_wrong_outcomes(monkeypatch):
    """Negative controls: the tables name real pairs; a pair that should refuse but trains, one refused
    with a reason outside its row, and a neutral token that changes the numbers each fail."""
    for pair in CONFLICTS:
        assert pair in PAIRS, pair  # in the matrix's order: expected_refusal looks them up so
    for first, second in SIXTEEN_BIT | LOSSY:
        assert (first, second) in PAIRS or (second, first) in PAIRS
        assert second in NEUTRAL
    fake = {"fp16+fused-step": ("ok", [1.0, 1.0, 1.0]),               # should have been refused
            "accum:2+fused-step": ("refused", "fused-step: no reason"),  # refused, reason not its row's
            "sgd+checkpoint": ("ok", [5.0, 5.0, 5.0]),                 # trains, but checkpoint moved sgd's losses
            "sgd": ("ok", [5.0, 5.0, 5.001]),
            "lion+sgd": ("ok", [5.0, 5.0, 5.0])}                       # two optimizers: must be refused
    monkeypatch.setattr(sys.modules[__name__], "run", lambda plan: fake[plan])
    for a, b in [("fp16", "fused-step"), ("accum:2", "fused-step"), ("sgd", "checkpoint"), ("lion", "sgd")]:
        with pytest.raises(AssertionError):
            check_pair(a, b)
