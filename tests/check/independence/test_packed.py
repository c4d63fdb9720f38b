"""Packed sequences (issue 72, item 5): ``independence="auto"`` checks documents.

Under the Hugging Face Trainer with ``DataCollatorWithFlattening`` (one row of documents whose position ids restart at
0) and in a plain loop given position ids. A model attending across documents is alerted at the first check with the
module where the leak starts; a correct one (documents respected, or a block-diagonal 4-D mask) is clean. Every
transformers verdict is held against brute force: change the first document's tokens, look at the later documents'
logits.

transformers 5.24 masks packed documents only where ``create_causal_mask`` sees ``position_ids`` with no attention
mask and no cache; a causal LM called with ``use_cache`` true (its config's default, outside the Trainer, which sets
``config.use_cache = TrainingArguments.use_cache``, False by default) makes a ``DynamicCache`` even in training, and
then the mask is plain causal: it attends across documents. So does any 2-D ``attention_mask``, all ones included.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch, check_independence

T = pytest.importorskip("transformers")

# the tests' own pre-hook, recording the Trainer's model call, is the user's: a check does not run it, and says so
pytestmark = pytest.mark.filterwarnings("ignore:the check did not run 1 hook")

VOCAB, WIDTH = 60, 16


class DocumentAttention(nn.Module):
    """Causal self-attention over a packed row; ``respects`` keeps each position to its own document."""

    def __init__(self, respects: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.respects = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), respects

    def forward(self, x: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None]
        if self.respects:
            allowed = allowed & (docs[:, :, None] == docs[:, None, :])
        scores = (q @ k.transpose(-1, -2) / math.sqrt(WIDTH)).masked_fill(~allowed, float("-inf"))
        return self.out(scores.softmax(-1) @ v)


class PackedLM(nn.Module):
    """A model of one's own for packed rows: the documents from ``position_ids`` (restarting at 0) or ``seq_idx``."""

    def __init__(self, respects: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(64, WIDTH)
        self.attn = DocumentAttention(respects)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids, position_ids=None, seq_idx=None, labels=None, **kwargs):
        docs = (position_ids == 0).long().cumsum(-1) if seq_idx is None else seq_idx
        if position_ids is None:  # positions within each document, from its index
            starts = torch.cat([torch.ones_like(docs[:, :1]), (docs[:, 1:] != docs[:, :-1]).long()], 1)
            index = torch.arange(docs.shape[1]).expand_as(docs)
            position_ids = index - torch.cummax(index * starts, 1).values
        x = self.emb(input_ids) + self.pos(position_ids)
        logits = self.head(x + self.attn(x, docs))
        loss = None if labels is None else F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


def llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def mixtral():
    torch.manual_seed(0)
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True))


def documents(count: int = 16, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(3, 9, (count,), generator=g)]


def packed(seed: int = 0, four_d: bool = False, **collator) -> dict:
    """One row of 4 documents, as ``DataCollatorWithFlattening`` packs them; with their block-diagonal 4-D mask."""
    batch = T.DataCollatorWithFlattening(**collator)(documents(4, seed))
    if four_d:
        docs = (batch["position_ids"] == 0).long().cumsum(-1)[0]
        n = docs.shape[0]
        allowed = (docs[:, None] == docs[None]) & torch.ones(n, n, dtype=torch.bool).tril()
        batch["attention_mask"] = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
    return batch


@torch.no_grad()
def crosses(model: nn.Module, call: dict) -> bool:
    """Brute force, no gradwatch: do the later documents' logits move when the first document's tokens change?"""
    call = {k: v for k, v in call.items() if k not in ("labels", "num_items_in_batch")}
    first = int((call["position_ids"][0, 1:] == 0).nonzero()[0]) + 1
    ids = call["input_ids"].clone()
    ids[0, :first] = (ids[0, :first] + 7) % VOCAB
    was = model.training
    model.eval()
    a = model(**call)["logits"][0, first:]
    b = model(**{**call, "input_ids": ids})["logits"][0, first:]
    model.train(was)
    return bool((a - b).abs().max() > 1e-5 * a.abs().max())


def checks_of(folder) -> list:
    lines = next(folder.rglob("checks.jsonl")).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "check"]


def leaks(watch) -> list:
    return [a for a in watch.alerts if a.kind == "independence"]


# ---------------------------------------------------------------- under the Trainer


