"""Stage-3 unit planning (fused_zero/sharding/units.py): which modules are units, which unit owns each parameter.

Pure module-tree tests: no process group, no optimizer, no tensor data touched.
"""
import os
import sys

import pytest
import torch
from torch import nn

from _models import BNNet, PlainNet, TinyNet
from fused_zero.sharding.units import default_units, merge_small, plan_units, resolve_units

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, Block, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab=16, d_model=8, n_layer=3, n_head=2, seq_len=8)


def same(got, want):
    """Identity equality of two sequences (modules or parameters), order included."""
    got, want = list(got), list(want)
    assert len(got) == len(want), (len(got), len(want))
    assert all(a is b for a, b in zip(got, want)), [(type(a).__name__, type(b).__name__) for a, b in zip(got, want)]


def single(plan):
    """The one module of each unit (the plans here merge nothing)."""
    assert all(len(ms) == 1 for ms in plan.modules), [len(ms) for ms in plan.modules]
    return [ms[0] for ms in plan.modules]


def check_partition(model, plan):
    """Unit 0 is the model; each parameter in exactly one unit; each unit non-empty, in model order."""
    assert plan.modules[0] == (model,) and len(plan.modules) == len(plan.params)
    pos = {id(p): i for i, p in enumerate(model.parameters())}
    assert sorted(pos[id(p)] for ps in plan.params for p in ps) == list(range(len(pos)))
    for i, ps in enumerate(plan.params):
        assert [pos[id(p)] for p in ps] == sorted(pos[id(p)] for p in ps) and (ps or i == 0)


# ----------------------------------------------------------------------------- default_units

def test_default_gpt_is_its_blocks():
    model = GPT(CFG)
    same(default_units(model), model.blocks)
    same(resolve_units(model, None), model.blocks)


def test_default_nested_modulelists_outermost_only():
    inner = lambda: nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))  # noqa: E731
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([inner(), inner()]))
    same(default_units(model), model[1])


def test_default_skips_paramless_elements_and_searches_below():
    # a param-less element is searched, but (parameters() being recursive) only finds param-less lists
    blocks = nn.ModuleList([nn.Linear(2, 2), nn.GELU(), nn.Sequential(nn.Identity(), nn.ModuleList([nn.ReLU()])),
                            nn.Linear(2, 2)])
    same(default_units(nn.Sequential(nn.Linear(2, 2), blocks)), [blocks[0], blocks[3]])
    wrapper = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)]))  # below a non-list
    same(default_units(nn.Sequential(nn.ModuleList([nn.GELU()]), wrapper)), [wrapper[0][0], wrapper[0][2]])


def test_default_without_modulelist_is_children_with_params():
    model = TinyNet()
    same(default_units(model), [model.inp, model.ln1, model.qkv, model.proj, model.ln2, model.fc1, model.fc2,
                                model.branch, model.side, model.frozen, model.head])
    flat = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Identity(), nn.LayerNorm(2))
    same(default_units(flat), [flat[0], flat[3]])
    plain = PlainNet()  # a single Sequential child: its layers (a loop over them skips the Sequential's forward)
    same(default_units(plain), [plain.layers[i] for i in (0, 1, 3, 5, 7)])
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Tanh(), nn.Linear(2, 2))), nn.Linear(2, 2))
    same(default_units(nested), [nested[0][0], nested[0][1][1], nested[1]])
    bn = BNNet()
    same(default_units(bn), bn.blocks)


# ----------------------------------------------------------------------------- resolve_units

def test_resolve_classes_every_instance_in_model_order():
    model = GPT(CFG)
    lns = [m for b in model.blocks for m in (b.ln1, b.ln2)] + [model.ln_f]
    same(resolve_units(model, [nn.LayerNorm]), lns)
    same(resolve_units(model, (nn.LayerNorm, Block)),
         [m for b in model.blocks for m in (b, b.ln1, b.ln2)] + [model.ln_f])
    same(resolve_units(model, [nn.Embedding, nn.Embedding]), [model.tok_emb, model.pos_emb])
    same(resolve_units(model, [GPT]), [])  # the root is never a unit, even as an instance
    outer = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    same(resolve_units(outer, [nn.Sequential]), [outer[1]])


