import atexit
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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# notebooks/conftest.py carries doctests, so --doctest-modules imports it as the module "conftest"; this
# file has none, and collecting it too would import a second "conftest" (pytest: "import file mismatch").
collect_ignore = ["conftest.py"]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
