"""GradWatchCallback on PEFT LoRA models in real ``transformers.Trainer`` and TRL ``SFTTrainer`` runs, on CPU.

``get_peft_model`` on a tiny random Llama: the base model is frozen, the LoRA tensors train. Only trainable
tensors get verdicts (both, at every check), named as the PEFT model's ``named_parameters()`` names them; the
frozen base model is still differentiated through, so a wrong backward in it is named on the adapters upstream of
it. Padded, variable-length token rows (labels -100 on padding), two micro-batches per optimizer step.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")
from helpers import WrongSilu  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from token_batches import Rows, collate  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from gradwatch import GradWatch  # noqa: E402
from gradwatch.integrations.transformers import GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

GOOD = ("excellent", "acceptable")
# PEFT's default targets for Llama are q_proj and v_proj; up_proj's adapter is one whose gradient does not pass
# through the MLP's activation (its output is multiplied by act_fn(gate_proj(x))).
TARGETS = ["q_proj", "v_proj", "up_proj"]


def lora_llama(buggy: bool = False, task_type: Optional[str] = "CAUSAL_LM") -> nn.Module:
    """A tiny random Llama (vocabulary 50) with LoRA adapters on TARGETS; ``buggy``: the frozen MLP's SiLU is wrong."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    if buggy:
        base.model.layers[0].mlp.act_fn = WrongSilu()
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=TARGETS,
                                           task_type=task_type))


def train(output_dir, model, callbacks=(), max_steps=3, **kwargs):
    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, use_cpu=True, disable_tqdm=True, seed=0, report_to=[],
                             save_strategy="no", logging_steps=100, **kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(vocab=50, longest=16), data_collator=collate,
                      callbacks=list(callbacks))
    trainer.train()
    return trainer


def checks_of(path):
    return [c for c in read_jsonl(path)[0] if c["type"] == "check"]


def trainable(model: nn.Module) -> set:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """3 optimizer steps of the Trainer on a LoRA model, checked at every step."""
    out = tmp_path_factory.mktemp("lora")
    callback = GradWatchCallback(every=1, tensorboard=False)
    model = lora_llama()
    train(out, model, [callback])
    return callback, model, checks_of(out / "checks.jsonl")


def test_lora_under_the_trainer_both_verdicts_on_every_adapter_tensor_no_alert(lora_run, tmp_path):
    callback, model, checks = lora_run
    names = trainable(model)
    assert len(names) == 2 * len(TARGETS) and all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert len(list(model.parameters())) > len(names)  # the frozen base model
    assert callback.watch.paused is None and callback.watch.alerts == [], [a.message for a in callback.watch.alerts]
    assert [c["step"] for c in checks] == [0, 1, 2]
    for c in checks:
        # only the trainable tensors, under the PEFT model's names; each gets both verdicts, and both agree
        assert set(c["tensors"]) == names and set(c["training"]) == names
        assert {n: t["verdict"] for n, t in c["tensors"].items() if t["verdict"] not in GOOD} == {}
        assert {n: t["verdict"] for n, t in c["training"].items() if t["verdict"] not in GOOD} == {}
        assert all(t["directional_rel_diff"] < 1e-4 for t in c["tensors"].values())
        assert c["training_items"]["rule"] == "target tokens (labels[..., 1:] != -100)"
        # a PeftModelForCausalLM is a causal LM to independence="auto"
        assert c["independence"]["ok"] and "causal" in c["independence"]["structures"], c["notes"]
    # PEFT starts every lora_B at zero: at the first check the objective does not move with any lora_A, which is
    # judged on its module alone (a note names them all); from the next check on, on the objective like the others
    [alone] = [n for n in checks[0]["notes"] if n.startswith("judged on their modules alone")]
    assert set(alone.rsplit(": ", 1)[1].split(", ")) == {n for n in names if ".lora_A." in n}
    assert not any(n.startswith("judged on their modules alone") for c in checks[1:] for n in c["notes"])
    # the check leaves training alone: the adapters end bit for bit where an unwatched run ends
    plain = train(tmp_path, lora_llama()).model
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


