"""The GPU paths proven without a GPU (issue 24).

* The CPU twin of CUDA's ordering rules (``CudaTwin`` under a simulated ``DevicePair``): each rule
  against a hand-written case.
* The mutation test: every CUDA-only ordering statement of the seam (the wait, the event record, the
  record_stream, the synchronizes, and each call site that relies on them), every delegation of
  ``CudaRuntime`` to torch.cuda (checked against a recording stand-in for torch) and the host-side unscale
  of fp16 gradients, deleted alone, makes at least one check fail; with none deleted every check passes.
* The stricter twin (issue 34): sides, deferred copies into pinned memory, hidden syncs and
  ``sync_debug("error")``, writes before a copy landed — each rule with its case and its control.
* The tracker's per-phase CUDA peak (a fake allocator in torch.cuda's place): each phase's own peak,
  not the maximum since the last reset.
"""
from __future__ import annotations

import __future__
import contextlib
import copy
import functools
import inspect
import textwrap
import time
import weakref

import pytest
import torch

from colabkit.data import TextData
from colabkit.memory import MemoryTracker
from colabkit.models import build_model
from colabkit.techniques import disk_offload as disk
from colabkit import device as dev
from colabkit.techniques import offload_activations, offload_optimizer, offload_params
from colabkit.trainer import Trainer


# ----- the twin's rules ------------------------------------------------------------------------
def _side_copy(pair, dst, src):
    with pair.side():
        pair.copy_(dst, src)


def test_side_copy_lands_only_when_waited_for():
    pair = dev.DevicePair("cpu")
    src, dst = torch.arange(4.0), torch.zeros(4)
    _side_copy(pair, dst, src)
    ev = pair.done()
    assert dst.isnan().all()                       # read before anyone waited: poison
    pair.use(ev)                                   # the compute stream waits for the event
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]
    src1 = src + 1
    for wait in (lambda ev: pair.sync(), lambda ev: pair.wait_host(ev)):   # or the host waits
        _side_copy(pair, dst, src1)
        ev = pair.done()
        assert dst.isnan().all()
        wait(ev)
        assert dst.tolist() == [1.0, 2.0, 3.0, 4.0]
    _side_copy(pair, dst, src)                     # an event recorded before the copy does not cover it
    early = pair.rt.Event()
    early.record(pair.rt.Stream())
    pair.use(early)
    pair.use(pair.rt.Event())                      # nor does one never recorded (CUDA: a no-op wait)
    assert dst.isnan().all()
    pair.sync()
    assert torch.equal(dst, src)


def test_freed_source_needs_record_stream():
    pair = dev.DevicePair("cpu")
    dst = torch.zeros(4)
    src = torch.ones(4)
    _side_copy(pair, dst, src)
    del src                                        # freed before the copy ran, nothing recorded it
    pair.sync()
    assert dst.isnan().all() and pair.stats()["poisoned"] == 1
    src = torch.ones(4)
    alive = weakref.ref(src)
    _side_copy(pair, dst, src)
    pair.lend(src)                                 # record_stream: the copy reads what src held
    del src
    assert alive() is None                         # the twin does not keep it (CUDA frees it moments later)
    src2 = torch.full((4,), 7.0)                   # the allocator may hand its memory out again
    pair.sync()
    assert dst.tolist() == [1.0] * 4 and src2[0] == 7.0


def test_reused_source_and_missing_wait_stream_are_poison():
    pair = dev.DevicePair("cpu")
    src, dst = torch.ones(4), torch.zeros(4)
    _side_copy(pair, dst, src)
    src.fill_(5.0)                                 # written before the copy ran: a race, poison
    pair.sync()
    assert dst.isnan().all() and pair.stats()["written_before_landed"] == 1
    _side_copy(pair, dst, src)                     # control: written only once the copy landed
    pair.sync()
    src.fill_(6.0)
    assert dst.tolist() == [5.0] * 4
    with pair.rt.stream(pair.stream):              # a side copy that did not wait for the compute stream
        pair.copy_(dst, src)
    pair.sync()
    assert dst.isnan().all()


