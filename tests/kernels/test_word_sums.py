"""kernels/word_sums.py on a GPU: the state digest's sums of every tensor of a word width in one launch, equal
to torch's reductions tensor by tensor, under torch's deterministic mode as a recording runs. On the CPU the
kernel is interpreted and compiled for the GPU: test_word_sums_integration.py."""

from __future__ import annotations

import pytest
import torch

from replay.recorder.digest import StateDigest, _device_sums
from replay.recorder.state import TorchTrainState
from tests.kernels.test_word_sums_integration import _tensors


def needs_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the CPU "
                                              "runs the kernel interpreted (test_word_sums_integration.py)")(test))


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@needs_gpu
def test_gpu_sums_are_torchs_tensor_by_tensor(deterministic):
    from replay.kernels.word_sums import WordSums

    tensors = [t.cuda() for t in _tensors()]
    fused = WordSums(tensors)
    assert torch.equal(fused().cpu(), _device_sums(tensors).cpu())
    tensors[0][5] += 1
    assert torch.equal(fused().cpu(), _device_sums(tensors).cpu())


@needs_gpu
def test_gpu_state_digest_takes_one_launch_and_the_same_digests(deterministic):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]], device="cuda")).sum().backward()
    opt.step()
    digest = StateDigest(TorchTrainState(model, opt), rank=0)
    fused = digest()
    assert digest.kind == "crc32c+sum64" and digest._plan is not None and digest._plan.device_sums is not None
    digest._plan.device_sums = None   # the tensor-by-tensor path, for comparison
    assert (digest() == fused).all()
    with torch.no_grad():
        model[1].bias.view(torch.int32)[3] ^= 1
    changed = digest() != fused
    assert [digest.names[i] for i in changed.nonzero()[0]] == ["model/1.bias"]
