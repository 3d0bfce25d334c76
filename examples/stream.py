"""Producer → consumer streaming on the embedded default.

Two producer threads put GRPO-style rollouts (ragged token sequences, per-token behaviour logprobs,
a scalar reward, the prompt text, a group per prompt) while two consumer tasks read them: "actor"
reads whole groups, "critic" reads rows; each acks what it trained on. At the end it prints what
moved and the throughput, checks that every task saw every row exactly once, and clears the
partition so the storage bytes go back to zero.

    python examples/stream.py [--rows 4096] [--group-size 8] [--batch 256] [--max-len 512]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import tqstream


def rollouts(
    first_prompt: int, prompts: int, group_size: int, max_len: int, gen: torch.Generator
) -> tuple[dict[str, object], list[str]]:
    rows = prompts * group_size
    lengths = torch.randint(1, max_len + 1, (rows,), generator=gen).tolist()
    data = {
        "input_ids": [torch.randint(0, 32_000, (n,), generator=gen) for n in lengths],
        "old_logprobs": [-torch.rand(n, generator=gen) for n in lengths],
        "rewards": torch.rand(rows, generator=gen),
        "prompt": [f"prompt {first_prompt + i // group_size}" for i in range(rows)],
    }
    groups = [f"uid-{first_prompt + i // group_size}" for i in range(rows)]
    return data, groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096, help="rows in total (default 4096)")
    ap.add_argument("--group-size", type=int, default=8, help="rows per prompt group (default 8)")
    ap.add_argument("--batch", type=int, default=256, help="consumer batch size (default 256)")
    ap.add_argument("--max-len", type=int, default=512, help="longest sequence (default 512)")
    args = ap.parse_args()
    per_put = 4  # prompts per put
    prompts = args.rows // args.group_size
    producers = 2

    client = tqstream.init()
    client.create_partition("train", ["input_ids", "old_logprobs", "rewards", "prompt"])
    put_bytes = [0] * producers

    def produce(index: int) -> None:
        gen = torch.Generator().manual_seed(index)
        share = range(index * prompts // producers, (index + 1) * prompts // producers, per_put)
        for first in share:
            n = min(per_put, (index + 1) * prompts // producers - first)
            data, groups = rollouts(first, n, args.group_size, args.max_len, gen)
            client.put(data, "train", groups=groups, version=first // 64)
            put_bytes[index] += sum(
                t.numel() * t.element_size()
                for key in ("input_ids", "old_logprobs")
                for t in data[key]
            )  # type: ignore[attr-defined]

    seen: dict[str, list[str]] = {"actor": [], "critic": []}

    def consume(task: str, whole_groups: bool) -> None:
        fields = ["input_ids", "old_logprobs", "rewards"]
        while len(seen[task]) < prompts * args.group_size:
            batch = client.get(
                "train", fields, args.batch, task, whole_groups=whole_groups, timeout=60
            )
            tokens = batch.data["input_ids"]
            assert tokens.is_nested and len(tokens) == len(batch)
            seen[task].extend(batch.meta.keys)
            batch.ack()

    start = time.perf_counter()
    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    threads += [
        threading.Thread(target=consume, args=("actor", True)),
        threading.Thread(target=consume, args=("critic", False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start

    rows = prompts * args.group_size
    st = client.stats("train").partitions["train"]
    for task, keys in seen.items():
        assert len(keys) == len(set(keys)) == rows, f"{task} saw {len(set(keys))} of {rows}"
        assert st.tasks[task].acked == rows
    mb = sum(put_bytes) / 1e6
    print(
        f"moved {rows} rows ({prompts} groups of {args.group_size}), {mb:.1f} MB of tokens and "
        f"logprobs, to 2 tasks in {elapsed:.2f}s"
    )
    print(
        f"throughput: {rows / elapsed:,.0f} rows/s put, {2 * rows / elapsed:,.0f} rows/s "
        f"delivered, {3 * mb / elapsed:,.0f} MB/s moved (put + 2 reads)"
    )
    print(
        f"storage held {client.stats().storage_bytes / 1e6:.1f} MB; every task saw every row "
        f"exactly once"
    )
    client.clear_partition("train")
    assert client.stats().storage_bytes == 0
    print("cleared: storage bytes back to 0")
    client.close()


if __name__ == "__main__":
    main()
