"""The CUDA seam: every stream, event, pinned-memory and asynchronous-copy call of colabkit is here.

On a GPU, :class:`CudaRuntime` makes those calls on ``torch.cuda``; on a CPU its twin, :class:`CudaTwin`,
runs the same code with CUDA's ordering rules (a copy on a side stream lands only when something waits
for it; until then, or if its source was freed without ``record_stream``, its destination holds NaN).
:class:`DevicePair` (compute side, host side) is what the rest of colabkit calls: offload, disk offload,
the estimator and selftest move tensors between device and host only through it. Host-side storages are
tagged (:func:`host_side`, :func:`mark_host`) so the tracker reports them apart; :func:`host_ram_guard`
refuses to fill host RAM (a Colab VM is killed, not warned), pinned blocks rounded as CUDA rounds them
(:func:`pinned_bytes`). What needs techniques (optimizer state sizes: ``host_footprint``, ``guard_plan``)
stays in ``colabkit.techniques``. Modules: :mod:`.host` (host tagging, pinned rounding, the guard),
:mod:`.twin` (the CPU twin), :mod:`.pair` (the CUDA runtime, ``DevicePair``, its pinned cache).

>>> pair = DevicePair("cpu")                  # a CPU run: the twin under the pair
>>> h = pair.to_host(torch.ones(3)); is_host(h), fmt_bytes(pair.stats()["pinned_bytes"])
(True, '16 B')
"""
from __future__ import annotations

import torch  # noqa: F401  (the doctest above)

from .host import (HOST_RESERVE, _HOST, _HOST_SCOPE, _PLAIN, _storages, fmt_bytes, host_ram,  # noqa: F401
                   host_ram_guard, host_side, is_host, mark_host, pinned_bytes)
from .pair import CudaRuntime, DevicePair, PinnedCache, host_unscaling, pair_of, to_device_async  # noqa: F401
from .twin import CudaTwin, TwinError, _TwinEvent, _TwinStream  # noqa: F401
