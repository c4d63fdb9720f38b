"""The update, verified (issue 74, one process): the step after each check watched through the optimizer's hooks.

Clipping (one factor for every tensor, at the asked threshold), the update torch's optimizers apply (replayed in
float64 on sampled coordinates), a step that moves nothing, and tied parameters untied. Real optimizers, real
clipping, a real HF Trainer; training bit-identical watched and unwatched."""

from __future__ import annotations

import pytest
import torch
from helpers import HotAdam
from test_optimizer_replay import NoBiasCorrection
from torch import nn
from torch.nn import functional as F

from gradwatch import GradWatch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 20, bias=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids))))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]).reshape(-1, 20), batch[1].reshape(-1))


def batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 20, (8, 6), generator=g), torch.randint(0, 20, (8, 6), generator=g)) for _ in range(n)]


def run(make_opt, clip=None, watched=True, model=None, steps=4, **options):
    """A plain loop of ``steps`` steps with a check at each; ``clip(model, opt)`` between the check and the step."""
    model = model or Net()
    opt = make_opt(model)
    options.setdefault("log_dir", None)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1, **options) if watched else None
    for b in batches(steps):
        opt.zero_grad()
        loss_fn(model, b).backward()
        if watch is not None:
            watch.step(b)
        if clip is not None:
            clip(model, opt)
        opt.step()
    return model, watch


OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adamw_foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
}


def clip_all(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_torchs_optimizers_and_clipping_are_clean_and_training_bit_identical(name):
    model, watch = run(OPTIMIZERS[name], clip_all)
    assert watch.alerts == [], [a.message for a in watch.alerts]
    last = watch.update.last
    assert last["step"] == 3
    assert last["update"]
    assert all(u["verdict"] == "excellent" for u in last["update"].values())
    assert last["clipping"]["factor"] < 1.0 and last["clipping"]["threshold"] == pytest.approx(0.05, rel=1e-4), last
    plain, _ = run(OPTIMIZERS[name], clip_all, watched=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


def test_clipping_per_parameter_group_is_named_at_the_first_clipped_check():
    def two_groups(m):
        return torch.optim.SGD([{"params": [m.emb.weight, m.body.weight, m.body.bias]}, {"params": [m.head.weight]}],
                               lr=0.1)

    def per_group(model, opt):
        for group in opt.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], 0.1)

    _, watch = run(two_groups, per_group)
    clipping = [a for a in watch.alerts if a.part == "update"]
    assert [a.kind for a in clipping] == ["clipping"] and clipping[0].step == 0, [a.message for a in watch.alerts]
    assert "parameter group 0 (3 tensors)" in clipping[0].message
    assert "parameter group 1 (1 tensor)" in clipping[0].message
    assert "its own norm" in clipping[0].message


def test_a_threshold_taken_over_half_the_gradient_moves_and_is_named():
    def half(model, opt):  # the norm of a part of the gradient (one "shard"), applied to all of it
        part = torch.linalg.vector_norm(torch.cat([model.head.weight.grad.reshape(-1)]))
        for p in model.parameters():
            p.grad.mul_(min(1.0, 0.05 / (float(part) + 1e-6)))

    _, watch = run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), half, steps=4)
    moved = [a for a in watch.alerts if a.kind == "clipping"]
    assert moved and "moves with the gradient" in moved[0].message, [a.message for a in watch.alerts]


def test_an_optimizer_built_before_the_parameters_were_replaced_is_alerted_at_the_first_check():
    def stale(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)  # new Parameter objects
        return opt

    model, watch = run(stale)
    update = [a for a in watch.alerts if a.part == "update"]
    assert update and update[0].step == 0 and update[0].kind == "update", [a.message for a in watch.alerts]
    assert "holds none of 4 of the 4 trained tensors" in update[0].message
    assert len(update) == 1  # said once for the run (and the step moved nothing it holds: the same cause)
    assert all(w.grad is not None for w in model.parameters())


def test_an_adamw_without_bias_correction_is_alerted_at_the_first_check_with_its_ratio():
    _, watch = run(lambda m: NoBiasCorrection(m.parameters(), lr=1e-2, weight_decay=0.0))
    update = [a for a in watch.alerts if a.part == "update"]
    assert [a.kind for a in update] == ["update"] and update[0].step == 0, [a.message for a in watch.alerts]
    assert "departs from AdamW's algorithm" in update[0].message and "NoBiasCorrection" in update[0].message


