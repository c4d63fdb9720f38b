"""What GradWatchCallback costs under TRL's SFTTrainer at its defaults, beside a plain Hugging Face Trainer.

The same tiny Llama (or ``--width``/``--layers``) on the same padded texts, trained by

- ``hf``: ``transformers.Trainer`` at its defaults (float32, no checkpointing, the model's loss), a causal-LM collator;
- ``trl``: ``trl.SFTTrainer`` at its defaults (bf16 autocast, gradient checkpointing, its fused LM head and loss).

For each, measured side by side in one process (warm, interleaved):

- ``check / step``: the seconds of one check (``every=1``) over the seconds of one unwatched training step:
  how many training steps a check costs;
- ``run ratio``: a run of ``--steps`` steps at the default ``every="auto"`` (2% overhead budget), watched over
  unwatched, median of ``--repeats``.

Run alone on a quiet machine: ``.venv/bin/python benchmarks/trl_cost.py`` (about 2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build(kind: str, callbacks: Optional[List[Any]], steps: int, width: int, layers: int, out: str) -> Any:
    from test_trl import texts, tokenizer
    from transformers import DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    tok = tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width,
                                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=32, pad_token_id=0, eos_token_id=1))
    common = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=4, use_cpu=True, report_to=[],
                  disable_tqdm=True, logging_steps=10_000, save_strategy="no", seed=0)
    data = texts(64)
    if kind == "trl":
        from trl import SFTConfig, SFTTrainer

        return SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=data, processing_class=tok,
                          callbacks=callbacks)
    ids = [{"input_ids": tok(t)["input_ids"] + [1]} for t in data["text"]]
    return Trainer(model=model, args=TrainingArguments(**common), train_dataset=ids,
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=callbacks)


def timed(kind: str, watched: Optional[dict], steps: int, args: argparse.Namespace) -> float:
    from gradwatch.integrations.transformers import GradWatchCallback

    callbacks = [GradWatchCallback(tensorboard=False, jsonl=False, **watched)] if watched is not None else None
    trainer = build(kind, callbacks, steps, args.width, args.layers, args.out)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    if callbacks and callbacks[0].watch.alerts:
        raise SystemExit(f"{kind}: alerts on a correct model: {[a.message for a in callbacks[0].watch.alerts]}")
    return seconds


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of the every='auto' runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--out", default="/tmp/gradwatch_trl_cost")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    print(f"tiny Llama, width {args.width}, {args.layers} layer(s), batches of 4 padded texts; one thread")
    rows = {}
    for kind in ("hf", "trl"):
        timed(kind, None, 2, args)  # warm: imports, the first forward's one-time costs
        step = statistics.median(timed(kind, None, 10, args) / 10 for _ in range(args.repeats))
        check = statistics.median((timed(kind, {"every": 1}, 2, args) - 2 * step) / 2 for _ in range(args.repeats))
        plain, watched = [], []
        for _ in range(args.repeats):  # interleaved
            plain.append(timed(kind, None, args.steps, args))
            watched.append(timed(kind, {}, args.steps, args))
        rows[kind] = (step, check, statistics.median(watched) / statistics.median(plain))
        print(f"{kind:>4}: step {step * 1e3:7.1f} ms   check {check:6.2f} s = {check / step:6.0f} steps   "
              f"run of {args.steps} steps at every='auto': watched/unwatched {rows[kind][2]:.2f}x", flush=True)
    hf, trl = rows["hf"], rows["trl"]
    print(f"trl/hf: check in steps {trl[1] / trl[0] / (hf[1] / hf[0]):.2f}x, run ratio {trl[2] / hf[2]:.2f}x")


if __name__ == "__main__":
    main()