def test_pinned_blocks_are_rounded_and_counted():
    pair = dev.DevicePair("cpu")
    h = pair.host_empty((250,), torch.float32)     # 1000 B asked, a 1024 B block taken
    s = pair.stats()
    assert (s["pinned_bytes"], s["payload_bytes"]) == (1024, 1000)
    del h
    assert pair.stats()["pinned_bytes"] == 0 and pair.stats()["pinned_peak_bytes"] == 1024


def test_lent_tensor_written_before_its_copy_landed_is_poison():
    pair = dev.DevicePair("cpu")
    src, dst = torch.ones(4), torch.zeros(4)
    _side_copy(pair, dst, src)
    pair.lend(src)
    src.add_(1)                                    # the caller reuses a lent tensor too early
    pair.sync()
    assert dst.isnan().all()
    _side_copy(pair, dst, src)                     # control: lent, left alone until the copy landed
    pair.lend(src)
    pair.sync()
    assert dst.tolist() == [2.0] * 4


def test_pinned_buffer_reused_before_its_copy_landed_is_poison():
    pair = dev.DevicePair("cpu")
    buf = pair.host_empty((4,), torch.float32)
    ones, twos = torch.ones(4), torch.full((4,), 2.0)
    _side_copy(pair, buf, ones)
    buf.fill_(3.0)                                 # the host refills the buffer before the copy landed
    pair.sync()
    assert buf.isnan().all()
    other = pair.rt.Stream()                       # two streams filling one buffer at once
    _side_copy(pair, buf, ones)
    other.wait_stream(pair.rt.current_stream())
    with pair.rt.stream(other):
        pair.copy_(buf, twos)
    pair.sync(), other.synchronize()
    assert buf.isnan().all() and pair.stats()["reused_before_landed"] == 1
    _side_copy(pair, buf, ones)                    # control: reused once the copy landed
    pair.sync()
    assert buf.tolist() == [1.0] * 4
    buf.fill_(3.0)
    _side_copy(pair, buf, twos)
    _side_copy(pair, buf, ones)                    # control: two copies in order on one stream
    pair.sync()
    assert buf.tolist() == [1.0] * 4


def test_compute_stream_copy_into_pinned_memory_lands_when_waited_for():
    pair = dev.DevicePair("cpu")
    host, dev_t = pair.host_empty((3,), torch.float32), torch.arange(3.0)
    pair.copy_(host, dev_t)                        # device -> pinned on the compute stream: the device runs ahead
    assert host.isnan().all()                      # the host reads before it waited
    ev = pair.rt.Event()
    ev.record(pair.rt.current_stream())
    pair.wait_host(ev)
    assert host.tolist() == [0.0, 1.0, 2.0]
    d2 = torch.zeros(3)                            # control: into compute-side memory, in order at once
    pair.copy_(d2, dev_t)
    assert d2.tolist() == [0.0, 1.0, 2.0]


def test_sides_record_stream_and_mixed_ops():
    pair = dev.DevicePair("cpu")
    host = pair.to_host(torch.ones(4))
    with pytest.raises(dev.TwinError, match="record_stream on a host tensor"):
        pair.lend(host)
    pair.lend(torch.ones(4))                       # control: a compute-side tensor may be lent
    with pair.rt.strict_sides():
        with pytest.raises(dev.TwinError, match="mixes host-side and compute-side"):
            torch.ones(4) + host                   # CUDA: "Expected all tensors to be on the same device"
        assert (host + host).tolist() == [2.0] * 4                      # control: one side each
        assert (torch.ones(4) * 2).tolist() == [2.0] * 4
        assert pair.to_compute(host).tolist() == [1.0] * 4              # a copy between the sides passes
        assert dev.is_host(torch.zeros_like(host))                     # the side propagates, as a device does
        comp = torch.ones(4)
        torch._foreach_add_([host, comp], [host, comp])                 # a list op: one side per index (torch
        with pytest.raises(dev.TwinError, match="mixes"):               # groups by device), not across
            torch._foreach_add_([host], [comp])


