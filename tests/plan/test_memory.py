"""The memory budget and the module form of the backward part (issue 17, part A).

- the module form catches a wrong backward planted in a custom autograd.Function inside a bigger
  model and names the module; a correct model gives no alert;
- the form follows the budget, and the record (CheckReport, checks.jsonl) says which ran;
- training is bit-identical with and without the watch in the module form.

Peak RSS of a watched loop within 1.1x of the same loop without the watch (one subprocess each) is asserted on
the memory section of ``gradwatch bench --quick``, in ``test_bench.py``: the same ``benchmarks/membench.py``
runs, measured once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from helpers import Act
from torch import nn

from gradwatch import GradWatch, load_config
from gradwatch.check.modules.module_form import float64_copy, module_units, run_module_check
from gradwatch.check.objective.terms import Objective
from gradwatch.cli import commands, main
from gradwatch.config import GradWatchConfig
from gradwatch.errors import ConfigError
from gradwatch.options import CheckOptions
from gradwatch.plan.memory import SAFETY, MemoryMeter, in_use_bytes, module_bytes, objective_bytes

ROOT = Path(__file__).resolve().parents[2]
make_case = commands.load_bench(ROOT / "benchmarks" / "bench.py").make_case


class Net(nn.Module):
    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), Act(False))
        self.middle = nn.Sequential(nn.Linear(16, 16), Act(wrong))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.middle(self.encoder(x)))


def xent(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def data(n: int = 12):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_module_form_catches_a_wrong_backward_and_names_the_module():
    model = Net(wrong=True)
    report = run_module_check(model, Objective(xent), data(), CheckOptions())
    assert report.form == "module"
    assert [t.name for t in report.failures] == ["middle.1:input"]
    failing = [m for m in report.localized if m.failed]
    assert [m.name for m in failing] == ["middle.1"] and failing[0].functions == ["WrongTanh"]
    assert "`middle.1` (Act, autograd.Function WrongTanh)" in str(report)


def test_module_form_correct_model_has_no_failure_and_checks_every_parameter():
    model = Net(wrong=False)
    report = run_module_check(model, Objective(xent), data(), CheckOptions())
    assert report.ok, str(report)
    names = {n for n, p in model.named_parameters()}
    assert names <= set(report.tensors)
    assert {"encoder.2:input", "middle.1:input"} <= set(report.tensors)


def test_module_form_leaves_the_live_model_untouched():
    model = Net(wrong=False)
    model.encoder.append(nn.BatchNorm1d(16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    run_module_check(model, Objective(xent), data(), CheckOptions())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_float64_copy_holds_one_module_and_no_live_dtype_copy():
    lin = nn.Linear(5, 4)
    copy = float64_copy(lin)
    assert copy.weight.dtype == torch.float64 and torch.equal(copy.weight, lin.weight.double())
    assert copy.weight.data_ptr() != lin.weight.data_ptr()


def test_module_units_are_innermost_modules_with_their_parameters():
    units = module_units(Net(), xent, data())
    assert [u.name for u in units] == ["encoder.0", "encoder.1", "encoder.2", "middle.0", "middle.1", "head"]
    assert sorted(units[1].params) == ["encoder.1.bias", "encoder.1.weight"]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_watch_in_module_form_catches_the_bench_bugs_and_no_false_alarm(name):
    # Within the cycle: a paced check (its step timed over 20 ms, as under a loaded test run) holds fewer pieces, and
    # the planted module's may come at a later check of the K (with the bug: until it is named; without: K checks).
    for bug in (True, False):
        case = make_case(name, bug, quick=True)
        named: list = []
        with GradWatch(case.model, case.loss_fn, every=1, log_dir=None, form="module") as watch:
            for check in range(8):
                case.model.zero_grad(set_to_none=True)
                case.loss_fn(case.model, case.batch).backward()
                report = watch.step(case.batch)
                assert report.form == "module"
                named = [m.name for m in report.localized if m.failed]
                if (bug and named) or check + 1 >= watch.planner._cycle.length:
                    break
                assert not named, str(report)  # nothing named falsely before the planted module's check
        if bug:
            assert named == [case.planted_module], str(report)
            assert watch.alerts and case.planted_module in watch.alerts[0].tensor
        else:
            assert report.ok and not watch.alerts, str(report)


def test_a_tiny_budget_chooses_the_module_form_and_the_record_says_so(tmp_path):
    model = Net()
    with GradWatch(model, xent, every=1, log_dir=str(tmp_path), tensorboard=False, memory_budget=1e-6) as watch:
        # In a test process the peak RSS is an earlier test's: take training's peak as what is in use now.
        watch.memory.observe = lambda: None
        watch.memory.training_peak = in_use_bytes(torch.device("cpu"))
        xent(model, data()).backward()
        report = watch.step(data())
    assert report.form == "module"
    assert any("form: module" in n and "memory_budget=1e-06" in n for n in report.notes)
    assert any("not checked, over the room" in n for n in report.notes)  # 1e-6 of the peak holds no module
    records = [json.loads(line) for line in (tmp_path / "checks.jsonl").read_text().splitlines()]
    check = [r for r in records if r["type"] == "check"][0]
    assert check["form"] == "module" and check["memory"]["memory_budget"] == 1e-6
    assert all(t["form"] == "module" for t in check["tensors"].values())


def test_a_generous_budget_keeps_the_whole_objective():
    model = Net()
    with GradWatch(model, xent, every=1, log_dir=None) as watch:
        xent(model, data()).backward()
        report = watch.step(data())
    assert report.form == "objective" and report.memory["memory_budget"] == 0.1
    assert report.memory["estimate_bytes"] <= report.memory["room_bytes"]
    assert set(report.training) == {n for n, _ in model.named_parameters()}


def test_module_form_training_bit_identical_with_and_without_the_watch():
    def train(watched: bool):
        model = Net()
        model.middle.insert(1, nn.Dropout(0.3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        watch = GradWatch(model, xent, every=1, log_dir=None, form="module") if watched else None
        torch.manual_seed(5)
        losses = []
        for step in range(4):
            batch = data(12 + step)
            opt.zero_grad()
            loss = xent(model, batch)
            loss.backward()
            if watch is not None:
                report = watch.step(batch, loss=loss)
                assert report.form == "module"
            opt.step()
            losses.append(loss.item())
        return model.state_dict(), losses, torch.get_rng_state()

    (sa, la, ra), (sb, lb, rb) = train(False), train(True)
    assert la == lb and torch.equal(ra, rb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_training_part_judges_a_rotating_subset_when_the_room_is_small():
    model = Net()
    watch = GradWatch(model, xent, every=1, log_dir=None, form="module")
    params = watch.training.params()
    one = max(p.numel() * p.element_size() for p in params.values())
    watch.memory.transient = lambda model=None: 0
    seen = set()
    for _ in range(4):
        chosen, rows = watch.training.subset(params, int(one / SAFETY) + 1, rows=False)
        assert 0 < len(chosen) < len(params) and rows == {}
        assert sum(p.numel() * p.element_size() for p in chosen.values()) <= one + 1
        seen |= set(chosen)
    assert seen == set(params)  # the rotation reaches every tensor
    watch.close()


def test_a_linear_weight_too_big_for_the_room_is_judged_by_rows_and_every_row_within_a_known_number_of_checks():
    """The LM-head case: its replayed gradient does not fit the safe share whole, so a block of its rows does, the
    next block at the next check; the replay holds those rows' gradient only, bit for bit the full gradient's rows."""
    import torch.nn.functional as F

    from gradwatch.check.judging.report import CheckReport

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4000))

    def loss_fn(m, b):
        return F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten() % 4000)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1000, log_dir=None, form="module")
    room = 2 * 200_000  # a safe share of 200 KB: the head's 256 KB gradient does not fit whole
    covered = torch.zeros(4000, dtype=torch.bool)
    for check in range(7):
        b = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(check))
        opt.zero_grad()
        loss_fn(model, b).backward()
        if check == 2:  # a wrong .grad in one row of the head's next block (what the optimizer would apply)
            g, at = model[3].weight.grad, watch.training.row_cursor["3.weight"]
            g[at + int(g[at:at + 500].norm(dim=1).argmax())] *= 2.0
        replay = watch.training.replay(watch.context.take(b, None), room=room)
        first, end = replay.rows["3.weight"]
        report = CheckReport(tensors={})
        watch.training.judge(report, replay)
        assert report.training_rows == {"3.weight": (first, end)} and end - first >= min(500, 4000 - first)
        verdict = report.training["3.weight"].verdict.value
        assert verdict == ("wrong" if check == 2 else "excellent"), (check, verdict)
        assert all(t.verdict.value == "excellent" for n, t in report.training.items() if n != "3.weight")
        watch.planner.attach(model, watch._watched_names())
        watch.planner.record(report)
        covered[first:end] = True
        opt.step()
    assert covered.all()  # every row within ceil(4000 / block) = 6 checks; the seventh starts again at row 0
    assert watch.planner.coverage.fraction("training", "3.weight") == 1.0
    assert model[3].weight.requires_grad  # put back after each replay
    watch.close()


def test_a_head_whose_weight_the_model_reads_itself_is_never_judged_by_rows_of_its_module():
    """A fused LM head (TRL's reads ``lm_head.weight`` in the model's own code; the Linear never runs): the rows' hook
    on the Linear sees nothing, so a zero gradient of its rows would be a false WRONG. Not judged at that check, said
    why, and judged whole from then on; every other tensor's verdict as before."""
    import torch.nn.functional as F

    from gradwatch.check.judging.report import CheckReport

    class FusedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.body, self.head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 4000, bias=False)

        def forward(self, ids):
            return F.linear(torch.tanh(self.body(self.emb(ids))), self.head.weight)  # the head's weight read here

    torch.manual_seed(0)
    model = FusedHead()

    def loss_fn(m, b):
        return F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten() % 4000)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1000, log_dir=None, form="module")
    reports = []
    for check, room in enumerate((2 * 200_000, 2 * 200_000, 8_000_000)):  # tight twice (rows), then room for it whole
        b = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(check))
        opt.zero_grad()
        loss_fn(model, b).backward()
        replay = watch.training.replay(watch.context.take(b, None), room=room)
        report = CheckReport(tensors={})
        watch.training.judge(report, replay)
        reports.append((replay.rows, report))
        opt.step()
    (rows0, first), (rows1, second), (_, third) = reports
    assert "head.weight" in rows0
    assert "head.weight" not in first.training
    assert not first.training_rows
    assert "head.weight not judged at this check: its module never ran in the replay" in first.training_note
    assert all(t.verdict.value == "excellent" for t in first.training.values()) and len(first.training) == 3
    assert rows1 == {} and "head.weight" not in (second.training_note or "")  # never by rows again, said once
    assert third.training["head.weight"].verdict.value == "excellent" and not third.training_rows  # whole
    assert model.head.weight.requires_grad
    watch.close()


