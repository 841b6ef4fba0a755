import os

import pytest
import torch

os.environ.setdefault("COLABKIT_SMOKE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
