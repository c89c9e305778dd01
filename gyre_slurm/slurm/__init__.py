"""Slurm integration: submitting the job through submitit (`submit.submit_job`, `gyre
submit`), the bounded self-requeue, and a real local multi-node Slurm cluster for tests
and trials (`localcluster`). Simulator sweeps as job arrays: `gyre_slurm.sim.array`."""