def test_an_embedding_too_big_for_the_room_is_judged_by_token_rows():
    import torch.nn.functional as F

    from gradwatch.check.judging.report import CheckReport

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4000, 16, padding_idx=0), nn.Linear(16, 8))

    def loss_fn(m, b):
        return F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten() % 8)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1000, log_dir=None, form="module")
    b = torch.randint(0, 4000, (4, 9))
    b[0, :3] = 0  # the padding row: its gradient is 0 by definition, in the block as in the whole
    b[1, 0] = 7  # a token of the first block
    opt.zero_grad()
    loss_fn(model, b).backward()
    model[0].weight.grad[7] *= 2.0  # a wrong .grad in the row of a token the batch uses
    report = CheckReport(tensors={})
    watch.training.judge(report, watch.training.replay(watch.context.take(b, None), room=2 * 200_000))
    first, end = report.training_rows["0.weight"]
    assert first == 0
    assert end > 500
    assert model[0].weight.requires_grad
    assert report.training["0.weight"].verdict.value == "wrong"
    assert report.training["1.weight"].verdict.value == "excellent"
    watch.close()


def test_the_training_part_rotates_over_every_tensor_with_the_big_weights_by_rows_and_the_rest_whole():
    """A tight room: the token embedding and the head (each over half the safe share) are judged by equal blocks
    of rows at their turns, every other tensor whole, and every tensor gets its turn within a known number of
    checks (no big weight starves the layers after it; no small weight is cut into slivers)."""
    torch.manual_seed(0)
    layers = [nn.Embedding(4000, 16)]
    for _ in range(6):
        layers += [nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 16)]
    model = nn.Sequential(*layers, nn.Linear(16, 4000))
    watch = GradWatch(model, lambda m, b: m(b).sum(), every=1000, log_dir=None, form="module")
    params = watch.training.params()
    room = 2 * 60_000  # a safe share of 60 KB: the two 256 KB weights never fit, a few 8 KB layer weights at a time
    judged = {n: 0 for n in params}
    for check in range(16):
        out, sliced = watch.training.subset(params, room)
        assert set(sliced) <= {"0.weight", "19.weight"}
        assert all(end - first == 117 for first, end in sliced.values())  # 15 KB each: 117 rows of 128 bytes (copy and gradient)
        used = sum(p.numel() * 4 for n, p in out.items() if n not in sliced) + 117 * 128 * len(sliced)
        assert used <= 60_000
        for n in out:
            judged[n] += 1
        if check == 4:  # 12 layer weights of 8 KB, three a check beside the two blocks
            assert min(judged.values()) >= 1, [n for n, c in judged.items() if not c]
    weights = [c for n, c in judged.items() if params[n].dim() == 2]
    assert max(weights) - min(weights) <= 1  # least-judged first: the weights' turns stay even (biases fill the rest)
    watch.close()


