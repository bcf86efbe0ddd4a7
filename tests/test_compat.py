"""lmtrain.training.compat on real objects of the pinned torch and Lightning: an upgrade that renames a private member lmtrain
relies on fails here, naming it."""

from __future__ import annotations

import importlib

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lmtrain.training import compat


@pytest.mark.parametrize("path", sorted(compat.SUBCLASS_PRIVATES))
def test_the_private_members_our_subclasses_use_exist(path, tmp_path):
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if name == "MLFlowLogger":  # instance attributes: set by __init__
        obj = cls(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
        missing = [m for m in compat.SUBCLASS_PRIVATES[path] if not hasattr(obj, m)]
    else:
        missing = [m for m in compat.SUBCLASS_PRIVATES[path] if not (hasattr(cls, m) or m in cls.__init__.__code__.co_names)]
    assert not missing, f"{path} no longer has {missing}: see lmtrain/training/compat.py"


def test_trainer_privates_after_a_real_fit(tmp_path):
    trainer = L.Trainer(
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, limit_val_batches=0, accelerator="cpu", devices=1,
    )  # fmt: skip
    model = BoringModel()
    ends = []
    model.on_before_backward = lambda loss: ends.append(compat.ends_optimizer_step(trainer))
    trainer.fit(model)
    assert ends == [True] * 3  # no accumulation: every micro-batch ends its step
    assert compat.step_number(trainer) == 4  # the next step's number: 3 were done
    state = compat.dump_checkpoint(trainer)
    assert state["global_step"] == 3 and set(state["state_dict"]) == set(model.state_dict()) and state["optimizer_states"]
    mesh = object()
    compat.set_module_device_mesh(model, mesh)
    assert model.device_mesh is mesh
    ends.clear()
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, limit_val_batches=0, accelerator="cpu", devices=1, accumulate_grad_batches=3,
    )  # fmt: skip
    trainer.fit(model)  # 3 micro-batches a step: the third ends it
    assert ends == [False, False, True] * 2


def test_config_node_returns_the_unresolved_node():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"a": {"b": "${missing.key}", "c": "???"}})
    node = compat.config_node(cfg, "a")
    assert OmegaConf.is_config(node) and compat.config_node(node, "b")._value() == "${missing.key}"


def test_grad_scaler_privates():
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    (scaler.scale(p.sum()) * float("inf")).backward()
    assert compat.scaler_scale(scaler).item() == 64.0
    assert compat.scaler_found_inf(scaler, opt) == {}  # before unscale_
    scaler.unscale_(opt)
    assert [f.item() for f in compat.scaler_found_inf(scaler, opt).values()] == [1.0]


def test_forget_mesh_groups_on_a_real_gloo_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        assert mesh._pg_registry  # what forget_mesh_groups clears
        dist.destroy_process_group()
        assert compat.forget_mesh_groups() >= 1 and not mesh._pg_registry
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_dtensor_around_keeps_the_local_tensor_where_it_is(tmp_path):
    """compat.dtensor_around: the layout of a real DTensor around a local tensor of another device, not moved (a meta
    tensor on a CPU mesh here; a host buffer on a CUDA mesh in an asynchronous save, which DTensor.from_local moved to
    the GPU: tests/test_checkpoint.py's host-copy test checks that case on a GPU), and a host tensor not copied."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lmtrain.train import _close_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        like = distribute_tensor(torch.randn(8, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        local = torch.empty(8, 4, device="meta")
        around = compat.dtensor_around(local, like)
        assert isinstance(around, DTensor) and around.to_local().device.type == "meta" and around.device_mesh == like.device_mesh
        host = torch.zeros(8, 4)
        assert compat.dtensor_around(host, like).to_local().data_ptr() == host.data_ptr()  # no copy
        assert around.placements == like.placements and around.shape == like.shape and not around.requires_grad
    finally:
        _close_process_group()  # as train.py closes: no group left to a later fork


def test_which_strategies_save_sharded_checkpoints():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    assert compat.saves_sharded(ModelParallelStrategy()) and not compat.saves_sharded(
        ModelParallelStrategy(save_distributed_checkpoint=False)
    )
    assert compat.saves_sharded(FSDPStrategy(state_dict_type="sharded")) and not compat.saves_sharded(FSDPStrategy())
    assert not compat.saves_sharded(DDPStrategy())


def test_checkpoint_wrapper_recomputes_the_same_block():
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.GELU())
    wrapped = compat.checkpoint_wrapper(block)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    wrapped(x).sum().backward()  # the recomputation replays the dropout mask: the gradient is the plain block's
    g = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    block(x).sum().backward()
    assert torch.equal(g, x.grad) and type(wrapped).__name__ == "CheckpointWrapper"


# CPU attention: PyTorch's fused kernel without attention dropout, the math path's products with it; fp8: torchao's float8 products
@pytest.mark.parametrize("dropout,fp8", [(0.0, False), (0.1, False), (0.0, True)], ids=["fused-attention", "dropout", "fp8"])
def test_op_level_checkpointing_keeps_the_products_and_recomputes_the_rest(dropout, fp8):
    """``checkpoint_wrapper(keep_products=True)`` (``strategy.activation_checkpointing=op``) on a real Llama-style
    decoder, in fp32 and with torchao's float8 products: the gradients are the plain model's bit for bit (the
    dropout masks replayed); the backward pass
    recomputes the blocks' SiLU (their cheap work) but not one of their matrix products or attention calls, where
    full checkpointing recomputes them all."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmtrain.nn.model import Decoder

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def run(mode):
        torch.manual_seed(0)
        model = Decoder(
            family="llama", vocab_size=96, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, dropout=dropout, attention_dropout=dropout
        )
        if fp8:
            from lmtrain.training import fp8 as fp8_module

            fp8_module.convert(model, "tensorwise", sharded=False, device=torch.device("cpu"))
        if mode != "none":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = compat.checkpoint_wrapper(block, keep_products=mode == "op")
        idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)  # the dropout masks
        loss = model(idx, idx)
        with Count() as count:
            loss.backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
        return grads, count.ops

    def replayed(ops, plain_ops, name):
        return sum(ops.count(o) - plain_ops.count(o) for o in set(ops) if name(o) and "backward" not in o)

    plain, plain_ops = run("none")
    for mode in ("op", "full"):
        grads, ops = run(mode)
        assert grads.keys() == plain.keys() and all(torch.equal(grads[n], plain[n]) for n in plain), mode
        products = replayed(ops, plain_ops, lambda o: o in ("mm", "_scaled_mm"))  # qkv, proj, gate_up, down: 4 per block
        attention = replayed(ops, plain_ops, lambda o: o == "bmm" or "scaled_dot_product" in o)
        silu = replayed(ops, plain_ops, lambda o: o == "silu")
        assert silu == 2, (mode, silu)
        # full: every product up to the last one the backward needs (PyTorch stops replaying there: 3 or 4 per block)
        assert (products, attention) == (0, 0) if mode == "op" else (products >= 6 and attention == 2 * (1 + (dropout > 0))), (
            mode,
            products,
            attention,
        )


