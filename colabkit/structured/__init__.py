"""Structured low-rank matrices measured against dense: tridiagonal + rank-r (``SemiseparableMatrix``),
fp16 factors, hierarchical off-diagonal low rank (``HODLRMatrix``), a causal semiseparable mixing layer
for the GPT (``structured_gpt``), factors split across processes or kept in host memory, and the
``python -m colabkit structured`` report.

>>> S = SemiseparableMatrix.random(256, 8)
>>> SemiseparableMatrix.from_dense(S.to_dense(), 8).error(S.to_dense()) < 1e-5
True
"""
from .hodlr import HODLRMatrix, hodlr_bytes
from .layer import SemiseparableMixing, structured_gpt
from .matrix import SemiseparableMatrix, relative_error, storage_bytes, tridiag_matmul
from .parallel import OffloadedSemiseparable, ShardedSemiseparable, sharded_bytes, sharded_run
from .report import best_time, max_rank_for_saving, register_cli, scaling, structured_report, tracked_bytes

__all__ = ["HODLRMatrix", "hodlr_bytes", "SemiseparableMixing", "structured_gpt", "SemiseparableMatrix", "relative_error",
           "storage_bytes", "tridiag_matmul", "OffloadedSemiseparable", "ShardedSemiseparable", "sharded_bytes",
           "sharded_run", "best_time", "max_rank_for_saving", "register_cli", "scaling", "structured_report",
           "tracked_bytes"]