def test_memory_budget_option_everywhere():
    assert GradWatchConfig().memory_budget == 0.1 and GradWatchConfig().form == "auto"
    assert GradWatchConfig(memory_budget=None).memory_budget is None
    assert load_config(ROOT / "configs" / "default.yaml").memory_budget == 0.1
    with pytest.raises(ConfigError, match=r"memory_budget: got -1, expected a number > 0"):
        GradWatchConfig(memory_budget=-1)
    with pytest.raises(ConfigError, match=r"form: got 'modules', expected one of auto, objective, module"):
        GradWatchConfig(form="modules")


def test_estimates_count_the_tensors_each_form_holds():
    lin = nn.Linear(100, 10)
    assert objective_bytes(lin, [], torch.float64) == 8 * 1010
    assert objective_bytes(lin, ["weight"], torch.float64) > objective_bytes(lin, [], torch.float64) + 8 * 1000
    assert module_bytes(lin.parameters(), torch.ones(4, 100)) >= 16 * 1010 + 3 * 8 * 400


def test_meter_keeps_training_peak_apart_from_the_checks():
    meter = MemoryMeter(0.1, torch.device("cpu"))
    meter.observe()
    peak = meter.training_peak
    meter.checked()
    junk = torch.ones(8 * 2**20)  # 32 MB after the check, beyond no peak of training's yet
    junk += 1
    del junk
    meter.observe()
    assert meter.training_peak >= peak and meter.room() is not None


