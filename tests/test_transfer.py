"""tiers/transfer.py: the copies between the parameters' device and the host, and the upload staging.

On the host every copy is synchronous (the path the CPU tests of the offload tiers run); with CUDA
the copies run on a side stream and the same checks run against the device.
"""
import pytest
import torch

from fused_zero.comm.collectives import Handle
from fused_zero.tiers.transfer import DONE, Ticket, Transfers, Uploads, host_buffer, transfers

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _Work:
    """A stand-in for a collective's Work: records that it was waited on."""

    def __init__(self):
        self.waited = 0

    def is_completed(self):
        return True

    def wait(self):
        self.waited += 1


@pytest.mark.parametrize("device", DEVICES)
def test_copy_waits_for_the_collective_then_copies(device):
    src = torch.arange(1000, dtype=torch.bfloat16, device=device)
    dst = host_buffer(1000, torch.bfloat16)
    work = _Work()
    ticket = transfers(torch.device(device)).copy(dst, src, after=Handle(work))
    assert isinstance(ticket, Ticket) and work.waited == 1
    ticket.wait()
    assert ticket.done() and torch.equal(dst, src.cpu())
    ticket.order_before()  # harmless once done
    if device == "cpu":
        assert ticket is DONE  # synchronous on the host


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", DEVICES)
def test_add_down_adds_on_the_device_as_the_host_would(device, dtype):
    """An accumulating round: the host slice goes up, takes the new values and comes back down, bitwise the
    host's own ``dst.add_(src)`` (bf16: one rounding of the fp32 sum)."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(1000, generator=g).to(dtype)
    new = torch.randn(1000, generator=g).to(dtype)
    dst = host_buffer(1000, dtype)
    dst.copy_(old)
    scratch = torch.full((1200,), float("nan"), dtype=dtype, device=device)[:1000]  # a pool buffer's, reused
    work = _Work()
    ticket = transfers(torch.device(device)).add_down(dst, new.to(device), scratch, after=Handle(work))
    assert work.waited == 1
    ticket.wait()
    assert torch.equal(dst, old.clone().add_(new))


def test_one_transfers_per_device():
    assert transfers(torch.device("cpu")) is transfers("cpu")
    assert Transfers(torch.device("cpu")).stream is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_uploads_rotate_and_deliver_every_chunk(device, depth):
    dst = torch.zeros(1000, dtype=torch.bfloat16, device=device)
    up = Uploads(torch.bfloat16, chunk_numel=128, depth=depth)
    expect = torch.randn(1000).to(torch.bfloat16)
    for a in range(0, 1000, 128):
        b = min(1000, a + 128)
        buf = up.buffer(b - a)
        assert buf.device.type == "cpu" and buf.numel() == b - a
        buf.copy_(expect[a:b])  # the kernel writes the staging buffer ...
        up.send(dst[a:b])  # ... which goes up while the next chunk is updated
    up.finish()
    assert torch.equal(dst.cpu(), expect)
    assert up.nbytes() == min(depth, 8) * 128 * 2  # no more buffers than the depth


def test_uploads_refuse_misuse():
    up = Uploads(torch.float32, chunk_numel=64)
    with pytest.raises(ValueError, match="does not fit"):
        up.buffer(65)
    with pytest.raises(RuntimeError, match="without a buffer"):
        up.send(torch.zeros(4))
