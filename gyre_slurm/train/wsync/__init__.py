"""Streamed weight sync: the policy goes from the training ranks that hold its shards to
the rollout servers' workers, in buckets, over a transfer group (gloo on CPU, NCCL on
GPUs), converted to the Hugging Face names vLLM loads on the way; no rank ever holds the
whole model. See docs/weight-sync.md.

    plan      which piece of which tensor each rank sends, in which bucket (pure)
    stream    one round: senders' and receivers' loops, faults, peak memory
    endpoint  a member's group and plan across rounds; the trainers' side (StreamSender)

The receivers are the vLLM worker engine (`gyre_slurm.engines.vllm_wsync`, registered in
vLLM's weight-transfer framework) and the embedded engine (`gyre_slurm.engines.embedded`);
the coordinator drives the rounds.
"""