def test_what_a_check_leaves_held_is_the_checks_not_training_peak():
    meter = MemoryMeter(0.1, torch.device("cpu"))
    meter.observe()
    peak, room = meter.training_peak, meter.room()
    kept = torch.ones(16 * 2**20)  # 64 MB a "check" allocated and still holds when it ends (a fragmented heap)
    kept += 1
    meter.checked()
    meter.observe()  # the next step: training itself allocated nothing new
    assert meter.training_peak < peak + 16 * 2**20, "the check's residue was counted as training's peak"
    # nor does it raise the room: it is the checks' own heap, which the next check reuses
    assert room is not None and abs(cast(int, meter.room()) - room) < 16 * 2**20
    del kept
    meter.checked()
    meter.observe()
    assert meter.training_peak < peak + 16 * 2**20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the budget reads torch.cuda peak allocated memory")
def test_cuda_budget_reads_allocated_memory():  # pragma: no cover - no GPU here
    model = Net().cuda()
    batch = tuple(t.cuda() for t in data())
    with GradWatch(model, xent, every=1, log_dir=None) as watch:
        xent(model, batch).backward()
        report = watch.step(batch)
    assert report.memory["device"].startswith("cuda")
    assert report.memory["training_peak_bytes"] <= torch.cuda.max_memory_allocated()


