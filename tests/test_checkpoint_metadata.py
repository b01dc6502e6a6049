"""fused_zero.checkpoint.metadata: the fit of a checkpoint to a model."""
from fused_zero.checkpoint.metadata import describe_mismatch


def test_describe_mismatch():
    lines = describe_mismatch("parameters", {"a": (2,), "b": (3, 4), "c": (1,)}, {"b": (4, 3), "c": (1,), "d": ()})
    assert lines == ["parameters of the model missing from the checkpoint: a",
                     "parameters in the checkpoint that the model does not have: d",
                     "parameters with another shape: b (checkpoint [4, 3], model [3, 4])"]
    assert describe_mismatch("x", {"a": (1,)}, {"a": (1,)}) == []
