"""The torch training side: process groups per generation, the policy loss, and the
long-lived per-node `TrainerWorker` that survives handoffs.

Modules: `dist` (the long-lived TCPStore and one process group per world generation:
the only place groups are created), `layout` (pure rank arithmetic for train cells and
handoff plans), `loss` (token-level clipped policy-gradient loss), `worker`
(`TrainerWorker`: join/flush/leave a world, micro-batches, optimizer steps,
checkpoints), `harness` (local worker processes driven by commands: tests, benchmarks,
the embedded launcher), `wsync/` (the streamed weight sync: the policy from the ranks
holding its shards to the rollout servers, in buckets, no rank holding the whole model).
"""