def train(model: nn.Module, folder, watched: bool = True, steps: int = 2, **args):
    """``steps`` of the Trainer on packed rows (``DataCollatorWithFlattening``), with ``GradWatchCallback()`` as it comes,
    and the model call of its first step."""
    from gradwatch.integrations.transformers import GradWatchCallback

    calls: list = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)) if m.training and not calls else None,
                                    with_kwargs=True)
    callback = GradWatchCallback() if watched else None
    arguments = T.TrainingArguments(output_dir=str(folder), max_steps=steps, per_device_train_batch_size=4,
                                    use_cpu=True, disable_tqdm=True, seed=0, report_to=[], save_strategy="no",
                                    logging_steps=100, **args)
    T.Trainer(model=model, args=arguments, train_dataset=documents(), data_collator=T.DataCollatorWithFlattening(),
              callbacks=[callback] if callback else []).train()
    return callback.watch if callback else None, calls[0]


def test_a_model_of_ones_own_attending_across_documents_is_alerted_at_the_first_check_under_the_trainer(tmp_path):
    watch, call = train(PackedLM(respects=False), tmp_path)
    assert crosses(PackedLM(respects=False), call) and set(call) >= {"input_ids", "position_ids", "labels"}
    alerts = leaks(watch)
    assert alerts and alerts[0].step == 0 and alerts[0].tensor == "attn", [str(a) for a in watch.alerts]
    assert "documents independence broken" in alerts[0].message and "another document" in alerts[0].message
    assert "called again" not in alerts[0].message  # a model of one's own: no other call of it is tried
    records = checks_of(tmp_path)
    assert records[0]["independence"]["structures"]["documents"]["violation"]["module"] == "attn"
    assert set(records[0]["independence"]["structures"]) == {"documents"}  # not a causal LM of transformers


