"""PEFT LoRA on a tiny GPT-2 (issue 24): the frozen base costs its (sharded) weights only.

2 gloo ranks, 2 accumulated micro-batches per step, an active clip: ZeroTrainer at stages 1-3 (the
framework's trainable-only param groups, the module at stage 3) against transformers.Trainer with
its DDP + torch AdamW, per-step losses within 1e-5; the same model in a plain loop against DDP +
torch AdamW; ZeroAccelerator and Lightning's ZeroStrategy at stage 3 given the frameworks'
trainable-only optimizers, against Accelerate's and Lightning's own DDP; ZeroTrainer's stage-3
checkpoint resumed at world size 1.
"""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from _dist import run_ranks  # noqa: E402
from _frameworks import TokenDataset, accelerator, launcher_env, rel_close, tiny_gpt2, tokens  # noqa: E402

STEPS, ACCUM, BATCH, SAVE_AT, TOL = 6, 2, 2, 3, 1e-5


def lora_gpt2():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True,
                        init_lora_weights="gaussian")  # B nonzero too: both factors move from step 1
    return get_peft_model(tiny_gpt2(), config)


def _train(rank, world_size, stage, out, save_steps=None, resume=None):
    launcher_env(rank, world_size)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroTrainer

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append((state.global_step, logs["loss"], logs["grad_norm"]))

    records = []
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH * 2 // world_size, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.05, logging_steps=1, report_to=[],
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500)
    kw = dict(model=lora_gpt2(), args=args, train_dataset=TokenDataset(), callbacks=[Logs()])
    trainer = Trainer(**kw) if stage is None else ZeroTrainer(**kw, zero=ZeroConfig(stage=stage, bucket_numel=4096))
    trainer.train(resume_from_checkpoint=resume)
    mem = trainer.sharded_optimizer.memory_bytes() if stage is not None else None
    return records, mem


def _plain(rank, world_size):
    """The PEFT model in a plain loop: ShardedOptimizer at stages 1-3 against DDP + torch AdamW."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fused_zero import ShardedOptimizer

    out = {}
    for stage in (1, 2, 3):
        model = lora_gpt2()
        ref = copy.deepcopy(model)
        ddp = DDP(ref)
        trainable = [p for p in ref.parameters() if p.requires_grad]
        ref_opt = torch.optim.AdamW(trainable, lr=1e-2, foreach=False)
        opt = ShardedOptimizer(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage)
        losses = {"ours": [], "ref": []}
        for step in range(3):
            for m, o, key, sync, clip in ((model, opt, "ours", opt.no_sync, opt.clip_grad_norm_),
                                          (ddp, ref_opt, "ref", ddp.no_sync,
                                           lambda c: torch.nn.utils.clip_grad_norm_(trainable, c))):
                o.zero_grad()
                total = 0.0
                for micro in range(ACCUM):
                    x = tokens(BATCH, seed=100 * step + 10 * rank + micro)
                    ctx = sync() if micro < ACCUM - 1 else torch.enable_grad()
                    with ctx:
                        loss = m(input_ids=x, labels=x).loss / ACCUM
                        loss.backward()
                    total += float(loss.detach())
                clip(0.05)
                o.step()
                losses[key].append(total)
        out[stage] = losses
    return out


def _trainable_adamw(model):
    """What fine-tuning scripts write: torch AdamW over the trainable parameters only."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _accelerate(rank, world_size, stage):
    """Accelerate's loop on the LoRA model: its own DDP (``stage`` None) or ZeroAccelerator."""
    acc = accelerator(rank, world_size, stage, ACCUM)
    model = lora_gpt2()
    opt = _trainable_adamw(model)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=BATCH * 2, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, norms = [], []
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.05)))
            opt.step()
            opt.zero_grad()
        losses.append(acc.gather(loss.detach().reshape(1)).mean().item())
        if len(losses) == STEPS * ACCUM:
            break
    return losses, norms