def test_op_level_checkpointing_writes_nothing_it_keeps_and_its_compile_advice_is_not_printed(capfd):
    """Under compile, torch advises once per rank that a checkpointed region with a policy must not hold in-place
    ops. Ours: in OPT and Llama blocks, with dropout and with float8 products, no op writes into a tensor the policy
    keeps or into the block's input (PyTorch's own kernels write only into their fresh temporaries: dropout's mask,
    rms_norm's sum), so the advice is dropped; torch's other warnings on that logger still print. A compiled
    checkpointed model (``aot_eager``: no C compiler needed) then prints no such line."""
    import logging

    from torch.utils._python_dispatch import TorchDispatchMode

    from lmtrain.nn.model import Decoder
    from lmtrain.training import fp8 as fp8_module

    class Writes(TorchDispatchMode):
        """Every op that writes into a kept tensor (an input of the region or a product's output)."""

        def __init__(self, inputs):
            super().__init__()
            self.kept, self.bad, self.seen = list(inputs), [], set()  # the kept tensors stay referenced: no reused storage

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func._schema.is_mutable:
                self.seen.add(str(func))
                values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
                written = [values.get(a.name) for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
                kept = {t.untyped_storage().data_ptr() for t in self.kept}
                if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in kept for t in written):
                    self.bad.append(str(func))
            out = func(*args, **kwargs)
            if func in compat._KEPT:
                self.kept += [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            return out

    for family in ("opt", "llama"):
        for dropout, fp8 in ((0.0, False), (0.1, False), (0.1, True)):
            torch.manual_seed(0)
            model = Decoder(family=family, vocab_size=96, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, dropout=dropout,
                            attention_dropout=dropout)
            if fp8:
                fp8_module.convert(model, "tensorwise", sharded=False, device=torch.device("cpu"))
            for i, block in enumerate(model.blocks):
                model.blocks[i] = compat.checkpoint_wrapper(block, keep_products=True)
            x = torch.randn(2, 16, 32, requires_grad=True)
            rope = ((model.rope_cos[:16], model.rope_sin[:16]),) if family == "llama" else ()
            with Writes([x]) as forward:
                y = model.blocks[0](x, *rope)
            with Writes([x, *forward.kept]) as recompute:
                y.sum().backward()
            assert forward.bad == recompute.bad == [], (family, dropout, fp8, forward.bad, recompute.bad)
            if dropout:  # the check saw writes (the dropout mask's), none of them into kept tensors
                assert "aten.bernoulli_.float" in forward.seen | recompute.seen, forward.seen

    log = logging.getLogger("torch._higher_order_ops.wrap")

    def record(msg):
        return logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, (), None)

    assert not log.filter(record(f"\nDetected that {compat.IN_PLACE_ADVICE}.\nPlease make sure ..."))
    assert log.filter(record("another warning of that logger"))
    records = []
    catch = logging.Handler()
    catch.emit = records.append  # what passes the logger's filters, however torch's logging prints it
    log.addHandler(catch)
    try:
        torch.manual_seed(0)
        model = Decoder(family="llama", vocab_size=96, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, dropout=0.0)
        for i, block in enumerate(model.blocks):
            block = compat.checkpoint_wrapper(block, keep_products=True)
            block.compile(backend="aot_eager")
            model.blocks[i] = block
        model(torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))).backward()
    finally:
        log.removeHandler(catch)
    assert not [r.getMessage() for r in records if "context_fn" in r.getMessage()]
    assert "context_fn" not in capfd.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="FlexAttention's backward pass runs on a GPU only (run there: docs/BENCHMARKS.md)"
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-blocks", "compiled-blocks"])
def test_op_level_checkpointing_keeps_flex_attention_under_the_document_mask(compiled, monkeypatch):
    """``activation_checkpointing=op`` with the document mask on a GPU, where attention runs in FlexAttention's kernel.
    The gradients are the unwrapped model's (to float tolerance: the compiled kernels may order their sums
    differently), with the blocks run as they are and compiled (``module.compile`` under fsdp). In compiled blocks the policy
    sees FlexAttention and keeps its output, like SDPA's. In eager blocks FlexAttention is its own compiled function,
    which the policy never sees: it is run again in the backward pass (docs/scale-out.md says so)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from lmtrain.nn.model import Decoder

    seen, policy = [], compat.keep_products_policy

    def recording_policy(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        seen.append((str(op), decision))
        return decision

    monkeypatch.setattr(compat, "keep_products_policy", recording_policy)

    def run(op_mode):
        torch.manual_seed(0)
        model = Decoder(family="llama", vocab_size=256, max_seq_len=256, d_model=128, n_layers=2, n_heads=4, dropout=0.0).cuda()
        model.flex_attention = True
        for i, block in enumerate(model.blocks):
            if op_mode:
                block = compat.checkpoint_wrapper(block, keep_products=True)
            if compiled:
                block.compile()
            model.blocks[i] = block
        idx = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(1)).cuda()
        doc = (torch.arange(256) >= 100).long().expand(2, 256).cuda()  # two documents per row
        model(idx, idx, doc).backward()
        return {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}

    plain = run(False)
    grads = run(True)
    assert grads.keys() == plain.keys()
    for n in plain:
        torch.testing.assert_close(grads[n], plain[n], rtol=1e-4, atol=1e-5, msg=n)
    flex = [decision for op, decision in seen if "flex_attention" in op]
    assert seen and all(d == CheckpointPolicy.MUST_SAVE for d in flex), sorted({op for op, _ in seen})
    assert bool(flex) == compiled, sorted({op for op, _ in seen})


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_state_inside_a_real_lightning_checkpoint(tmp_path, workers):
    """loader_states / sampler_state find our sampler's position in torchdata's layout (with and without workers) as
    Lightning saves it, and set_epoch_progress sets the fit loop's batch counters Lightning then restores."""
    from lightning.pytorch.demos.boring_classes import RandomDataset

    from lmtrain.data.datamodule import BlockSampler, ResumableLoader

    class Model(BoringModel):
        def train_dataloader(self):
            return ResumableLoader(RandomDataset(32, 64), batch_size=2, sampler=BlockSampler(64, batch_size=2), num_workers=workers)

    class AtStep5(L.Callback):  # where our checkpointer takes it: at the end of a training batch
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 5:
                self.checkpoint = compat.dump_checkpoint(trainer)

    grab = AtStep5()
    trainer = L.Trainer(
        max_steps=8, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, limit_val_batches=0, accelerator="cpu", devices=1, use_distributed_sampler=False, callbacks=[grab],
    )  # fmt: skip
    trainer.fit(Model())
    checkpoint = grab.checkpoint
    (loader,) = compat.loader_states(checkpoint)
    state = compat.sampler_state(loader)
    assert state["epoch"] == 0 and state["position"] == 10 and state["num_replicas"] == 1
    compat.set_epoch_progress(checkpoint, 3, 7, last=False)
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"]["ready"] == 3 and progress["total"]["ready"] == 7 and not progress["is_last_batch"]
    assert progress["current"]["completed"] == 2  # one behind ready, as saved (the batch's end, before Lightning counts it)


def test_read_distributed_checkpoint_without_a_process_group(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer_0": {"state": {"w": {"step": torch.tensor(3.0)}},
                                                                                 "param_groups": [{"lr": 0.1, "params": ["w"]}]}}  # fmt: skip
    dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    got = compat.read_distributed_checkpoint(tmp_path / "c")
    assert torch.equal(got["state_dict"]["w"], state["state_dict"]["w"])
    assert got["optimizer_0"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    assert float(got["optimizer_0"]["state"]["w"]["step"]) == 3.0
