"""The module form's copies compute without the autocast accelerate wraps a model's forward in.

``Accelerator.prepare`` (the Hugging Face Trainer under ``bf16``, TRL's SFTTrainer at its defaults) replaces the
model's ``forward`` with one that runs the original under autocast. The objective form's shadow already dropped it;
the module form's copies of the root's own code did not, and TRL's fused LM head (its chunked log-prob kernel computes
in the autocast dtype it reads) ran in bfloat16 inside the float64 check: ``lm_head.weight`` WRONG (numeric 0) and an
undeclared surrogate on ``model:output``, on a correct model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradwatch.check.modules.own_code import fresh_shallow


def test_a_shallow_copy_runs_the_forward_accelerate_wrapped_in_autocast_without_it():
    m = nn.Linear(2, 2)
    m._original_forward = m.forward
    m.forward = torch.autocast("cpu", dtype=torch.bfloat16)(m.forward)
    x = torch.ones(1, 2)
    assert m(x).dtype == torch.bfloat16  # the live module, as training runs it
    copy = fresh_shallow(m)
    assert copy(x).dtype == torch.float32 and "_original_forward" in m.__dict__  # the live module untouched
    assert m(x).dtype == torch.bfloat16


@pytest.mark.slow  # a TRL run of 3 checked steps: 5-10 s
def test_trls_sft_trainer_at_its_defaults_in_the_module_form_has_no_alert(tmp_path):
    pytest.importorskip("trl")
    from test_item_probe import llama, sft
    from test_trl import WORDS

    from gradwatch.integrations.transformers import GradWatchCallback

    model = llama(vocab=len(WORDS) + 3)
    callback = GradWatchCallback(every=1, tensorboard=False, independence=None, form="module", log_dir=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sft(tmp_path, model, [callback], steps=3, texts_count=40)
    watch = callback.watch
    assert watch.paused is None and watch.alerts == [], [a.message[:300] for a in watch.alerts]
    assert watch.coverage["lm_head.weight"]["backward"] > 0, watch.coverage["lm_head.weight"]
