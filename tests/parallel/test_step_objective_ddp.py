"""One step, one objective under DDP: 2 gloo ranks holding different token counts, a plain loop.

Per-rank token means averaged by DDP (with and without gradient accumulation) are named at the first
check with each rank's count; the correct form (the token sum times the ranks over the all-reduced
count) gives no alert over 4 checks; every rank reaches the same verdicts. The DDP runs and the FSDP2 runs
share one launch of the 2 ranks (a module fixture), each test reading its own part's results.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch.distributed as dist
from helpers import run_two_ranks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

_HEAD = textwrap.dedent(
    r'''
    import contextlib, datetime, json, os, sys
    import torch, torch.distributed as dist

    torch.set_num_threads(1)
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    from gradwatch import GradWatch
    from token_batches import TinyLM, targets, token_loss, uneven_micro_batches

    parts = sys.argv[4].split(",")


    def save(part, results):
        """This rank's results of one part to <part>_rank<r>.json in the folder given."""
        with open(os.path.join(out, f"{part}_rank{rank}.json"), "w") as f:
            json.dump(results, f)
    '''
)
#: Each part's results saved as soon as it ends (an exception: its traceback, the next part run still).
_TAIL = textwrap.dedent(
    r'''
    for part in parts:
        try:
            save(part, {"ddp": ddp, "fsdp": fsdp}[part]())
        except Exception:
            import traceback

            save(part, {"exception": traceback.format_exc()})
    dist.destroy_process_group()
    '''
)

#: DDP: per-rank means (with and without accumulation) and the step count all-reduced.
DDP_PART = textwrap.indent(textwrap.dedent(
    r'''
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for form in ("rank_means", "rank_means_accumulated", "step_count", "step_count_accumulated"):
        k = 3 if form.endswith("accumulated") else 1
        torch.manual_seed(0)
        model = DDP(TinyLM())
        watch = GradWatch(model, token_loss, every=1, tensorboard=False, jsonl=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own rows: unequal token counts
        counts = []
        for step in range(4):
            micro = uneven_micro_batches(k, gen, sizes=(1 + 2 * rank, 2 + 2 * rank))
            mine = torch.tensor(float(sum(targets(b) for b in micro)))
            total = mine.clone()
            dist.all_reduce(total)
            counts.append([targets(b) for b in micro])
            opt.zero_grad()
            for i, b in enumerate(micro):
                with model.no_sync() if i < k - 1 else contextlib.nullcontext():
                    if form.startswith("rank_means"):
                        (token_loss(model, b) / k).backward()  # this rank's mean; DDP averages the ranks
                    else:
                        (token_loss(model, b, "sum") * 2 / total).backward()  # the step's mean over both ranks
                if k > 1:
                    watch.accumulate(b)
            watch.step(None if k > 1 else micro[0])
            opt.step()
        results[form] = {"counts": counts, "checks": watch._checks,
                         "alerts": [(a.step, a.part, a.message) for a in watch.alerts]}
    return results
    '''
), "    ")


def _fsdp2_available() -> bool:
    try:
        import torch.distributed.fsdp  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One launch of 2 ranks running the DDP part, then the FSDP2 part where torch has it: (folder, exit codes,
    logs); a hang (the launch killed after its time limit) gives codes None, and the parts without results fail."""
    out = tmp_path_factory.mktemp("step_ddp")
    parts = ["ddp", "fsdp"] if _fsdp2_available() else ["ddp"]
    try:  # 180 s for the DDP part, 240 s for the FSDP2 part: what each had as a launch of its own
        codes, logs = run_two_ranks(WORKER, out / "worker.py", [str(out), ",".join(parts)], timeout=420,
                                    what="2-rank step objective runs (DDP, FSDP2)")
    except pytest.fail.Exception as hang:
        return out, None, [str(hang)]
    return out, codes, logs


def _both_ranks(launch, part):
    """Every rank's results of ``part`` ("ddp" or "fsdp") in ``launch``, by rank; the launch must end with (0, 0)."""
    out, codes, logs = launch
    launched = f"the launch's exit codes {codes}\n" + "\n".join(log[-3000:] for log in logs)
    files = [out / f"{part}_rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), f"no results for part {part!r}; {launched}"
    results = [json.loads(f.read_text()) for f in files]
    for r, res in enumerate(results):
        assert "exception" not in res, f"rank {r} raised in part {part!r}:\n{res['exception']}\n{launched}"
    assert codes == (0, 0), f"part {part!r}: {launched}"
    return results


@pytest.fixture(scope="module")
def ranks(launch):
    return _both_ranks(launch, "ddp")


@pytest.mark.parametrize("form", ["rank_means", "rank_means_accumulated"])
def test_per_rank_means_are_named_with_each_ranks_count(ranks, form):
    run = ranks[0][form]
    training = [m for step, part, m in run["alerts"] if part == "training"]
    assert training and all(step == 0 for step, part, _ in run["alerts"] if part == "training")
    first0, first1 = ranks[0][form]["counts"][0], ranks[1][form]["counts"][0]
    if form == "rank_means":
        expected = f"training weighs the 2 ranks equally, but rank 0 holds {first0[0]} and rank 1 holds {first1[0]} target tokens"
    else:
        expected = ("training weighs the 6 micro-batches of the 2 ranks equally, but they hold "
                    f"rank 0: {', '.join(map(str, first0))}; rank 1: {', '.join(map(str, first1))} target tokens")
    assert expected in training[0]
    assert f"divide each {'rank' if form == 'rank_means' else 'micro-batch'}'s summed loss by {sum(first0) + sum(first1)}" in training[0]
    assert ranks[0][form]["alerts"] == ranks[1][form]["alerts"]


@pytest.mark.parametrize("form", ["step_count", "step_count_accumulated"])
def test_the_step_count_all_reduced_is_clean(ranks, form):
    for r in range(2):
        assert ranks[r][form]["alerts"] == [] and ranks[r][form]["checks"] == 4
    assert any(sum(a) != sum(b) for a, b in zip(ranks[0][form]["counts"], ranks[1][form]["counts"]))


#: FSDP2: the step count all-reduced, per-rank means, labels the data shifted.
FSDP_PART = textwrap.indent(textwrap.dedent(
    r'''
    from torch.distributed.fsdp import fully_shard

    def shifted_loss(model, b, reduction="mean"):  # labels shifted by the data (inputs ids[:-1], labels ids[1:])
        logits = model(b["input_ids"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100,
                                                 reduction=reduction)

    results = {}
    for form in ("rank_means", "step_count", "shifted_by_the_data"):
        loss_fn = shifted_loss if form == "shifted_by_the_data" else token_loss
        torch.manual_seed(0)
        model = TinyLM(width=32)
        fully_shard(model.mix)
        fully_shard(model)
        watch = GradWatch(model, loss_fn, every=1, tensorboard=False, jsonl=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        notes = []
        for step in range(4):
            micro = uneven_micro_batches(2, gen, sizes=(1 + 2 * rank, 2 + 2 * rank))
            if loss_fn is shifted_loss:
                micro = [{"input_ids": b["input_ids"][:, :-1], "labels": b["labels"][:, 1:]} for b in micro]
            total = torch.tensor(float(sum(targets(b) if loss_fn is token_loss else int((b["labels"] != -100).sum())
                                           for b in micro)))
            dist.all_reduce(total)
            opt.zero_grad()
            for b in micro:
                if form == "rank_means":
                    (loss_fn(model, b) / 2).backward()
                else:
                    (loss_fn(model, b, "sum") * 2 / total).backward()
                watch.accumulate(b)
            report = watch.step()
            notes.append(report.training_note if report is not None else None)
            opt.step()
        results[form] = {"checks": watch._checks, "notes": notes,
                         "alerts": [(a.step, a.part, a.message) for a in watch.alerts]}
    return results
    '''
), "    ")
#: Both parts in one launch (each rank's process start-up, imports and gloo set-up paid once).
WORKER = _HEAD + "\n\ndef ddp():" + DDP_PART + "\n\ndef fsdp():" + FSDP_PART + _TAIL


@pytest.fixture(scope="module")
def sharded(launch):
    pytest.importorskip("torch.distributed.fsdp")
    return _both_ranks(launch, "fsdp")


def test_fsdp2_judges_the_step_objective_shard_by_shard(sharded):
    """FSDP2: the counts are exchanged before the replay, each rank's objective weighs its share, FSDP2's own
    reduce-scatter averages them: the step count all-reduced is clean, per-rank means are caught with the counts,
    and labels the data already shifted are counted unshifted (no probe under FSDP2: read off the data)."""
    clean, buggy, shifted = sharded[0]["step_count"], sharded[0]["rank_means"], sharded[0]["shifted_by_the_data"]
    assert clean["alerts"] == [] and clean["checks"] == 4
    assert all("target tokens (labels[..., 1:] != -100)" in n and "not verified by a probe" in n for n in clean["notes"])
    # labels the data shifted (equal to the next ids): counted without the shift, read off the data
    assert shifted["alerts"] == [] and all("target tokens (labels != -100)" in n for n in shifted["notes"])
    training = [m for step, part, m in buggy["alerts"] if part == "training"]
    assert training and all(step == 0 for step, part, _ in buggy["alerts"] if part == "training")
    assert "the step holds micro-batch 1 on rank 0:" in training[0] and "per-rank means averaged" in training[0]
    assert sharded[0]["rank_means"]["alerts"] == sharded[1]["rank_means"]["alerts"]