def test_resolve_modules_model_order_and_dedup():
    model = GPT(CFG)
    b0, b1, b2 = model.blocks
    same(resolve_units(model, [b2, model.ln_f, b0, b2.mlp, b0]), [b0, b2, b2.mlp, model.ln_f])
    same(resolve_units(model, (model.lm_head, model.tok_emb)), [model.tok_emb, model.lm_head])


def test_resolve_modules_errors():
    model = GPT(CFG)
    with pytest.raises(ValueError, match="not a submodule of the model; pass modules of the model"):
        resolve_units(model, [model.blocks[0], nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="model itself"):
        resolve_units(model, [model.blocks[0], model])


@pytest.mark.parametrize("bad", [Block, nn.Linear(2, 2), "Block", [Block, nn.Linear(2, 2)], [nn.Linear, int],
                                 {Block}, iter([Block])])
def test_resolve_type_errors(bad):
    with pytest.raises(TypeError, match="units must be"):
        resolve_units(GPT(CFG), bad)


def test_resolve_empty_list_means_no_units():
    model = GPT(CFG)
    same(resolve_units(model, []), [])
    plan = plan_units(model, [])
    same(single(plan), [model])
    same(plan.params[0], model.parameters())


# ----------------------------------------------------------------------------- plan_units

def test_plan_gpt_default_tied():
    model = GPT(CFG)
    assert model.lm_head.weight is model.tok_emb.weight
    plan = plan_units(model)
    check_partition(model, plan)
    same(single(plan), [model, *model.blocks])
    same(plan.params[0], [model.tok_emb.weight, model.pos_emb.weight, model.ln_f.weight, model.ln_f.bias])
    for b, ps in zip(model.blocks, plan.params[1:]):
        same(ps, b.parameters())


def test_plan_gpt_tied_embedding_unit_goes_to_root():
    model = GPT(CFG)
    plan = plan_units(model, [nn.Embedding])
    check_partition(model, plan)
    # tok_emb.weight is also lm_head.weight (under the root): it goes to the root, and the
    # tok_emb unit, left with nothing, is dropped
    same(single(plan), [model, model.pos_emb])
    same(plan.params[1], [model.pos_emb.weight])
    same(plan.params[0], [model.tok_emb.weight, *(p for b in model.blocks for p in b.parameters()),
                          model.ln_f.weight, model.ln_f.bias])


def test_plan_gpt_untied_embedding_units():
    model = GPT(GPTConfig(vocab=16, d_model=8, n_layer=2, n_head=2, seq_len=8, tie_weights=False))
    plan = plan_units(model, [nn.Embedding])
    check_partition(model, plan)
    same(single(plan), [model, model.tok_emb, model.pos_emb])
    same(plan.params[1], [model.tok_emb.weight])
    same(plan.params[2], [model.pos_emb.weight])
    assert any(p is model.lm_head.weight for p in plan.params[0])


def test_plan_nested_units_innermost_wins():
    model = GPT(CFG)
    plan = plan_units(model, [Block, nn.LayerNorm])
    check_partition(model, plan)
    same(single(plan), [model] + [m for b in model.blocks for m in (b, b.ln1, b.ln2)] + [model.ln_f])
    same(plan.params[0], [model.tok_emb.weight, model.pos_emb.weight])
    for i, b in enumerate(model.blocks):
        same(plan.params[1 + 3 * i], [*b.attn.parameters(), *b.mlp.parameters()])
        same(plan.params[2 + 3 * i], [b.ln1.weight, b.ln1.bias])
        same(plan.params[3 + 3 * i], [b.ln2.weight, b.ln2.bias])
    same(plan.params[-1], [model.ln_f.weight, model.ln_f.bias])


def test_plan_drops_units_without_params():
    model = GPT(CFG)
    plan = plan_units(model, [Block, nn.Linear, nn.LayerNorm])  # every Block param is in a Linear or LayerNorm
    check_partition(model, plan)
    assert not any(isinstance(m, Block) for m in single(plan))
    assert model.lm_head not in single(plan)  # its only weight is tied to tok_emb (root)
    net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)]))
    plan = plan_units(net, [net[1][0], net[0]])
    same(single(plan), [net, net[0], net[1][0]])
    same(plan.params[0], [])  # the root stays even when it owns nothing
    plan = plan_units(nn.Sequential(nn.GELU(), nn.ModuleList([nn.ReLU()])))
    assert len(plan.modules) == 1 and plan.params == ((),)


