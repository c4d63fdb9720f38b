"""GradWatch(independence=...): the independence check on the live batch, on the check schedule.

A real training loop on the planted token models of ``tests/independence_models.py``; alerts read
back from ``checks.jsonl``, TensorBoard event files and ``gradwatch report``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from independence_models import VOCAB, TinyLM
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradwatch import ConfigError, GradientDriftError, GradWatch, load_config
from gradwatch.cli import commands as cli
from gradwatch.io.sinks import read_jsonl


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def train(kind, steps=3, watch_options=None, seed=0):
    torch.manual_seed(seed)
    model = TinyLM(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = None if watch_options is None else GradWatch(model, loss_fn, optimizer=opt, every=1, coords=2,
                                                         directions=1, **watch_options)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (3, 10), generator=g)
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if watch is not None:
            watch.step(batch)
        opt.step()
    if watch is not None:
        watch.close()
    return model, watch


def test_a_causal_leak_is_alerted_at_the_first_check_everywhere_it_is_written(tmp_path, capsys):
    _, watch = train("causal_off_by_one", watch_options={"independence": "causal", "log_dir": str(tmp_path)})
    leaks = [a for a in watch.alerts if a.kind == "independence"]
    assert leaks
    assert leaks[0].step == 0
    assert leaks[0].tensor == "blocks.1.mixer"
    assert leaks[0].part == "independence"
    assert "causal independence broken" in leaks[0].message and "a later position" in leaks[0].message
    assert len(leaks) == 1  # the same leak stays silent for alert_cooldown checks
    records, _ = read_jsonl(tmp_path / "checks.jsonl")
    checks = [r for r in records if r["type"] == "check"]
    assert len(checks) == 3 and all(r["independence"]["ok"] is False for r in checks)
    assert checks[0]["independence"]["structures"]["causal"]["violation"]["module"] == "blocks.1.mixer"
    assert any(r["type"] == "alert" and r["kind"] == "independence" for r in records)
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("gradwatch/alerts/text_summary")]
    assert any("causal independence broken" in t for t in texts)
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "independence: causal LEAK in 3 of 3 checks (blocks.1.mixer)" in out


def test_the_correct_twin_passes_and_training_is_left_as_it_would_have_been(tmp_path):
    watched, watch = train("causal_ok", watch_options={"independence": ["causal", "batch"], "log_dir": str(tmp_path)})
    plain, _ = train("causal_ok")
    assert not [a for a in watch.alerts if a.kind == "independence"]
    for (n, a), b in zip(watched.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n
    checks = [r for r in read_jsonl(tmp_path / "checks.jsonl")[0] if r["type"] == "check"]
    assert all(r["independence"]["ok"] and set(r["independence"]["structures"]) == {"causal", "batch"} for r in checks)


def test_auto_leaves_a_model_that_is_not_a_hugging_face_causal_lm_alone(tmp_path):
    _, watch = train("causal_mask_forgotten", steps=1, watch_options={"log_dir": str(tmp_path)})
    assert watch.config.independence == "auto"
    assert not [a for a in watch.alerts if a.kind == "independence"]
    assert [r["independence"] for r in read_jsonl(tmp_path / "checks.jsonl")[0] if r["type"] == "check"] == [None]


def test_raise_on_raises_for_a_leak():
    with pytest.raises(GradientDriftError, match="causal independence broken"):
        train("causal_mask_forgotten", steps=1, watch_options={"independence": "causal", "raise_on": "wrong",
                                                                 "tensorboard": False, "jsonl": False})


def test_the_option_is_validated_with_one_name_everywhere(tmp_path):
    model = TinyLM("causal_ok")
    with pytest.raises(ConfigError, match="independence: got 'casual'.*auto, off, null.*batch, causal"):
        GradWatch(model, loss_fn, independence="casual")
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({"independence": ["causal", "padding"]}))
    assert load_config(path).independence == ["causal", "padding"]
    path.write_text(yaml.safe_dump({"independence": "off"}))
    assert load_config(path).independence is None


def test_a_loss_fn_that_never_calls_the_model_is_said_not_checked(tmp_path):
    torch.manual_seed(0)
    model = TinyLM("causal_ok")

    def by_parts(m, batch):
        x = m.emb(batch)
        for block in m.blocks:
            x = block(x, None, None)
        return m.head(x).logsumexp(-1).mean()

    watch = GradWatch(model, by_parts, every=1, coords=2, directions=1, independence="causal", log_dir=str(tmp_path))
    batch = torch.randint(0, VOCAB, (2, 6))
    by_parts(model, batch).backward()
    report = watch.step(batch)
    assert report.independence is None
    assert any("independence not checked: loss_fn never calls the model" in n for n in report.notes)
    watch.close()


def test_the_cooldown_survives_a_resume():
    _, watch = train("causal_off_by_one", steps=1, watch_options={"independence": "causal", "tensorboard": False,
                                                                   "jsonl": False})
    state = watch.state_dict()
    torch.manual_seed(0)
    model = TinyLM("causal_off_by_one")
    again = GradWatch(model, loss_fn, every=1, coords=2, directions=1, independence="causal", tensorboard=False,
                      jsonl=False)
    again.load_state_dict(state)
    batch = torch.randint(0, VOCAB, (3, 10))
    loss_fn(model, batch).backward()
    again.step(batch)
    leaks = [a for a in again.alerts if a.kind == "independence"]
    assert [a.step for a in leaks] == [0]  # the first run's alert, restored; the same leak silent within alert_cooldown
    again.close()


def test_structures_within_a_sample_are_checked_on_the_first_two_samples_and_a_leak_still_found():
    # Each probe is a backward pass of the model: a causal or padding leak is the model's code, the same in every sample,
    # so a batch of 6 is checked on its first 2 (TRL's first check: 18 backward passes of a batch of 4 took 40.8 s of 56)
    runs = {}
    for kind in ("causal_off_by_one", "causal_ok"):
        torch.manual_seed(0)
        model = TinyLM(kind)
        watch = GradWatch(model, loss_fn, every=1, coords=2, directions=1, independence="causal", tensorboard=False,
                          jsonl=False, log_dir=None)
        batch = torch.randint(0, VOCAB, (6, 10), generator=torch.Generator().manual_seed(1))
        loss_fn(model, batch).backward()
        report = watch.step(batch)
        runs[kind] = (report.independence, [a for a in watch.alerts if a.kind == "independence"])
        watch.close()
    found, leaks = runs["causal_off_by_one"]
    assert "independence checked on the batch's first 2 of 6 samples (a leak within a sample is the model's code)" \
        in found.notes
    assert leaks and leaks[0].tensor == "blocks.1.mixer"
    clean, none = runs["causal_ok"]
    assert clean.ok
    assert none == []
    assert any("first 2 of 6" in n for n in clean.notes)
