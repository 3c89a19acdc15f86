"""The disaggregated path on a CUDA device, against HF `generate` on the same device.

Skipped without a GPU (CI has none); run on the lent GPU machine.
"""

import pytest
import torch

from connectors.ec import FilesystemECStore
from services.disaggregated import InProcessEPD
from services.engine.config import EngineConfig
from services.engine.sequence import SamplingParams
from tests.hf_reference import HFReference, template_messages
from tests.test_disaggregated_path import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_epd(tiny_checkpoint, tmp_path_factory):
    torch.backends.cudnn.allow_tf32 = False  # float32 means float32 for both sides
    torch.backends.cuda.matmul.allow_tf32 = False
    store = FilesystemECStore(tmp_path_factory.mktemp("ec"), max_bytes=1 << 30)
    return InProcessEPD(tiny_checkpoint, store, EngineConfig(device="cuda", block_size=16, num_blocks=256))


@pytest.mark.parametrize("case", list(cases()))
def test_cuda_tokens_equal_hf_generate_on_cuda(cuda_epd, tiny_checkpoint, case):
    reference = HFReference(tiny_checkpoint, device="cuda")
    messages, images = cases()[case]
    expected = reference.generate(template_messages(messages), images, 40)
    [got] = cuda_epd.generate([(messages, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))])
    assert got.token_ids == expected


def test_bfloat16_runs_on_cuda(tiny_checkpoint, tmp_path):
    store = FilesystemECStore(tmp_path, max_bytes=1 << 30)
    epd = InProcessEPD(tiny_checkpoint, store, EngineConfig(device="cuda", dtype="bfloat16", num_blocks=64))
    messages, _ = cases()["three-images"]
    [got] = epd.generate([(messages, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))])
    assert got.error is None and len(got.token_ids) == 16
    assert epd.prefill.engine.runner.kv_cache.dtype == torch.bfloat16