def test_plan_shared_module_in_two_units_goes_to_root():
    shared = nn.Linear(2, 2)
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), shared), nn.Sequential(shared, nn.Linear(2, 2))])
    model = nn.Sequential(blocks)
    plan = plan_units(model)
    check_partition(model, plan)
    same(single(plan), [model, blocks[0], blocks[1]])
    same(plan.params[0], [shared.weight, shared.bias])
    same(plan.params[1], blocks[0][0].parameters())
    same(plan.params[2], blocks[1][1].parameters())
    # the shared module is itself a unit: it owns its parameters wherever it appears
    plan = plan_units(model, [blocks[1], shared, blocks[0]])
    same(single(plan), [model, blocks[0], shared, blocks[1]])
    same(plan.params[2], [shared.weight, shared.bias])


def test_plan_param_shared_with_non_unit_sibling_goes_to_root():
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)) for _ in range(2)])
    model.head = nn.Linear(3, 3)
    model.head.weight = model.blocks[1][0].weight
    same_unit = model.blocks[0]  # two Linears of one unit sharing a weight: stays in that unit
    same_unit[1].weight = same_unit[0].weight
    plan = plan_units(model)
    check_partition(model, plan)
    same(single(plan), [model, *model.blocks])
    same(plan.params[0], [model.blocks[1][0].weight, model.head.bias])
    same(plan.params[1], [same_unit[0].weight, same_unit[0].bias, same_unit[1].bias])
    same(plan.params[2], [model.blocks[1][0].bias, *model.blocks[1][1].parameters()])


def test_plan_param_order_follows_model_parameters():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(2))  # registered last, yet listed first by parameters()

    model = nn.Sequential(nn.ModuleList([Scaled(), Scaled()]))
    plan = plan_units(model)
    check_partition(model, plan)
    for unit, ps in zip(model[0], plan.params[1:]):
        same(ps, [unit.scale, unit.lin.weight, unit.lin.bias])
    tiny = TinyNet()  # every parameter in a child unit: the root owns nothing, units keep model order
    plan = plan_units(tiny)
    same(single(plan)[1:], default_units(tiny))
    same([p for ps in plan.params for p in ps], tiny.parameters())
    assert plan.params[0] == ()


# ----------------------------------------------------------------------------- containers
# A ModuleList / ModuleDict / ParameterList never runs forward: as a unit its hooks would never
# fire and its parameters would never be gathered.

class _Stages(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]) for _ in range(2))

    def forward(self, x):
        for stage in self.stages:
            for layer in stage:
                x = layer(x)
        return x


class _Dict(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(4))])

    def forward(self, x):
        return self.layers["b"](self.layers["a"](x)) * self.scales[0]


def test_default_descends_into_container_elements():
    model = _Stages()
    same(default_units(model), [layer for stage in model.stages for layer in stage])
    model = _Dict()
    same(default_units(model), [model.layers["a"], model.layers["b"]])
    plan = plan_units(model)
    check_partition(model, plan)
    same(plan.params[0], [model.scales[0]])  # a ParameterList's parameters stay in the root


def test_default_units_once_each():
    a = nn.Linear(4, 4)
    model = nn.Sequential(nn.ModuleList([a, a]))
    same(default_units(model), [a])


