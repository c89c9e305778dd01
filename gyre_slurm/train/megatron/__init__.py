"""The Megatron-core training backend (runs in the megatron role environment, Python 3.12).

- `worker.MegatronWorker`: `TrainerWorker`'s API over a Megatron `GPTModel` (TP x PP x DP);
  state crosses a rebuild through a resharding `dist_checkpointing` checkpoint.
- `convert`: Hugging Face <-> Megatron names and shards (llama, qwen2); pure torch.
- `cpu_shim`: lets Megatron's hard-coded CUDA calls run on CPU (no GPU present only).
The node agent runs a worker as `python -m gyre_slurm.train.rankproc --backend megatron`.

Importing this package imports nothing heavy.
"""
