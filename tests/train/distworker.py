"""One rank of the distributed training tests (tests/train/test_distributed.py): torch.distributed's
own engines only (DistributedDataParallel, FSDP2 `fully_shard`, `torch.distributed.checkpoint`)."""

from __future__ import annotations

import os
import sys

import torch


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, engine: str, out: str, steps: int, to: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    import trainkit as tk
    from normfold import train as nftrain

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fam = tk.FAMILIES["gpt2"]
        torch.manual_seed(0)
        model = fam.build().double()
        nftrain.prepare(model, to=to)
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
            wrapped = model
        opt, sched = tk.make_optimizer("adamw", wrapped)
        g = torch.Generator().manual_seed(0)
        losses = []
        wrapped.train()
        for step in range(steps):
            batch = fam.batch(model, g)  # the single-process run's global batch; this rank takes its rows
            per = batch["input_ids"].shape[0] // world
            local = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
            torch.manual_seed(1000 * step)
            labels = local.pop("labels")  # the loss in float64 (HF's own upcasts logits to float32 only)
            logits = wrapped(**local).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if engine == "fsdp":
            import torch.distributed.checkpoint as dcp

            dcp.save(get_model_state_dict(wrapped), checkpoint_id=os.path.join(out, "dcp"))
        if rank == 0:
            torch.save({"losses": torch.tensor(losses, dtype=torch.float64),
                        "params": {k: v.detach().clone() for k, v in full.items()}},
                       os.path.join(out, "result.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(engine: str, out: str, steps: int = 20, to: str = "rmsnorm", world: int = 2) -> None:
    import torch.multiprocessing as mp

    # fork: the ranks inherit the imported modules (spawn would re-import torch and transformers per rank)
    mp.start_processes(worker, args=(world, free_port(), engine, out, steps, to), nprocs=world, join=True,
                       start_method="fork")