@pytest.mark.parametrize("units", ["modulelist", "class"])
def test_container_units_are_rejected(units):
    model = GPT(CFG)
    with pytest.raises(ValueError, match="forward never runs"):
        resolve_units(model, [model.blocks] if units == "modulelist" else [nn.ModuleList])


def test_string_units_are_rejected():
    with pytest.raises(TypeError, match="units must be"):
        resolve_units(GPT(CFG), "")


def _stage3_trains_as_torch(make, x, compared=lambda name, p: p, **options):
    """Three steps of ``make()`` at stage 3 (``options``) and of a copy under torch AdamW: the same parameters
    (``compared(name, p)``: the elements of each that are compared). Returns the model and its optimizer."""
    from fused_zero import ShardedOptimizer
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    with opt.full_parameters():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(compared(name, p), compared(name, q), rtol=1e-5, atol=1e-6)
    return model, opt


def test_stage3_trains_a_model_of_nested_modulelists():
    _stage3_trains_as_torch(_Stages, torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))


class _TiedNet(nn.Module):
    """Its forward reads a child's weight directly (a tied output projection): only a unit around it serves that."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(50, 16), nn.Linear(16, 16)

    def forward(self, x):
        return nn.functional.linear(self.mid(self.emb(x)), self.emb.weight)


class _Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _TiedNet()

    def forward(self, x):
        return self.net(x).square()


def test_default_keeps_a_plain_wrapped_model_a_unit():
    """Looking through every parameterless single-child wrapper (peft's are looked through: test_peft) made the tied
    net's layers the units, and its forward then read an empty placeholder."""
    model = _Wrapper()
    same(default_units(model), [model.net])
    _stage3_trains_as_torch(_Wrapper, torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(0)),
                            min_unit_numel=0)


# ----------------------------------------------------------------------------- merging small units
def test_merge_small_runs():
    assert merge_small([], 10) == []
    assert merge_small([3, 3, 3], 0) == [range(0, 1), range(1, 2), range(2, 3)]  # 0: one unit each
    assert merge_small([3, 3, 3, 3, 3], 6) == [range(0, 2), range(2, 5)]  # the small tail joins the run before
    assert merge_small([3, 3, 3, 3], 6) == [range(0, 2), range(2, 4)]
    # a unit at least min_numel stands alone; small ones before it join it; a small tail joins the last run
    assert merge_small([10, 1, 10, 1], 5) == [range(0, 1), range(1, 4)]
    assert merge_small([2, 2], 100) == [range(0, 2)]  # all smaller than one: a single unit
    runs = merge_small([7, 1, 1, 9, 2, 5, 5], 6)
    assert [i for r in runs for i in r] == list(range(7)) and all(len(r) for r in runs)


def test_plan_merges_small_default_units_only():
    model = GPT(GPTConfig(vocab=16, d_model=8, n_layer=6, n_head=2, seq_len=8))
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    plan = plan_units(model, min_unit_numel=2 * per_block)
    check_partition(model, plan)
    assert plan.modules[1:] == ((model.blocks[0], model.blocks[1]), (model.blocks[2], model.blocks[3]),
                                (model.blocks[4], model.blocks[5]))
    same(plan.params[1], [*model.blocks[0].parameters(), *model.blocks[1].parameters()])
    plan = plan_units(model, min_unit_numel=3 * per_block)  # two units of three blocks
    check_partition(model, plan)
    assert plan.modules == ((model,), tuple(model.blocks[:3]), tuple(model.blocks[3:]))
    plan = plan_units(model, min_unit_numel=10 ** 9)  # all blocks would be one unit: the root holds them
    check_partition(model, plan)
    assert plan.modules == ((model,),) and plan.params == (tuple(model.parameters()),)
    plan = plan_units(model, min_unit_numel=4 * per_block)  # 4 + a tail of 2, added to the run: one run
    assert plan.modules == ((model,),)
    same(single(plan_units(model, min_unit_numel=per_block)), [model, *model.blocks])  # each big enough
    # units= given explicitly are the user's choice: never merged
    same(single(plan_units(model, list(model.blocks), min_unit_numel=10 ** 9)), [model, *model.blocks])
    same(single(plan_units(model, [Block], min_unit_numel=10 ** 9)), [model, *model.blocks])


