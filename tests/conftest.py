import os
import tempfile

import pytest
import torch

os.environ.setdefault("COLABKIT_SMOKE", "1")
# NCCL's rule on gloo: collectives refuse tensors not made on the rank's compute device (colabkit.collectives)
os.environ.setdefault("COLABKIT_STRICT_COLLECTIVES", "1")
# estimates must not depend on a calibration profile stored on this machine (python -m colabkit calibrate)
os.environ["COLABKIT_PROFILE_DIR"] = tempfile.mkdtemp(prefix="colabkit-test-profiles-")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