def test_pageable_or_strided_host_end_is_a_hidden_sync():
    pair = dev.DevicePair("cpu")
    pinned = pair.host_empty((2, 8), torch.float32).zero_()
    pageable = dev.mark_host(torch.zeros(8))
    pair.copy_(torch.empty(8), pinned[0])          # control: pinned and contiguous
    assert pair.stats().get("hidden_syncs", 0) == 0
    pair.copy_(torch.empty(2, 4), pinned[:, :4])   # a non-contiguous view of a pinned buffer
    pair.copy_(torch.empty(8), pageable)           # pageable host memory
    assert pair.stats()["hidden_syncs"] == 2
    with pair.rt.sync_debug("error"):
        pair.copy_(torch.empty(8), pinned[1])      # control: no sync
        with pytest.raises(dev.TwinError, match="pageable"):
            pair.copy_(torch.empty(8), pageable)
        with pytest.raises(dev.TwinError, match="torch.tensor"):
            torch.tensor(1.0, device="cpu")
        with pytest.raises(dev.TwinError, match="Tensor.to"):
            torch.ones(2).to("cpu")
        with pytest.raises(dev.TwinError, match="stream synchronize"):
            pair.sync()
        torch.ones(2).to(torch.float16), torch.full((), 1.0, device="cpu")   # control: no copy to a device
    torch.tensor(1.0, device="cpu")                # outside: not counted
    assert pair.stats()["hidden_syncs"] == 5


# ----- the offload equivalence checks the mutation test runs ----------------------------------------
def _weights(t):
    return [p.detach().clone() for p in t.model.parameters()]


@functools.lru_cache(maxsize=None)
def _reference(plan, tie=False):  # plans without offload: the mutants do not touch them, run once
    return _trained(plan, tie=tie)


def _trained(plan, steps=2, model="gpt:2x32", tie=False):
    torch.manual_seed(0)
    m = build_model(model, seq=16)
    if tie:
        m.blocks[1] = m.blocks[0]
    t = Trainer(m, plan, device="cpu", offload_sim="offload" in plan)
    losses = [t.step(*TextData().batch(4, 16, step=i)) for i in range(steps)]
    return losses, _weights(t)


def _same(a, b, tol=1e-5):
    (la, wa), (lb, wb) = a, b
    return la == pytest.approx(lb, rel=1e-6) and all(torch.allclose(x, y, rtol=0, atol=tol) for x, y in zip(wa, wb))


def check_host_optimizer():
    return _same(_trained("offload:optimizer"), _reference("baseline"))


def check_host_optimizer_accumulation():
    return _same(_trained("offload:optimizer+accum:2"), _reference("accum:2"))


def check_host_optimizer_grad_scaler():
    # the GradScaler unscales and inf-checks the host gradient buffers (HostOptimizer.param_groups), the
    # accumulated gradient added
    torch.manual_seed(0)
    a = build_model("gpt:2x32", seq=16)
    b = copy.deepcopy(a)
    opts = (torch.optim.AdamW(a.parameters(), lr=1e-3),
            offload_optimizer.HostOptimizer([{"params": list(b.parameters())}], lambda g: torch.optim.AdamW(g, lr=1e-3)))
    for m, opt in zip((a, b), opts):
        sc = torch.amp.GradScaler("cpu", init_scale=1024.0)
        if opt is opts[1]:  # host gradients: unscaled on the host (on a GPU torch's copy of the scale races)
            sc = dev.host_unscaling(sc)
        for i in range(2):
            parts = [slice(0, 4)] if i == 0 else [slice(0, 2), slice(2, 4)]  # step 2: a gradient accumulated
            for part in parts:
                x, y = (t[part] for t in TextData().batch(4, 16, step=i))
                sc.scale(torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()) / len(parts)).backward()
            with _scale_read_before_landed(opt is opts[1]):
                sc.step(opt)
            sc.update()
            opt.zero_grad()
    return all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))


@contextlib.contextmanager
def _scale_read_before_landed(on):
    """On a GPU with host gradients, torch's _MultiDeviceReplicator hands the CPU unscale a pinned copy of
    inv_scale / found_inf read before it landed: the twin's poison (NaN) in its place."""
    from torch.amp import grad_scaler

    class ReadBeforeLanded(grad_scaler._MultiDeviceReplicator):
        def get(self, device):
            return self._per_device_tensors.setdefault(device, torch.full_like(self.master, float("nan")))
    real = grad_scaler._MultiDeviceReplicator
    grad_scaler._MultiDeviceReplicator = ReadBeforeLanded if on else real
    try:
        yield
    finally:
        grad_scaler._MultiDeviceReplicator = real


