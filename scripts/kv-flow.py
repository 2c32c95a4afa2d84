#!/usr/bin/env python3
"""A vLLM-shaped KV flow between two processes of one host, through te's Python API.

Prefill (the target, a child process) and decode (this process) each hold per-layer KV
caches in vLLM's FlashAttention layout — one joint ``[2, blocks, block_tokens, heads,
head_dim]`` bf16 tensor per layer — registered with ``register_kv_caches``. Decode
pulls batches of random block ids (``pull_blocks``) and pushes others back
(``push_blocks``), as a connector does, and checks the bytes of one batch each way.
Both engines use their defaults for everything but the backend (tcp), so two processes
of one host take te's same-host channel unless ``--no-local-ipc`` says otherwise.

``--device cuda:0`` needs torch and a GPU; ``--device host`` uses numpy arrays.

    python3 scripts/kv-flow.py --device cuda:0 --duration 2
    python3 scripts/kv-flow.py --device cuda:0 --no-local-ipc     # the socket path
    python3 scripts/kv-flow.py --device cuda:0 --caller-reads     # caller_reads = true
"""

import argparse
import json
import multiprocessing as mp
import random
import time


def caches(args):
    """Per layer a joint K/V cache, and a function that fills block ``b`` of slot
    ``kv`` of layer ``l`` with a value of its own."""
    shape = (2, args.blocks, args.block_tokens, args.heads, args.head_dim)
    if args.device == "host":
        import numpy as np

        layers = [np.zeros(shape, dtype=np.uint16) for _ in range(args.layers)]

        def fill(layer, kv, b, v):
            layers[layer][kv, b] = v

        def read(layer, kv, b):
            return int(layers[layer][kv, b].reshape(-1)[0]), bool((layers[layer][kv, b] == layers[layer][kv, b].reshape(-1)[0]).all())
    else:
        import torch

        layers = [torch.zeros(shape, dtype=torch.bfloat16, device=args.device) for _ in range(args.layers)]

        def fill(layer, kv, b, v):
            layers[layer][kv, b].view(torch.int16).fill_(v)

        def read(layer, kv, b):
            t = layers[layer][kv, b].view(torch.int16)
            first = int(t.reshape(-1)[0].item())
            return first, bool((t == first).all().item())

    return layers, fill, read


def value(layer, kv, b):
    return (layer * 1009 + kv * 131 + b * 7) % 30000 + 1


def engine(args):
    import te

    cfg = {"engine": {"backend": "tcp"}}
    if args.no_local_ipc:
        cfg["backends"] = {"tcp": {"local_ipc": False}}
    if args.caller_reads:
        cfg["backends"] = {"tcp": {"caller_reads": True}}
    return te.Engine(cfg)


def prefill(args, conn):
    layers, fill, _ = caches(args)
    for layer in range(args.layers):
        for kv in range(2):
            for b in range(args.blocks):
                fill(layer, kv, b, value(layer, kv, b))
    if args.device != "host":
        import torch

        torch.cuda.synchronize()
    with engine(args) as e:
        e.register_kv_caches("kv", layers)
        conn.send(e.address)
        conn.recv()  # decode is done


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=64, help="blocks per batch")
    p.add_argument("--duration", type=float, default=2.0)
    p.add_argument("--no-local-ipc", action="store_true")
    p.add_argument(
        "--caller-reads",
        action="store_true",
        help="callers waiting for a batch read its same-host answers themselves",
    )
    args = p.parse_args()

    mp.set_start_method("spawn")
    mine, theirs = mp.Pipe()
    child = mp.Process(target=prefill, args=(args, theirs))
    child.start()
    try:
        address = mine.recv()
        layers, fill, read = caches(args)
        with engine(args) as e:
            e.register_kv_caches("kv", layers)
            peer = e.connect(address, timeout=10)
            block_bytes = args.block_tokens * args.heads * args.head_dim * 2
            per_batch = args.batch * 2 * args.layers * block_bytes
            rng = random.Random(1)
            ids = list(range(args.blocks))

            # Every byte of one pulled batch: each block's value is its remote id's.
            remote, local = rng.sample(ids, args.batch), rng.sample(ids, args.batch)
            e.pull_blocks(peer, "kv", local, remote, timeout=30).wait(30)
            for r, l in zip(remote, local):
                for layer in range(args.layers):
                    for kv in range(2):
                        got, uniform = read(layer, kv, l)
                        assert uniform and got == value(layer, kv, r), (layer, kv, r, l, got)

            out = {"device": args.device, "local_ipc": not args.no_local_ipc,
                   "caller_reads": args.caller_reads, "batch_bytes": per_batch}
            for op in ("pull", "push"):
                n, start = 0, time.perf_counter()
                while time.perf_counter() - start < args.duration:
                    remote, local = rng.sample(ids, args.batch), rng.sample(ids, args.batch)
                    call = e.pull_blocks if op == "pull" else e.push_blocks
                    call(peer, "kv", local, remote, timeout=30).wait(30)
                    n += 1
                secs = time.perf_counter() - start
                out[f"{op}_gb_per_s"] = round(n * per_batch / secs / 1e9, 2)
                out[f"{op}_ms_per_batch"] = round(secs / n * 1e3, 3)
            print(json.dumps(out), flush=True)
    finally:
        mine.send("done")
        child.join(30)
        if child.is_alive():
            child.kill()


if __name__ == "__main__":
    main()
