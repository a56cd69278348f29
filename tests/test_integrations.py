"""gradsync inside the frameworks that wrap DDP for their users: PyTorch Lightning (through
``gradsync.lightning.Strategy``) and Hugging Face Accelerate (the documented recipe:
``accelerator.prepare(model)``, then ``gradsync.register_comm_hook``). Two CPU ranks on loopback,
each framework run as its users run it, against the same framework with plain DDP.

The worlds look like torchrun's to the frameworks (``TORCHELASTIC_RUN_ID``, ranks in the
environment) and their process group already exists (FileStore), so neither starts processes or
listens on a port of its own.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from worlds import expect_all, run_checks, run_world, same_on_every_rank

pytestmark = pytest.mark.timeout(600)

TORCHRUN_ENV = {
    "TORCHELASTIC_RUN_ID": "gradsync-test",
    "LOCAL_RANK": "{rank}",
    "GROUP_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",  # never used: the process group exists before the framework looks
    "OMP_NUM_THREADS": "1",
}


def dataset(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 2))


def params(module):
    return [p.detach().clone() for p in module.parameters()]


# ------------------------------------------------------------------------------------ Lightning
def lightning_world(tmp):
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    import gradsync.lightning

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def fit(strategy, steps=24, ckpt_path=None, **trainer_kw):
        torch.manual_seed(0)
        module = Classifier()
        module.losses = []
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            deterministic=True, **trainer_kw,
        )  # fmt: skip
        trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
        return trainer, module

    def check_none_is_lightnings_own_ddp():
        """Bit for bit (on CPU, where DDPStrategy ignores hooks)."""
        _, ref = fit(DDPStrategy())
        strategy = gradsync.lightning.Strategy("none")
        _, ours = fit(strategy)
        assert strategy.hook_state is not None and strategy.hook_state.step == 24  # it did synchronize
        for a, b in zip(params(ref), params(ours), strict=True):
            assert torch.equal(a, b), float((a - b).abs().max())

    def check_compressed_with_accumulation_and_a_checkpoint():
        """A compressed scheme trains, the same model on every rank, with Lightning's accumulation;
        its compression state survives a Lightning checkpoint, per rank."""
        strategy = gradsync.lightning.Strategy(
            "topk:density=0.05", sync_options={"min_compress_bytes": 0}, find_unused_parameters=True
        )
        trainer, model = fit(strategy, steps=40, accumulate_grad_batches=2)
        with expect_all() as expect:
            with expect("trained, one model everywhere"):
                same_on_every_rank(params(model), "lightning topk")
                assert sum(model.losses[-5:]) < sum(model.losses[:5]), model.losses
            path = os.path.join(tmp, "last.ckpt")
            trainer.save_checkpoint(path)
            with expect("the checkpoint has this rank's compression state"):
                assert os.path.isfile(f"{path}.gradsync-rank{dist.get_rank()}.pt")
            resumed = gradsync.lightning.Strategy("topk:density=0.05", sync_options={"min_compress_bytes": 0},
                                                  find_unused_parameters=True)  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no "starts afresh" warning
                fit(resumed, steps=44, ckpt_path=path, accumulate_grad_batches=2)
            with expect("resumed: 40 steps restored, 4 more"):
                assert resumed.hook_state is not None and resumed.hook_state.step == 44

    def check_model_checkpoint_prunes_every_ranks_part():
        """ModelCheckpoint keeping one checkpoint removes the older ones' per-rank compression
        state too: every part left belongs to a checkpoint that is left."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        folder = os.path.join(tmp, "pruned")
        torch.manual_seed(0)
        module = Classifier()
        module.losses = []
        keep = ModelCheckpoint(dirpath=folder, save_top_k=1, every_n_train_steps=4)
        strategy = gradsync.lightning.Strategy("topk:density=0.05", sync_options={"min_compress_bytes": 0})
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=12, logger=False, callbacks=[keep],
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True))
        dist.barrier()
        names = sorted(os.listdir(folder))
        ckpts = [n for n in names if n.endswith(".ckpt")]
        parts = sorted(n for n in names if ".gradsync-rank" in n)
        assert len(ckpts) == 1, names
        assert parts == [f"{ckpts[0]}.gradsync-rank{r}.pt" for r in range(2)], names

    def check_error_feedback_told_the_loss_scale_under_16_mixed():
        from lightning.pytorch.plugins import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        strategy = gradsync.lightning.Strategy("topk:density=0.05", sync_options={"min_compress_bytes": 0})
        _, model = fit(strategy, steps=8, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        same_on_every_rank(params(model), "lightning 16-mixed topk")
        assert strategy.hook_state.loss_scale == scaler.get_scale() != 1.0

    def check_options_are_checked_before_anything_starts():
        with pytest.raises(ValueError, match="sync: plan must be one of auto, compress, dense"):
            gradsync.lightning.Strategy("none", sync_options={"plan": "always"})
        with pytest.raises(ValueError, match="registers its own DDP comm hook"):
            gradsync.lightning.Strategy("none", ddp_comm_hook=lambda s, b: None)

    def check_fsdp2_under_model_parallel_strategy():
        """Lightning's FSDP2 strategy (ModelParallelStrategy): fully_shard then compress_fsdp in
        configure_model. "none" is the plain strategy bit for bit; top-k trains."""
        from lightning.pytorch.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import fully_shard

        import gradsync.fsdp

        class Sharded(L.LightningModule):
            def __init__(self, scheme):
                super().__init__()
                self.scheme, self.net, self.losses, self.comp = scheme, net(), [], None

            def configure_model(self):
                mesh = self.device_mesh["data_parallel"]
                for layer in (self.net[0], self.net[2], self.net):
                    fully_shard(layer, mesh=mesh)
                if self.scheme is not None:
                    self.comp = gradsync.fsdp.compress_fsdp(self.net, self.scheme, min_compress_bytes=0)

            def training_step(self, batch, _):
                x, y = batch
                loss = nn.functional.cross_entropy(self.net(x), y)
                self.losses.append(float(loss.detach()))
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

        def run(scheme):
            torch.manual_seed(0)
            module = Sharded(scheme)
            trainer = L.Trainer(
                accelerator="cpu", devices=2, strategy=ModelParallelStrategy(2, 1), max_steps=20,
                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, deterministic=True,
            )  # fmt: skip
            trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True))
            return module, torch.cat([p.full_tensor().detach().reshape(-1) for p in module.net.parameters()])

        _, plain = run(None)
        _, none = run("none")
        topk, flat = run("topk:density=0.1")
        with expect_all() as expect:
            with expect("none == Lightning's FSDP2, bit for bit"):
                assert torch.equal(plain, none)
            with expect("top-k trains, compressing"):
                assert sum(topk.losses[-5:]) < sum(topk.losses[:5]), topk.losses
                assert topk.comp is not None and topk.comp.residual_norm() > 0
            same_on_every_rank([flat], "lightning fsdp2 topk")

    run_checks(
        check_fsdp2_under_model_parallel_strategy,
        check_none_is_lightnings_own_ddp,
        check_compressed_with_accumulation_and_a_checkpoint,
        check_model_checkpoint_prunes_every_ranks_part,
        check_error_feedback_told_the_loss_scale_under_16_mixed,
        check_options_are_checked_before_anything_starts,
    )


