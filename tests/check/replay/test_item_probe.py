"""The item probe (which count ``loss_fn`` follows) wherever the training verdict works: under gradient checkpointing
of either kind, TRL's ``SFTTrainer`` at its defaults, and PEFT, with two micro-batches of unequal token counts.

The probe differentiates the live model, checkpoints and all, on batches of a few samples. Two things stood in its
way. A checkpoint recomputes its forward in backward without the torch function mode that keeps dropout off, so a
model passing its attention dropout to ``scaled_dot_product_attention`` (GPT-2's default, any config with
``attention_dropout``) recomputed other values than its forward saved: a non-reentrant checkpoint raised
``CheckpointError`` ("different metadata"), and the training verdict was "not checked" on every tensor. A reentrant
checkpoint hides its parameters from ``autograd.grad`` (torch refuses it), and with a frozen embedding (PEFT) it
differentiates nothing unless transformers' ``make_inputs_require_grads`` hook runs, which the check suspended.
Each test here failed before that was fixed (gradwatch/check/objective/checkpointed.py, guards.py).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from token_batches import Rows, collate  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from gradwatch.integrations.transformers import GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

GOOD = ("excellent", "acceptable")
VOCAB = 50


def llama(vocab: int = VOCAB, attention_dropout: float = 0.1) -> nn.Module:
    """A tiny random Llama whose attention drops out (functionally, inside ``scaled_dot_product_attention``)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        attention_dropout=attention_dropout, pad_token_id=0, eos_token_id=1,
                                        bos_token_id=None))


def checks_of(path) -> List[Dict[str, Any]]:
    return [c for c in read_jsonl(path)[0] if c["type"] == "check"]


def trainable(model: nn.Module) -> set:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def assert_both_verdicts(checks: List[Dict[str, Any]], names: set, steps: int) -> None:
    """Both verdicts on every trained tensor at every check, all good; the step weighed by its target tokens (the whole
    objective's form: the module form's cycle may judge a tensor at some checks only)."""
    assert [c["step"] for c in checks] == list(range(steps))
    for c in checks:
        assert set(c["tensors"]) == names and set(c["training"]) == names, c.get("training_note")
        assert {n: t["verdict"] for n, t in c["tensors"].items() if t["verdict"] not in GOOD} == {}
        assert {n: t["verdict"] for n, t in c["training"].items() if t["verdict"] not in GOOD} == {}
        assert c["training_items"]["rule"] == "target tokens (labels[..., 1:] != -100)", c["training_items"]
    assert any(len(set(c["training_items"]["counts"][0])) > 1 for c in checks)  # unequal counts: the probe decided