def test_the_model_respecting_documents_is_clean_and_trains_bit_identically(tmp_path):
    watched = PackedLM(respects=True)
    watch, call = train(watched, tmp_path / "watched")
    plain = PackedLM(respects=True)
    train(plain, tmp_path / "plain", watched=False)
    assert not crosses(watched, call)
    assert not leaks(watch), [str(a) for a in watch.alerts]
    records = checks_of(tmp_path / "watched")
    assert records and all(r["independence"]["structures"]["documents"]["ok"] for r in records)
    assert records[0]["independence"]["structures"]["documents"]["probes"] == 4  # 4 documents a row: 2 bits
    for (name, a), b in zip(watched.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("use_cache", [False, True], ids=["trainer-defaults", "use_cache"])
def test_mixtral_under_the_trainer_gets_the_verdict_brute_force_gives(use_cache, tmp_path):
    model = mixtral()
    watch, call = train(model, tmp_path, use_cache=use_cache)
    truth = crosses(model, call)  # as the Trainer ran it: config.use_cache = TrainingArguments.use_cache
    assert truth == use_cache, f"transformers {T.__version__}: packed documents masked only without a cache"
    records = checks_of(tmp_path)
    assert set(records[0]["independence"]["structures"]) == {"causal", "documents"}
    alerts = leaks(watch)
    assert bool(alerts) == truth, [str(a) for a in watch.alerts]
    if truth:
        assert alerts[0].step == 0 and alerts[0].tensor == "model.layers.0.self_attn", str(alerts[0])
        assert "called again with use_cache=False, the documents are independent" in alerts[0].message
    assert not [a for a in watch.alerts if a.kind in ("error", "paused")], [str(a) for a in watch.alerts]


# ---------------------------------------------------------------- a plain loop


def loop(model: nn.Module, batches: list):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = GradWatch(model, lambda m, b: m(**b)["loss"], optimizer=opt, every=1, tensorboard=False, jsonl=False)
    reports = []
    for batch in batches:
        opt.zero_grad()
        model(**batch)["loss"].backward()
        reports.append(watch.step(batch))
        opt.step()
    watch.close()
    return watch, reports


@pytest.mark.parametrize("four_d", [False, True], ids=["position-ids", "block-diagonal-mask"])
def test_llama_in_a_plain_loop_gets_the_verdict_brute_force_gives(four_d):
    model = llama()  # its config's use_cache, True: a DynamicCache in training too
    batches = [packed(seed, four_d=four_d) for seed in range(2)]
    truth = crosses(model, batches[0])
    watch, reports = loop(model, batches)
    assert set(reports[0].independence.results) == {"causal", "documents"}
    assert reports[0].independence.results["documents"].ok == (not truth), str(reports[0].independence)
    alerts = leaks(watch)
    assert bool(alerts) == truth
    if truth:
        assert alerts[0].step == 0 and alerts[0].tensor == "model.layers.0.self_attn"
    if four_d:
        assert any("shape (1, 1, " in n and "not read as a padding mask" in n for n in reports[0].independence.notes)


def test_auto_checks_documents_of_a_model_of_ones_own_in_a_plain_loop():
    batches = [packed(seed) for seed in range(2)]
    watch, reports = loop(PackedLM(respects=False), batches)
    assert set(reports[0].independence.results) == {"documents"}
    assert [(a.step, a.tensor) for a in leaks(watch)] == [(0, "attn")]
    _, reports = loop(PackedLM(respects=True), batches)
    assert all(r.independence.ok for r in reports)


# ---------------------------------------------------------------- where the documents are read


def test_the_collators_three_forms_give_the_same_documents():
    from gradwatch.check.independence.structures import packed_documents

    forms = [packed(), packed(return_position_ids=False, return_seq_idx=True),
             packed(return_position_ids=False, return_flash_attn_kwargs=True)]
    docs = [packed_documents(f) for f in forms]
    assert docs[0].tolist() == docs[1].tolist() == docs[2].tolist() and int(docs[0].max()) == 3


@pytest.mark.parametrize("respects", [False, True])
def test_documents_are_read_from_seq_idx_without_position_ids(respects):
    call = packed(return_position_ids=False, return_seq_idx=True)
    call.pop("labels")
    assert "position_ids" not in call
    report = check_independence(PackedLM(respects), call, "documents")
    assert report.ok == respects, str(report)
    assert report.results["documents"].probes == 4
    if not respects:
        assert report.worst.module == "attn"


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_leak_through_an_all_ones_mask_says_the_call_that_has_none(use_cache):
    call = packed()
    call.pop("labels")
    call = {**call, "attention_mask": torch.ones_like(call["input_ids"]), "use_cache": use_cache}
    model = llama()
    assert crosses(model, call)
    report = check_independence(model, call, "documents")
    fix = "without its all-ones attention_mask" + (" and with use_cache=False" if use_cache else "")
    assert f"called again {fix}, the documents are independent" in report.worst.describe(), str(report)
    padded = {**call, "attention_mask": call["attention_mask"].clone()}
    padded["attention_mask"][0, -1] = 0  # a padded position: the mask is kept, and with it the leak
    report = check_independence(model, padded, "documents")
    assert not report.ok and report.worst.remedy is None, str(report)


def test_padding_with_a_four_d_mask_is_refused_with_its_shape():
    call = packed(four_d=True)
    with pytest.raises(ValueError, match=r"'padding' needs a \[batch, sequence\] padding mask.*shape \(1, 1, 2"):
        check_independence(llama(), call, ["documents", "padding"])


def test_auto_on_a_packed_batch_a_loss_fn_never_calling_the_model_is_left_alone():
    model = PackedLM(respects=False)

    def by_parts(m, batch):  # the model's modules called one by one: no model call to check
        x = m.emb(batch["input_ids"]) + m.pos(batch["position_ids"])
        return m.head(x + m.attn(x, (batch["position_ids"] == 0).long().cumsum(-1))).logsumexp(-1).mean()

    watch = GradWatch(model, by_parts, every=1, tensorboard=False, jsonl=False)
    batch = packed()
    by_parts(model, batch).backward()
    report = watch.step(batch)
    watch.close()
    assert report.independence is None and not [n for n in report.notes if "independence" in n], report.notes


@pytest.mark.slow  # TRL at its defaults (bf16 autocast, checkpointing, its fused LM head): about 8 s
def test_trl_padding_free_sft_is_checked_by_document_and_clean(tmp_path):
    pytest.importorskip("trl")
    from test_trl import texts, tiny_llama, tokenizer
    from trl import SFTConfig, SFTTrainer

    from gradwatch.integrations.transformers import GradWatchCallback

    model = tiny_llama()
    calls: list = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)) if not calls else None, with_kwargs=True)
    callback = GradWatchCallback(every=1, tensorboard=False)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                     disable_tqdm=True, logging_steps=100, save_strategy="no", seed=0, padding_free=True, max_length=None)
    SFTTrainer(model=model, args=args, train_dataset=texts(), processing_class=tokenizer(), callbacks=[callback]).train()
    call = {k: v for k, v in calls[0].items() if k != "fused_lm_head"}  # the logits, not the labels' log-probabilities
    assert call["position_ids"].shape[0] == 1 and call["use_cache"] is False  # TRL's compute_loss says so
    assert not crosses(model, call)
    records = checks_of(tmp_path)
    assert len(records) == 2 and all(set(r["independence"]["structures"]) == {"causal", "documents"} for r in records)
    assert all(r["independence"]["ok"] for r in records) and not leaks(callback.watch)
