"""fused_zero.checkpoint.files: tag names and crc32."""
import math

import pytest
import torch

from fused_zero.checkpoint.files import check_tag, crc32


@pytest.mark.parametrize("tag", ["", ".", "..", "latest", ".hidden", "a/b", "a\\b", " x", 3])
def test_bad_tags(tag):
    with pytest.raises((ValueError, TypeError)):
        check_tag(tag)


def test_good_tag():
    assert check_tag("step100") == "step100"


def test_crc32_sees_every_byte_and_dtype():
    t = torch.randn(100)
    u = t.clone()
    u[57] = torch.nextafter(u[57], torch.tensor(math.inf))
    assert crc32(t) != crc32(u) and crc32(t) == crc32(t.clone())
    assert crc32(t.bfloat16()) != crc32(t.half()) and crc32(torch.zeros(0)) == 0