def test_lightning_strategy(tmp_path):
    pytest.importorskip("lightning")
    run_world(2, lightning_world, str(tmp_path), env=TORCHRUN_ENV)


# ----------------------------------------------------------------------------------- Accelerate
def accelerate_world():
    from accelerate import Accelerator

    def train(scheme, steps=20, accumulate=1):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
        torch.manual_seed(0)
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        loader = DataLoader(dataset(), batch_size=8, shuffle=True)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        state = None
        if scheme is not None:  # the recipe: one call after prepare()
            state = gradsync.register_comm_hook(model, scheme, min_compress_bytes=0)
        losses, done = [], 0
        while done < steps:
            for x, y in loader:
                with accelerator.accumulate(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    opt.step()
                    opt.zero_grad()
                losses.append(float(loss))
                done += 1
                if done == steps:
                    break
        if state is not None:
            state.close()
        return accelerator.unwrap_model(model), losses

    def check_none_is_plain_accelerate():
        ref, _ = train(None)
        ours, _ = train("none")
        for a, b in zip(params(ref), params(ours), strict=True):
            assert torch.equal(a, b), float((a - b).abs().max())

    def check_powersgd_trains_with_accumulation():
        model, losses = train("powersgd:rank=2", steps=40, accumulate=2)
        same_on_every_rank(params(model), "accelerate powersgd")
        assert sum(losses[-5:]) < sum(losses[:5]), losses

    run_checks(check_none_is_plain_accelerate, check_powersgd_trains_with_accumulation)


def test_accelerate_recipe():
    pytest.importorskip("accelerate")
    run_world(2, accelerate_world, env=TORCHRUN_ENV)