def check_streamed_params():
    return _same(_trained("offload:params"), _reference("baseline"))


def check_streamed_params_accumulation():
    # micro-batch 2's block gradients are added to micro-batch 1's on the host, each once it has landed
    return _same(_trained("offload:params+accum:2"), _reference("accum:2"))


def check_streamed_tied_blocks():
    # one block called twice per forward: its gradient reaches the host twice within one backward
    return _same(_trained("offload:params", tie=True), _reference("baseline", tie=True))


def check_activations():
    return _same(_trained("offload:activations"), _reference("baseline"))


def check_disk_staged(tmp="."):
    # DiskAdamW's GPU path (pinned buffers, copies on the side stream, write-back after the event)
    import tempfile

    def run(make):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
        opt = make(m.parameters())
        for i in range(3):
            m(torch.randn(8, 32, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in m.parameters()]

    with tempfile.TemporaryDirectory() as d:
        ref = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))  # DiskAdamW runs the fused kernel
        got = run(lambda ps: disk.DiskAdamW(ps, lr=1e-2, directory=d, chunk_elems=500, pair=dev.DevicePair("cpu")))
    return all(torch.equal(a, b) for a, b in zip(ref, got))


class _Recorded:
    """A recording stand-in for ``torch`` (its ``cuda``, ``empty``, ``accelerator``) and for CUDA tensors:
    every call lands in ``calls`` as (name, args, kwargs) and returns a new stand-in."""

    def __init__(self, calls, name=""):
        self._calls, self._name = calls, name

    def __getattr__(self, attr):
        if attr == "host_memory_stats":
            return lambda: {"allocated_bytes.current": 3, "allocated_bytes.peak": 5}
        return _Recorded(self._calls, f"{self._name}.{attr}".lstrip("."))

    def __call__(self, *args, **kwargs):
        self._calls.append((self._name, args, kwargs))
        return _Recorded(self._calls, f"{self._name}()")

    def __enter__(self):
        self._calls.append((f"{self._name}.__enter__", (), {}))

    def __exit__(self, *exc):
        self._calls.append((f"{self._name}.__exit__", (), {}))


def check_cuda_runtime_contract():
    """Each CudaRuntime verb, with torch replaced by a recording stand-in, issues exactly the intended call."""
    import colabkit.device.pair as pair_mod
    calls = []
    real, pair_mod.torch = pair_mod.torch, _Recorded(calls)
    try:
        cuda = torch.device("cuda", 0)
        rt = dev.CudaRuntime(cuda)
        t, s = _Recorded(calls, "t"), _Recorded(calls, "s")
        results = {}
        for verb, run in [("Stream", lambda: rt.Stream()), ("Event", lambda: rt.Event()),
                          ("current_stream", lambda: rt.current_stream()), ("stream", lambda: rt.stream(s)),
                          ("record_stream", lambda: rt.record_stream(t, s)), ("copy_", lambda: rt.copy_(t, s)),
                          ("host_empty", lambda: rt.host_empty((2, 3), torch.float16)),
                          ("empty_host_cache", lambda: rt.empty_host_cache()), ("stats", lambda: rt.stats())]:
            calls.clear()
            out = run()
            results[verb] = (list(calls), out)
        calls.clear()
        with rt.sync_debug("error"):
            inside = list(calls)
        after = list(calls)
    finally:
        pair_mod.torch = real
    want = {"Stream": [("cuda.Stream", (cuda,), {})], "Event": [("cuda.Event", (), {})],
            "current_stream": [("cuda.current_stream", (cuda,), {})], "stream": [("cuda.stream", (s,), {})],
            "record_stream": [("t.record_stream", (s,), {})], "copy_": [("t.copy_", (s,), {"non_blocking": True})],
            "host_empty": [("empty", ((2, 3),), {"dtype": torch.float16, "pin_memory": True})],
            "empty_host_cache": [("accelerator.empty_host_cache", (), {})], "stats": []}
    ok = all(results[v][0] == c for v, c in want.items())
    ok &= all(isinstance(results[v][1], _Recorded) for v in ("Stream", "Event", "current_stream", "stream"))
    ok &= results["stats"][1] == {"pinned_bytes": 3, "pinned_peak_bytes": 5}
    ok &= [c[0] for c in inside] == ["cuda.get_sync_debug_mode", "cuda.set_sync_debug_mode"] and \
        inside[1][1] == ("error",) and after[-1][0] == "cuda.set_sync_debug_mode" and len(after) == 3
    return ok


