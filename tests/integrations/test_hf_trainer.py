"""ZeroTrainer against transformers.Trainer with its own DDP + torch AdamW.

2 gloo ranks, a tiny GPT-2 built from a config, 20 optimizer steps of 2 accumulated micro-batches,
Trainer's linear warm-up schedule, decay/no-decay groups and an active ``max_grad_norm``: the
logged per-step losses and grad norms within 1e-5 relative of plain Trainer's at stages 1, 2
and 3. A ``checkpoint-10`` resumed in a new process at world size 1 (same global batch)
continues within 1e-5 of the uninterrupted run; ``save_model()`` at stage 3 writes the full
trained model. Misuse is refused with errors that name the fix.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _dist import run_ranks  # noqa: E402
from _frameworks import TokenDataset, launcher_env, rel_close, tiny_gpt2, tokens  # noqa: E402

STEPS, ACCUM, BATCH, SAVE_AT = 20, 2, 2, 10
TOL = 1e-5


def _args(out, world_size, save_steps=None, **kw):
    from transformers import TrainingArguments

    kw.setdefault("max_steps", STEPS)
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH * 2 // world_size, gradient_accumulation_steps=ACCUM,
        learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95, warmup_steps=3,
        lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        data_seed=0, disable_tqdm=True, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        **kw)


def _probe(model) -> float:
    """The loss on a fixed batch (a function of the weights alone)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        x = tokens(8, seed=7)
        loss = model(input_ids=x, labels=x).loss.item()
    model.train(was)
    return loss


def _train(rank, world_size, stage, out, save_steps=None, resume=None, save_model=None):
    launcher_env(rank, world_size)
    from transformers import Trainer, TrainerCallback

    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroTrainer

    probes = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            probes.append(_probe(model))

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append((state.global_step, logs["loss"], logs["grad_norm"]))

    records = []
    model = tiny_gpt2()
    kw = dict(model=model, args=_args(out, world_size, save_steps), train_dataset=TokenDataset(),
              callbacks=[Record(), Logs()])
    trainer = Trainer(**kw) if stage is None else ZeroTrainer(**kw, zero=ZeroConfig(stage=stage, bucket_numel=4096))
    trainer.train(resume_from_checkpoint=resume)
    if save_model:
        trainer.save_model(save_model)
    wrapped = type(trainer.model_wrapped).__name__
    probe = _probe(trainer.model)
    if stage is not None and world_size > 1:  # gradients reduced once per optimizer step, not per micro-batch
        opt = trainer.sharded_optimizer
        accumulated = opt.comm_bytes()["reduce_scatter"]
        x = tokens(BATCH, seed=3)
        trainer.model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        assert accumulated == opt.comm_bytes()["reduce_scatter"] > 0, (accumulated, opt.comm_bytes())
    return records, probes, wrapped, probe, trainer.state.total_flos


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_ranks(_train, 2, None, str(tmp_path_factory.mktemp("ref")), timeout=300)[0]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """ZeroTrainer at 2 ranks per stage, saving checkpoint-10 (its output folder, its results)."""
    runs = {}

    def run(stage):
        if stage not in runs:
            out = str(tmp_path_factory.mktemp(f"stage{stage}"))
            runs[stage] = out, run_ranks(_train, 2, stage, out, SAVE_AT, timeout=300)[0]
        return runs[stage]
    return run


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_trainer_matches_trainer_ddp(reference, zero_runs, stage):
    records, probes, wrapped, _, flos = zero_runs(stage)[1]
    ref_records, ref_probes, ref_wrapped, _, ref_flos = reference
    assert ref_wrapped == "DistributedDataParallel" and wrapped == "GPT2LMHeadModel"
    assert [r[0] for r in records] == list(range(1, STEPS + 1))
    assert rel_close([r[1] for r in records], [r[1] for r in ref_records], TOL) < TOL
    assert rel_close([r[2] for r in records], [r[2] for r in ref_records], TOL) < TOL
    assert min(r[2] for r in ref_records) > 0.5  # max_grad_norm clipped every step
    assert rel_close(probes, ref_probes, TOL) < TOL
    assert flos == ref_flos > 0  # stage 3 counted the placeholders' 0 parameters (total_flos 0)


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_resumes_at_world_size_1(zero_runs, tmp_path, stage):
    out, (full_records, full_probes, _, _, _) = zero_runs(stage)
    ckpt = os.path.join(out, f"checkpoint-{SAVE_AT}")
    assert os.path.isdir(os.path.join(ckpt, "fused_zero"))
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
    records, probes, _, _, _ = run_ranks(_train, 1, stage, str(tmp_path / "resumed"), None, ckpt, timeout=300)[0]
    assert [r[0] for r in records] == list(range(SAVE_AT + 1, STEPS + 1))
    assert rel_close([r[1] for r in records], [r[1] for r in full_records[SAVE_AT:]], TOL) < TOL
    assert rel_close(probes, full_probes[SAVE_AT:], TOL) < TOL


