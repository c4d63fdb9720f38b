"""A library's own hooks are part of its model (issue 72, item 1).

transformers 5 collects MoE router logits with forward hooks of its own (``output_capturing_hook``), and the model's
loss reads them (``load_balancing_loss_func``). A check that suspended every hook not torch's broke that loss
(``IndexError: tuple index out of range`` at every check, then the watch paused). Hooks whose code is an installed
library's, one that makes the model, now run in every evaluation of a check, on the shadow and on the live model;
the user's own hooks (a script, a test file, the user's project) are still suspended and named. Tiny random
Mixtral, Qwen2-MoE and OLMoE models from transformers, on CPU.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.utils import output_capturing  # noqa: E402

import gradwatch  # noqa: E402
from gradwatch.check.objective.guards import HookRule, LiveIsolation, suspended_hooks  # noqa: E402
from gradwatch.check.objective.library_code import library_of  # noqa: E402
from gradwatch.check.probes.experts import expert_of  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

#: A large aux coefficient, so that a loss without the router logits (the hooks suspended) is far from one with them.
AUX = 0.5
COMMON = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, output_router_logits=True, max_position_embeddings=32, router_aux_loss_coef=AUX)


def tiny_moe(kind: str) -> nn.Module:
    """A random 2-layer, 4-expert, top-2 model of transformers' ``kind`` (about 35k parameters)."""
    torch.manual_seed(0)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=4, **COMMON))
    if kind == "qwen2_moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                                                  shared_expert_intermediate_size=32, decoder_sparse_step=1, **COMMON))
    return OlmoeForCausalLM(OlmoeConfig(intermediate_size=32, num_experts=4, eos_token_id=None, **COMMON))


KINDS = ["mixtral", "qwen2_moe", "olmoe"]


def padded_batch(seed: int = 0, rows: int = 2, seq: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, seq - 2:] = 0  # padded: load_balancing_loss_func takes the mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def model_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def counting_hook(calls: list):
    def users_hook(module, args, output):  # defined in a test file: the user's code
        calls.append(1)
    return users_hook


# ---------------------------------------------------------------- whose code a hook is


