"""Every NATS subject the mesh uses. `{prefix}` defaults to "mm".

| subject                                 | kind          | from -> to        | message (reply)                   |
|-----------------------------------------|---------------|-------------------|-----------------------------------|
| {p}.prefill.jobs   (queue group prefill)| request/reply | gateway -> prefill| PrefillJob (Ack)                  |
| {p}.decode.{worker}.kv_ready            | request/reply | prefill -> decode | KVReady (KVReadyReply)            |
| {p}.decode.{worker}.bench_job           | request/reply | gateway -> decode | PrefillJob (Ack), bench mode only |
| {p}.decode.{worker}.kv_failed           | publish       | prefill -> decode | KVSendFailed (a KVReady's bytes)  |
| {p}.prefill.{worker}.kv.release         | request/reply | decode -> prefill | KVRelease (Ack)                   |
| {p}.gateway.{gateway}.tokens.{worker}   | publish       | workers -> gateway| TokenBatch, one per step          |
| {p}.requests.abort                      | publish       | gateway -> all    | Abort                             |
| {p}.heartbeat.{role}.{worker}           | publish       | workers -> all    | Heartbeat, every interval         |
| {p}.worker.{worker}.stats               | request/reply | anyone -> worker  | StatsRequest (WorkerStats)        |
| {p}.worker.{worker}.resend              | publish       | gateway -> worker | TokenResend (answered by batches) |
| {p}.eplb.{instance}.load                | publish       | ranks -> balancer | ExpertLoad, every publish interval|
| {p}.eplb.{instance}.plan                | request/reply | balancer -> ranks | MovePlan (Ack)                    |
| {p}.eplb.{instance}.staged              | publish       | ranks -> balancer | MoveStaged                        |
| {p}.eplb.{instance}.commit              | publish       | balancer -> ranks | MoveCommit                        |
| {p}.eplb.{instance}.abort               | publish       | balancer -> ranks | MoveAbort                         |
| {p}.eplb.{instance}.done                | publish       | ranks -> balancer | MoveDone                          |
| {p}.eplb.{instance}.rebalance           | request/reply | anyone -> balancer| RebalanceRequest (RebalanceReply) |
| {p}.prefill.{worker}.jobs               | request/reply | gateway -> prefill| PrefillJob (Ack): KV-aware routing|
| {p}.kv.{holder}.events                  | publish       | holders -> all    | KVEvents (blocks stored/removed)  |
| {p}.kv.{holder}.snapshot                | request/reply | gateway -> holder | KVSnapshotRequest (KVEvents)      |
| {p}.kv.{holder}.fetch                   | request/reply | worker -> holder  | KVFetch (KVFetchReply) + UCX      |
| {p}.kv_store.put                        | request/reply | worker -> store   | KVPut (KVPutReply) + UCX          |

Any request whose payload does not validate is answered with an ErrorReply and
logged; the service keeps serving. Trace context travels in the NATS message headers
(`traceparent`).

Every subject a service publishes on its own behalf ends in its worker id (heartbeats,
token batches, KV events), so that a NATS user can be allowed exactly its own subjects
(tools/launch/nats_auth.py writes those permissions). A message whose claimed sender
differs from its subject's is dropped on arrival (messages.py, `sender_matches`): with
per-worker credentials, a worker cannot speak for another.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subjects:
    prefix: str = "mm"

    @property
    def prefill_jobs(self) -> str:
        return f"{self.prefix}.prefill.jobs"

    prefill_queue_group = "prefill"

    def decode_kv_ready(self, worker: str) -> str:
        return f"{self.prefix}.decode.{worker}.kv_ready"

    def prefill_direct(self, worker: str) -> str:
        return f"{self.prefix}.prefill.{worker}.jobs"

    def kv_events(self, holder: str) -> str:
        """holder: its own id to publish, "*" to hear every holder."""
        return f"{self.prefix}.kv.{holder}.events"

    def kv_snapshot(self, holder: str) -> str:
        return f"{self.prefix}.kv.{holder}.snapshot"

    def kv_fetch(self, holder: str) -> str:
        return f"{self.prefix}.kv.{holder}.fetch"

    @property
    def kv_store_put(self) -> str:
        return f"{self.prefix}.kv_store.put"

    def decode_bench_job(self, worker: str) -> str:
        return f"{self.prefix}.decode.{worker}.bench_job"

    def decode_kv_failed(self, worker: str) -> str:
        return f"{self.prefix}.decode.{worker}.kv_failed"

    def kv_release(self, worker: str) -> str:
        return f"{self.prefix}.prefill.{worker}.kv.release"

    def gateway_tokens(self, gateway: str, worker: str) -> str:
        """worker: the sender's own id to publish, "*" for the gateway to hear every worker."""
        return f"{self.prefix}.gateway.{gateway}.tokens.{worker}"

    @property
    def abort(self) -> str:
        return f"{self.prefix}.requests.abort"

    def heartbeat(self, role: str, worker: str) -> str:
        return f"{self.prefix}.heartbeat.{role}.{worker}"

    @property
    def heartbeat_all(self) -> str:
        return f"{self.prefix}.heartbeat.>"

    def stats(self, worker: str) -> str:
        return f"{self.prefix}.worker.{worker}.stats"

    def token_resend(self, worker: str) -> str:
        return f"{self.prefix}.worker.{worker}.resend"

    def eplb(self, instance: str, what: str) -> str:
        """what: load | plan | staged | commit | abort | done | rebalance"""
        return f"{self.prefix}.eplb.{instance}.{what}"

    def eplb_all(self, what: str) -> str:
        return f"{self.prefix}.eplb.*.{what}"