def test_save_model_at_stage_3_writes_the_full_model(tmp_path):
    from transformers import GPT2LMHeadModel

    final = str(tmp_path / "final")
    _, _, _, trained, _ = run_ranks(_train, 2, 3, str(tmp_path / "run"), None, None, final, timeout=300)[0]
    loaded = GPT2LMHeadModel.from_pretrained(final)
    assert _probe(loaded) == pytest.approx(trained, rel=1e-6)


def _misuses(rank, world_size, cases):
    return {case: _misuse(rank, world_size, case) for case in cases}


def _misuse(rank, world_size, case):
    launcher_env(rank, world_size)
    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroTrainer

    model = tiny_gpt2()
    args = dict(model=model, args=_args("/tmp/unused", world_size), train_dataset=TokenDataset())
    try:
        if case == "optimizers":
            ZeroTrainer(**args, optimizers=(torch.optim.AdamW(model.parameters()), None))
        elif case == "optim":
            args["args"] = _args("/tmp/unused", world_size, optim="sgd")
            ZeroTrainer(**args)
        elif case == "clip":
            ZeroTrainer(**args, zero=ZeroConfig(max_grad_norm=1.0))
        elif case == "zero":
            ZeroTrainer(**args, zero={"stage": 2})
        elif case == "full_eval":
            args["args"] = _args("/tmp/unused", world_size, bf16_full_eval=True)
            ZeroTrainer(**args, zero=ZeroConfig(stage=3))
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


MISUSE = {"optimizers": "learning_rate", "optim": "AdamW", "clip": "max_grad_norm", "zero": "ZeroConfig",
          "full_eval": "drop bf16_full_eval"}


def test_misuse_is_refused_on_every_rank():
    for per_rank in run_ranks(_misuses, 2, list(MISUSE), timeout=120):
        for case, needle in MISUSE.items():
            assert per_rank[case] is not None and needle in per_rank[case][1], (case, per_rank[case])


def _plain_trainer_with_sharded(rank, world_size, stages):
    """Each stage's refusal in turn, in one launch (a fresh model, optimizer and Trainer each)."""
    launcher_env(rank, world_size)
    from transformers import Trainer

    from fused_zero import ShardedOptimizer

    refusals = {}
    for stage in stages:
        model = tiny_gpt2()
        opt = ShardedOptimizer(model, lr=1e-3, stage=stage)
        trainer = Trainer(model=model, args=_args("/tmp/unused", 2), train_dataset=TokenDataset(),
                          optimizers=(opt, None))
        try:
            trainer.train()
            refusals[stage] = None
        except RuntimeError as e:
            refusals[stage] = str(e)
        opt.close()
    return refusals


@pytest.mark.parametrize("world_size,stages", [(1, (1, 2, 3)), (2, (2, 3))])
def test_plain_trainer_with_a_sharded_optimizer_is_refused(world_size, stages):
    """Trainer would clip .grad (None at stages 2-3) or wrap the model in DDP: never silently wrong. At
    stage 3 it is refused at the first forward (it would fail in backward with an autograd shape error)."""
    for refusals in run_ranks(_plain_trainer_with_sharded, world_size, stages, timeout=180):
        assert list(refusals) == list(stages)
        assert all(r is not None and "ZeroTrainer" in r for r in refusals.values()), refusals


def _with_eval(rank, world_size, stage, out, extra):
    launcher_env(rank, world_size)
    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroTrainer

    args = _args(out, world_size, save_steps=4, eval_strategy="steps", eval_steps=4, load_best_model_at_end=True,
                 metric_for_best_model="loss", **extra)
    args.max_steps = 8
    trainer = ZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(16),
                          zero=ZeroConfig(stage=stage, bucket_numel=4096))
    result = trainer.train()
    return result.training_loss, trainer.evaluate()["eval_loss"]