@pytest.fixture
def libraries(tmp_path):
    """Two packages installed in a site-packages directory (one makes a module, one only observes) and a package of
    the user's own project (an editable install keeps its files there)."""
    site = tmp_path / "env" / "lib" / "site-packages"
    project = tmp_path / "project" / "src"
    files = {
        site / "moelib" / "__init__.py": """
            from torch import nn

            class Router(nn.Linear):
                def __init__(self):
                    super().__init__(3, 2)
                    self.seen = []
                    self.register_forward_hook(collect)

            def collect(module, args, output):  # what the library's model returns reads it
                module.seen.append(output.shape)
        """,
        site / "observer" / "__init__.py": """
            calls = []

            def watch(model):
                model.register_forward_hook(lambda module, args, output: calls.append(1))
        """,
        project / "mine" / "__init__.py": """
            def my_hook(module, args, output):
                pass
        """,
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    sys.path[:0] = [str(site), str(project)]
    try:
        yield {name: importlib.import_module(name) for name in ("moelib", "observer", "mine")}
    finally:
        sys.path.remove(str(site))
        sys.path.remove(str(project))
        for name in ("moelib", "observer", "mine"):
            sys.modules.pop(name, None)


def test_library_of_tells_installed_code_from_the_users(libraries):
    assert library_of(libraries["moelib"].collect) == "moelib"
    assert library_of(libraries["mine"].my_hook) is None  # the user's project, an editable install included
    assert library_of(counting_hook([])) is None  # a test file
    assert library_of(lambda m, i, o: None) is None
    namespace: dict = {}
    exec("def hook(m, i, o): pass", namespace)  # a notebook cell or exec'd code
    assert library_of(namespace["hook"]) is None
    mixtral = tiny_moe("mixtral")
    mixtral(**padded_batch())  # transformers installs its capturing hooks at the first call
    installed = [h for m in mixtral.modules() for h in m._forward_hooks.values()]
    assert installed and {library_of(h) for h in installed} == {"transformers"}
    assert library_of(output_capturing.install_output_capuring_hook) == "transformers"
    assert library_of(torch.nn.functional.relu) == "torch" and library_of(len) == "builtins"


def test_a_library_hook_runs_on_the_model_it_made_and_an_observer_library_is_suspended(libraries):
    moelib, observer = libraries["moelib"], libraries["observer"]
    model = nn.Sequential(moelib.Router(), nn.Tanh())
    observer.watch(model)  # an installed library's hook on a model it did not make: a logger's watch()
    calls: list = []
    model.register_forward_hook(counting_hook(calls))
    with suspended_hooks(model) as names:
        model(torch.ones(1, 3))
    assert model[0].seen == [torch.Size([1, 2])]  # the model's own library: ran
    assert observer.calls == [] and calls == []  # the observer and the user's: suspended
    assert names == ["forward hook <lambda> (observer) on the model", "forward hook users_hook on the model"]
    rule = HookRule(list(model.modules()))
    assert rule.packages() >= {"moelib", "torch"}
    with LiveIsolation(list(model.modules())):
        model(torch.ones(1, 3))
    assert len(model[0].seen) == 2
    assert observer.calls == []
    assert calls == []
    model(torch.ones(1, 3))  # every hook back in its place
    assert len(model[0].seen) == 3
    assert observer.calls == [1]
    assert calls == [1]


# ---------------------------------------------------------------- the MoE models' own loss inside a check


@pytest.mark.parametrize("kind", KINDS)
def test_the_moe_loss_with_its_router_logits_runs_with_user_hooks_suspended(kind):
    model = tiny_moe(kind)
    batch = padded_batch()
    expected = model(**batch)
    calls: list = []
    model.model.layers[0].mlp.register_forward_hook(counting_hook(calls))
    for isolation in (lambda: suspended_hooks(model), lambda: LiveIsolation(list(model.modules()))):
        with isolation() as names:
            out = model(**batch)  # IndexError in load_balancing_loss_func when transformers' hooks were suspended
        assert calls == []
        assert torch.equal(out.loss, expected.loss) and torch.equal(out.aux_loss, expected.aux_loss)
        if isinstance(names, list):
            assert names == ["forward hook users_hook on model.layers.0.mlp"]


@pytest.mark.parametrize("kind", KINDS)
def test_check_model_of_an_moe_with_its_own_loss_runs_in_float64(kind):
    model = tiny_moe(kind)
    model.train()
    batch = padded_batch()
    calls: list = []
    model.model.layers[1].mlp.register_forward_hook(counting_hook(calls))
    with pytest.warns(UserWarning, match="users_hook on model.layers.1.mlp"):
        report = gradwatch.check_model(model, model_loss, batch, coords=2, directions=1)
    assert calls == []
    assert report.ok, str(report)
    # The objective holds the aux loss, which only the router logits transformers' hooks collect can give.
    with torch.no_grad():
        out = model(**batch)
    assert report.objective == pytest.approx(float(out.loss), rel=1e-6)
    assert abs(report.objective - (float(out.loss) - AUX * float(out.aux_loss))) > 0.1
    assert report.dtype == "float64"
    assert any("mixed_dtypes" in k for k in report.precision) and report.precision["mixed_dtypes"]  # the aux loss's
    assert not [n for n in report.notes if "IndexError" in n]


# ---------------------------------------------------------------- a run: the HF Trainer and a plain loop


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 100, (n, seq), generator=g)
        self.lengths = torch.randint(5, seq + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[i]).long()  # right padding, variable lengths
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.ids[i].masked_fill(mask == 0, -100)}


def train(kind: str, tmp_path, callbacks=(), steps: int = 3):
    model = tiny_moe(kind)
    calls: list = []
    model.model.layers[0].mlp.register_forward_hook(counting_hook(calls))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
                             disable_tqdm=True, seed=0, report_to=[], save_strategy="no", logging_steps=100)
    Trainer(model=model, args=args, train_dataset=Ids(), callbacks=list(callbacks)).train()
    return model, calls


