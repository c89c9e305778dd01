"""Trajectory processing: the call store, per-run prefix trees, trajectory selection
under the shared-prefix rule, and packing into micro-batches.

Modules: `records` (JSONL call/run records and validation), `delta` (the stored
parent/shared-length form of a call), `encode` (choosing each call's parent), `store`
(append-only binary call segments), `tree` (radix prefix tree), `select` (greedy
max-coverage of K paths), `process` (runs to trajectories, with rejections and
advantages), `pack` (micro-batches and deduplication stats), `dump` (human views),
`cli` (`gyre traj`).

Runtime entry points: `store.CallStoreWriter` (gateway), `store.RunBuffer` or
`store.load_store` (processor input), `process.process` / `process.process_run`
(trajectories), `pack.pack` (micro-batches)."""