def _lightning(rank, world_size, stage):
    """Lightning's Trainer on the LoRA model: its own DDP (``stage`` None) or ZeroStrategy."""
    launcher_env(rank, world_size)
    import lightning.pytorch as L

    from fused_zero.integrations.lightning import ZeroStrategy

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses = lora_gpt2(), []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(float(loss.detach()))
            return loss

        def train_dataloader(self):  # this rank's half of each global micro-batch, as split_batches does
            data = TokenDataset()
            idx = [i for i in range(len(data)) if (i // BATCH) % world_size == rank]
            return torch.utils.data.DataLoader(torch.utils.data.Subset(data, idx), batch_size=BATCH,
                                               shuffle=False)

        def configure_optimizers(self):
            return _trainable_adamw(self)

    lit = Lit()
    trainer = L.Trainer(strategy="ddp" if stage is None else ZeroStrategy(stage=stage, bucket_numel=4096),
                        accelerator="cpu", devices=world_size, max_steps=STEPS, accumulate_grad_batches=ACCUM,
                        gradient_clip_val=0.05, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False)
    trainer.fit(lit)
    return lit.losses


def test_zero_accelerator_and_strategy_take_trainable_only_optimizers_at_stage3():
    """The frameworks' optimizers list the trainable parameters only; stage 3 shards the frozen base too."""
    want, ref_norms = run_ranks(_accelerate, 2, None, timeout=300)[0]
    have, norms = run_ranks(_accelerate, 2, 3, timeout=300)[0]
    assert len(have) == len(want) == STEPS * ACCUM and min(ref_norms) > 0.05  # the clip is active
    assert rel_close(have, want, TOL) < TOL
    assert rel_close(norms, ref_norms, TOL) < TOL
    want = run_ranks(_lightning, 2, None, timeout=300)
    have = run_ranks(_lightning, 2, 3, timeout=300)
    for rank in range(2):
        assert len(have[rank]) == len(want[rank]) == STEPS * ACCUM
        assert rel_close(have[rank], want[rank], TOL) < TOL


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_ranks(_train, 2, None, str(tmp_path_factory.mktemp("ref")), timeout=300)[0]


@pytest.fixture(scope="module")
def stage3_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("stage3"))
    return out, run_ranks(_train, 2, 3, out, SAVE_AT, timeout=300)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_trainer_lora_matches_trainer_ddp(reference, stage3_run, tmp_path, stage):
    records, mem = stage3_run[1] if stage == 3 else run_ranks(_train, 2, stage, str(tmp_path), timeout=300)[0]
    ref_records, _ = reference
    assert [r[0] for r in records] == list(range(1, STEPS + 1))
    assert rel_close([r[1] for r in records], [r[1] for r in ref_records], TOL) < TOL
    assert rel_close([r[2] for r in records], [r[2] for r in ref_records], TOL) < TOL
    assert min(r[2] for r in ref_records) > 0.05  # the clip is active every step
    model = lora_gpt2()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # states for the LoRA factors only (their half, padded), not for the 100k frozen elements
    assert mem["master"] + mem["exp_avg"] + mem["exp_avg_sq"] <= 12 * (trained // 2 + 64 * 16)


def test_plain_loop_lora_matches_ddp_adamw():
    for per_rank in run_ranks(_plain, 2, timeout=300):
        for stage, losses in per_rank.items():
            assert rel_close(losses["ours"], losses["ref"], TOL) < TOL, (stage, losses)


def test_stage3_lora_checkpoint_resumes_at_world_size_1(stage3_run, tmp_path):
    out, (full_records, _) = stage3_run
    ckpt = os.path.join(out, f"checkpoint-{SAVE_AT}")
    records, _ = run_ranks(_train, 1, 3, str(tmp_path / "resumed"), None, ckpt, timeout=300)[0]
    assert [r[0] for r in records] == list(range(SAVE_AT + 1, STEPS + 1))
    assert rel_close([r[1] for r in records], [r[1] for r in full_records[SAVE_AT:]], TOL) < TOL


def _load_best(rank, world_size, stage, out):
    """``load_best_model_at_end`` with a LoRA model: the best checkpoint is an earlier one (the loss is taken as
    higher-is-better), loaded back into the adapter at the end; its evaluation loss comes back."""
    launcher_env(rank, world_size)
    from transformers import Trainer, TrainingArguments

    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroTrainer

    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH * 2 // world_size, max_steps=4, learning_rate=1e-2,
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, eval_strategy="steps", eval_steps=2,
        save_strategy="steps", save_steps=2, save_total_limit=1, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True)
    kw = dict(model=lora_gpt2(), args=args, train_dataset=TokenDataset(), eval_dataset=TokenDataset())
    trainer = Trainer(**kw) if stage is None else ZeroTrainer(**kw, zero=ZeroConfig(stage=stage, bucket_numel=4096))
    trainer.train()
    evaluated = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
    return trainer.state.best_model_checkpoint, evaluated, trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trainer_lora_loads_the_best_adapter_at_the_end(stage, tmp_path):
    """At stage 3 peft's load_adapter reads model.state_dict() first, which stage 3 refuses outside
    full_parameters(): before, the run crashed after training (a probe found it)."""
    best, evaluated, final = run_ranks(_load_best, 1, stage, str(tmp_path / "out"), timeout=300)[0]
    assert best.endswith("checkpoint-2") and len(evaluated) == 2
    assert abs(final - evaluated[0]) < 1e-5 * abs(evaluated[0]), (final, evaluated)


def test_stage3_lora_on_a_model_without_a_modulelist_trains_as_torch():
    """peft's PeftModel (no task type) calls the model inside directly, past its LoraModel: the default units were
    [LoraModel], never gathered (its first forward raised); they are now the model's own layers."""
    from peft import LoraConfig, get_peft_model

    from fused_zero import ShardedOptimizer

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.act, self.o = torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.o(self.act(self.q(x)))

    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["q"], init_lora_weights="gaussian")
    model = get_peft_model(Net(), config)
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model, stage=3, lr=1e-2, min_unit_numel=0)
    inner = model.base_model.model
    assert [u.modules for u in opt._stage.gatherer.units[1:]] == [(inner.q,), (inner.o,)]
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    with opt.full_parameters():
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