def test_a_subclass_whose_step_wraps_its_bases_is_judged_at_its_own_end_and_its_ratio_named():
    torch.optim.Adam(Net().parameters())  # (an Adam built before: the base's step is hooked too, and runs inside)
    _, watch = run(lambda m: HotAdam(m.parameters(), lr=1e-2))
    update = [a for a in watch.alerts if a.part == "update"]
    assert [a.kind for a in update] == ["update"] and update[0].step == 0, [a.message for a in watch.alerts]
    assert "departs from Adam's algorithm" in update[0].message and "1.3x the algorithm's" in update[0].message


def test_tied_weights_untied_after_the_watch_was_built_are_alerted_and_a_tied_model_is_clean():
    def tied():
        m = Net()
        m.head.weight = m.emb.weight
        return m

    _, clean = run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), model=tied())
    assert clean.alerts == [], [a.message for a in clean.alerts]

    model = tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None)
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())  # untied, as a load or to_empty leaves it
    b = batches(1)[0]
    opt.zero_grad()
    loss_fn(model, b).backward()
    watch.step(b)
    ties = [a for a in watch.alerts if a.kind == "tie"]
    assert ties and "emb.weight and head.weight are declared tied" in ties[0].message, [a.message for a in watch.alerts]


def test_a_transformers_model_whose_config_ties_its_embeddings_but_that_was_untied_is_alerted():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in transformers.GPT2LMHeadModel(cfg).state_dict().items()}
    with torch.device("meta"):  # built on the meta device, then materialized and loaded (verl's, lingua's way)
        model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied on the meta device
    model.to_empty(device="cpu")  # a new tensor for each module's entry: the tie is gone
    model.load_state_dict(state, strict=False)
    assert model.lm_head.weight is not model.transformer.wte.weight and cfg.tie_word_embeddings
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = GradWatch(model, lambda m, b: m(input_ids=b, labels=b).loss, optimizer=opt, every=1, log_dir=None)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    watch.step(ids)
    ties = [a for a in watch.alerts if a.kind == "tie"]
    assert ties and "transformer.wte.weight and lm_head.weight" in ties[0].message, [a.message for a in watch.alerts]


