"""GradWatchCallback in real ``transformers.Trainer`` runs on CPU: a tiny random BertConfig, random ids.

The callback captures the batch itself, checks once per optimizer step under gradient
accumulation, reads ``.grad`` before the Trainer clips it (and leaves training bit-identical),
writes through the TensorBoard reporting callback and ``checks.jsonl``, names a planted wrong
backward, and keeps one run across ``resume_from_checkpoint``.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from gradwatch.cli import commands as cli  # noqa: E402
from gradwatch.integrations.transformers import STATE_NAME, GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

pytestmark = pytest.mark.slow  # real Trainer runs, several over 5 s

class RandomIds(torch.utils.data.Dataset):
    def __init__(self, n: int = 80, seq: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 50, (n, seq), generator=g)  # 0 is the padding id
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


class WrongGeluFunction(torch.autograd.Function):
    """GELU whose backward is 1.5x the true derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return nn.functional.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return grad * 1.5 * (cdf + x * pdf)


class WrongGelu(nn.Module):
    def forward(self, x):
        return WrongGeluFunction.apply(x)


def tiny_bert(buggy: bool = False, dropped: bool = False) -> nn.Module:
    """A BERT classifier. Its forward declares **kwargs but its loss drops num_items_in_batch, so the Trainer
    would skip dividing by the accumulation steps (transformers #47688): ``accepts_loss_kwargs = False`` tells it,
    unless ``dropped`` keeps that bug."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    if not dropped:
        model.accepts_loss_kwargs = False
    if buggy:
        model.bert.encoder.layer[0].intermediate.intermediate_act_fn = WrongGelu()
    return model


def train(output_dir, callbacks=(), *, model=None, max_steps=20, resume=None, **kwargs):
    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, use_cpu=True, disable_tqdm=True, seed=0,
                             logging_steps=5, **{"report_to": [], "save_strategy": "no", **kwargs})
    trainer = Trainer(model=model if model is not None else tiny_bert(), args=args, train_dataset=RandomIds(),
                      callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def check_steps(path):
    records, _ = read_jsonl(path)
    return [r["step"] for r in records if r["type"] == "check"]


class SeesGrad(GradWatchCallback):
    """Records the gradient norm the check saw and the one the optimizer steps with (the clipped one), and whether the
    check read it in the tensors the optimizer steps with (the pre-clip copies folded into them: no second gradient)."""

    seen: list = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = kwargs["model"]
        stepped = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
        tensors = [p.grad for p in model.parameters()]
        original = self.watch.step

        def step(batch, global_step=None):
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
            same = all(p.grad is t for p, t in zip(model.parameters(), tensors))
            report = original(batch, global_step=global_step)
            if report is not None:
                self.seen.append((global_step, float(norm), float(stepped), same))
            return report

        self.watch.step = step
        try:
            super().on_pre_optimizer_step(args, state, control, **kwargs)
        finally:
            del self.watch.step


def test_checks_every_n_steps_before_clipping_bit_identical_and_through_tensorboard(tmp_path):
    plain = train(tmp_path / "plain", max_grad_norm=0.01).model
    callback = SeesGrad(every=5, coords=2, directions=1)
    callback.seen = []
    watched = train(tmp_path / "watched", [callback], max_grad_norm=0.01, report_to=["tensorboard"]).model
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), watched.state_dict().values()))

    watch = callback.watch
    assert watch.alerts == [] and watch.paused is None
    # gradient_accumulation_steps=2: both micro-batches of the step are given to the watch, each with the
    # Trainer's scaling, so the training verdict judges every tensor at every check
    checks = [c for c in read_jsonl(next((tmp_path / "watched").rglob("checks.jsonl")))[0] if c["type"] == "check"]
    n_params = len(list(watched.parameters()))
    assert all(len(c["training"]) == n_params and "accumulating" not in (c["training_note"] or "") for c in checks)
    assert sorted({r["step"] for h in watch.history.values() for r in h}) == [0, 5, 10, 15]
    # the check read .grad as backprop left it; the optimizer stepped with the clipped gradients
    assert [s for s, _, _, _ in callback.seen] == [0, 5, 10, 15]
    assert all(seen > 0.05 and stepped == pytest.approx(0.01, rel=1e-3) for _, seen, stepped, _ in callback.seen)
    assert all(same for *_, same in callback.seen), "the pre-clip values folded into the tensors the optimizer steps with"

    [jsonl] = list((tmp_path / "watched").rglob("checks.jsonl"))
    assert check_steps(jsonl) == [0, 5, 10, 15]
    [events] = list(jsonl.parent.glob("events.out.tfevents*"))  # the TensorBoardCallback's own event file
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "train/loss" in tags and "gradwatch/judged_rel_diff/classifier.weight" in tags
    assert [e.step for e in acc.Scalars("gradwatch/rel_diff/bert.encoder.layer.0.intermediate.dense.weight")] == [0, 5, 10, 15]


def test_a_planted_wrong_backward_is_named(tmp_path):
    callback = GradWatchCallback(every=10, coords=4, directions=2)
    train(tmp_path, [callback], model=tiny_bert(buggy=True))
    # one alert names the module (issue 73: it was one per failing tensor), the tensors upstream of it under it
    (alert,) = [a for a in callback.watch.alerts if a.kind == "threshold"]
    assert alert.tensor == "bert.encoder.layer.0.intermediate.intermediate_act_fn"
    assert "bert.encoder.layer.0.intermediate.dense.weight" in alert.tensors
    assert not any(name.startswith(("classifier.", "bert.pooler.", "bert.encoder.layer.0.output.")) for name in alert.tensors)
    assert check_steps(tmp_path / "checks.jsonl") == [0, 10]  # no TensorBoard: output_dir


def test_resume_from_checkpoint_keeps_one_run(tmp_path, capsys):
    first = GradWatchCallback(every=5, coords=2, directions=1)
    train(tmp_path, [first], max_steps=10, save_strategy="steps", save_steps=10)
    saved = json.loads((tmp_path / "checkpoint-10" / STATE_NAME).read_text())
    assert saved["checks"] == 2 and saved["run_id"] == first.watch.run_id

    second = GradWatchCallback(every=5, coords=2, directions=1)
    train(tmp_path, [second], max_steps=20, resume=True)
    assert second.watch.run_id == first.watch.run_id
    assert second.watch.state_dict()["checks"] == 4
    capsys.readouterr()  # the Trainer's own log lines
    code = cli.main(["report", str(tmp_path), "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["checks"] == 4
    assert (doc["first_step"], doc["last_step"]) == (0, 15)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="evry"):
        GradWatchCallback(evry=5)
    with pytest.raises(ValueError, match="on_alert"):
        GradWatchCallback(on_alert="print")


def test_reporting_integrations_get_the_scalars_through_on_log(tmp_path):
    from transformers import TrainerControl, TrainerState
    from transformers.integrations import TensorBoardCallback

    from gradwatch.integrations.transformers import ReportingSink

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    reporter = TensorBoardCallback()
    reporter.logging_dir = str(tmp_path / "tb")

    state = TrainerState(global_step=7)
    assert state.is_world_process_zero
    sink = ReportingSink([reporter], lambda: (args, state, TrainerControl()))
    sink.write_check({"step": 7, "tensors": {"w": {"rel_diff": 1e-9, "judged_rel_diff": 0.0}}, "summary": {}}, 1)
    reporter.tb_writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/gradwatch/alerts/count")] == [(7, 1.0)]
    assert "train/gradwatch/judged_rel_diff/w" in acc.Tags()["scalars"]


class TokenIds(torch.utils.data.Dataset):
    """Causal-LM samples: labels are the inputs (some masked with -100, so micro-batches hold unequal item counts)."""

    def __init__(self, n: int = 64, seq: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 50, (n, seq), generator=g)
        self.keep = torch.rand(n, seq, generator=g) > 0.3

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": torch.where(self.keep[i], self.ids[i], -100)}


def tiny_lm(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16))
        if kind == "gpt2-counted":  # the Trainer then counts labels[..., 1:], as the loss does
            model.loss_type = "ForCausalLM"
        return model
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))


def test_gpt2_counted_before_the_shift_is_named_without_accumulation_too(tmp_path):
    """One micro-batch per step: no cut to fit, the ratio alone (the shifted count over every label) names it."""
    callback = GradWatchCallback(every=1, coords=2, directions=1, tensorboard=False, independence=None)
    model = tiny_lm("gpt2")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True,
                             disable_tqdm=True, seed=0, report_to=[], save_strategy="no", logging_steps=100)
    Trainer(model=model, args=args, train_dataset=TokenIds(), callbacks=[callback]).train()
    training = [a for a in callback.watch.alerts if a.part == "training"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    # One cause, one alert (issue 73): the count names every tensor's failure; it was one alert per tensor (16)
    assert len(training) == 1 and training[0].tensor == "*", [a.message[:200] for a in training]
    assert training[0].count == len(names) and sorted(training[0].tensors) == sorted(names)
    assert "the count includes each sample's first label" in training[0].message
    assert "model.loss_type = 'ForCausalLM'" in training[0].message


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert", "bert-dropped", "bert-buggy"])  # GPT-2 told: the test below
def test_accumulation_training_verdict_at_every_check(tmp_path, kind):
    """gradient_accumulation_steps=4: the training verdict judges the step's .grad against the mean over every
    item of the step. Models that divide their summed loss by the step's target-token count (num_items_in_batch)
    are right at every check, and so is a BERT classifier the Trainer divides by the 4 micro-batches. Two Hugging
    Face bugs are named: GPT2LMHeadModel, whose loss_type is None, is counted before the next-token shift (one
    label per row too many: its gradient a few percent short), and BertForSequenceClassification declares
    **kwargs but drops num_items_in_batch, so the Trainer skips its division by the 4 micro-batches
    (transformers #47688; ``model.accepts_loss_kwargs = False`` is the fix). A planted wrong backward is named."""
    callback = GradWatchCallback(every=2, coords=2, directions=1, tensorboard=False)
    lm = not kind.startswith("bert")
    model = tiny_lm(kind) if lm else tiny_bert(buggy=kind == "bert-buggy", dropped=kind == "bert-dropped")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, use_cpu=True, disable_tqdm=True, seed=0,
                             report_to=[], save_strategy="no", logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=TokenIds() if lm else RandomIds(), callbacks=[callback])
    assert trainer.model_accepts_loss_kwargs or not lm
    trainer.train()
    checks = [c for c in read_jsonl(tmp_path / "checks.jsonl")[0] if c["type"] == "check"]
    assert [c["step"] for c in checks] == [0, 2]
    n_params = len([p for p in model.parameters() if p.requires_grad])
    assert all(len(c["training"]) == n_params for c in checks), [c["training_note"] for c in checks]
    training = [a for a in callback.watch.alerts if a.part == "training"]
    if kind == "bert-buggy":
        # one alert names the module (issue 73: it was one per tensor); the upstream tensors are listed under it
        (alert,) = [a for a in callback.watch.alerts if a.kind == "threshold"]
        assert alert.tensor == "bert.encoder.layer.0.intermediate.intermediate_act_fn", alert.message
        assert "bert.encoder.layer.0.intermediate.dense.weight" in alert.tensors
        assert training == []  # the training verdict agrees: .grad is the objective's
        return
    # One cause, one alert (issue 73), updated at the second check: it was one alert per tensor
    if kind == "bert-dropped":  # every tensor with a gradient (the token-type embedding of unused types has none)
        assert len(training) == 1
        assert training[0].count == n_params - 1
        assert training[0].step == 0
        assert "4.00x the objective's" in training[0].message and "accumulation over 4 micro-batches" in training[0].message
        assert [c["causes"][0]["last_step"] for c in checks] == [0, 2]
        return
    if kind == "gpt2":
        assert len(training) == 1
        assert training[0].count == n_params
        assert training[0].step == 0
        assert "the count includes each sample's first label" in training[0].message
        assert "model.loss_type = 'ForCausalLM'" in training[0].message
        assert [(c["causes"][0]["new"], c["causes"][0]["last_step"]) for c in checks] == [(True, 0), (False, 2)]
        return
    assert callback.watch.alerts == []
    rule = "target tokens (labels[..., 1:] != -100)" if lm else "samples"
    assert all(c["training_items"]["rule"] == rule for c in checks)
    if lm:  # independence="auto": a Hugging Face causal LM is checked causal on the Trainer's batch
        assert all(c["independence"]["ok"] and list(c["independence"]["structures"]) == ["causal"] for c in checks)
    else:  # a classifier is not checked unless asked
        assert all(c["independence"] is None for c in checks)


