"""GradWatchCallback in a real ``transformers.Trainer`` under ``torchrun``: 2 gloo ranks, DDP, a tiny GPT-2.

The training verdict judges the ``.grad`` DDP averaged (read before the Trainer clips it) against the step's
objective: the mean over every target token of the world's step. The Trainer's defaults give no alert with
clipping on and off and with ``gradient_accumulation_steps=2`` on labels holding -100 (unequal counts per rank);
``average_tokens_across_devices=False`` (per-rank normalization) and a count taken before the next-token shift
(GPT2LMHeadModel, whose loss_type is None) are named, and so is a wrong backward planted in one block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    r'''
    import gc, json, math, os, sys
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from gradwatch.integrations.transformers import GradWatchCallback

    torch.set_num_threads(1)
    gc.freeze()  # what the imports made, out of the way of the gc.collect() each train() runs (accelerate's)

    class Ids(torch.utils.data.Dataset):
        def __init__(self, n=64, seq=16, masked=False):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 100, (n, seq), generator=g)
            keep = torch.rand(n, seq, generator=g) > (0.4 if masked else -1.0)  # masked: unequal counts per rank
            self.labels = torch.where(keep, self.ids, -100)
        def __len__(self):
            return len(self.ids)
        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    class WrongGelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return nn.functional.gelu(x)
        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
            return g * 1.3 * (cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))

    class Act(nn.Module):
        def forward(self, x):
            return WrongGelu.apply(x)

    out, results = sys.argv[1], {}
    # (name, max_grad_norm, planted bug, accumulation steps, labels -100 at random, average_tokens_across_devices,
    #  the Trainer told that GPT-2 shifts its labels)
    runs = (("clip", 1.0, False, 1, False, True, True), ("bug", 1.0, True, 1, False, True, True),
            ("accumulate", 0.0, False, 2, True, True, True),  # clipping off
            ("per_rank", 1.0, False, 2, True, False, True), ("uncounted", 1.0, False, 2, True, True, False))
    for name, max_grad_norm, bug, accumulate, masked, across, counted in runs:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32))
        if counted:  # GPT2LMHeadModel's loss_type is None: the Trainer would count labels before the shift
            model.loss_type = "ForCausalLM"
        if bug:
            model.transformer.h[1].mlp.act = Act()
        cb = GradWatchCallback(every=1 if name == "accumulate" else 2, tensorboard=False)  # accumulate: 4 checks
        args = TrainingArguments(output_dir=os.path.join(out, name), max_steps=4, per_device_train_batch_size=4,
                                 use_cpu=True, disable_tqdm=True, seed=0, report_to=[], save_strategy="no",
                                 max_grad_norm=max_grad_norm, ddp_backend="gloo", logging_steps=100,
                                 gradient_accumulation_steps=accumulate, average_tokens_across_devices=across)
        trainer = Trainer(model=model, args=args, train_dataset=Ids(masked=masked), callbacks=[cb])
        trainer.train()
        watch = cb.watch
        results[name] = {
            "world": int(os.environ["WORLD_SIZE"]),
            "ddp": type(trainer.model_wrapped).__name__,
            "checks": watch._checks,
            "training_verdicts": sum(v["training"] > 0 for v in watch.coverage.values()),
            # each tensor an alert names (one cause's alert names several: issue 73)
            "alerts": [(a.kind, n, str(a.message)[:1200]) for a in watch.alerts for n in a.names],
        }
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)
    '''
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results of the five Trainer runs (one ``torchrun`` launch)."""
    out = tmp_path_factory.mktemp("hf_ddp")
    script = out / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(out)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("torchrun with 2 ranks did not finish within 240 s: a hang")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_are_ddp_and_check_at_the_same_steps(ranks):
    for results in ranks:
        for name, run in results.items():
            assert run["world"] == 2 and run["ddp"] == "DistributedDataParallel"
            assert run["checks"] == (4 if name == "accumulate" else 2)
    assert ranks[0] == ranks[1]  # merged reports: the same verdicts and alerts on every rank


@pytest.mark.parametrize("run", ["clip", "accumulate"])
def test_correct_gpt2_no_alert_with_clipping_on_and_off_and_accumulation(ranks, run):
    """The Trainer's defaults (num_items_in_batch over the world's step, times the ranks): the step's objective, with
    clipping on (``clip``) and off (``accumulate``, 2 micro-batches a step)."""
    result = ranks[0][run]
    assert result["alerts"] == []
    assert result["training_verdicts"] > 20  # every tensor of the tiny GPT-2 got a training verdict


def test_per_rank_token_counts_are_named(ranks):
    """average_tokens_across_devices=False: each rank divides by its own tokens, DDP averages the ranks."""
    training = [m for kind, _, m in ranks[0]["per_rank"]["alerts"] if kind == "threshold" and "training" in m.split("\n")[0]]
    assert training and all("training weighs the 2 ranks equally, but rank 0 holds" in m for m in training)
    assert all("(the micro-batches within each rank are weighed right)" in m for m in training)
    assert "average_tokens_across_devices=True" in training[0]


def test_a_count_before_the_shift_is_named_under_ddp(ranks):
    training = [m for kind, _, m in ranks[0]["uncounted"]["alerts"] if kind == "threshold"]
    assert training and all("the count includes each sample's first label" in m for m in training)


def test_planted_wrong_backward_is_named(ranks):
    named = {tensor for kind, tensor, _ in ranks[0]["bug"]["alerts"] if kind == "threshold"}
    assert "transformer.h.1.mlp.c_fc.weight" in named  # the layer feeding the wrong GELU backward
    assert not any(n.startswith(("transformer.h.1.mlp.c_proj.", "transformer.ln_f.")) for n in named)  # after it
