"""check_independence on Hugging Face models (tiny random configs), each verdict against brute force."""

from __future__ import annotations

import pytest
import torch

from gradwatch import check_independence

# The package at collection (every pytest worker collects every module); its models when a test builds one.
T = pytest.importorskip("transformers")

VOCAB = 60


def _ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _output(model, **inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


@torch.no_grad()
def _moves(model, inputs, where, guarded) -> bool:
    """Brute force: change the ids at ``where``; do the outputs at ``guarded`` move?"""
    model.eval()
    base = _output(model, **inputs)
    ids = inputs["input_ids"].clone()
    ids[where] = (ids[where] + 7) % VOCAB
    moved = _output(model, **{**inputs, "input_ids": ids})
    return bool((base[guarded] - moved[guarded]).abs().max() > 1e-5 * base[guarded].abs().max())


def _gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32))


def _bert():
    torch.manual_seed(0)
    return T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=32))


def test_gpt2_is_causal_and_batch_independent_and_left_as_it_was():
    model = _gpt2().train()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    report = check_independence(model, {"input_ids": _ids()}, ["batch", "causal"])
    assert report.ok, str(report)
    assert "transformer.wte" in report.notes[0]
    assert model.training and all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_gpt2_with_left_padding_passes_padding_and_causal():
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    report = check_independence(_gpt2(), {"input_ids": ids, "attention_mask": mask}, ["causal", "padding"])
    assert report.ok, str(report)
    assert report.results["padding"].probes == 1


def test_bert_declared_causal_is_flagged_in_its_self_attention():
    model = _bert()
    ids = _ids()
    later = torch.zeros_like(ids, dtype=torch.bool)
    later[:, 6:] = True
    earlier = ~later
    assert _moves(model, {"input_ids": ids}, later, earlier)  # brute force: bidirectional
    report = check_independence(model, {"input_ids": ids}, "causal")
    assert not report.ok
    assert report.worst.module.startswith("encoder.layer.0.attention"), str(report)


def test_bert_with_a_padding_mask_passes_padding_and_batch():
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    model = _bert()
    assert not _moves(model, {"input_ids": ids, "attention_mask": mask}, mask == 0, mask == 1)
    report = check_independence(model, {"input_ids": ids, "attention_mask": mask}, ["padding", "batch"])
    assert report.ok, str(report)
    assert report.results["padding"].probes == 1 and report.results["batch"].probes == 2


def test_llama_sdpa_packed_sequences_get_the_verdict_brute_force_gives():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         attn_implementation="sdpa"))
    ids = _ids()
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    inputs = {"input_ids": ids, "position_ids": positions}
    first_doc = torch.zeros_like(ids, dtype=torch.bool)
    first_doc[0, :5] = True
    others = torch.zeros_like(ids, dtype=torch.bool)
    others[0, 5:] = True
    truth = _moves(model, inputs, first_doc, others)  # a later document's outputs against the first's inputs
    report = check_independence(model, inputs, ["causal", "documents"])
    assert report.results["causal"].violation is None, str(report)
    assert report.results["documents"].ok == (not truth), str(report)
    if truth:
        assert report.worst.module.startswith("model.layers.0.self_attn"), str(report)


def test_the_readme_examples_run_and_say_what_the_readme_says(capsys):
    from docs_text import page

    section = page("guides/independence.md")
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/guides/independence.md", "exec"), {})
    out = capsys.readouterr().out
    shown = section.split("```\nindependence:", 1)[1].split("```", 1)[0].splitlines()
    assert out.startswith("independence:" + shown[0])  # " LEAK (documents)"
    # the leak (which output, which input, the module; its figures to the digits this CPU's kernels give), the notes
    assert all(line.strip().split(" (gradient")[0] in out for line in shown[1:] if line.strip())
