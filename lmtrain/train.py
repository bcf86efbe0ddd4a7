"""Train a decoder-only LM: compose the Hydra config, validate, instantiate, fit (``lmtrain train``, or
``python train.py`` in a checkout; the same command line either way).

python train.py                                   # the CPU quickstart on the embedded corpus
python train.py model=opt-125m trainer=gpu optimizer.lr=1e-4 trainer.max_steps=100
python train.py -m optimizer.lr=1e-3,3e-4         # a sweep: one run directory per job
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from lmtrain import config_dir
from lmtrain.errors import PREEMPTED_EXIT, InputError, Preempted, RunStopped
from lmtrain.training.config import explain_hydra_error  # (importing lmtrain.training.config registers the run-name resolver)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # each job of a sweep gets its own directory under the sweep's
        with open_dict(cfg):
            cfg.run_dir = hc.runtime.output_dir
            cfg.run_name = f"{cfg.run_name}-{hc.job.num}"
    from lmtrain.training.run import train  # here, not at the top: --help, --cfg and a misspelled key answer in a second

    try:
        metrics = train(cfg)
    except InputError as exc:  # config, data, tokenizer, checkpoint or disk: one message, no traceback
        print(f"error: {exc}", file=sys.stderr)
        if _other_ranks():
            _leave_at_once(2, with_traceback=False)
        sys.exit(2)
    except RunStopped as exc:  # every rank took the same decision: leave together, not finished
        print(f"stopped: {exc.reason}", file=sys.stderr)
        sys.exit(exc.status)
    except Preempted as exc:  # a signal, agreed by every rank at one step: saved, not finished
        print(f"preempted: {exc.reason}", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT)
    except BaseException:
        if _other_ranks():
            _leave_at_once(1, with_traceback=True)
        raise
    finally:
        _close_process_group()
    return metrics.get("val/loss")  # the value a sweeper would optimise


def _other_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _leave_at_once(code: int, with_traceback: bool) -> None:
    """A failure on this rank while the others may be inside a collective that will never complete. Tearing the
    NCCL communicator down (destroy_process_group, or its destructor at exit) waits for those ranks: the process
    would never exit, and the launcher (torchrun, srun, Lightning's) never learn that it failed. Print the error
    and exit now; the launcher then ends the other ranks. Logs, loggers and checkpoints are already closed by
    then (lmtrain.training.run)."""
    import logging
    import os
    import traceback

    if with_traceback:
        traceback.print_exc()
    print("[lmtrain] this rank failed: exiting without waiting for the other ranks", file=sys.stderr)
    logging.shutdown()  # flush the run's log file
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _close_process_group() -> None:
    """Tear every process group down, and free them, before the interpreter exits.

    ``destroy_process_group`` only unregisters the groups: a gloo group's worker threads live as long as the
    Python objects that hold it. Under FSDP2 those are the FSDP state of the model (freed by a collection: it sits
    in reference cycles) and the ``DeviceMesh`` objects, which DTensor's global sharding caches keep alive until
    the interpreter's finalization. Freed there, a gloo thread still releasing a tensor needs the GIL of a
    finalizing interpreter, is unwound by ``pthread_exit`` through a ``noexcept`` frame, and the process aborts with
    "terminate called without an active exception" after a successful run (rare: a race; seen in CI). Measured on
    a 2-rank gloo FSDP run: after ``destroy_process_group`` 4 gloo worker threads, the transport threads and the
    TCP store thread were still running; after the steps below, none. A failed rank with others never gets here
    (``_leave_at_once``)."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - another rank already gone: still release ours
        pass
    dist.destroy_process_group()
    gc.collect()  # the FSDP state (reference cycles) and whatever else still holds a group
    from lmtrain.training.compat import forget_mesh_groups

    forget_mesh_groups()  # the meshes' own references to their groups (tests/test_distributed.py checks the threads go)


def cli() -> None:
    """``main`` with Hydra's own composition errors (a misspelled key or option on the command line) answered like
    ours: one line naming it, with a did-you-mean, exit status 2. ``HYDRA_FULL_ERROR=1`` makes Hydra raise them
    instead of printing its text; set by the user, it keeps Hydra's full traceback."""
    import faulthandler
    import os

    from hydra.errors import HydraException

    # A crash in native code (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) prints where every thread of this rank was
    # before the process dies of it: a launch with several ranks otherwise shows only the other ranks' "connection
    # closed by peer" and one rank's exit status (-11 for a segmentation fault).
    faulthandler.enable(all_threads=True)
    user_full_error = "HYDRA_FULL_ERROR" in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except HydraException as exc:
        if user_full_error:
            raise
        print(f"error: {explain_hydra_error(exc)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
