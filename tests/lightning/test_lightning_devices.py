"""Which device SparkHvdStrategy gives each process, checked in one process with CUDA counts
simulated (this machine has no GPU): its local rank's GPU, the only GPU it sees, or a clear error."""

import pytest
import torch

from spark_hvd.lightning import SparkHvdEnvironment, SparkHvdStrategy


class _Placed(SparkHvdEnvironment):
    """The environment of a process with a given local rank."""

    def __init__(self, local_rank):
        self._local_rank = local_rank

    def local_rank(self):
        return self._local_rank


def _strategy(devices, local_rank):
    strategy = SparkHvdStrategy()
    strategy.cluster_environment = _Placed(local_rank)
    strategy.parallel_devices = devices
    return strategy


@pytest.mark.parametrize("visible, local_rank, expected", [
    (4, 0, torch.device("cuda", 0)),
    (4, 3, torch.device("cuda", 3)),
    (1, 2, torch.device("cuda", 0)),  # each process sees one GPU (CUDA_VISIBLE_DEVICES per task)
])
def test_cuda_process_takes_its_local_gpu(monkeypatch, visible, local_rank, expected):
    """With the Trainer's devices=1 on GPUs, the root device is the local rank's GPU, or the only one visible."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert _strategy([torch.device("cuda", 0)], local_rank).root_device == expected


def test_more_local_ranks_than_gpus_is_refused(monkeypatch):
    """A local rank beyond the visible GPUs gets a ValueError naming the rank, the count and the fix."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="local rank 3 has no GPU of its own: this process sees 2 GPUs"):
        _ = _strategy([torch.device("cuda", 0)], 3).root_device


def test_device_lists(monkeypatch):
    """devices='auto' on GPUs (all visible GPUs) is accepted and the process still takes its own;
    any other list of several devices is refused with the fix (devices=1)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    everything = [torch.device("cuda", i) for i in range(4)]
    strategy = _strategy(everything, 2)
    strategy._check_devices()
    assert strategy.root_device == torch.device("cuda", 2)
    with pytest.raises(ValueError, match=r"2 devices \(cuda:0, cuda:1\).*Trainer\(devices=1\)"):
        _strategy(everything[:2], 0)._check_devices()
    cpu = _strategy([torch.device("cpu")], 0)
    cpu._check_devices()
    assert cpu.root_device == torch.device("cpu")