CHECKS = [check_cuda_runtime_contract, check_host_optimizer, check_host_optimizer_accumulation,
          check_host_optimizer_grad_scaler,
          check_streamed_params, check_streamed_params_accumulation, check_streamed_tied_blocks, check_activations,
          check_disk_staged]

# Every ordering statement, deleted alone: (module, function, the statement). The first six are the
# CUDA calls themselves (DevicePair runs them against torch.cuda or the twin); the rest are the
# places offload relies on them.
MUTANTS = [
    # CudaRuntime: each delegation to torch.cuda (check_cuda_runtime_contract)
    (dev, "CudaRuntime.Stream", "return torch.cuda.Stream(self.device)"),
    (dev, "CudaRuntime.Event", "return torch.cuda.Event()"),
    (dev, "CudaRuntime.current_stream", "return torch.cuda.current_stream(self.device)"),
    (dev, "CudaRuntime.stream", "return torch.cuda.stream(s)"),
    (dev, "CudaRuntime.record_stream", "t.record_stream(s)"),
    (dev, "CudaRuntime.copy_", "dst.copy_(src, non_blocking=True)"),
    (dev, "CudaRuntime.host_empty", "return torch.empty(shape, dtype=dtype, pin_memory=True)"),
    (dev, "CudaRuntime.empty_host_cache", "fn()"),
    (dev, "CudaRuntime.sync_debug", "torch.cuda.set_sync_debug_mode(mode)"),
    (dev, "CudaRuntime.sync_debug", "torch.cuda.set_sync_debug_mode(prev)"),
    (dev, "CudaRuntime.stats", 's = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}'),
    (dev, "host_unscaling", "scaler._unscale_grads_ = _unscale_grads_"),   # host gradients unscaled on the host
    (dev, "host_unscaling", "host_inv = inv_scale.to(host_dev, copy=True)"),  # ... with a blocking read
    (dev, "DevicePair.side", "self.stream.wait_stream(self.rt.current_stream())"),   # side waits for compute
    (dev, "DevicePair.done", "ev.record(self.stream)"),                               # the event record
    (dev, "DevicePair.use", "self.rt.current_stream().wait_event(event)"),            # compute waits for the event
    (dev, "DevicePair.lend", "self.rt.record_stream(t, self.stream)"),               # record_stream
    (dev, "DevicePair.sync", "self.stream.synchronize()"),                            # stream synchronize
    (dev, "DevicePair.wait_host", "event.synchronize()"),                             # host waits for an event
    (dev, "DevicePair.to_host_async", "self.lend(t)"),                   # streamed gradients: record_stream
    (offload_optimizer, "HostOptimizer._grad_to_host", "self.pair.lend(p.grad)"),      # gradient copy: record_stream
    (offload_optimizer, "HostOptimizer._land_adds", "self.pair.sync()"),               # accumulation: wait before the add
    (offload_optimizer, "HostOptimizer.step", "self.pair.sync()"),                     # the step waits for the copies
    (offload_optimizer, "HostOptimizer.step", "self._land_adds()"),                    # ... and adds the accumulated ones
    (offload_optimizer, "HostOptimizer.param_groups", "self.pair.sync()"),             # the GradScaler reads landed grads
    (offload_optimizer, "HostOptimizer.param_groups", "self._land_adds()"),            # ... with the accumulated ones added
    (offload_params, "BlockStreamer.get", "self.pair.use(ev)"),                     # prefetched weights: wait
    (offload_params, "BlockStreamer._land_adds", "self.pair.sync()"),               # a 2nd gradient: wait before the add
    (offload_params, "BlockStreamer._end_of_backward", "self._land_adds()"),        # ... added when backward ends
    (offload_params, "BlockStreamer._end_of_backward", "self.pair.sync()"),         # streamed grads done with backward
    (offload_activations, "activation_offload", "pair.lend(t)"),                         # saved activation: record_stream
    (offload_activations, "activation_offload", "pair.use(saved.event)"),                # copy back waits for the copy out
    (disk, "DiskAdamW.step", "self.pair.lend(mv)"),                      # chunk on the GPU: record_stream
    (disk, "DiskAdamW._write_back", "self.pair.wait_host(event)"),       # write back after the copy landed
]


