"""The Megatron-core training backend (runs in the megatron role environment, Python 3.12).

- `worker.MegatronWorker`: `TrainerWorker`'s API over a Megatron `GPTModel` (TP x PP x DP);
  state crosses a rebuild through a resharding `dist_checkpointing` checkpoint.
- `convert`: Hugging Face <-> Megatron names and shards (llama, qwen2); pure torch.
- `cpu_shim`: lets Megatron's hard-coded CUDA calls run on CPU (no GPU present only).
- `driver`: a line-based JSON command loop around one worker, for a parent process
  in another Python (tests, local runs).

Importing this package imports nothing heavy.
"""
