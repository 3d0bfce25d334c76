"""A rollout producer of the asynchronous RL simulation (run as a script, not collected).

Each producer loops: acquire a slot of the shared "capacity" admission, read the trainer's
published version, "generate" one group of G rows (per-token versions: -1 on prompt tokens, the
generating version on response tokens), put it with ``reject_mixed_versions=True``, release the
slot. Some groups span two versions: the trainer published a new version mid-generation (every row
mixed: the whole group is refused), or a forced partial mix (two rows refused). One producer
straggles once (its 3rd group), holding it until the trainer is more than K versions ahead, so
the trainer must drop it as stale. The producers start together (a barrier on the admission's
``enqueued`` counter). It stops when the trainer publishes version STEPS and writes a JSON report.
"""

from __future__ import annotations

import json
import random
import sys
import time

import torch

import tqstream

G = 4  # rows per group (GRPO samples per prompt)
GROUPS_PER_STEP = 2  # the trainer's batch in groups; one admission slot is one group
B = G * GROUPS_PER_STEP  # the trainer's batch in rows
K = 2  # max staleness in versions, for the admission and the trainer's window
MAX_CONCURRENT = 3
STEPS = 14  # trainer steps; publishing version STEPS tells the producers to stop
PRODUCERS = 3
ADMISSION = "rollout"
FIELDS = ["tokens", "versions", "reward"]
SPEED = [1.0, 1.6, 2.4]  # generation time factor per producer
STRAGGLER = 2  # this producer holds its 3rd group until it is stale


def _version(adm: tqstream.client.admission.AdmissionHandle) -> int:
    return int(adm.state()["version"])


def _group(
    rng: random.Random, uid: str, start: list[int], end: list[int]
) -> dict[str, list[torch.Tensor] | torch.Tensor]:
    """G rows; row i's response tokens carry version start[i] in the first half, end[i] after."""
    tokens, versions = [], []
    for i in range(G):
        prompt, response = rng.randint(2, 5), rng.randint(2, 8)
        half = response // 2
        tokens.append(torch.randint(0, 1000, (prompt + response,)))
        versions.append(
            torch.tensor([-1] * prompt + [start[i]] * half + [end[i]] * (response - half))
        )
    return {"tokens": tokens, "versions": versions, "reward": torch.rand(G)}


def produce(address: str, partition: str, index: int, out: str) -> None:
    rng = random.Random(index)
    report = {
        "groups": 0,  # slots acquired = groups generated
        "rows_put": 0,
        "rows_rejected": 0,
        "slots_accepted": 0,
        "slots_rejected": 0,
        "stored": {},  # uid -> rows stored
        "straggled": None,  # uid of the group held until stale
    }
    with tqstream.connect(address) as client:
        adm = client.admission(
            "capacity",
            name=ADMISSION,
            max_concurrent=MAX_CONCURRENT,
            max_staleness=K,
            consumer_batch_size=GROUPS_PER_STEP,
        )
        adm.on_rollout_enqueued()  # a start barrier: count the producers that are up
        while adm.state()["enqueued"] < PRODUCERS:
            time.sleep(0.01)
        while True:
            v = _version(adm)
            if v >= STEPS:
                break
            try:
                slots = adm.acquire(1, version=v, timeout=0.5)
            except tqstream.RequestTimeoutError:
                continue  # re-check the stop signal
            v = _version(adm)  # the weights this generation starts with
            report["groups"] += 1
            uid = f"p{index}-g{report['groups']}"
            time.sleep(SPEED[index] * rng.uniform(0.004, 0.012))  # generating
            now = _version(adm)
            start, end = [v] * G, [now] * G  # the trainer moved on mid-generation: all mixed
            if report["groups"] % 5 == 0 and v == now and v >= 1:
                start[0] = start[1] = v - 1  # forced partial mix: rows 0 and 1 are refused
            if index == STRAGGLER and report["groups"] == 3:  # slow, on version v's weights
                start = end = [v] * G
                deadline = time.monotonic() + 20
                while v + K >= (w := _version(adm)) and w < STEPS:
                    time.sleep(0.01)  # a very slow generation: the group goes stale
                    assert time.monotonic() < deadline, "the trainer stopped publishing"
                report["straggled"] = uid
            meta = client.put(
                _group(rng, uid, start, end),
                partition,
                groups=[uid] * G,
                version=v,
                dispatch_version=v,
                reject_mixed_versions=True,
            )
            report["rows_put"] += len(meta)
            report["rows_rejected"] += meta.rejected
            if len(meta):
                report["stored"][uid] = len(meta)
            outcome = "rejected" if meta.rejected else "accepted"
            report[f"slots_{outcome}"] += 1
            adm.release(slots, outcome)
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    address, partition, index, out = sys.argv[1:]
    produce(address, partition, int(index), out)