class _Attention(nn.Module):
    """A Linear, a MultiheadAttention (its forward passes ``out_proj.weight`` to ``F.multi_head_attention_forward``
    without calling ``out_proj``) and a TransformerEncoderLayer (its eval fast path under ``no_grad`` passes every
    child's weights to one fused op)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        h = self.inp(x)
        return self.layer(self.attn(h, h, h, need_weights=False)[0])


def test_linear_units_leave_the_weights_attention_reads_directly_to_the_unit_around_it():
    """units=[nn.Linear] (wrap every Linear, an FSDP habit) made MultiheadAttention.out_proj a unit, whose forward
    never runs: the attention read its empty placeholder ("mat2 must be a matrix, got 1-D tensor"). Linears inside
    a MultiheadAttention or a TransformerEncoderLayer are no units; the others are."""
    model = _Attention()
    same(resolve_units(model, [nn.Linear]), [model.inp])
    same(resolve_units(model, [nn.Linear, nn.TransformerEncoderLayer]), [model.inp, model.layer])
    same(resolve_units(model, [nn.MultiheadAttention]), [model.attn])  # not the layer's own self_attn
    for root in (nn.MultiheadAttention(8, 2), nn.TransformerEncoderLayer(8, 2, 16)):
        assert resolve_units(root, None) == []  # the default: the root's children, none of them here


@pytest.mark.parametrize("where", ["attn.out_proj", "layer.linear1", "layer.self_attn"])
def test_a_unit_inside_attention_is_refused_naming_the_module_to_pass(where):
    model = _Attention()
    reader = "MultiheadAttention attn" if where.startswith("attn") else "TransformerEncoderLayer layer"
    with pytest.raises(ValueError, match=f"units contains {where}, inside the {reader}, whose forward reads its "
                                         f"weights directly.*pass the {reader.split()[0]}"):
        resolve_units(model, [model.get_submodule(where)])


def test_stage3_with_linear_units_trains_attention_as_torch():
    """Three steps against torch AdamW (the key bias's gradient is zero but for rounding, which Adam scales up to
    +-lr a step in any implementation: left out), then an eval forward on the fast path."""
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    model, opt = _stage3_trains_as_torch(_Attention, x, lambda name, p: torch.cat([p[:8], p[16:]])
                                         if name.endswith("in_proj_bias") else p, units=[nn.Linear])
    model.eval()
    with torch.no_grad():  # the layer's fast path reads all its weights at once: gathered with the root
        out = model(x)
    with opt.full_parameters(), torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_a_block_compiled_in_place_is_its_wrappers_unit_and_a_model_compiled_whole_keeps_its_units():
    """torchtitan's per-block ``torch.compile(block)`` registered in place: a unit chosen inside the block (the
    block itself by class, or its Linears) is the compiled wrapper, whose call runs eagerly (hooks inside it would be
    traced into its graph). A model compiled whole keeps the units inside it (one unit would gather everything)."""
    model = GPT(CFG)
    inner = list(model.blocks)
    for i, b in enumerate(inner):
        model.blocks[i] = torch.compile(b, backend="eager")
    wrappers = list(model.blocks)
    assert resolve_units(model, None) == wrappers
    assert resolve_units(model, [Block]) == wrappers
    assert resolve_units(model, [nn.Linear])[:3] == wrappers  # (the head's Linear after them)
    assert plan_units(model, None, 0).modules[1:] == tuple((w,) for w in wrappers)
    whole = torch.compile(GPT(CFG), backend="eager")
    assert resolve_units(whole, None) == list(whole._orig_mod.blocks)