def _function(module, qualname):
    obj = module
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    if isinstance(obj, property):
        obj = obj.fget
    return inspect.unwrap(obj)  # under @contextmanager


def _without(fn, statement):
    """fn's code with ``statement`` (a whole line, exactly once in fn) replaced by ``pass``."""
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    hits = [i for i, line in enumerate(lines) if line.split("#")[0].strip() == statement]
    assert len(hits) == 1, (fn.__qualname__, statement, len(hits))
    line = lines[hits[0]]
    lines[hits[0]] = line[: len(line) - len(line.lstrip())] + "pass"
    start = next(i for i, line in enumerate(lines) if line.startswith("def "))  # decorators dropped
    code = compile("\n".join(lines[start:]), inspect.getsourcefile(fn), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns: dict = {}
    exec(code, dict(fn.__globals__), ns)
    return ns[fn.__name__].__code__


def _failing_checks(first=False, checks=None):
    """The checks (all of CHECKS, in the order ``checks`` gives) that fail (``first``: stop at the first one)."""
    failed = []
    for check in checks or CHECKS:
        try:
            ok = check()
        except Exception:  # a mutant may also crash a check: that is a failure too
            ok = False
        if not ok:
            failed.append(check.__name__)
            if first:
                break
    return failed


def test_cuda_runtime_contract(monkeypatch):
    assert check_cuda_runtime_contract()
    # negative controls: a blocking copy, a pageable host buffer, a record_stream that is not made
    for verb, wrong in (("copy_", lambda self, dst, src: dst.copy_(src)),
                        ("host_empty", lambda self, shape, dtype: torch.empty(shape, dtype=dtype)),
                        ("record_stream", lambda self, t, s: None)):
        with monkeypatch.context() as m:
            m.setattr(dev.CudaRuntime, verb, wrong)
            assert not check_cuda_runtime_contract(), verb


def test_every_check_passes_on_the_real_code():
    assert _failing_checks() == []


def test_each_ordering_statement_deleted_alone_fails_a_check():
    t0 = time.process_time()
    survivors, caught = {}, {}
    order = list(CHECKS)  # the check that caught the last mutant tried first: neighbours mutate the same code
    for module, qualname, statement in MUTANTS:
        fn = _function(module, qualname)
        original = fn.__code__
        fn.__code__ = _without(fn, statement)
        try:
            failed = _failing_checks(first=True, checks=order)
        finally:
            fn.__code__ = original
        caught[f"{qualname}: {statement}"] = failed
        if failed:
            order.remove(check := next(c for c in CHECKS if c.__name__ == failed[0]))
            order.insert(0, check)
        else:
            survivors[f"{qualname}: {statement}"] = "no check failed"
    for mutant, failed in caught.items():
        print(f"{mutant:<75} -> {failed[0] if failed else 'SURVIVED'}")
    assert survivors == {}
    assert _failing_checks() == []  # restored
    print(f"{len(MUTANTS)} mutants x {len(CHECKS)} checks in {time.process_time() - t0:.1f} s CPU")


def test_mutants_name_every_cuda_call_in_devicepair():
    # the list above names each statement of DevicePair that calls the runtime's ordering API
    src = inspect.getsource(dev.DevicePair)
    calls = [line.strip() for line in src.splitlines() if any(k in line for k in (
        ".wait_stream(", ".wait_event(", ".record(", ".record_stream(", ".synchronize()"))]
    listed = {s for m, q, s in MUTANTS if q.startswith("DevicePair.")}
    assert calls and set(calls) <= listed, set(calls) - listed
    # ... and every verb of CudaRuntime that delegates to torch (strict_sides: CUDA checks sides itself)
    verbs = {n for n, f in vars(dev.CudaRuntime).items() if callable(f) or isinstance(f, property)} - {
        "__init__", "strict_sides"}
    assert verbs and verbs <= {q.split(".")[1] for m, q, s in MUTANTS if q.startswith("CudaRuntime.")}


# ----- the seam: every CUDA stream/event/pinned/async-copy call lives in colabkit/device/ ----------------
SEAM_CALLS = ("torch.cuda.Stream", "torch.cuda.Event", "record_stream", "pin_memory=True", "non_blocking=True")


def _seam_calls(source: str) -> list[str]:
    """The seam calls in Python source, comments and strings left out (code tokens only)."""
    import io
    import tokenize
    code = " ".join(tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                    if tok.type not in (tokenize.COMMENT, tokenize.STRING))
    code = code.replace(" . ", ".").replace(" = ", "=").replace(" .", ".").replace(". ", ".")
    return [c for c in SEAM_CALLS if c in code]


def test_cuda_seam_calls_only_in_colabkit_device():
    import pathlib
    root = pathlib.Path(dev.__file__).parent.parent  # colabkit/
    found = {str(p.relative_to(root)): calls for p in sorted(root.rglob("*.py"))
             if (calls := _seam_calls(p.read_text()))}
    assert set(found) <= {"device/pair.py", "device/twin.py", "device/host.py"}, found   # the seam has them all
    assert set(found["device/pair.py"]) == set(SEAM_CALLS)
    # negative control: the scan sees each call written in code, and none in comments or strings
    samples = {"torch.cuda.Stream": "s = torch.cuda.Stream(d)", "torch.cuda.Event": "e = torch . cuda.Event()",
               "record_stream": "t.record_stream(s)", "pin_memory=True": "torch.empty(3, pin_memory = True)",
               "non_blocking=True": "t.copy_(s, non_blocking=True)"}
    for call, line in samples.items():
        assert _seam_calls(line + "\n") == [call]
        assert _seam_calls(f"# {line}\nx = {line!r}\n") == []


def test_old_import_paths_still_work():
    from colabkit.techniques import offload as off   # re-exported for one release
    import colabkit
    for name in ("DevicePair", "CudaTwin", "CudaRuntime", "PinnedCache", "pair_of", "pinned_bytes", "host_ram_guard",
                 "HOST_RESERVE"):
        assert getattr(off, name) is getattr(dev, name), name
    for name, mod in (("HostOptimizer", offload_optimizer), ("HostStateOptimizer", offload_optimizer),
                      ("offloaded", offload_optimizer), ("STRATEGIES", offload_optimizer),
                      ("activation_offload", offload_activations), ("BlockStreamer", offload_params),
                      ("stream_blocks", offload_params)):
        assert getattr(off, name) is getattr(mod, name), name
    from colabkit.techniques.offload import guard_plan, host_footprint  # noqa: F401
    from colabkit.memory import fmt_bytes, host_side, is_host, mark_host
    assert (fmt_bytes, host_side, is_host, mark_host) == (dev.fmt_bytes, dev.host_side, dev.is_host, dev.mark_host)
    assert colabkit.DevicePair is dev.DevicePair and colabkit.HostOptimizer is offload_optimizer.HostOptimizer
    assert colabkit.OFFLOAD_STRATEGIES == offload_optimizer.STRATEGIES


# ----- the tracker's per-phase CUDA peak --------------------------------------------------------
class FakeAllocator:
    """torch.cuda's allocator counters, driven by hand: ``alloc``/``free`` move ``allocated``; the peak
    counters only go up until ``reset_peak_memory_stats``."""

    def __init__(self):
        self.now = self.peak = self.reserved = self.peak_reserved = 0

    def alloc(self, n):
        self.now += n
        self.reserved = max(self.reserved, self.now)
        self.peak, self.peak_reserved = max(self.peak, self.now), max(self.peak_reserved, self.reserved)

    def free(self, n):
        self.now -= n

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.now)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(cuda, "device_memory_used", lambda device=None: self.reserved)

        def reset(device=None):
            self.peak, self.peak_reserved = self.now, self.reserved
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset)


