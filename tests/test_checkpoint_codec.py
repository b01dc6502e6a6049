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


def test_blobs_keep_container_types_a_loader_relies_on():
    """MultiStepLR keeps its milestones in a Counter and its closed form calls Counter.elements(): a blob gives it
    back a Counter (a torch file), where JSON made it a plain dict. What torch cannot load either (a defaultdict)
    still comes back, as the plain dict JSON makes of it."""
    import collections

    from fused_zero.checkpoint.codec import from_blob, to_blob

    class Pair(tuple):
        pass

    for value in ({"milestones": collections.Counter([2, 5, 5])}, collections.OrderedDict(b=1, a=2)):
        back = from_blob(*to_blob(value, "s", "the value"))
        assert back == value and type(back) is type(value)
        assert all(type(back[k]) is type(v) for k, v in value.items())
    assert not json_ok({"x": Pair((1, 2))}) and json_ok({"x": (1, 2)})
    name, data = to_blob(collections.defaultdict(list, a=[1]), "s", "the value")
    assert name.endswith(".json") and from_blob(name, data) == {"a": [1]}


def test_a_multistep_schedule_resumes_from_a_checkpoint_with_its_closed_form(tmp_path):
    from torch import nn

    from fused_zero import ShardedOptimizer, checkpoint
    model = nn.Linear(4, 4)
    opt = ShardedOptimizer(model.parameters(), lr=1e-3, stage=1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5], gamma=0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    checkpoint.save(str(tmp_path), model, opt, sched)
    again = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1], gamma=0.1)
    checkpoint.load(str(tmp_path), model, opt, again)
    assert again.milestones == collections_counter(2, 5) and type(again.milestones) is type(sched.milestones)
    with pytest.warns(UserWarning):  # torch deprecates step(epoch); its closed form is what needs the Counter
        again.step(3)
    assert again.get_last_lr() == [5e-4]


def collections_counter(*values):
    import collections
    return collections.Counter(values)
