"""GradWatchCallback under Lightning's ``ModelParallelStrategy``: FSDP2 through ``configure_model``, 2 CPU ranks.

The model is checked shard by shard (:mod:`gradwatch.parallel.shard_check`): each rank checks the rows
it holds and judges its shard of ``.grad``. A correct model gives checks on both verdicts and no
alert; a wrong backward planted in one layer is named by its module.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch.distributed as dist
from helpers import run_launcher

pytest.importorskip("lightning")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)


SCRIPT = textwrap.dedent(
    r'''
    import json, os, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from gradwatch.integrations.lightning import GradWatchCallback

    class WrongTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = torch.tanh(x)
            ctx.save_for_backward(y)
            return y
        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * 1.3 * (1 - y * y)

    class Act(nn.Module):
        def __init__(self, bug):
            super().__init__()
            self.bug = bug
        def forward(self, x):
            return WrongTanh.apply(x) if self.bug else torch.tanh(x)

    class Net(L.LightningModule):
        def __init__(self, bug):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), Act(False), nn.Linear(64, 64), Act(bug), nn.Linear(64, 1))
        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        def training_step(self, batch, i):
            return F.mse_loss(self.net(batch[0]), batch[1])
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Dump(L.Callback):
        def __init__(self, watcher, out, name):
            self.watcher, self.out, self.name = watcher, out, name
        def on_train_end(self, trainer, pl_module):
            watch = self.watcher.watch
            info = {"distributed": watch.dist is not None, "counts": watch.check_counts,
                    "training": {n: v["training"] for n, v in watch.coverage.items()},
                    "alerts": [(a.kind, a.tensor, str(a.message)[:300]) for a in watch.alerts]}
            with open(os.path.join(self.out, f"{self.name}_rank{trainer.global_rank}.json"), "w") as f:
                json.dump(info, f)

    if __name__ == "__main__":
        torch.set_num_threads(1)
        out = sys.argv[1]
        for name in sys.argv[2].split(","):  # one launch, one Trainer fit after the other
            torch.manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
            watcher = GradWatchCallback(lambda m, b: F.mse_loss(m.net(b[0]), b[1]), every=2)
            trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4, logger=False,
                                strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                                callbacks=[watcher, Dump(watcher, out, name)], enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(Net(name == "bug"), torch.utils.data.DataLoader(data, batch_size=8))
    '''
)


NAMES = ("correct", "bug")


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict:
    """Both fits (a correct model, one with a wrong backward planted) in one launch of 2 ranks: each name's ranks'
    records."""
    tmp_path = tmp_path_factory.mktemp("model_parallel")
    run_launcher(SCRIPT, tmp_path / "fit.py", [str(tmp_path), ",".join(NAMES)], 180, "Lightning ModelParallelStrategy fits")
    return {name: [json.loads((tmp_path / f"{name}_rank{r}.json").read_text()) for r in range(2)] for name in NAMES}


def test_correct_model_checked_on_both_verdicts_without_alert(fits):
    r0, r1 = fits["correct"]
    assert r0["distributed"] and r1["distributed"]
    assert r0["alerts"] == [] and r1["alerts"] == []
    names = {f"net.{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")}
    assert set(r0["counts"]) == names and all(c == 2 for c in r0["counts"].values())  # steps 0 and 2
    assert all(r0["training"][n] == 1.0 for n in names)


def test_planted_wrong_backward_is_named(fits):
    r0, r1 = fits["bug"]
    assert r0["alerts"] == r1["alerts"]
    named = {tensor for kind, tensor, _ in r0["alerts"] if kind == "threshold"}
    assert named == {"net.3:input"}  # checked shard by shard: the wrong tanh itself, module net.3