def test_gradwatch_report_says_which_form_ran(tmp_path, capsys):
    model = Net()
    with GradWatch(model, xent, every=1, log_dir=str(tmp_path), tensorboard=False, form="module") as watch:
        for _ in range(2):
            model.zero_grad()
            xent(model, data()).backward()
            watch.step(data())
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "backward part's form: 2 checks module" in out
    assert "middle.1:input" in out
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["forms"] == {"module": 2}


def test_module_form_follows_a_replaced_layer():
    model = Net(wrong=False)
    with GradWatch(model, xent, every=1, log_dir=None, form="module") as watch:
        xent(model, data()).backward()
        assert watch.step(data()).ok
        model.middle[1] = Act(wrong=True)  # same shapes, another module: the next check must see it
        model.zero_grad()
        xent(model, data()).backward()
        report = watch.step(data())
    assert [m.name for m in report.localized if m.failed] == ["middle.1"]


def test_no_budget_keeps_the_whole_objective_and_forcing_a_form_wins():
    model = Net()
    with GradWatch(model, xent, every=1, log_dir=None, memory_budget=None) as watch:
        watch.memory.observe = lambda: None
        watch.memory.training_peak = 1  # a budget would leave no room at all
        xent(model, data()).backward()
        report = watch.step(data())
    assert report.form == "objective" and report.memory["room_bytes"] is None
    with GradWatch(model, xent, every=1, log_dir=None, form="objective", memory_budget=1e-6) as watch:
        watch.memory.observe = lambda: None
        watch.memory.training_peak = in_use_bytes(torch.device("cpu"))
        report = watch.step(data())
    assert report.form == "objective" and any("form: objective (forced)" in n for n in report.notes)