def test_cuda_phase_peaks_are_per_phase(monkeypatch):
    fake = FakeAllocator()
    fake.install(monkeypatch)
    fake.alloc(1000)                                   # weights, before the tracker
    with MemoryTracker(device="cuda", categories=False, alert_at=None, budget_bytes=1 << 40) as mt:
        with mt.phase("step"):                         # an outer phase holds its inner phases' peaks
            with mt.phase("forward"):
                fake.alloc(500)                        # activations
                fake.alloc(300), fake.free(300)        # a temporary
            with mt.phase("backward"):
                fake.free(500)
                fake.alloc(200), fake.free(200)        # gradients made and freed (fused step)
            with mt.phase("optimizer"):
                fake.alloc(50), fake.free(50)
    peaks = {s["phase"]: s["phase_peak_cuda"] for s in mt.timeline if s["phase"] in ("forward", "backward", "optimizer", "step")}
    # each phase's own peak (what it carried in included); before the fix every phase after the first
    # reported 1800, the maximum since the tracker started
    assert peaks == {"forward": 1800, "backward": 1500, "optimizer": 1050, "step": 1800}
    r = mt.report()
    assert r["peak_bytes"] == 1800 and r["peak_reserved_bytes"] == 1800   # the window's peak survives the resets
    fake.alloc(10)
    mt.reset_peaks()                                    # the measured window restarts from what is live
    assert mt.report()["peak_bytes"] == 1010