def test_eval_best_model_checkpointing_and_compile(tmp_path):
    """Evaluation between steps and load_best_model_at_end at stage 3 with activation checkpointing (reentrant, as
    transformers 4 defaulted to, and not), and Trainer's torch_compile at stage 2 (the aot_eager backend on CPU), train the same model."""
    plain = run_ranks(_with_eval, 2, 3, str(tmp_path / "a"), {}, timeout=300)
    ckpt = run_ranks(_with_eval, 2, 3, str(tmp_path / "b"), {"gradient_checkpointing": True}, timeout=300)
    reentrant = run_ranks(_with_eval, 2, 3, str(tmp_path / "r"), {
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, timeout=300)
    compiled = run_ranks(_with_eval, 2, 2, str(tmp_path / "c"),
                         {"torch_compile": True, "torch_compile_backend": "aot_eager"}, timeout=300)
    for results in (ckpt, reentrant, compiled):
        for (loss, ev), (ref_loss, ref_ev) in zip(results, plain):
            assert loss == pytest.approx(ref_loss, rel=1e-5) and ev == pytest.approx(ref_ev, rel=1e-5)


def _seq2seq_generate(rank, world_size, out):
    """ZeroSeq2SeqTrainer at stage 3, predict_with_generate: rank 0's sequence ends at its first token (its eos),
    rank 1's runs on; the predictions equal a plain greedy generate of the trained weights."""
    launcher_env(rank, world_size)
    from transformers import Seq2SeqTrainingArguments

    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroSeq2SeqTrainer

    args = Seq2SeqTrainingArguments(
        output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=1, max_steps=2, learning_rate=1e-3,
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, save_strategy="no",
        predict_with_generate=True)
    model = tiny_gpt2()
    trainer = ZeroSeq2SeqTrainer(model=model, args=args, train_dataset=TokenDataset(),
                                 zero=ZeroConfig(stage=3, bucket_numel=4096))
    trainer.train()
    opt = trainer.sharded_optimizer
    prompts = tokens(8, seed=11)[:, :6]
    with opt.full_parameters():  # every rank alike: the trained weights' greedy continuations
        model.eval()
        runs = model.generate(prompts, max_new_tokens=6, do_sample=False, pad_token_id=0, synced_gpus=False)[:, 6:]
    pair = next((i, j) for i in range(len(runs)) for j in range(len(runs))
                if i != j and runs[i, 0] not in runs[j].tolist())
    eos = int(runs[pair[0], 0])
    model.generation_config.update(eos_token_id=eos, pad_token_id=eos, max_new_tokens=6)
    model.config.pad_token_id = eos  # (what Seq2SeqTrainer pads the predictions with)
    data = [{"input_ids": prompts[i], "labels": prompts[i]} for i in pair]
    predicted = trainer.predict(data).predictions  # (every rank's, gathered)
    expected = [runs[pair[0], :1].tolist(), runs[pair[1]].tolist()]
    return [row[6:].tolist() for row in torch.as_tensor(predicted)], expected, eos


def test_seq2seq_trainer_generates_at_stage_3_with_ranks_ending_apart(tmp_path):
    """Seq2SeqTrainer's predict_with_generate at stage 3: rank 0 is done after one token, rank 1 after six; without
    synced_gpus rank 1's forwards would gather alone and hang."""
    for predicted, expected, eos in run_ranks(_seq2seq_generate, 2, str(tmp_path), timeout=300):
        first = [t for t in predicted[0] if t != eos]
        assert first == [] and predicted[0][0] == eos, (predicted, expected)
        assert predicted[1][:len(expected[1])] == expected[1], (predicted, expected)


def _plain_generate(rank, world_size, peft):
    """A stage-3 model's own generate() (no synced_gpus given, as TRL's GRPO calls it), rank 0 asking for 2 new
    tokens and rank 1 for 6: every rank's continuation equals the same model's generate without the optimizer."""
    from fused_zero import ShardedOptimizer
    model, ref = tiny_gpt2(), tiny_gpt2()
    if peft:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False))
        ref = get_peft_model(ref, LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False))
        ref.load_state_dict(model.state_dict())
    opt = ShardedOptimizer(model, stage=3, lr=1e-3, min_unit_numel=0)
    prompts = tokens(2, seed=11 + rank)[:, :5]
    n = 2 if rank == 0 else 6
    model.eval()
    got = model.generate(input_ids=prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    want = ref.eval().generate(input_ids=prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
    marked = [m for m in model.modules() if "_is_fsdp_managed_module" in m.__dict__]
    import copy
    import torch._dynamo
    from transformers.distributed.fsdp import is_fsdp_managed_module
    seen = (bool(marked[0]._is_fsdp_managed_module),  # (a read outside transformers' generation code: false)
            is_fsdp_managed_module(marked[0]))  # (not from generation code either: false)
    with opt.full_parameters():  # rank 0 alone generates samples inside the block: nothing to sync, no wait
        copied = copy.deepcopy(model)
        sample = model.generate(input_ids=prompts, max_new_tokens=2, do_sample=False, pad_token_id=0).tolist() \
            if rank == 0 else None
    if rank == 0:  # a copy is a plain model: generated alone, without waiting for the other rank
        copied.generate(input_ids=prompts, max_new_tokens=2, do_sample=False, pad_token_id=0)
    torch.distributed.barrier()
    # torch.compile reads the same attribute to treat a module as FSDP's: it must not see it
    explained = torch._dynamo.explain(marked[0])(input_ids=prompts)
    fsdp_breaks = [r for r in explained.break_reasons if "FSDP" in str(r)]
    opt.close()
    left = [m for m in model.modules() if "_is_fsdp_managed_module" in m.__dict__]
    return got.tolist(), want.tolist(), len(marked), len(left), seen, sample, len(fsdp_breaks)


@pytest.mark.parametrize("peft", [False, True], ids=["model", "peft"])
def test_generate_at_stage_3_keeps_ranks_ending_apart_in_step(peft):
    """transformers syncs the ranks' generate() (synced_gpus) only for models it sees sharded (DeepSpeed ZeRO-3,
    FSDP's mark): at stage 3 a rank that was done stopped making the gathers the others waited in, and
    TRL's GRPO hung at 2 ranks (its generate() takes no synced_gpus). The stage-3 model is marked as FSDP marks
    its own, so any generate() syncs; close() takes the mark off. Only generation code sees it true: not a
    generate() inside full_parameters() on one rank, not a deep copy, not torch.compile (which would treat the
    module as FSDP's)."""
    pytest.importorskip("peft") if peft else None
    for rank, (got, want, marked, left, seen, sample, fsdp_breaks) in enumerate(
            run_ranks(_plain_generate, 2, peft, timeout=300)):
        assert got == want, (got, want)
        assert marked >= 1 and left == 0 and seen == (False, False) and fsdp_breaks == 0
        assert (sample is not None) == (rank == 0)


def _sync_ref_model(rank, world_size, stage, out):
    """TRL's SyncRefModelCallback (DPO's sync_ref_model=True) as TRL writes it, without TRL installed: every step
    it mixes the trained weights into a reference model. Returns the reference model's weights after training."""
    launcher_env(rank, world_size)
    from transformers import Trainer, TrainerCallback

    from fused_zero import ZeroConfig
    from fused_zero.integrations.transformers import ZeroTrainer

    class SyncRefModelCallback(TrainerCallback):  # trl/trainer/callbacks.py's, where TRL's ZeRO-3 branch is not taken
        def __init__(self, ref_model):
            self.ref_model = ref_model

        @staticmethod
        def sync_target_model(model, target_model, alpha):
            for target_param, copy_param in zip(target_model.parameters(), model.parameters(), strict=True):
                target_param.data.mul_(1.0 - alpha).add_(copy_param.data, alpha=alpha)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:
                self.sync_target_model(kwargs["model"], self.ref_model, 0.5)
    SyncRefModelCallback.__module__ = "trl.trainer.callbacks"

    model, ref = tiny_gpt2(), tiny_gpt2()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    kw = dict(model=model, args=_args(out, world_size, max_steps=4), train_dataset=TokenDataset(),
              callbacks=[SyncRefModelCallback(ref)])
    trainer = Trainer(**kw) if stage is None else ZeroTrainer(**kw, zero=ZeroConfig(stage=stage, bucket_numel=4096))
    trainer.train()
    return [p.detach().clone() for p in ref.parameters()]


def test_trls_sync_ref_model_callback_reads_the_gathered_weights_at_stage_3(tmp_path):
    """At stage 3 TRL's SyncRefModelCallback read the empty placeholders between steps (torch's size error; TRL
    gathers only for DeepSpeed ZeRO-3). ZeroTrainer runs its sync_target_model inside full_parameters(): the
    reference model ends as under Trainer + DDP."""
    want = run_ranks(_sync_ref_model, 2, None, str(tmp_path / "ref"), timeout=300)
    got = run_ranks(_sync_ref_model, 2, 3, str(tmp_path / "s3"), timeout=300)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
