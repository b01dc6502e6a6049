"""State kinds beyond (master, exp_avg, exp_avg_sq): checkpoints and state dicts handle the
``kinds`` of every partition generically. ShardedOptimizer gains max_exp_avg_sq with amsgrad;
until then a subclass adds it through the public shard interface only."""
import pytest
import torch

from _models import HYPER, TinyNet, param_groups
from fused_zero import ShardedOptimizer

pytest.importorskip("safetensors", reason="fused_zero.checkpoint writes safetensors: pip install safetensors")
from fused_zero import checkpoint as ckpt  # noqa: E402
from test_checkpoint import _train  # noqa: E402

EXTRA = "max_exp_avg_sq"


class _WithMax(ShardedOptimizer):
    """A ShardedOptimizer whose partitions of param groups ``amsgrad`` also hold max_exp_avg_sq."""

    def __init__(self, *args, amsgrad=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.amsgrad = set(amsgrad)
        self.extra = {k: torch.zeros(part.shard_numel) for k, part in enumerate(super().shard_index())
                      if part.group_index in self.amsgrad}

    def fill(self, seed):
        """Random values on the elements of stepped parameters; the rest stays zero, as steps leave it."""
        g = torch.Generator().manual_seed(seed)
        for k, part in enumerate(super().shard_index()):
            if k in self.extra:
                for pc in part.pieces:
                    if "step" not in self.state.get(part.params[pc.param_index], {}):
                        continue
                    self.extra[k][pc.shard_offset:pc.shard_offset + pc.numel] = torch.rand(pc.numel, generator=g)

    def shard_index(self):
        return tuple(part._replace(kinds=part.kinds + (EXTRA,)) if k in self.extra else part
                     for k, part in enumerate(super().shard_index()))

    def read_shard(self, partition, kind, start, end, settle=True):
        if kind == EXTRA:
            return self.extra[partition][start:end].clone()
        return super().read_shard(partition, kind, start, end, settle)

    def load_shards(self, staged, pending=None):
        rest = []
        for k, new in enumerate(staged):
            new = dict(new)
            t = new.pop(EXTRA, None)
            assert (k in self.extra) == (EXTRA in staged[k]), "a kind the partition lacks was staged"
            if t is not None:
                self.extra[k].copy_(t)
            rest.append(new)
        super().load_shards(rest, pending)


def _make(amsgrad=(0, 2), seed=None):
    model = TinyNet()
    opt = _WithMax(param_groups(model), **HYPER, stage=2, bucket_numel=1000, amsgrad=amsgrad)
    _train(model, opt, None, 0, 2, 1, 0)
    if seed is not None:
        opt.fill(seed)
    return model, opt


def test_saved_kind_round_trips(tmp_path):
    model, opt = _make(seed=1)
    ckpt.save(tmp_path, model, opt, chunk_numel=300)
    fresh, fopt = _make()
    ckpt.load(tmp_path, fresh, fopt)
    assert fopt.extra.keys() == opt.extra.keys()
    assert all(torch.equal(fopt.extra[k], t) for k, t in opt.extra.items())
    _, optim_sd = ckpt.consolidate(tmp_path)
    groups = optim_sd["param_groups"]
    for gi, g in enumerate(groups):
        for i in g["params"]:
            if i in optim_sd["state"]:
                assert (EXTRA in optim_sd["state"][i]) == (gi in (0, 2)), (gi, i)


def test_kind_the_checkpoint_lacks_is_zero_filled(tmp_path):
    model, opt = _make(amsgrad=())
    ckpt.save(tmp_path, model, opt)
    fresh, fopt = _make(seed=2)
    ckpt.load(tmp_path, fresh, fopt)
    assert all(not t.any() for t in fopt.extra.values())


def test_saved_kind_the_optimizer_lacks_names_the_option(tmp_path):
    model, opt = _make(seed=3)
    ckpt.save(tmp_path, model, opt)
    fresh, fopt = _make(amsgrad=(2,))
    with pytest.raises(ValueError, match=r"max_exp_avg_sq.*build param group 0 with amsgrad=True"):
        ckpt.load(tmp_path, fresh, fopt)


def test_state_dict_carries_the_kind():
    model, opt = _make(seed=4)
    sd = opt.state_dict()
    fresh, fopt = _make()
    fopt.load_state_dict(sd)
    assert all(torch.equal(fopt.extra[k], t) for k, t in opt.extra.items())
    plain = ShardedOptimizer(param_groups(TinyNet()), **HYPER, stage=2, bucket_numel=1000)
    with pytest.raises(ValueError, match=r"max_exp_avg_sq.*build param group 0 with amsgrad=True"):
        plain.load_state_dict(sd)
    zero = _make(amsgrad=(0, 1, 2), seed=5)[1]
    zero.load_state_dict(sd)  # group 1 was saved without it: zero-filled
    assert all(torch.equal(zero.extra[k], opt.extra[k]) if k in opt.extra else not t.any()
               for k, t in zero.extra.items())


def test_amsgrad_set_in_a_loaded_group_without_its_state_is_named_as_the_flag():
    """A dict whose param group says amsgrad=True but whose states hold no max_exp_avg_sq: the refusal said the
    dict "has optimizer state ['max_exp_avg_sq']", which it lacks; it names the group's flag now."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = ShardedOptimizer(model.parameters(), stage=2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert all("max_exp_avg_sq" not in s for s in sd["state"].values())
    sd["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(sd)
    assert str(err.value) == ("param group 0 of the state dict sets amsgrad=True, which needs optimizer state "
                              "['max_exp_avg_sq'] that this optimizer does not keep: build param group 0 with "
                              "amsgrad=True")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_beyond_steps_and_moments_round_trips_as_state_dict_keeps_it(stage, tmp_path):
    """optimizer.state under keys that are no parameter (torch keeps them in state_dict()) and keys of user code's own
    in a parameter's state: checkpoint.save raised on a non-dict value ("argument of type 'int' is not iterable")
    and dropped the rest, silently."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        return model, ShardedOptimizer(model if stage == 3 else model.parameters(), lr=1e-3, stage=stage)
    model, opt = build()
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    first = next(model.parameters())
    opt.state["epoch"] = 7
    opt.state[3] = {"seen": torch.tensor([1.0, 2.0])}
    opt.state[first]["ema_norm"] = torch.tensor(0.5)
    ckpt.save(str(tmp_path), model, opt)
    fresh, fresh_opt = build()
    fresh_opt.state["stale"] = 1  # replaced by the checkpoint's, as load_state_dict replaces them
    ckpt.load(str(tmp_path), fresh, fresh_opt)
    assert "stale" not in fresh_opt.state
    assert fresh_opt.state["epoch"] == 7 and torch.equal(fresh_opt.state[3]["seen"], torch.tensor([1.0, 2.0]))
    assert torch.equal(fresh_opt.state[next(fresh.parameters())]["ema_norm"], torch.tensor(0.5))
    assert fresh_opt.state_dict()["state"]["epoch"] == 7
    fresh_opt.zero_grad()
    fresh(torch.randn(3, 4)).sum().backward()
    fresh_opt.step()  # and training goes on


def test_saving_into_a_path_that_is_a_file_names_it(tmp_path):
    model = torch.nn.Linear(3, 3)
    opt = ShardedOptimizer(model.parameters(), lr=1e-3)
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a folder")
    with pytest.raises(FileExistsError, match=r"is a file, not a folder.*pass a folder path"):
        ckpt.save(str(path), model, opt)
    assert path.read_bytes() == b"not a folder"