def test_a_linear_too_big_for_the_room_is_checked_a_block_of_rows_at_a_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), Act(True), nn.Linear(64, 200), nn.Tanh(), nn.Linear(200, 3))
    whole = 201 * 64 * 36
    reports = [run_module_check(model, Objective(xent), data(), CheckOptions(seed=s), room=whole // 3) for s in (0, 1)]
    for report in reports:
        w = report.tensors["2.weight"]
        assert 1 <= w.shape[0] < 200
        assert w.shape[1] == 64
        assert w.verdict is not None
        assert not w.failed
        assert any("`2` (Linear) checked on output rows" in n for n in report.notes)
        assert "2:input" in report.tensors and not report.tensors["2:input"].failed
        assert [m.name for m in report.localized if m.failed] == ["1"]  # the planted bug is still caught
    rows = [next(n for n in r.notes if "`2` (Linear) checked on output rows" in n) for r in reports]
    assert rows[0] != rows[1]  # the block moves with the check's seed


@pytest.mark.slow
def test_peak_is_this_process_image_not_a_bigger_parent():
    """Linux keeps ru_maxrss across exec: a watched run started by a big launcher (a test runner, a
    benchmark driver) must not read the launcher's peak as training's (the budget would be too big)."""
    import mmap

    # 1.5 GB resident (mapped populated: the kernel fills it in one go, where touching it page by page took 8 s of CPU):
    # this process's peak RSS is above that, and the child's ru_maxrss starts there
    ballast = mmap.mmap(-1, 1_500_000_000, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    code = "import torch; from gradwatch.plan.memory import peak_bytes; print(peak_bytes(torch.device('cpu')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    ballast.close()
    child = int(out.stdout.strip())
    assert 0 < child < 1_000_000_000, child  # the child's own peak (torch imported: a few hundred MB)


def test_no_peak_to_read_means_no_bound(monkeypatch):
    """Windows has neither /proc nor the resource module (it cannot run here): with no peak to read, the
    budget bounds nothing (the whole objective runs) rather than leaving a room of 0 that would skip every check."""
    from gradwatch.plan import memory as memory

    monkeypatch.setattr(memory, "_rss_peak_bytes", lambda: 0)
    monkeypatch.setattr(memory, "_rss_now_bytes", lambda: None)
    meter = memory.MemoryMeter(0.1, torch.device("cpu"))
    meter.observe()
    assert meter.training_peak == 0 and meter.room() is None


def test_a_sharded_piece_room_is_what_the_process_may_still_add_the_heap_given_back_first():
    """The heap left holding what earlier pieces freed is given back before a piece's room is measured; a piece's room
    is never more than what the process may still add under the pieces' limit."""
    from gradwatch.check.modules.module_form import _measured

    cpu = torch.device("cpu")
    now = in_use_bytes(cpu)
    assert _measured(1 << 20, now + (64 << 20), cpu) == 1 << 20  # room to spare: the estimate's room stands
    assert _measured(64 << 20, now + (4 << 20), cpu) <= 8 << 20  # the limit binds (a few MB of measurement slack)
    junk = [torch.ones(1 << 14) for _ in range(2000)]  # 128 MB of small blocks, freed into the heap
    pin = torch.ones(1 << 14)  # above them in the heap: glibc cannot give them back by itself when they are freed
    held = in_use_bytes(cpu)
    del junk
    assert in_use_bytes(cpu) > held - (96 << 20)  # glibc keeps most of it: the process still holds it
    assert _measured(16 << 20, held - (64 << 20), cpu) > 0  # given back first, the piece gets room again
    del pin


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set size from /proc")
def test_what_the_checks_left_and_training_freed_again_does_not_raise_the_room():
    """Each check leaves 64 MB held that training's next step frees (as ZeRO-3's checks left about 80 MB each at
    20.8M): the room must not grow by it check after check (it grew from 484 MB to 993 MB over 8 checks)."""
    meter = MemoryMeter(0.1, torch.device("cpu"))
    left = []
    rooms = []
    for _ in range(5):
        meter.observe()
        rooms.append(cast(int, meter.room()))
        left.append(torch.ones(8 << 20, dtype=torch.float64))  # 64 MB the check leaves held
        meter.checked()
        left.clear()  # freed by training's next step
    assert max(rooms) - rooms[0] < 32 << 20, [r >> 20 for r in rooms]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set size from /proc")
def test_a_replay_that_rose_above_the_ceiling_leaves_its_blocks_less_room_from_then_on():
    """Shard by shard, the training part's replay sizes its checkpointed blocks from an estimate that misses what a
    sharded backward adds; where the peak a replay reached rose above the check's ceiling, the later replays size
    them for that much less room. A peak that did not rise teaches nothing. (A fresh process: its peak is its own.)"""
    code = """
import torch
from torch import nn
from gradwatch import GradWatch
from gradwatch.plan.memory import in_use_bytes, peak_bytes
cpu = torch.device("cpu")
watch = GradWatch(nn.Linear(4, 1), lambda m, b: m(b).sum(), every=1, log_dir=None, memory_budget=0.01)
part, meter = watch.training, watch.training.watch.memory
meter.observe()
now, room, ceiling = in_use_bytes(cpu), meter.room(), meter.ceiling()
assert abs(now + room - ceiling) < 2 << 20, (now, room, ceiling)  # the ceiling is the room's bound
before = peak_bytes(cpu)
over = torch.ones((ceiling - now + (48 << 20)) // 4)  # a "replay" 48 MB above the ceiling
over += 1
part._learn_overshoot(before)
learned = part.overshoot
del over
part._learn_overshoot(peak_bytes(cpu))  # nothing rose: nothing learned
print(learned >> 20, part.overshoot >> 20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    learned, kept = map(int, out.stdout.split())
    assert 40 <= learned <= 56 and kept == learned, out.stdout
