"""A check beside training on models whose activations dwarf their trained parameters: peak memory and steps a check.

Each shape trains ``--steps`` steps (one thread) in a fresh process, once unwatched and once with
``GradWatch(every=1)`` at its default options (``memory_budget=0.1``), and prints, side by side:

- the peak RSS of the watched run over the unwatched one (``VmHWM``, one subprocess per figure);
- each check's seconds over the unwatched run's median training step: "steps a check", the first check and
  the median of all of them;
- the checks' forms, the tensors judged by each part, and the alerts.

The shapes (``--shapes`` picks some):

============== =========================================================================================
lora_gpt2      GPT-2 (2 blocks of 128, the 50,257-token vocabulary), LoRA (r=8) on ``c_attn``, batch 4 x 128
gpt2_ckpt      the same GPT-2 whole, gradient checkpointing on
gpt2_frozen    the same GPT-2, embeddings and first block frozen
encoder_long   ``nn.TransformerEncoder`` (2 layers of 128, 4 heads) on 1,024-token sequences, batch 4, LM head 1,000
mlp_batch      an MLP 64 -> 256 -> 256 -> 10 on a batch of 16,384, ``form="objective"``
cnn64          two 3x3 convolutions of 32 channels, BatchNorm, a linear head; batch 8, 64x64
cnn128         the same CNN at batch 32, 128x128
cnn_wide       a CNN of 64 channels, BatchNorm, ReLU, max-pooling, dropout, a 100-class head; batch 16, 64x64
resnetish      residual blocks of their own code (GroupNorm, SiLU, a sum), a strided convolution; batch 4, 96x96
unet           diffusers' ``UNet2DModel`` (channels 16 and 32, attention blocks), 32x32, batch 8, the DDPM loss
unet64         diffusers' ``UNet2DModel`` (channels 32, 64, 64, an attention block), 64x64, batch 4, the DDPM loss
moe8           transformers' Mixtral, 8 experts (top 2), 4 layers of 256, a 32,000-token vocabulary (29.6M
               parameters), batch 4 x 128, the model's own loss with its router aux loss
trl_sft        TRL's ``SFTTrainer`` at its defaults (bf16 autocast, gradient checkpointing, its loss) on a Llama of
               4 layers of 256 and a 32,000-token vocabulary, batches of 4 padded texts of 48 to 128 words,
               ``GradWatchCallback(every=1)``
hf_gpt2        transformers' ``Trainer`` at its defaults (AdamW, clipping at 1.0), a full fine-tune of a GPT-2 of
               4 blocks of 192 on the 50,257-token vocabulary, batch 4 x 96, ``GradWatchCallback(every=1)``
============== =========================================================================================

Peaks of the same code move from run to run (the unwatched process alone by up to 10%: ``mlp_batch`` 423 MB to
521 MB in nine runs, with the same hash seed or without address randomization alike): glibc serves a block from its
heap or from a mapping by a threshold that moves as blocks are freed. ``--repeats N`` runs N pairs a shape,
alternated, and prints the medians after them; ``--mmap-threshold 131072`` fixes the threshold in both processes, and
the peaks then repeat from run to run (the watch's own bytes, without the allocator's moves; training's steps run
slower so).

Example::

    python benchmarks/shapes.py --shapes cnn64 lora_gpt2 --steps 6 --repeats 3
    python benchmarks/shapes.py --mmap-threshold 131072
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

SHAPES = ("lora_gpt2", "gpt2_ckpt", "gpt2_frozen", "encoder_long", "mlp_batch", "cnn64", "cnn128", "cnn_wide",
          "resnetish", "unet", "unet64", "moe8", "trl_sft", "hf_gpt2")
#: The shapes trained by a Hugging Face ``Trainer`` (:func:`trainer_worker`).
TRAINERS = ("trl_sft", "hf_gpt2")


def _gpt2(kind: str) -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=50257,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    if kind == "lora_gpt2":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0))
    elif kind == "gpt2_ckpt":
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    elif kind == "gpt2_frozen":
        for p in list(model.transformer.wte.parameters()) + list(model.transformer.wpe.parameters()) + \
                list(model.transformer.h[0].parameters()):
            p.requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), generator=gen)

    def loss_fn(m: Any, b: Any) -> Any:
        return m(input_ids=b, labels=b).loss

    return model, loss_fn, ids, {}


def _encoder() -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 128)
            layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
            self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(128, 1000)

        def forward(self, ids: Any) -> Any:
            return self.head(self.body(self.emb(ids)))

    torch.manual_seed(0)
    model = Encoder()
    ids = torch.randint(0, 1000, (4, 1024), generator=torch.Generator().manual_seed(1))

    def loss_fn(m: Any, b: Any) -> Any:
        return F.cross_entropy(m(b).flatten(0, 1), b.flatten())

    return model, loss_fn, ids, {}


def _mlp() -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(16384, 64, generator=gen), torch.randint(0, 10, (16384,), generator=gen))

    def loss_fn(m: Any, b: Any) -> Any:
        return F.cross_entropy(m(b[0]), b[1])

    return model, loss_fn, batch, {"form": "objective"}


def _cnn(size: int, batch: int) -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 16, 10))
    gen = torch.Generator().manual_seed(1)
    data = (torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, 10, (batch,), generator=gen))

    def loss_fn(m: Any, b: Any) -> Any:
        return F.cross_entropy(m(b[0]), b[1])

    return model, loss_fn, data, {}


def _cnn_wide() -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.Dropout(0.1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 100))
    gen = torch.Generator().manual_seed(1)
    data = (torch.randn(16, 3, 64, 64, generator=gen), torch.randint(0, 100, (16,), generator=gen))

    def loss_fn(m: Any, b: Any) -> Any:
        return F.cross_entropy(m(b[0]), b[1])

    return model, loss_fn, data, {}


def _resnetish() -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):  # its own code: the activations and the sum between the modules it calls
        def __init__(self, c: int) -> None:
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, c), nn.Conv2d(c, c, 3, padding=1)
            self.n2, self.c2 = nn.GroupNorm(8, c), nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x: Any) -> Any:
            return x + self.c2(F.silu(self.n2(self.c1(F.silu(self.n1(x))))))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), Block(32), nn.Conv2d(32, 48, 3, stride=2, padding=1),
                          Block(48), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 10))
    gen = torch.Generator().manual_seed(1)
    data = (torch.randn(4, 3, 96, 96, generator=gen), torch.randint(0, 10, (4,), generator=gen))

    def loss_fn(m: Any, b: Any) -> Any:
        return F.cross_entropy(m(b[0]), b[1])

    return model, loss_fn, data, {}


def _unet(size: int = 32) -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from diffusers import UNet2DModel
    from torch.nn import functional as F

    torch.manual_seed(0)
    if size == 32:
        model = UNet2DModel(sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
                            block_out_channels=(16, 32), norm_num_groups=8,
                            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                            up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    else:
        model = UNet2DModel(sample_size=size, in_channels=3, out_channels=3, layers_per_block=1,
                            block_out_channels=(32, 64, 64),
                            down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                            up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"))
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(8 if size == 32 else 4, 3, size, size, generator=gen)

    def loss_fn(m: Any, x: Any) -> Any:  # the DDPM loss: it draws its own noise and timesteps
        noise = torch.randn_like(x)
        t = torch.randint(0, 1000, (x.shape[0],))
        alpha = torch.cos(t.float() / 1000 * 1.5707963).view(-1, 1, 1, 1)
        noisy = alpha * x + (1 - alpha ** 2).sqrt() * noise
        return F.mse_loss(m(noisy, t).sample, noise)

    return model, loss_fn, images, {}


def _moe() -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=8, num_experts_per_tok=2, output_router_logits=True,
                                             max_position_embeddings=128))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (4, 128), generator=gen)

    def loss_fn(m: Any, b: Any) -> Any:
        return m(input_ids=b, labels=b).loss

    return model, loss_fn, ids, {}


def build(shape: str) -> Tuple[Any, Callable, Any, Dict[str, Any]]:
    """``(model, loss_fn, batch, watch options)`` of ``shape``."""
    if shape.startswith("gpt2") or shape == "lora_gpt2":
        return _gpt2(shape)
    if shape == "encoder_long":
        return _encoder()
    if shape == "mlp_batch":
        return _mlp()
    if shape == "cnn64":
        return _cnn(64, 8)
    if shape == "cnn128":
        return _cnn(128, 32)
    if shape == "cnn_wide":
        return _cnn_wide()
    if shape == "resnetish":
        return _resnetish()
    if shape == "unet":
        return _unet()
    if shape == "unet64":
        return _unet(64)
    if shape == "moe8":
        return _moe()
    raise ValueError(f"shape {shape!r}: one of {', '.join(SHAPES)}")


def worker(shape: str, watch: bool, steps: int) -> Dict[str, Any]:
    """One run of ``shape`` in this process: its peak, its steps' and checks' seconds (the module docstring)."""
    import torch

    torch.set_num_threads(1)
    model, loss_fn, batch, options = build(shape)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    w = None
    if watch:
        from gradwatch import GradWatch

        w = GradWatch(model, loss_fn, every=1, log_dir=None, **options)
    step_s: List[float] = []
    check_s: List[float] = []
    forms, backward, training, notes = [], [], [], []
    torch.manual_seed(2)
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        step_s.append(time.perf_counter() - start)
        if w is not None:
            start = time.perf_counter()
            report = w.step(batch, loss=loss)
            check_s.append(time.perf_counter() - start)
            if report is not None:
                forms.append(report.form)
                backward.append(len(report.tensors))
                training.append(len(report.training))
                notes += [n for n in report.notes if n not in notes]
        start = time.perf_counter()
        opt.step()
        step_s[-1] += time.perf_counter() - start
    from gradwatch.plan.memory import peak_bytes

    out: Dict[str, Any] = {"shape": shape, "watch": watch, "peak_bytes": peak_bytes(torch.device("cpu")),
                           "step_seconds": step_s, "check_seconds": check_s,
                           "params": sum(p.numel() for p in model.parameters()),
                           "trained": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if w is not None:
        out.update(forms=forms, backward=backward, training=training, notes=notes[:12],
                   alerts=[a.message[:200] for a in w.alerts], cycle=w.cycle_length if hasattr(w, "cycle_length")
                   else None)
        w.close()
    return out


def trainer_worker(shape: str, watch: bool, steps: int) -> Dict[str, Any]:
    """A Hugging Face ``Trainer`` shape (``trl_sft``, ``hf_gpt2``): its steps' seconds and the checks' (each
    ``watch.step``), under ``GradWatchCallback(every=1)`` where watched."""
    import logging
    import tempfile

    import torch
    from transformers import TrainerCallback

    from gradwatch.plan.memory import peak_bytes

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    times: List[float] = []
    check_s: List[float] = []
    forms: List[str] = []
    backward: List[int] = []
    training: List[int] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            times[-1] = time.perf_counter() - times[-1]

    callbacks: List[Any] = []
    if watch:
        from gradwatch.integrations.transformers import GradWatchCallback
        from gradwatch.watch.gradwatch import GradWatch

        plain_step = GradWatch.step

        def timed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            report = plain_step(self, *args, **kwargs)
            if report is not None:
                check_s.append(time.perf_counter() - start)
                forms.append(report.form)
                backward.append(len(report.tensors))
                training.append(len(report.training))
            return report

        GradWatch.step = timed_step  # type: ignore[method-assign]
        callbacks.append(GradWatchCallback(every=1, tensorboard=False, jsonl=False))
    with tempfile.TemporaryDirectory() as out:
        trainer = (_sft_trainer if shape == "trl_sft" else _gpt2_trainer)(out, steps, [Clock()] + callbacks)
        trainer.train()
    step_s = [t - (check_s[i] if i < len(check_s) else 0.0) for i, t in enumerate(times)]
    result: Dict[str, Any] = {"shape": shape, "watch": watch, "peak_bytes": peak_bytes(torch.device("cpu")),
                              "step_seconds": step_s, "check_seconds": check_s,
                              "params": sum(p.numel() for p in trainer.model.parameters())}
    if watch:
        w = callbacks[0].watch
        result.update(forms=forms, backward=backward, training=training, notes=[], cycle=None,
                      alerts=[a.message[:200] for a in w.alerts] if w is not None else [])
    return result


def _sft_trainer(out: str, steps: int, callbacks: List[Any]) -> Any:
    """``trl_sft``: TRL's ``SFTTrainer`` at its defaults on a Llama of 4 layers of 256 and 32,000 tokens."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    words = [f"w{i}" for i in range(2000)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(48, 129, (4 * steps,), generator=g).tolist()
    data = Dataset.from_dict({"text": [" ".join(words[j] for j in torch.randint(0, len(words), (k,), generator=g).tolist())
                                       for k in lengths]})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=None))
    args = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                     disable_tqdm=True, logging_steps=10_000, save_strategy="no", seed=0, max_length=256)
    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)


