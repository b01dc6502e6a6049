"""fused_zero.checkpoint.codec: the JSON codec of scheduler states and param groups."""
import math

import pytest
import torch

from fused_zero.checkpoint.codec import NotJSON, decode, encode, json_ok


def test_codec_round_trips_what_schedulers_and_groups_hold():
    import json

    value = {"lr": 1e-3, "betas": (0.9, 0.999), "steps": [1, 2.5, None, True], "name": "x",
             "nested": {"t": (1, (2, 3))}, 3: "int key", "__odd": 1, "inf": math.inf, "nan": math.nan,
             "lr_t": torch.tensor(3e-4), "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
             "ints": torch.arange(6).reshape(2, 3)}
    back = decode(json.loads(json.dumps(encode(value))))
    assert back.keys() == value.keys()
    for k, v in value.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        elif isinstance(v, float) and math.isnan(v):
            assert math.isnan(back[k])
        else:
            assert back[k] == v and type(back[k]) is type(v), k
    assert isinstance(back["nested"]["t"][1], tuple)


@pytest.mark.parametrize("value", [lambda: 0, torch.zeros(1000), object(), {"f": print}])
def test_codec_refuses_what_it_cannot_rebuild(value):
    assert not json_ok(value)
    with pytest.raises(NotJSON):
        encode(value)