@pytest.mark.parametrize("own, rows, steps, loss_fn", [
    (True, 2, 3, None), (True, 1, 4, None), ("gpt2-counted", 2, 3, None), ("llama", 2, 3, None),
    ("llama", 2, 3, lambda model, inputs: model(**inputs).loss),  # a loss_fn of one's own: the micro-batch's loss
])
def test_a_model_without_num_items_in_batch_is_named_under_accumulation(tmp_path, own, rows, steps, loss_fn):
    """A model of one's own whose forward takes no num_items_in_batch: the Trainer divides each micro-batch's token
    mean by the accumulation steps, and the micro-batches hold unequal token counts (the 2024 bug), padded or, one
    row each (TRL #2175's batch 1), not. GPT-2 (told its loss_type) and Llama divide by the step's count themselves:
    at the Trainer's defaults, 0 alerts over 4 checks, also with a loss_fn of one's own (it is handed the inputs
    without num_items_in_batch)."""
    from token_batches import OwnLM, Rows, collate

    torch.manual_seed(0)
    model = OwnLM() if own is True else tiny_lm(own)
    callback = GradWatchCallback(loss_fn, every=1, tensorboard=False)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=rows,
                             gradient_accumulation_steps=steps, use_cpu=True, disable_tqdm=True, seed=0,
                             report_to=[], save_strategy="no", logging_steps=100)
    Trainer(model=model, args=args, train_dataset=Rows(vocab=50, longest=16), data_collator=collate,
            callbacks=[callback]).train()
    training = [a for a in callback.watch.alerts if a.part == "training"]
    if own is not True:  # the model divides by the step's count itself: clean over 4 checks
        assert callback.watch.alerts == []
        assert callback.watch.check_counts
        assert callback.watch._checks == 4
        return
    assert training and all(a.step == 0 for a in training)
    assert f"training weighs the {steps} micro-batches equally, but they hold" in training[0].message
    assert "(in Hugging Face: a model whose forward takes num_items_in_batch" in training[0].message


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gets_both_verdicts_no_alert_and_training_is_bit_identical(reentrant):
    """``gradient_checkpointing_enable`` with either ``use_reentrant``. The float64 copy the backward part checks
    runs without checkpointing (a recomputation in backward would have to match a forward that the check's
    dropout-off mode rewrote: torch refused it, an error alert and a paused watch). With ``use_reentrant=True``
    the training part's replay of the live model takes its gradients through ``backward()``, each ``.grad`` set
    aside and put back (``autograd.grad`` raised "incompatible with .grad()"). Training keeps its checkpointing
    and ends bit for bit where the unwatched run ends."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradwatch import GradWatch

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids).loss

    def train(watched: bool):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=16))
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None) if watched else None
        data = torch.Generator().manual_seed(1)
        reports = []
        for _ in range(2):
            ids = torch.randint(0, 100, (2, 12), generator=data)
            opt.zero_grad()
            loss_fn(model, ids).backward()
            if watch is not None:
                reports.append(watch.step(ids))
            opt.step()
        if watch is not None:
            watch.close()
        return model, watch, reports

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, watch, reports = train(True)
    # Reentrant: transformers registers its make_inputs_require_grads hook; it is not blamed on the user's code.
    assert not [w for w in said if "your code registered" in str(w.message)], [str(w.message) for w in said]
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    for report in reports:
        assert {n for n, t in report.tensors.items() if t.verdict is not None} == names
        assert {n for n, t in report.training.items() if t.verdict is not None} == names
    assert watch.alerts == [], [str(a.message)[:300] for a in watch.alerts]
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing  # still checkpoints
    plain, _, _ = train(False)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n