def _gpt2_trainer(out: str, steps: int, callbacks: List[Any]) -> Any:
    """``hf_gpt2``: transformers' ``Trainer`` at its defaults (AdamW, clipping at 1.0), a full fine-tune of a GPT-2 of
    4 blocks of 192 on the 50,257-token vocabulary, batches of 4 x 96 tokens."""
    import torch
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=192, n_head=4, n_positions=128, vocab_size=50257))
    ids = torch.randint(0, 50257, (4 * steps, 96), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                             disable_tqdm=True, logging_steps=10_000, save_strategy="no", seed=0)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def spawn(shape: str, watch: bool, steps: int, mmap_threshold: Optional[int] = None) -> Dict[str, Any]:
    """:func:`worker` in a fresh interpreter (its own peak RSS); with ``mmap_threshold``, glibc's mmap threshold fixed
    there (``MALLOC_MMAP_THRESHOLD_``)."""
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    cmd = [sys.executable, here, "--worker", shape, "--steps", str(steps)] + (["--watch"] if watch else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"shape": shape, "watch": watch, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(plain: Dict[str, Any], watched: Dict[str, Any]) -> Dict[str, Any]:
    """The side-by-side figures of one shape."""
    if "error" in plain or "error" in watched:
        return {"shape": plain["shape"], "error": plain.get("error") or watched.get("error")}
    step = statistics.median(plain["step_seconds"][1:] or plain["step_seconds"])
    per = [c / step for c in watched["check_seconds"]]
    return {"shape": plain["shape"], "peak_ratio": watched["peak_bytes"] / plain["peak_bytes"],
            "plain_mb": plain["peak_bytes"] / 2**20, "watched_mb": watched["peak_bytes"] / 2**20,
            "step_s": step, "first_steps": per[0] if per else None, "median_steps": statistics.median(per) if per else None,
            "max_steps": max(per) if per else None, "steps_a_check": [round(p, 1) for p in per],
            "forms": watched["forms"], "backward": watched["backward"], "training": watched["training"],
            "alerts": watched["alerts"], "notes": watched["notes"]}


def medians(pairs: Sequence[Dict[str, Any]]) -> str:
    """The line after a shape's pairs: the medians of its unwatched and watched peaks and their ratio, each pair's
    ratio, and the median of the checks' first and median steps.

    Example:
        >>> medians([{"plain_mb": 100.0, "watched_mb": 104.0, "peak_ratio": 1.04, "first_steps": 4.0, "median_steps": 3.0},
        ...          {"plain_mb": 110.0, "watched_mb": 112.0, "peak_ratio": 112 / 110, "first_steps": 5.0, "median_steps": 2.0}])
        '  median of 2: 105 MB, watched 108 MB, 1.03x (pairs 1.04, 1.02); steps a check, first 4.5, median 2.5'
    """
    plain = statistics.median(r["plain_mb"] for r in pairs)
    watched = statistics.median(r["watched_mb"] for r in pairs)
    ratios = ", ".join(f"{r['peak_ratio']:.2f}" for r in pairs)
    return (f"  median of {len(pairs)}: {plain:.0f} MB, watched {watched:.0f} MB, {watched / plain:.2f}x (pairs {ratios}); "
            f"steps a check, first {statistics.median(r['first_steps'] for r in pairs):.1f}, "
            f"median {statistics.median(r['median_steps'] for r in pairs):.1f}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/shapes.py", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", choices=SHAPES)
    parser.add_argument("--watch", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="side-by-side pairs a shape (each a fresh unwatched and a fresh watched process); with 2 or "
                             "more, a line of medians follows each shape's pairs")
    parser.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                        help="glibc's mmap threshold fixed at BYTES in both processes (MALLOC_MMAP_THRESHOLD_; 131072: "
                             "every block of 128 KiB or more mapped and unmapped): peaks then repeat from run to run, "
                             "where glibc's moving threshold makes the unwatched process's alone vary by up to 10%%")
    parser.add_argument("--out", help="write the rows as JSON here too")
    args = parser.parse_args(argv)
    if args.worker:
        run = trainer_worker(args.worker, args.watch, args.steps) if args.worker in TRAINERS \
            else worker(args.worker, args.watch, args.steps)
        print(json.dumps(run))
        return 0
    rows = []
    print(f"{'shape':13} {'plain MB':>9} {'watched MB':>10} {'peak':>6} {'step s':>7} {'first':>6} {'median':>7} "
          f"{'max':>6}  forms")
    for shape in args.shapes:
        pairs = []
        for _ in range(max(1, args.repeats)):
            r = row(spawn(shape, False, args.steps, args.mmap_threshold), spawn(shape, True, args.steps, args.mmap_threshold))
            rows.append(r)
            if "error" in r:
                print(f"{shape:13} error: {r['error']}")
                continue
            pairs.append(r)
            print(f"{shape:13} {r['plain_mb']:9.0f} {r['watched_mb']:10.0f} {r['peak_ratio']:6.2f} {r['step_s']:7.3f} "
                  f"{r['first_steps']:6.1f} {r['median_steps']:7.1f} {r['max_steps']:6.1f}  {','.join(r['forms'])}",
                  flush=True)
            for a in r["alerts"]:
                print(f"{'':13} alert: {a}")
        if len(pairs) > 1:
            print(medians(pairs), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
