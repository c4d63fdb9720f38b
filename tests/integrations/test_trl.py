"""GradWatchCallback in real TRL ``SFTTrainer`` runs at TRL's defaults, on CPU.

TRL's defaults are what a user gets: bf16 autocast (accelerate wraps the model's forward in it), gradient
checkpointing, its fused LM head (a chunked log-prob ``autograd.Function`` that accumulates in float32 buffers and
reads the autocast dtype), its own division by ``num_items_in_batch``, and transformers' input-grad hook. A tiny
Llama on padded, variable-length texts with a word-level tokenizer built here (no download).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from datasets import Dataset  # noqa: E402
from helpers import WrongSilu  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from gradwatch.integrations.transformers import GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

pytestmark = pytest.mark.slow  # real TRL trainers, each check a few seconds

WORDS = [f"w{i}" for i in range(120)]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def texts(n: int = 24) -> Dataset:
    """Texts of 3 to 15 words: every batch is padded, and its rows hold different numbers of target tokens."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 16, (n,), generator=g).tolist()
    return Dataset.from_dict({"text": [" ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (k,), generator=g).tolist())
                                       for k in lengths]})


def tiny_llama(buggy: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=None))
    if buggy:
        model.model.layers[0].mlp.act_fn = WrongSilu()
    return model


def sft(tmp_path, callback, model, max_steps):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, use_cpu=True,
                     report_to=[], disable_tqdm=True, logging_steps=100, save_strategy="no", seed=0)
    # TRL's defaults, which the test is about (a newer TRL changing them should fail here, not pass unseen)
    assert args.bf16
    assert args.gradient_checkpointing
    assert args.loss_type == "nll"
    trainer = SFTTrainer(model=model, args=args, train_dataset=texts(), processing_class=tokenizer(), callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in caught]


def test_sft_trainer_at_its_defaults_both_verdicts_on_every_tensor_and_no_alert(tmp_path):
    # the objective form named: which form a run takes is timed (a trial of the whole objective, TRIAL_SECONDS), and
    # under a test suite's workers this check's 2 s went over it and the form switched to modules
    callback = GradWatchCallback(every=1, tensorboard=False, form="objective")
    model = tiny_llama()
    trainer, said = sft(tmp_path, callback, model, max_steps=4)
    assert trainer.args.bf16 and model.is_activation_checkpointing  # checked at TRL's defaults, as trained
    assert callback.watch.paused is None and callback.watch.alerts == [], [a.message for a in callback.watch.alerts]
    checks = [c for c in read_jsonl(tmp_path / "checks.jsonl")[0] if c["type"] == "check"]
    assert [c["step"] for c in checks] == [0, 1, 2, 3]
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    for c in checks:
        assert set(c["tensors"]) == names and set(c["training"]) == names
        assert {n: t["verdict"] for n, t in c["tensors"].items() if t["verdict"] not in ("excellent", "acceptable")} == {}
        assert {n: t["verdict"] for n, t in c["training"].items() if t["verdict"] not in ("excellent", "acceptable")} == {}
        # TRL's fused LM head computed in float64 in the check: no low-precision island left
        assert not any("still computes in" in n for n in c["notes"]), c["notes"]
        assert c["independence"]["ok"] and {"causal", "padding"} <= set(c["independence"]["structures"]), c["notes"]
    assert not any("hook(s) your code registered" in s for s in said)


def test_sft_trainer_a_planted_wrong_backward_is_named(tmp_path):
    callback = GradWatchCallback(every=1, tensorboard=False, independence=None)
    trainer, _ = sft(tmp_path, callback, tiny_llama(buggy=True), max_steps=1)
    named = {n for a in callback.watch.alerts if a.kind == "threshold" and a.part == "backward" for n in a.names}
    assert "model.layers.0.mlp.gate_proj.weight" in named, [a.message for a in callback.watch.alerts]
    assert not [a for a in callback.watch.alerts if a.part == "training"]  # .grad is what the buggy backward gives