def test_a_wrong_backward_in_the_frozen_base_is_named_on_the_adapters_upstream(tmp_path):
    """The MLP's SiLU backward is 1.5x: the attention adapters' gradients pass through it and are named; up_proj's
    adapter, whose gradient does not, is not; .grad is what the buggy backward gives, so the training verdict agrees."""
    callback = GradWatchCallback(every=1, coords=4, directions=2, tensorboard=False, independence=None)
    model = train(tmp_path, lora_llama(buggy=True), [callback], max_steps=2).model
    alerts = [a for a in callback.watch.alerts if a.kind == "threshold"]
    named = {n for a in alerts if a.part == "backward" for n in a.names}  # one cause's alert names several (issue 73)
    attention = {n for n in trainable(model) if ".self_attn." in n}
    assert len(attention) == 4 and attention <= named, [a.message for a in alerts]
    assert not any(".up_proj." in n for n in named)
    assert not [a for a in alerts if a.part == "training"]
    # lora_B is zero at the first check: lora_A's zero gradient is right there, and the bug is named on it after
    assert all(a.step >= 1 for a in alerts if ".lora_A." in a.tensor)
    checks = checks_of(tmp_path / "checks.jsonl")
    assert max(t["rel_diff"] for c in checks for n, t in c["tensors"].items() if n in attention) > 1e-3


def test_lora_with_gradient_checkpointing_under_the_trainer(tmp_path):
    """PeftModel forwards the checkpointing switch to the model it wraps: the float64 copy turns it off there."""
    callback = GradWatchCallback(every=1, coords=2, directions=1, tensorboard=False)
    model = train(tmp_path, lora_llama(), [callback], max_steps=2, gradient_checkpointing=True).model
    assert model.is_gradient_checkpointing
    assert callback.watch.alerts == [], [a.message[:300] for a in callback.watch.alerts]
    assert all(set(c["training"]) == trainable(model) for c in checks_of(tmp_path / "checks.jsonl"))


def test_auto_independence_recognizes_a_plain_peft_model():
    """A LoraConfig without task_type gives a plain PeftModel: independence="auto" asks the model it wraps."""
    from peft import PeftModel

    model = lora_llama(task_type=None)
    assert type(model) is PeftModel
    rows = collate([{"input_ids": r} for r in Rows(n=3, vocab=50, longest=16).rows])
    watch = GradWatch(model, lambda m, batch: m(**batch).loss, log_dir=None)
    report = watch.check(rows)
    watch.close()
    assert report.independence is not None and report.independence.ok
    assert {n for n, t in report.tensors.items() if t.verdict is not None} == trainable(model)


def sft_peft(tmp_path, callback, max_steps, **kwargs):
    """TRL's SFTTrainer with ``peft_config=``: TRL wraps the model itself; bf16 autocast at TRL's defaults."""
    from test_trl import texts, tiny_llama, tokenizer
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, use_cpu=True,
                     report_to=[], disable_tqdm=True, logging_steps=100, save_strategy="no", seed=0, **kwargs)
    assert args.bf16 and args.loss_type == "nll"
    trainer = SFTTrainer(model=tiny_llama(), args=args, train_dataset=texts(), processing_class=tokenizer(),
                         callbacks=[callback], peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                                      task_type="CAUSAL_LM"))
    trainer.train()
    return trainer


def test_sft_trainer_with_peft_config_at_trls_defaults_both_verdicts_on_every_adapter_tensor_no_alert(tmp_path):
    """TRL's defaults: bf16, gradient checkpointing on the PEFT model, its fused LM head and loss."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    callback = GradWatchCallback(every=1, coords=4, directions=2, tensorboard=False)
    trainer = sft_peft(tmp_path, callback, max_steps=2)
    from peft import PeftModel

    model = trainer.model
    assert isinstance(model, PeftModel) and trainer.args.gradient_checkpointing
    names = trainable(model)
    assert len(names) == 2 * len(TARGETS)
    assert callback.watch.paused is None and callback.watch.alerts == [], [a.message[:300] for a in callback.watch.alerts]
    checks = checks_of(tmp_path / "checks.jsonl")
    assert [c["step"] for c in checks] == [0, 1]
    for c in checks:
        assert set(c["tensors"]) == names and set(c["training"]) == names
        assert {n: t["verdict"] for n, t in c["tensors"].items() if t["verdict"] not in GOOD} == {}
        assert {n: t["verdict"] for n, t in c["training"].items() if t["verdict"] not in GOOD} == {}
        assert c["independence"]["ok"] and {"causal", "padding"} <= set(c["independence"]["structures"]), c["notes"]