# ----- the no-sync-per-chunk paths under the twin's sync_debug("error") (issue 34, item 4) ------------
def _disk_step(tmp_path, pair, refused=None):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 7))
    opt = disk.DiskAdamW(m.parameters(), lr=1e-2, directory=str(tmp_path), chunk_elems=500, pair=pair)
    m(torch.randn(8, 32)).pow(2).mean().backward()
    try:
        with pytest.raises(dev.TwinError, match=refused) if refused else contextlib.nullcontext():
            with pair.rt.sync_debug("error"):
                opt.step()
    finally:
        opt._pool.submit(lambda: None).result()   # the IO thread lets go of the optimizer before we do


def test_disk_adamw_staged_step_makes_no_hidden_sync(tmp_path, monkeypatch):
    pair = dev.DevicePair("cpu")
    _disk_step(tmp_path, pair)                     # chunks of 512, 64, 448, 7 values: narrower than the buffers
    assert pair.stats().get("hidden_syncs", 0) == 0 and "poisoned" not in pair.stats()
    # negative controls: the code before the fix — a step tensor per chunk copied from the host, and the
    # chunk staged through a strided view of the pinned buffer
    fused = disk._update
    monkeypatch.setattr(disk, "_update", lambda p, g, mv, step, grp, step_t=None: fused(
        p, g, mv, step, grp, torch.tensor(float(step), device=p.device)))
    _disk_step(tmp_path, dev.DevicePair("cpu"), refused="torch.tensor")
    monkeypatch.setattr(disk, "_update", fused)

    def strided_read(self, k, buf):
        n = self.chunks[k][2] - self.chunks[k][1]
        out = buf[:, :n]
        out.copy_(self._view(k))
        return out
    monkeypatch.setattr(disk.DiskAdamW, "_read", strided_read)
    _disk_step(tmp_path, dev.DevicePair("cpu"), refused="not contiguous")


def test_adamw4bit_step_makes_no_hidden_sync(monkeypatch):
    from colabkit.techniques import optimizers
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3 * optimizers.AdamW4bit.CHUNK // 2))   # two chunks, the last partial
    opt = optimizers.AdamW4bit([w])
    twin = dev.CudaTwin()
    for _ in range(2):
        w.grad = torch.randn_like(w)
        with twin.sync_debug("error"):
            opt.step()
    assert twin.stats().get("hidden_syncs", 0) == 0
    # negative control: the step tensor copied to the parameter's device per chunk (the code before the fix)
    monkeypatch.setattr(optimizers, "_device_step", lambda step, device: step.to(device))
    with pytest.raises(dev.TwinError, match="Tensor.to"), twin.sync_debug("error"):
        opt.step()