@pytest.fixture(scope="module", params=KINDS)
def trainer_run(request, tmp_path_factory) -> SimpleNamespace:
    """One kind's Trainer runs of 3 steps, without the watch and with it (3 checks, every=1), shared by the tests of a
    run below (6-9 s each on 2 cores): the models, the user's hook's calls, the callback's watch, its records, the
    warnings the watched run gave."""
    from gradwatch.integrations.transformers import GradWatchCallback

    kind, tmp = request.param, tmp_path_factory.mktemp(request.param)
    plain, plain_calls = train(kind, tmp / "plain")
    callback = GradWatchCallback(every=1, log_dir=str(tmp / "runs"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched, calls = train(kind, tmp / "watched", [callback])
    return SimpleNamespace(plain=plain, plain_calls=plain_calls, watched=watched, calls=calls, watch=callback.watch,
                           runs=tmp / "runs", warnings=[str(w.message) for w in caught])


@pytest.mark.slow  # its kind's Trainer runs (the fixture)
def test_under_the_trainer_every_check_runs_and_training_is_bit_identical(trainer_run):
    run, watch = trainer_run, trainer_run.watch
    assert [w for w in run.warnings if "users_hook on model.layers.0.mlp" in w], run.warnings
    assert len(run.calls) == len(run.plain_calls) == 3  # the user's hook: training's forwards only
    for (name, a), b in zip(run.plain.state_dict().items(), run.watched.state_dict().values()):
        assert torch.equal(a, b), name
    assert watch.paused is None, watch.paused
    assert not [a for a in watch.alerts if a.kind in ("error", "paused")], [str(a) for a in watch.alerts]
    records = [r for r in read_jsonl(run.runs / "checks.jsonl")[0] if r["type"] == "check"]
    assert [r["step"] for r in records] == [0, 1, 2]  # every check ran
    assert not [n for r in records for n in r.get("notes", []) if "IndexError" in n or "raised" in n]


def experts_of(names, tensor: str) -> dict:
    """``{expert: name}`` of the keys of fused ``tensor`` among ``names`` (a report's tensors, a tracker's history)."""
    return {found[1]: n for n in names if (found := expert_of(n)) is not None and found[0] == tensor}


@pytest.mark.slow  # its kind's Trainer runs (the fixture)
def test_under_the_trainer_a_correct_moe_has_no_alert_and_both_verdicts_on_every_expert(trainer_run):
    watch = trainer_run.watch
    assert watch.alerts == [], [a.message for a in watch.alerts]
    assert len(watch.tracker.training_history) and watch.paused is None
    names = [n for n, p in watch.model.named_parameters() if p.requires_grad]
    fused = [n for n in names if "experts" in n]
    judged = set(watch.tracker.history) | set(watch.tracker.training_history)
    for n in fused:  # judged expert by expert, never as one tensor
        assert n not in judged
        for part in (watch.tracker.history, watch.tracker.training_history):
            assert sorted(experts_of(part, n)) == [0, 1, 2, 3], (n, sorted(part))
    assert all(n in watch.tracker.history and n in watch.tracker.training_history for n in names if n not in fused)


@pytest.mark.slow  # 2 checks of the whole objective: about 5 s
def test_a_plain_loop_with_the_models_own_loss_checks_every_step_and_trains_bit_identically():
    batches = [padded_batch(seed, rows=4, seq=8) for seed in range(2)]

    def run(watched: bool):
        model = tiny_moe("mixtral")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        calls: list = []
        model.model.layers[0].mlp.register_forward_hook(counting_hook(calls))
        watch = gradwatch.GradWatch(model, model_loss, every=1, tensorboard=False, jsonl=False) if watched else None
        reports, losses = [], []
        for batch in batches:
            opt.zero_grad()
            loss = model_loss(model, batch)
            loss.backward()
            losses.append(float(loss.detach()))
            if watch is not None:
                reports.append(watch.step(batch))
            opt.step()
        return model, calls, reports, losses, watch

    plain, plain_calls, _, _, _ = run(False)
    with pytest.warns(UserWarning, match="users_hook"):
        model, calls, reports, losses, watch = run(True)
    assert len(calls) == len(plain_calls) == 2
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(r is not None for r in reports) and watch.paused is None
    assert not [a for a in watch.alerts if a.kind in ("error", "paused")], [str(a) for a in watch.alerts]
    first = reports[0]  # the whole objective: the model's loss with its aux term, through transformers' hooks
    assert first.objective == pytest.approx(losses[0], rel=1e-5)
