"""``FakeTensorMode`` with short paths for the ops a shape-only trace runs most: the same outputs, less Python.

A trace runs ~1,300 ops a training step; ``FakeTensorMode`` spends ~100-250 µs on each (checks, cache keying,
decompositions) before an answer that only depends on the inputs' metadata. :class:`QuickFakeMode` answers
three kinds of op itself, and leaves every other one to ``FakeTensorMode`` (factories, real or constant inputs,
data-dependent ops, which must still raise, ``.item()``):

- an op whose outputs are new tensors (its schema aliases nothing, writes nothing): from the outputs' metadata
  (shape, stride, dtype, device, storage size) that the first identical call made -- the transformer's layers
  repeat the same shapes (a memo per trace, keyed by the inputs' metadata and the other arguments);
- a plain op (``mm``, ``view``, ``t``, ...) for which ``FakeTensorMode._dispatch_impl`` would end by running the
  op's meta kernel on the fake inputs and wrapping the outputs on their common device: those two steps, done
  directly (no Python decomposition preferred over the kernel, no fake implementation of its own);
- the in-place fills that initialise a model (``normal_``, ``uniform_``, ``zero_``, ``fill_``): the tensor itself.

It also leaves out torch's guard frame against torch.compile tracing into a mode's dispatch (nothing is compiled
in a trace). ``tests/test_quickfake.py`` compares every op of a training step, and whole estimates, with
``FakeTensorMode`` (outputs' shapes, strides, dtypes, storage sizes and aliasing; reports to the byte).
``benchmarks/peers.py`` measures what it saves.

>>> import torch
>>> with QuickFakeMode() as mode:
...     x = torch.empty(4, 8)
...     y = (x @ x.t()).relu()
>>> type(y).__name__, tuple(y.shape), y.device.type
('FakeTensor', (4, 4), 'cpu')
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

_SPECIAL_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view)
# FakeTensorMode's own implementations of these only differ from their meta kernels for symbolic (unbacked)
# sizes, which a trace of concrete shapes never has: torch._refs' view helper and the C++ meta view agree
_STATIC_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
# in-place writes of values only (a module's initialisation: ~80 ops a GPT-2 build): on a fake floating tensor
# the result is the tensor itself, as FakeTensorMode returns it (its decompositions' temporaries are its own)
_FILLS = frozenset((torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default, torch.ops.aten.fill_.Scalar,
                    torch.ops.aten.zero_.default))


# what the short paths call of FakeTensorMode's internals (torch 2.13): with another torch that lacks one, every op
# takes FakeTensorMode's own path
_INTERNALS = all(hasattr(c, n) for c, n in (
    (FakeTensor, "_find_common_device"), (FakeTensorMode, "wrap_meta_outputs_with_default_device_logic"),
    (FakeTensorMode, "is_our_fake"), (FakeTensorMode, "cpp_meta_supports_symint"), (FakeTensorMode, "lift_fns"),
    (fake_impls, "op_implementations_checks"), (fake_impls, "has_meta")))


def _plain(mode: FakeTensorMode, func: Any) -> bool:
    """Whether ``FakeTensorMode._dispatch_impl`` (torch 2.13) runs ``func`` as its meta kernel on the fake inputs
    and wraps the outputs, once its inputs are its own non-constant fake tensors: no other branch applies."""
    from torch._decomp import decomposition_table, meta_table
    from torch._subclasses.fake_tensor import (_DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS,
                                               torch_decomp_decompositions)
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return False
    if func in _DISPATCH_META_HANDLERS or func in _DISPATCH_HANDLE_DIRECTLY or func in mode.lift_fns:
        return False
    if any(tag in func.tags for tag in _SPECIAL_TAGS):
        return False  # data-dependent (raises in FakeTensorMode), in-place metadata: its own handling
    if func not in meta_table and not mode.cpp_meta_supports_symint(func):
        # FakeTensorMode then prefers a Python decomposition, else decomposes a CompositeImplicit op
        if func in decomposition_table and torch_decomp_decompositions(func):
            return False
        implicit = torch._C.DispatchKey.CompositeImplicitAutograd
        if implicit in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), implicit):
            return False
    if torch._library.simple_registry.singleton.find(func.name()).fake_impl.kernel is not None:
        return False
    if func not in _STATIC_VIEWS and any(check(func) for check, _ in fake_impls.op_implementations_checks):
        return False
    return fake_impls.has_meta(func)


def _fresh(func: Any) -> bool:
    """Whether each output of ``func`` is a new tensor: no output aliases an input and nothing is written."""
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


_UNCACHEABLE = object()


class QuickFakeMode(FakeTensorMode):
    """A ``FakeTensorMode`` with two short paths (see the module's docstring): an op whose outputs are new tensors
    is answered from the outputs' metadata the first identical call made (same op, same arguments' shapes,
    strides, dtypes and devices, same other arguments); another plain op runs its meta kernel directly."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # op -> _FRESH | _PLAIN | _CAST bits (0: FakeTensorMode's own path); (op, arguments' key) -> outputs'
        # metadata: both facts about torch's ops, shared by every trace of the process (a new sequence length
        # still finds the weights' casts, their gradients' shapes, the optimizer's ops)
        self._kind, self._memo = _KINDS, _MEMO
        if len(_MEMO) > MEMO_SIZE:
            _MEMO.clear()
        self.served = [0, 0, 0]  # ops answered by the memo, by their meta kernel directly, by FakeTensorMode
        self._quick = (_INTERNALS and getattr(torch._dynamo.config, "_custom_ops_profile", None) is None
                       and not getattr(self, "propagate_real_tensors", False))

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # nothing is compiled in a trace: no guard frame around each op
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # FakeTensorMode's, without the guard
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            raise AssertionError(f"FakeTensorMode should not be set when dispatching {func}")
        return self.dispatch(func, types, args, kwargs)

    def dispatch(self, func, types, args=(), kwargs=None):  # noqa: D102 (FakeTensorMode's)
        kwargs = kwargs or {}
        if not self._quick:
            self.served[2] += func is not _DEVICE
            return super().dispatch(func, types, args, kwargs)
        if func in _FILLS:
            t = args[0]
            if type(t) is FakeTensor and t.fake_mode is self and t.constant is None and t.is_floating_point() \
                    and all(not isinstance(a, torch.Tensor) for a in args[1:]) and not kwargs.get("generator"):
                return t
        kind = self._kind.get(func)
        if kind is None:
            kind = self._kind[func] = self._kind_of(func)
        if kind & _FRESH:
            key = self._key(func, args, kwargs)
            if key is not None:
                hit = self._memo.get(key)
                if hit is None:
                    out = self._run(func, types, args, kwargs, kind)
                    # (a schema can say "new" of an output that aliases an input: _unsafe_view)
                    shared = {id(a.untyped_storage()) for a in _flat(args, kwargs) or ()
                              if isinstance(a, torch.Tensor)}
                    self._memo[key] = _metadata(out, shared)
                    return out
                if hit is not _UNCACHEABLE:
                    self.served[0] += 1
                    return self._rebuild(hit)
        return self._run(func, types, args, kwargs, kind)

    def _kind_of(self, func: Any) -> int:
        if not (self._quick and isinstance(func, torch._ops.OpOverload)):
            return 0
        try:
            return (_FRESH if _fresh(func) else 0) | (_PLAIN if _plain(self, func) else 0) \
                | (_CAST if func is torch.ops.aten._to_copy.default else 0)
        except (AttributeError, ImportError):  # another torch's internals: FakeTensorMode's own path
            return 0

    def _run(self, func: Any, types: Any, args: tuple, kwargs: dict, kind: int) -> Any:
        """A plain op's meta kernel on the fake inputs, its outputs wrapped as FakeTensorMode wraps them (the last
        lines of its ``_dispatch_impl``); any other op through FakeTensorMode."""
        if kind & _PLAIN or (kind & _CAST and kwargs.get("device") is None and not kwargs.get("pin_memory")):
            flat = _flat(args, kwargs)
            if flat is not None and self._own(flat):
                try:
                    with in_kernel_invocation_manager(self):
                        r = func(*args, **kwargs)
                except NotImplementedError:  # (FakeTensorMode then runs its fallback kernel)
                    self.served[2] += 1
                    return super().dispatch(func, types, args, kwargs)
                self.served[1] += 1
                return self._wrap(r, func, flat, kwargs.get("device"))
        self.served[2] += func is not _DEVICE  # (a .device query: answered at once by FakeTensorMode)
        return super().dispatch(func, types, args, kwargs)

    def _wrap(self, r: Any, func: Any, flat: list, device: Any) -> Any:
        """``wrap_meta_outputs_with_default_device_logic`` for a tensor or a tuple/list of them (no pytree walk):
        meta outputs become fake tensors on the inputs' common device (or ``device``); an input returned (an
        in-place op) is returned as it is. Anything else, or a device clash to report, goes through it."""
        single = isinstance(r, torch.Tensor)
        if single or (type(r) in (tuple, list) and all(isinstance(e, torch.Tensor) or e is None for e in r)):
            common, scalar_only = FakeTensor._find_common_device(func, flat)
            outs = (r,) if single else r
            if not scalar_only and all(not self.is_our_fake(e) or e.device == common for e in outs if e is not None):
                conv = self.fake_tensor_converter
                to = device or common
                wrapped = [e if e is None or self.is_our_fake(e) else conv.from_meta_and_device(self, e, to)
                           for e in outs]
                return wrapped[0] if single else type(r)(wrapped)
        return self.wrap_meta_outputs_with_default_device_logic(r, func, flat, device=device)

    def _own(self, flat: list) -> bool:
        """At least one tensor, and each one this mode's fake tensor without a constant value."""
        seen = False
        for a in flat:
            if isinstance(a, torch.Tensor):
                if type(a) is not FakeTensor or a.fake_mode is not self or a.constant is not None:
                    return False
                seen = True
        return seen

    def _key(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        """What a new-tensor op's outputs depend on: its fake inputs' metadata, its other arguments (with their
        types: ``full(s, 1)`` is int64, ``full(s, 1.0)`` float32) and the default dtype; None when an input is not
        this mode's plain fake tensor (a real tensor, a constant) or an argument cannot be a key."""
        try:  # (the default dtype too: what a factory without dtype=, or int / 2, makes)
            return (func, tuple(self._arg(a) for a in args), tuple((k, self._arg(v)) for k, v in kwargs.items()),
                    torch.get_default_dtype())
        except _NoKey:
            return None

    def _arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if type(a) is not FakeTensor or a.fake_mode is not self or a.constant is not None:
                raise _NoKey
            return (a.shape, a.stride(), a.storage_offset(), a.dtype, a.fake_device)
        if isinstance(a, (list, tuple)):
            return (type(a), tuple(self._arg(b) for b in a))
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return (type(a), a)
        raise _NoKey

    def _rebuild(self, meta: Any) -> Any:
        """Outputs from :func:`_metadata`'s description: new meta storages of the same sizes, wrapped on their
        devices as FakeTensorMode wraps them."""
        if isinstance(meta, tuple) and meta and meta[0] == "T":
            _, shape, stride, dtype, device = meta
            t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            return self.fake_tensor_converter.from_meta_and_device(self, t, device)
        kind, items = meta
        return kind(self._rebuild(m) if m is not None else None for m in items)


class _NoKey(Exception):
    pass


_KINDS: dict[Any, int] = {}
_MEMO: dict[tuple, Any] = {}
MEMO_SIZE = 50_000  # entries (~300 bytes each; a new question adds ~100-250): cleared when a mode finds it fuller
_FRESH, _PLAIN = 1, 2
# a dtype cast (autocast's ~200 a GPT-2 step): FakeTensorMode runs torch's Python decomposition of _to_copy
# (prims.convert_element_type: the input's strides); its C++ meta kernel gives the same outputs directly (the
# test compares them); a copy to another device or to pinned memory keeps FakeTensorMode's own path
_CAST = 4
_DEVICE = torch.ops.prim.device.default


def _metadata(out: Any, shared: set[int]) -> Any:
    """A new-tensor op's outputs as what rebuilds them (each a fresh storage of exactly its extent, offset 0, no
    constant value), or :data:`_UNCACHEABLE` for anything else (a constant, an odd storage, a storage among
    ``shared``: the inputs', another type)."""
    if isinstance(out, FakeTensor):
        if out.constant is not None or out.storage_offset() != 0 or out.requires_grad \
                or id(out.untyped_storage()) in shared:
            return _UNCACHEABLE
        extent = 1 + sum((n - 1) * s for n, s in zip(out.shape, out.stride())) if out.numel() else 0
        if out.untyped_storage().nbytes() != extent * out.element_size():
            return _UNCACHEABLE
        return ("T", tuple(out.shape), out.stride(), out.dtype, out.fake_device)
    if type(out) in (tuple, list):
        items = tuple(None if o is None else _metadata(o, shared) for o in out)
        return _UNCACHEABLE if any(m is _UNCACHEABLE for m in items) else (type(out), items)
    return _UNCACHEABLE


def _flat(args: tuple, kwargs: dict) -> list | None:
    """The arguments' leaves, one level of lists or tuples deep (aten's schemas: ``Tensor[]``); None for
    anything nested deeper (then FakeTensorMode's own pytree handles it)."""
    flat: list = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, (list, tuple, dict)):
                    return None
                flat.append(b)
        elif isinstance(a, dict):
            return None
        else:
            flat.append(a)
    return flat