def llama_trainer(transformers, tmp_path, callbacks, **args):
    """A real HF Trainer of 4 steps on a tiny Llama (vocabulary 100, 2 layers), batches of 4 of 12 tokens;
    ``args``: more TrainingArguments (``max_grad_norm``)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 100, (16, 12), generator=g)]
    training = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                              use_cpu=True, disable_tqdm=True, report_to=[], save_strategy="no",
                                              learning_rate=1e-2, logging_steps=100, **args)
    return transformers.Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)


@pytest.mark.slow  # a real HF Trainer, 4 steps with its default clipping (max_grad_norm=1.0): 5-10 s
def test_under_the_hf_trainer_its_default_clipping_and_adamw_are_clean(tmp_path):
    transformers = pytest.importorskip("transformers")
    from gradwatch.integrations.transformers import GradWatchCallback

    callback = GradWatchCallback(every=1, log_dir=None)
    llama_trainer(transformers, tmp_path, [callback]).train()
    watch = callback.watch
    assert watch.update.asked == 1.0
    assert watch.update.last is not None
    assert watch.update.last["algorithm"] == "AdamW"
    assert [a for a in watch.alerts if a.part == "update"] == [], [a.message for a in watch.alerts]
    assert all(u["verdict"] == "excellent" for u in watch.update.last["update"].values()), watch.update.last
    assert watch.update.thresholds == [] or all(t == pytest.approx(1.0, rel=1e-4) for t in watch.update.thresholds)


@pytest.mark.slow  # a real HF Trainer, 4 steps: 5-10 s
def test_under_the_hf_trainer_a_threshold_divided_by_the_world_size_is_alerted_at_the_first_clipped_check(tmp_path):
    transformers = pytest.importorskip("transformers")
    from gradwatch.integrations.transformers import GradWatchCallback

    class WorldSizeClip(transformers.TrainerCallback):
        """The bug: the clip's threshold divided by a world size of 2 (each rank's share of a sharded norm)."""

        def on_train_begin(self, args, state, control, **kwargs):
            accelerator = self.trainer.accelerator
            plain = accelerator.clip_grad_norm_
            accelerator.clip_grad_norm_ = lambda params, max_norm, norm_type=2: plain(params, max_norm / 2, norm_type)

    callback, bug = GradWatchCallback(every=1, log_dir=None), WorldSizeClip()
    trainer = llama_trainer(transformers, tmp_path, [callback, bug], max_grad_norm=0.05)
    bug.trainer = trainer
    trainer.train()
    clipping = [a for a in callback.watch.alerts if a.kind == "clipping"]
    assert len(clipping) == 1 and clipping[0].step == 0, [a.message for a in callback.watch.alerts]
    assert "where 0.05 was asked for (x2: the threshold divided by 2, the world size?)" in clipping[0].message, \
        clipping[0].message


def test_through_fabrics_wrapped_optimizer_the_real_step_is_verified():
    fabric_module = pytest.importorskip("lightning.fabric")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    model = Net()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None)
    for b in batches(2):
        opt.zero_grad()
        fabric.backward(loss_fn(model, b))
        watch.step(b)
        fabric.clip_gradients(model, opt, max_norm=0.05)
        opt.step()
    assert watch.update.last["algorithm"] == "AdamW" and watch.update.last["clipping"]["factor"] < 1.0
    assert all(u["verdict"] == "excellent" for u in watch.update.last["update"].values()), watch.update.last
    assert [a for a in watch.alerts if a.part == "update"] == [], [a.message for a in watch.alerts]


def test_through_accelerates_wrapped_optimizer_the_real_step_is_verified():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # (a Trainer earlier in this process left its accumulation setting)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None)
    assert watch.update.optimizer is opt.optimizer  # the torch optimizer inside accelerate's wrapper
    hooks = opt.optimizer._optimizer_step_post_hooks
    for b in batches(4):
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, b))
            if accelerator.sync_gradients:
                watch.step(b)
            else:
                watch.accumulate(b)
            opt.step()
            opt.zero_grad()
    assert watch.alerts == [], [a.message for a in watch.alerts]
    assert len(hooks) == 1  # one idle hook for the run, not one per check
    watch.close()
    assert len(hooks) == 0
    assert watch.update.last["algorithm"] == "SGD" and all(u["verdict"] == "excellent"
                                                           for u in watch.update.last["update"].values())


@pytest.mark.slow  # three real Lightning Trainers, 6 steps each: 10-20 s
@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_under_lightning_its_clipping_by_norm_or_by_value_and_its_step_are_clean(tmp_path, clip):
    pl = pytest.importorskip("lightning.pytorch")
    from gradwatch.integrations.lightning import GradWatchCallback as LightningCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            return loss_fn(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)

    callback = LightningCallback(every=1, log_dir=None, tensorboard=False)
    options = {} if clip is None else {"gradient_clip_val": 0.05 if clip == "norm" else 0.002,
                                       "gradient_clip_algorithm": clip}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path),
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **options)
    ids = torch.randint(0, 20, (48, 6), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids.roll(1, 1)), batch_size=8)
    trainer.fit(Module(), data)
    watch = callback.watch
    assert watch.update.asked == {None: 0.0, "norm": 0.05, "value": None}[clip]
    assert [a for a in watch.alerts if a.part == "update"] == [], [a.message for a in watch.alerts]
    last = watch.update.last
    assert last is not None and last["step"] == 5 and last["algorithm"] == "AdamW", last
    assert all(u["verdict"] == "excellent" for u in last["update"].values()), last
    if clip == "norm":
        assert last["clipping"]["factor"] < 1 and last["clipping"]["threshold"] == pytest.approx(0.05, rel=1e-4)
    if clip == "value":
        assert last["clipping"]["factor"] is None and last["clipping"]["threshold"] == pytest.approx(0.002), last
    assert watch.update._hooks == []  # the fit's end closed the watch: its hook is gone


def test_each_steps_verdicts_are_in_the_jsonl_records_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gradwatch.io.sinks import read_jsonl

    _, watch = run(OPTIMIZERS["adamw_foreach"], clip_all, log_dir=str(tmp_path))
    watch.close()
    records, _ = read_jsonl(tmp_path / "checks.jsonl")
    updates = [r for r in records if r["type"] == "update"]
    assert [r["step"] for r in updates] == [0, 1, 2, 3], [r["type"] for r in records]
    assert all(r["algorithm"] == "AdamW" and r["clipping"]["factor"] < 1 for r in updates), updates[-1]
    assert set(updates[-1]["tensors"]) == {"emb.weight", "body.weight", "body.bias", "head.weight"}
    assert all(t["verdict"] == "excellent" for r in updates for t in r["tensors"].values())
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "gradwatch/update/clipping_factor" in tags and "gradwatch/update/log10_judged_rel_diff/head.weight" in tags
    assert [e.step for e in acc.Scalars("gradwatch/update/clipping_factor")] == [0, 1, 2, 3]
