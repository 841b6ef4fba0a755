"""Will it fit? Predict the memory of a training run before allocating it, and plan one that fits.

The package, file by file:

- :mod:`.trace`    — the real Trainer's steps traced on fake tensors under the tracker; substitutes
  for what cannot run on fake tensors (bitsandbytes kernels), listed in ``notes``;
- :mod:`.as_gpu`   — what a GPU profile changes in a trace (offload/attention tokens split off, its checks);
- :mod:`.inputs`   — a batch described by shapes (``inputs=``), what a trace feeds the Trainer;
- :mod:`.replay`   — the optimizer step in a trace replayed from profiles of the real step (same storages);
  traces cached per process, deep GPTs and hf: models from 2- and 3-layer traces (by segment), one forward/backward per plan shared by
  every optimizer (``trace.with_optimizer``; ``trace.full_trace()``: the reference);
- :mod:`.counting` — FLOPs, kernels and bytes counted in the memory trace's own step (the step-time input);
- :mod:`.speed`    — the predicted step time from those counts and a device's throughput;
- :mod:`.formulas` — the textbook formula (bytes per parameter, Korthikanti et al.'s activations)
  and the host/GPU split of offloaded state;
- :mod:`.overheads` — what a GPU adds to the traced tensors: CUDA context, cuBLAS workspaces, allocator
  rounding, fragmentation, optimizer-step temporaries, each with its size and source;
- :mod:`.predict`  — :func:`estimate`: one run's predicted peak, breakdown, overheads and verdict;
- :mod:`.planner`  — :func:`plans` (what fits, cheapest first), :func:`largest`, the OOM suggestion;
- :mod:`.calibrate` — :func:`calibrate`: measure this GPU's overheads, store a profile estimates use;
- :mod:`.cli`      — the ``estimate``, ``plan``, ``largest`` and ``calibrate`` subcommands.

>>> r = estimate("gpt-tiny", "baseline", batch=2, seq=16, device="cpu")
>>> r["fits"]
True
"""
from __future__ import annotations

from .formulas import analytic
from .planner import COST, candidate_plans, gpt2_shape, largest, pareto, plans, step_time, suggest, _fast_estimate
from .predict import estimate, from_config, plan_of_arguments
from .as_gpu import check_as_gpu
from .trace import CUDA_ALLOC_ROUND, trace
from .calibrate import calibrate
from .cli import _table, register_cli
from .auto import choose as choose_plan, train_auto

__all__ = ["analytic", "COST", "candidate_plans", "gpt2_shape", "largest", "pareto", "plans", "step_time",
           "suggest", "estimate", "from_config", "plan_of_arguments", "calibrate", "CUDA_ALLOC_ROUND", "check_as_gpu",
           "trace", "register_cli", "choose_plan", "train_auto"]
