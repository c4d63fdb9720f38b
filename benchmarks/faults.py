"""Faults during a check of an FSDP2, tensor parallel or ZeRO model checked shard by shard: 2 gloo ranks, one fault per run.

Each run starts 2 plain processes (no ``torchrun``: nothing but the process group ends a rank that
waits) with a process-group timeout of ``--pg-timeout`` seconds and ``distributed_timeout`` of
``--timeout``. Every rank first trains a small pre-norm transformer (hand-written attention, each
block ``fully_shard``-ed; with ``--engine tp`` each block's MLP and the head tensor parallel through
``parallelize_module``; with ``--engine zero3`` under DeepSpeed ZeRO-3, every parameter partitioned by
``stage3_param_persistence_threshold`` 0, the watch given the engine; ``--engine zero2`` the same under ZeRO-2)
without the watch, then the same run watched with ``every=1``, and one rank meets a fault during the check of
step ``--at``:

- ``raise-replay``: ``loss_fn`` raises before calling the model, in the training part's replay;
- ``raise-loss``: ``loss_fn`` raises after the model's forward (its all-gathers done), in the replay;
- ``raise-forward``: a block raises in the middle of the model's forward, in the replay;
- ``raise-capture``: ``loss_fn`` raises at its second call of the check: the units' capture forward where it runs
  one; where the replay's forward is the capture's (FSDP2, tensor parallel: ``gradwatch/watch/parts/replay_capture.py``),
  the next call (the forward that looks for terms reading the parameters, or a piece of ``loss_fn``'s own code);
- ``nan``: that rank's logits are NaN at that step (in training and in the check);
- ``stall``: ``loss_fn`` sleeps 3 s in the replay (less than ``distributed_timeout``);
- ``stall-long``: it sleeps ``distributed_timeout + 5`` s;
- ``raise-backward``: a custom backward (inside block 1) raises in the replay's backward;
- ``killed``: the rank kills itself (SIGKILL) in the replay;
- ``killed-capture``: the same at the second call (as ``raise-capture``).

Each fault runs once on rank 0 and once on rank 1 (20 runs). For each the table says whether both
processes ended within the process group's timeout, whether every step before the fault (every
step, where training goes on) left the parameters bit-identical to the unwatched run, and what the
records (rank 0's JSONL, or the survivor's alerts when rank 0 was the one killed) say of the fault's
step.

Example::

    python benchmarks/faults.py                 # the 20 runs
    python benchmarks/faults.py --only killed   # one fault, on both ranks
    python benchmarks/faults.py --engine tp     # the 20 runs on the tensor parallel model
    python benchmarks/faults.py --engine zero3  # the 20 runs on the ZeRO-3 model (needs deepspeed; zero2: ZeRO-2)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by the tests too: ddp_memory is beside it
from ddp_memory import _port  # noqa: E402 - a free port, as the DDP benchmark takes it

FAULTS = ("raise-replay", "raise-loss", "raise-forward", "raise-capture", "nan", "stall", "stall-long",
          "raise-backward", "killed", "killed-capture")
VOCAB, SEQ, BATCH, STEPS = 256, 16, 4, 5
#: Faults that end the job through the process group's timeout: the steps before the fault are compared.
ENDS_THE_JOB = ("killed", "killed-capture")


def worker(rank: int, port: str, out: str, fault: str, fault_rank: int, at: int, timeout: float,
           pg_timeout: float, engine: str = "fsdp") -> None:
    """One rank: the unwatched run, then the watched run with the fault; writes ``rank{r}.json``."""
    import datetime
    import math
    import signal

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from gradwatch import GradWatch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if engine.startswith("zero"):
        import logging

        os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=pg_timeout))
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=pg_timeout))
    state = {"checking": False, "calls": 0, "step": -1}
    mine = rank == fault_rank

    def due(call: int) -> bool:  # this rank, the fault's step, inside the check, at the call-th loss_fn call
        return mine and state["checking"] and state["step"] == at and state["calls"] == call

    class Boom(torch.autograd.Function):  # identity whose backward raises when armed
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.armed = fault == "raise-backward" and due(1)
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            if ctx.armed:
                raise RuntimeError("injected: a custom backward raised")
            return g

    class Attention(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), 2

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            s = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            return self.out((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self, d: int, index: int) -> None:
            super().__init__()
            self.index = index
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.index == 1 and fault == "raise-forward" and due(1):
                raise RuntimeError("injected: block 1's forward raised")
            x = x + self.attn(self.ln1(x))
            return Boom.apply(x + self.mlp(self.ln2(x))) if self.index == 1 else x + self.mlp(self.ln2(x))

    class LM(nn.Module):
        def __init__(self, d: int = 32, layers: int = 3) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.blocks = nn.ModuleList([Block(d, i) for i in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    def loss_fn(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if state["checking"]:
            state["calls"] += 1
        if fault == "raise-replay" and due(1) or fault == "raise-capture" and due(2):
            raise KeyError(f"injected: 'labels' missing on rank {rank}")
        if fault in ("stall", "stall-long") and due(1):
            time.sleep(3.0 if fault == "stall" else timeout + 5.0)
        if fault in ("killed", "killed-capture") and due(1 if fault == "killed" else 2):
            os.kill(os.getpid(), signal.SIGKILL)
        logits = m(ids[:, :-1])
        if fault == "nan" and mine and state["step"] == at:  # training's forward and the check's alike
            logits = logits * float("nan")
        if fault == "raise-loss" and due(1):
            raise ValueError("injected: the loss could not be computed")
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def digest(model: nn.Module) -> List[str]:  # the bits of this rank's shards (ZeRO-3: its partitions)
        return [str(hash((p.ds_tensor if hasattr(p, "ds_tensor") else getattr(p, "to_local", p.detach)()).detach()
                         .numpy().tobytes())) for p in model.parameters()]

    def train(watched: bool) -> Dict[str, Any]:
        torch.manual_seed(0)
        model = LM()
        if engine == "tp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (2,))
            for block in model.blocks:
                parallelize_module(block, mesh, {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
            parallelize_module(model, mesh, {"head": ColwiseParallel(output_layouts=Replicate())})
        elif engine == "fsdp":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
        engine_: Any = None
        if engine.startswith("zero"):
            config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True,
                      "zero_optimization": {"stage": int(engine[-1]), "stage3_param_persistence_threshold": 0}}
            engine_, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        watch = GradWatch(engine_ if engine_ is not None else model, loss_fn, optimizer=opt, every=1,
                          distributed_timeout=timeout, log_dir=os.path.join(out, "run") if watched else None) \
            if watched else None
        gen = torch.Generator().manual_seed(100 + (0 if engine == "tp" else rank))  # TP ranks share a batch
        res: Dict[str, Any] = {"digests": [], "error": None, "check_seconds": []}

        def dump() -> None:
            if watch is not None:
                res["alerts"] = [a.to_dict() for a in watch.alerts]
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump(res, f)

        try:
            for step in range(STEPS):
                state["step"] = step
                ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
                x = ids
                if engine_ is not None:
                    loss = loss_fn(engine_, x)
                    engine_.backward(loss)
                else:
                    opt.zero_grad()
                    loss = loss_fn(model, x)
                    loss.backward()
                if watch is not None:
                    state["checking"], state["calls"] = True, 0
                    t0 = time.perf_counter()
                    try:
                        watch.step(x, loss=loss)
                    finally:
                        state["checking"] = False
                        res["check_seconds"].append(time.perf_counter() - t0)
                if engine_ is not None:
                    engine_.step()
                else:
                    opt.step()
                res["digests"].append(digest(model))
                if watched:
                    dump()
        except Exception as exc:  # noqa: BLE001 - what ended training on this rank (a peer killed)
            res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if watched:
            dump()
        return res

    plain = train(False)
    with open(os.path.join(out, f"plain{rank}.json"), "w") as f:
        json.dump(plain, f)
    train(True)
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: a peer may be gone


def run(fault: str, fault_rank: int, at: int, timeout: float, pg_timeout: float, engine: str = "fsdp") -> Dict[str, Any]:
    """One run of 2 processes; its outcome."""
    from gradwatch.io.sinks import read_jsonl

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out:
        port = str(_port())
        start = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", port, out, fault, str(fault_rank), str(at),
               str(timeout), str(pg_timeout), engine]
        procs = [subprocess.Popen(cmd[:-1] + [str(r), engine], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        limit = 60 + 2 * pg_timeout + 2 * timeout  # two runs' start-up, and every wait the timeouts allow
        hung = False
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, start + limit - time.perf_counter()))[0])
            except subprocess.TimeoutExpired:
                hung = True
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0])
        seconds = time.perf_counter() - start
        ranks: List[Optional[Dict[str, Any]]] = []
        for r in range(2):
            path = os.path.join(out, f"rank{r}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else None)
        plain = [json.load(open(os.path.join(out, f"plain{r}.json"))) if os.path.exists(os.path.join(out, f"plain{r}.json"))
                 else None for r in range(2)]
        records, _ = read_jsonl(os.path.join(out, "run")) if os.path.isdir(os.path.join(out, "run")) else ([], [])
    killed = fault in ENDS_THE_JOB
    identical = []
    for r in range(2):
        if ranks[r] is None or plain[r] is None or (fault.startswith("killed") and r == fault_rank):
            continue
        steps = ranks[r]["digests"]
        want = plain[r]["digests"][:len(steps)]
        identical.append(steps == want and (killed or len(steps) == STEPS))
    survivor = next((x for r, x in enumerate(ranks) if x is not None and not (fault.startswith("killed") and r == fault_rank)),
                    None)
    said = [rec for rec in records if rec.get("type") == "alert" and rec.get("step") == at]
    said += [{"kind": "note", "message": n} for rec in records if rec.get("type") == "check" and rec.get("step") == at
             for n in rec.get("notes", []) if "ran slow" in n]
    if not said and survivor is not None:
        said = [a for a in survivor.get("alerts", []) if a.get("step") == at]
    checks = [rec for rec in records if rec.get("type") == "check"]
    return {
        "fault": fault, "rank": fault_rank, "seconds": round(seconds, 1), "hung": hung,
        "codes": [p.returncode for p in procs],
        "identical": bool(identical) and all(identical),
        "training_error": [x.get("error") if x else "no result" for x in ranks],
        "checks_written": [rec["step"] for rec in checks],
        "said": [f"{a.get('kind')}: {a.get('message', '')[:160]}" for a in said],
        "slowest_check": max((max(x["check_seconds"], default=0) for x in ranks if x), default=0.0),
        "log_tail": "" if not hung else "\n".join(logs)[-3000:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=FAULTS, action="append", help="these faults only (default: all)")
    parser.add_argument("--rank", type=int, choices=(0, 1), action="append", help="the faulty rank(s) (default: both)")
    parser.add_argument("--at", type=int, default=2, help="the step whose check meets the fault")
    parser.add_argument("--timeout", type=float, default=8.0, help="distributed_timeout (s)")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="the process group's timeout (s)")
    parser.add_argument("--engine", choices=("fsdp", "tp", "zero3", "zero2"), default="fsdp",
                        help="FSDP2 (fully_shard), tensor parallel (parallelize_module), DeepSpeed ZeRO-3 or ZeRO-2")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args()
    outcomes = []
    for fault in args.only or FAULTS:
        for rank in args.rank or (0, 1):
            o = run(fault, rank, args.at, args.timeout, args.pg_timeout, args.engine)
            outcomes.append(o)
            ok = "ok" if not o["hung"] and o["identical"] and o["said"] else "FAIL"
            print(f"{ok:4} {fault:15} rank {rank}  {o['seconds']:6.1f}s  exit {o['codes']}  bit-identical "
                  f"{o['identical']}  checks written {o['checks_written']}  training error {o['training_error']}",
                  flush=True)
            for line in o["said"]:
                print(f"       said: {line}")
            if o["hung"]:
                print(o["log_tail"])
    good = sum(not o["hung"] and o["identical"] and bool(o["said"]) for o in outcomes)
    print(f"\n{good} of {len(outcomes)} runs: no hang, training bit-identical (before the fault where the job ends: "
          f"{', '.join(ENDS_THE_JOB)}), the fault recorded")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outcomes, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        port, out, fault, fault_rank, at, timeout, pg_timeout, rank, engine = sys.argv[2:11]
        worker(int(rank), port, out, fault, int(fault_rank), int(at), float(timeout), float(pg_timeout), engine)
    else:
        main()