def trainer_run(tmp_path, model: nn.Module, callbacks=(), reentrant: bool = False, steps: int = 3) -> Trainer:
    """The plain Trainer, two micro-batches per step, the model's gradient checkpointing of the given kind."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, use_cpu=True, disable_tqdm=True, seed=0, report_to=[],
                             save_strategy="no", logging_steps=100, gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    trainer = Trainer(model=model, args=args, train_dataset=Rows(vocab=VOCAB, longest=16), data_collator=collate,
                      callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def assert_trained_alike(model: nn.Module, plain: nn.Module) -> None:
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_under_the_trainer_with_accumulation_both_verdicts_no_alert_training_bit_identical(
        tmp_path, reentrant):
    model = llama()
    model_plain = copy.deepcopy(model)
    callback = GradWatchCallback(every=1, tensorboard=False, independence=None, form="objective",
                                 log_dir=str(tmp_path / "run"))
    trainer_run(tmp_path / "watched", model, [callback], reentrant=reentrant)
    assert model.is_gradient_checkpointing
    assert callback.watch.alerts == [], [a.message[:300] for a in callback.watch.alerts]
    assert_both_verdicts(checks_of(tmp_path / "run" / "checks.jsonl"), trainable(model), 3)
    trainer_run(tmp_path / "plain", model_plain, reentrant=reentrant)
    assert_trained_alike(model, model_plain)


def test_lora_with_reentrant_checkpointing_and_accumulation_both_verdicts_no_alert_training_bit_identical(tmp_path):
    """A frozen embedding: the reentrant checkpoints differentiate the adapters inside them only through the hook
    transformers registers (``enable_input_require_grads``), in the probe and in the replay as in training."""
    peft = pytest.importorskip("peft")

    def lora() -> nn.Module:
        return peft.get_peft_model(llama(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                            target_modules=["q_proj", "v_proj", "up_proj"]))

    model, model_plain = lora(), lora()
    callback = GradWatchCallback(every=1, tensorboard=False, independence=None, form="objective",
                                 log_dir=str(tmp_path / "run"))
    trainer_run(tmp_path / "watched", model, [callback], reentrant=True)
    names = trainable(model)
    assert len(names) == 6 and len(list(model.parameters())) > len(names)
    assert callback.watch.paused is None and callback.watch.alerts == [], [a.message[:300] for a in callback.watch.alerts]
    assert_both_verdicts(checks_of(tmp_path / "run" / "checks.jsonl"), names, 3)
    trainer_run(tmp_path / "plain", model_plain, reentrant=True)
    assert_trained_alike(model, model_plain)


def sft(tmp_path, model: nn.Module, callbacks, trainer_class: Any = None, steps: int = 4, texts_count: int = 40):
    """TRL's SFTTrainer at its defaults (bf16, gradient checkpointing, its loss over num_items_in_batch), two
    micro-batches of padded texts per step."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from test_trl import texts, tokenizer
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=100,
                     save_strategy="no", seed=0)
    # TRL's defaults
    assert args.bf16
    assert args.gradient_checkpointing
    assert args.loss_type == "nll"
    trainer = (trainer_class or SFTTrainer)(model=model, args=args, train_dataset=texts(texts_count),
                                            processing_class=tokenizer(), callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


@pytest.mark.slow  # a TRL run of 6 checked steps
def test_sft_trainer_at_its_defaults_with_accumulation_both_verdicts_on_every_tensor_no_alert(tmp_path):
    """The training verdict judged in the precision the model computed in: accelerate opens bf16 autocast inside the
    model's forward, where training's recorded forward does not see it. Weighing the step's micro-batches (each one's
    token mean times n_i / N, training's sum over N) can round a bfloat16 value the other way: at the 5th check here
    gate_proj's rel_diff is 1.4e-4, rounding at bfloat16's tolerance, a SUSPICIOUS alert at float32's."""
    from test_trl import WORDS

    model = llama(vocab=len(WORDS) + 3)
    # the watch's defaults but the form: "auto" times a module-form trial where a whole-objective check took 5 s,
    # which a loaded machine can make this small model's first check take (on CI: the module form, paced, lm_head
    # and the root's outputs alone at a check)
    callback = GradWatchCallback(every=1, tensorboard=False, form="objective", log_dir=str(tmp_path / "run"))
    sft(tmp_path / "watched", model, [callback], steps=6, texts_count=60)
    assert model.is_gradient_checkpointing
    assert callback.watch.paused is None and callback.watch.alerts == [], [a.message[:300] for a in callback.watch.alerts]
    checks = checks_of(tmp_path / "run" / "checks.jsonl")
    assert_both_verdicts(checks, trainable(model), 6)
    assert {t["dtype"] for c in checks for t in c["training"].values()} == {"bfloat16"}


@pytest.mark.slow  # a TRL run of 4 checked steps
def test_sft_trainer_counting_its_micro_batches_alike_is_alerted_at_its_defaults(tmp_path):
    """A compute_loss that leaves out num_items_in_batch: each micro-batch's own token mean, the two added (the
    Trainer divides nothing, the model takes loss kwargs). The probe finds the token count; training's gradient is not
    the step's objective's, and the alert says the micro-batches were weighed alike."""
    from test_trl import WORDS
    from trl import SFTTrainer

    class OwnCount(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=None)

    callback = GradWatchCallback(every=1, tensorboard=False, independence=None, form="objective",
                                 log_dir=str(tmp_path / "run"))
    sft(tmp_path / "watched", llama(vocab=len(WORDS) + 3), [callback], trainer_class=OwnCount)
    training = [a for a in callback.watch.alerts if a.part == "training" and a.kind != "not_checked"]
    assert training, [a.message[:300] for a in callback.watch.alerts]
    assert any("micro-batch" in a.message for a in training), [a.message[:400] for a in training]
    checks = checks_of(tmp_path / "run" / "checks.jsonl")
    assert all(c["training_items"]["rule"] == "target tokens (labels[..., 1:] != -100)" for c in checks)
