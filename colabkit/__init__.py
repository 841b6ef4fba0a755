"""colabkit: see where GPU training memory goes, try each technique measured, know before you start
whether it fits a free Colab T4, and apply it to your own model in a few lines.

>>> import colabkit
>>> colabkit.Plan.parse("baseline").optimizer
'adamw'
"""
from __future__ import annotations

import logging as _logging

# On CPUs with AVX512-BF16, bitsandbytes warns at import that an optional hub kernel ("kernels"
# package) is missing and falls back to its own CPU kernel, which is what runs here anyway.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
# torchao (imported by peft/transformers) logs "Failed to load …_C_*.so" for CUDA-only kernels a CPU
# build cannot load, and torch's pytree warns about torchao's enum registrations: neither concerns a
# colabkit user, and both would land in every notebook cell and CLI answer that touches peft.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)

from . import techniques  # noqa: F401,E402  (registers the plan tokens)
from .data import ByteTokenizer, IGNORE_INDEX, TextData, corpus
from .env import GPU_PROFILES, T4_USABLE_BYTES, emulate_t4, env, format_env, native_bf16, sdpa_backends, smoke_mode
from .memory import CATEGORIES, MemoryTracker, fmt_bytes, format_report, show_snapshot
from .models import GPT, GPTConfig, PRESETS, blocks_of, build_model, count_params, gpt_config
from .plan import REGISTRY, Context, Plan, PlanError, Technique, available_tokens, compatible, register
from .trainer import Trainer, load_model, weights_sha256
from .train import load_checkpoint, measure, save_checkpoint, train
from .compare import compare, comparison_table, side_by_side, side_by_side_table, step_times
from .timing import Timing, interleaved, ratio, time_fn
from .plots import LivePlot, audit, draw_categories, draw_timeline, plot_breakdown, run_title, show
from .techniques.attention import attention_memory, attention_run, quadratic_fit, random_qkv
from .techniques.precision import autocast
from .demos import fp16_overflow_demo
from .estimate import calibrate, estimate, largest, plans  # noqa: E402  (colabkit.estimate is the function; the module: colabkit.estimate via sys.modules)
from .oom import OutOfMemoryWithAdvice, oom_guard
from .notices import CheckpointSkipped, ColabkitWarning, MemoryAlert  # noqa: E402
from .checkpoints import CheckpointError, Checkpointing, list_checkpoints
from .callbacks import Callback, Run  # noqa: E402  (the train loop's events: one object per concern, a user's own too)
from .drive import drive_dir
from .techniques.checkpoint import checkpoint_blocks, recomputed_with, saved_bytes
from .batches import check_labels  # noqa: E402
from .techniques.accumulation import micro_batch_sizes, window_loss
from .techniques.compress import int8_saved_tensors
from .techniques.optimizers import AdamW4bit, make_optimizer, optimizer_state_bytes, state_bytes_per_param
from .techniques.fused_step import FusedStepOptimizer
from .device import CudaTwin, DevicePair, host_ram_guard, host_unscaling, pinned_bytes
from .techniques.offload_guard import guard_plan, host_footprint
from .techniques.offload_optimizer import HostOptimizer, offloaded
from .techniques.offload_params import stream_blocks
from .techniques.lora import apply_lora, load_adapters, lora_memory, merge_lora, nf4_bytes, save_adapters
from .instruct import InstructData, generate
from .hf import MemoryCallback, load_hf_4bit, prepare_model, training_arguments
from .structured import HODLRMatrix, SemiseparableMatrix, SemiseparableMixing, structured_gpt, structured_report
from .distributed import bench_sharded, consolidate, launch, train_sharded
# notebooks 07-13: their charts, widgets and helpers (public, so a notebook imports nothing private)
from .plots import charts, integer_axis, line_chart, phase_slots, plot_estimates, plot_per_rank, plot_timelines, series_style  # noqa: E402
from .widgets import choices_widget, compatible_for, fit_view, token_picker, will_it_fit  # noqa: E402
from .techniques.galore import galore_state_bytes, projected as galore_projected  # noqa: E402
from .techniques.offload_optimizer import STRATEGIES as OFFLOAD_STRATEGIES  # noqa: E402
from .techniques.disk_offload import CHUNK_ELEMS as DISK_CHUNK_ELEMS, disk_bandwidth  # noqa: E402
from .compare import tracker_vs_allocator  # noqa: E402
from .estimate.planner import COST as PLAN_COSTS, pareto  # noqa: E402
from .estimate.calibrate import NoGPUError, calibration_table  # noqa: E402
from .techniques.lora import lora_adapter_params, target_modules  # noqa: E402
from .models import logits_of  # noqa: E402
from .estimate.zero import comm_elements  # noqa: E402
from .resilience import describe_resume, kill_and_resume  # noqa: E402
from .structured import (OffloadedSemiseparable, hodlr_bytes, max_rank_for_saving, relative_error, scaling,  # noqa: E402
                         sharded_bytes, sharded_run, storage_bytes, tracked_bytes)
from .techniques.optimizers import AdamW8bit, adamw8bit_kernel  # noqa: E402

from .selftest import report_markdown as selftest_markdown, selftest, write_report as write_selftest  # noqa: E402
from .determinism import deterministic, seed_all  # noqa: E402
from .lesson import answer_score, before_after_table, compare_bars, loss_curve, mean_score, plan_chart, signed, table  # noqa: E402

__version__ = "0.1.0"
# chunked-ce (issue 27): the LM head + cross-entropy over chunks of token rows
from .techniques.chunked_ce import (ChunkedCrossEntropy, ChunkedLogits, auto_chunk, chunked_cross_entropy,  # noqa: E402
                                    logits_bytes, logits_memory)
from .collectives import collective, rank_tensor  # noqa: E402
from .distributed import torchrun_world  # noqa: E402
from .estimate import plan_of_arguments  # noqa: E402  (a transformers TrainingArguments read back as a plan)
from .estimate.auto import choose as choose_plan  # noqa: E402  (plan="auto": the fastest plan predicted to fit)
from .estimate.speed import predict_step_time  # noqa: E402
from .hf_models import is_stand_in, offline_stand_in  # noqa: E402  (hub models on a machine without the hub: issue 35)