def preferences(n: int = 8) -> Dataset:
    g = torch.Generator().manual_seed(1)

    def words(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    return Dataset.from_dict({"prompt": [words(2, 6) for _ in range(n)], "chosen": [words(2, 8) for _ in range(n)],
                              "rejected": [words(2, 8) for _ in range(n)]})


def test_dpo_trainer_its_loss_is_the_objective_and_its_metrics_are_left_as_they_were(tmp_path):
    """DPO's loss compares the policy's log-probabilities with a reference model's: no model returns it. The objective is
    the trainer's own compute_loss; the metrics it appends at every call (hundreds in a check) are put back."""
    from trl import DPOConfig, DPOTrainer

    def run(callbacks):
        args = DPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True,
                         report_to=[], disable_tqdm=True, logging_steps=1, save_strategy="no", seed=0)
        trainer = DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=args, train_dataset=preferences(),
                             processing_class=tokenizer(), callbacks=callbacks)
        trainer.train()
        return trainer

    callback = GradWatchCallback(every=1, coords=2, directions=1, tensorboard=False)  # few samples: the loss is the point
    watched, plain = run([callback]), run([])
    assert callback.watch.alerts == [], [a.message for a in callback.watch.alerts]
    assert repr(callback.watch.loss_fn) == "ComputeLoss(DPOTrainer.compute_loss)"
    checks = [c for c in read_jsonl(tmp_path / "checks.jsonl")[0] if c["type"] == "check"]
    assert [c["step"] for c in checks] == [0]
    for c in checks:
        assert {n: t["verdict"] for n, t in c["tensors"].items() if t["verdict"] not in ("excellent", "acceptable")} == {}
        assert {n: t["verdict"] for n, t in c["training"].items() if t["verdict"] not in ("excellent", "acceptable")} == {}
    logged = [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k} for h in watched.state.log_history]
    assert logged == [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
                      for h in plain.state.log_history]  # the loss, rewards, accuracies, as training logged them


def grpo(tmp_path, callback, model, max_steps):
    from trl import GRPOConfig, GRPOTrainer

    prompts = Dataset.from_dict({"prompt": preferences(8)["prompt"]})

    def longer_is_better(completions, **kwargs):
        return [len(c.split()) / 8 for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=100,
                      save_strategy="no", seed=0)
    assert args.bf16 and args.gradient_checkpointing
    trainer = GRPOTrainer(model=model, reward_funcs=longer_is_better, args=args, train_dataset=prompts,
                          processing_class=tokenizer(), callbacks=[callback])
    trainer.train()
    return trainer


def test_grpo_trainer_its_on_policy_surrogate_is_checked_at_the_checks_point(tmp_path):
    """GRPO's loss on-policy is exp(logp - logp.detach()) times the advantages: its value never moves while its
    gradient is the policy gradient. The check holds the log-probabilities at its point, as an earlier policy's:
    both verdicts, no false 'surrogate' alert; a wrong backward is still named."""
    callback = GradWatchCallback(every=1, coords=2, directions=1, tensorboard=False, independence=None)
    grpo(tmp_path / "clean", callback, tiny_llama(), max_steps=1)
    assert callback.watch.alerts == [], [a.message for a in callback.watch.alerts]
    (c,) = [c for c in read_jsonl(tmp_path / "clean" / "checks.jsonl")[0] if c["type"] == "check"]
    assert {n: t["verdict"] for n, t in c["tensors"].items() if t["verdict"] not in ("excellent", "acceptable")} == {}
    assert {n: t["verdict"] for n, t in c["training"].items() if t["verdict"] not in ("excellent", "acceptable")} == {}
    buggy = GradWatchCallback(every=1, coords=2, directions=1, tensorboard=False, independence=None)
    grpo(tmp_path / "buggy", buggy, tiny_llama(buggy=True), max_steps=1)
    named = {n for a in buggy.watch.alerts if a.kind == "threshold" and a.part == "backward" for n in a.names}
    assert "model.layers.0.mlp.gate_proj.weight" in named, [a.message for a in buggy.watch.alerts]
