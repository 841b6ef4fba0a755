import atexit
import gc
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("COLABKIT_SMOKE", "1")
# Everything the suite writes to a temp folder (pytest's tmp_path, doctests, offload files, the CLI and
# notebook kernels it starts, which inherit TMPDIR) lands in one folder removed when the process exits:
# the system temp folder is left as it was.
# (Imported again as ``tests.conftest`` by test modules, and inherited by xdist workers: made once.)
_TMP = os.environ.get("COLABKIT_TEST_TMP")
if not _TMP:
    _TMP = os.environ["COLABKIT_TEST_TMP"] = tempfile.mkdtemp(prefix="colabkit-tests-")
    atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
os.environ["TMPDIR"] = tempfile.tempdir = _TMP
# NCCL's rule on gloo: collectives refuse tensors not made on the rank's compute device (colabkit.collectives)
os.environ.setdefault("COLABKIT_STRICT_COLLECTIVES", "1")
# estimates must not depend on a calibration profile stored on this machine (python -m colabkit calibrate)
os.environ["COLABKIT_PROFILE_DIR"] = os.path.join(_TMP, "profiles")
# every estimate traces (the tests count traces and patch the tracer): no traces kept on disk between processes
os.environ["COLABKIT_TRACE_CACHE"] = "off"


@pytest.fixture(autouse=True, scope="session")
def _gc_unfrozen_at_the_end():
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _gc_walks_only_this_tests_objects():
    """Garbage collected, then the survivors (imported modules, pytest's items, earlier tests' fixtures and
    caches) moved to the GC's permanent generation before each test: a full collection inside it -- Python's
    own when allocations pile up, accelerate's free_memory after each Trainer.train(), colabkit.oom's after an
    out-of-memory, colabkit.compare's -- walks only what this test made (0.01 s instead of 0.3-0.5 s: 11 s of
    the fast set's CPU went to full collections). Nothing that is garbage now is kept and the test's own
    objects are not frozen; a cycle among frozen objects that dies later stays until the session ends."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _not_emulating_a_t4():
    """Each test starts with T4 emulation off, the process's default: it is a process-wide switch that the CLI's
    in-process main([... "--t4"]) and colabkit.emulate_t4() turn on, and a test that needs it turns it on itself
    (until 2026-11-27 the env doctest left it on for every later test of the fast set)."""
    from colabkit.env import emulate_t4

    emulate_t4(False)
    yield


# notebooks/conftest.py carries doctests, so --doctest-modules imports it as the module "conftest"; this
# file has none, and collecting it too would import a second "conftest" (pytest: "import file mismatch").
collect_ignore = ["conftest.py"]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
