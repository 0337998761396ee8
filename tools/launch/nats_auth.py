"""The NATS user table of a deployment: one user per worker, allowed only its own subjects.

A worker's user name is its worker id (tools/launch/up.py `worker_names`, from the
deployment file's [pools]); `ops` is added for operators and tools. Each user may:
- publish only its own heartbeat, token batches and KV events (the subjects that name
  their sender: see shared/protocol/subjects.py), and only requests its role makes;
- subscribe only to the subjects addressed to it (its jobs, pulls, stats, KV snapshot
  and fetch, its DEP instance's expert moves), to what every peer announces, and to its
  own reply inbox `_INBOX.<user>.>` (ServiceConfig.inbox_prefix), never another's.

Passwords are not in the table: each is `$<USER>_NATS_PASSWORD` (up.py `password_env`),
which nats-server reads from its environment. nats-server 2.x also has permission
templates ({{name()}}), but only for JWT (operator mode) accounts; a plain user table is
what a config file can hold, so this writes one entry per worker.

Pure: `permissions` and `render_auth_conf` do no I/O; `write_auth_conf` writes the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moemesh.tools.launch.up import UpConfig, WorkerName, password_env, worker_names

OPS = WorkerName("ops", "ops")


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool  # may reply to requests it received, and publish nothing else on _INBOX


def permissions(w: WorkerName, prefix: str = "mm") -> Permissions:
    """What worker w's NATS user may do, in a mesh whose subjects start with prefix."""
    p, me, inst = prefix, w.worker_id, w.instance or w.worker_id
    inbox = f"_INBOX.{me}.>"
    if w.role == "gateway":
        return Permissions(
            (f"{p}.prefill.jobs", f"{p}.prefill.*.jobs", f"{p}.decode.*.bench_job", f"{p}.requests.abort",
             f"{p}.kv.*.snapshot", f"{p}.worker.*.resend", f"{p}.heartbeat.gateway.{me}"),
            (f"{p}.heartbeat.>", f"{p}.gateway.{me}.tokens.*", f"{p}.kv.*.events", inbox), False)
    if w.role in ("prefill", "decode"):
        # Both roles hold KV (snapshots, fetches, events), publish token batches and
        # expert loads, and are ranks of an instance the balancer moves experts in.
        own = [f"{p}.heartbeat.{w.role}.{me}", f"{p}.gateway.*.tokens.{me}", f"{p}.kv.{me}.events",
               f"{p}.kv.*.fetch", f"{p}.kv_store.put", *(f"{p}.eplb.{inst}.{x}" for x in ("load", "staged", "done"))]
        mine = [f"{p}.requests.abort", f"{p}.heartbeat.>", f"{p}.worker.{me}.stats", f"{p}.worker.{me}.resend",
                f"{p}.kv.{me}.snapshot",
                f"{p}.kv.{me}.fetch", *(f"{p}.eplb.{inst}.{x}" for x in ("plan", "commit", "abort")), inbox]
        if w.role == "prefill":
            own += [f"{p}.decode.*.kv_ready", f"{p}.decode.*.kv_failed"]
            mine[:0] = [f"{p}.prefill.jobs", f"{p}.prefill.{me}.jobs", f"{p}.prefill.{me}.kv.release"]
        else:
            own.append(f"{p}.prefill.*.kv.release")
            mine[:0] = [f"{p}.decode.{me}.kv_ready", f"{p}.decode.{me}.kv_failed", f"{p}.decode.{me}.bench_job"]
        return Permissions(tuple(own), tuple(mine), True)
    if w.role == "balancer":  # only the balancer moves experts: plan, commit and abort are its alone
        return Permissions(
            (*(f"{p}.eplb.*.{x}" for x in ("plan", "commit", "abort")), f"{p}.heartbeat.balancer.{me}"),
            (*(f"{p}.eplb.*.{x}" for x in ("load", "staged", "done", "rebalance")), inbox), True)
    if w.role == "kv_store":
        return Permissions(
            (f"{p}.kv.{me}.events", f"{p}.heartbeat.kv_store.{me}"),
            (f"{p}.kv_store.put", f"{p}.kv.{me}.snapshot", f"{p}.kv.{me}.fetch", f"{p}.worker.{me}.stats",
             f"{p}.heartbeat.>", inbox), True)
    if w.role == "ops":  # worker stats, manual rebalances, watching heartbeats and loads
        return Permissions((f"{p}.worker.*.stats", f"{p}.eplb.*.rebalance"),
                           (f"{p}.heartbeat.>", f"{p}.eplb.*.load", inbox), False)
    raise ValueError(f"no NATS permissions for role {w.role!r}")


def identities(cfg: UpConfig) -> list[WorkerName]:
    """Every process of the deployment, and ops."""
    return [*worker_names(cfg), OPS]


def render_auth_conf(workers: list[WorkerName], prefix: str = "mm", source: str = "") -> str:
    """The `authorization {}` block for nats-server: one user per worker.

    Args:
        workers: the users to write (their worker ids are the user names).
        prefix: the deployment's subject_prefix.
        source: where the worker list came from, for the header comment.
    """
    ids = [w.worker_id for w in workers]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"worker ids must be unique: {', '.join(dup)}")
    q = json.dumps  # a JSON string is a valid quoted NATS config string
    out = ["# Written by `moemesh nats-auth" + (f" --config {source}" if source else "") + "`; do not edit by hand:",
           "# change the deployment's [pools] and write it again. One user per worker (its worker id),",
           "# allowed only its own subjects; passwords come from the server's environment",
           "# ($<WORKER_ID>_NATS_PASSWORD, dashes as underscores).",
           "", "authorization {", "  users = ["]
    for w in workers:
        perm = permissions(w, prefix)
        out += [f"    {{user: {q(w.worker_id)}, password: ${password_env(w.worker_id)}, permissions: {{",
                f"      publish: [{', '.join(map(q, perm.publish))}]",
                f"      subscribe: [{', '.join(map(q, perm.subscribe))}]"]
        if perm.allow_responses:
            out.append("      allow_responses: true")
        out.append("    }}")
    out += ["  ]", "}", ""]
    return "\n".join(out)


def write_auth_conf(cfg: UpConfig, path: str | Path, prefix: str = "mm") -> list[WorkerName]:
    users = identities(cfg)
    Path(path).write_text(render_auth_conf(users, prefix, cfg.config_file))
    return users
